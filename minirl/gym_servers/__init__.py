"""The processes of a Gym deployment besides `python -m minirl.train`, none of which training
imports: minirl's generation side for Gym (`python -m minirl.gym_servers.generation`, docs/gym.md
step 1), and Gym's side of `make gym-check`, run with a Gym venv's python (scripts/gym_check.py,
scripts/gym07_check.py): `serve` launches nemo-gym 0.4.0's servers (and checks rows against its
models), `serve_v07` 0.7.0's; `doors_resources_server` is minirl's `doors` task as a Gym resources
server, `doors_v07` the same on 0.7's classes with the seeded fault plan, `episodes_v07` a Gym 0.7
Environment Server whose episodes fail.

Invariant: an entry-point floor (tests/unit/test_layering.py): nothing below imports from here.
`doors_resources_server`, `doors_v07` and `episodes_v07` import `nemo_gym` and run only in a Gym
venv; importing this package imports none of its modules.
"""
