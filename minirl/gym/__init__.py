"""What minirl reads and writes of NeMo Gym's shapes, on the ground floor: the `/run` request shape
written down from Gym's models (`shapes`; a row's sampling extras are `minirl.wire.extra_body`) and
Gym's failure facts read into minirl's lanes (`failures`). The processes of a Gym deployment (the
generation side's command, the Gym-venv servers `make gym-check` runs) are in `minirl.gym_servers`.

Invariant: nothing here imports a minirl module but `minirl.wire`, and nothing here needs a
`nemo_gym` install.
"""
