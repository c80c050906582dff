"""minirl's side of NeMo Gym: rows Gym's request models accept (`rows`), the request shape written
down from Gym's models (`shapes`), and a Gym resources server for the `doors` task
(`doors_resources_server`, the only module here that imports `nemo_gym`: it runs in the Gym venv).

Invariant: importing `minirl.gym` or any module here other than `doors_resources_server` needs no
`nemo_gym` install.
"""
