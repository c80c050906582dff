"""minirl's side of NeMo Gym: the request shape written down from Gym's models (`shapes`; a row's
sampling extras are `minirl.wire.extra_body`), a check of rows against the real models (`serve`),
and a Gym resources server for the `doors` task
(`doors_resources_server`, the only module here that imports `nemo_gym`: it runs in the Gym venv).

Invariant: importing `minirl.gym` or any module here other than `doors_resources_server` needs no
`nemo_gym` install.
"""
