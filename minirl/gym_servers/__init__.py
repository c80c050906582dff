"""The processes of a Gym deployment besides `python -m minirl.train`, which training never imports:
minirl's generation side for Gym (`generation`, docs/gym.md step 1) and Gym's side of `make
gym-check`, run with a Gym venv's python (scripts/gym_check.py, scripts/gym07_check.py): the
launchers `serve` (nemo-gym 0.4.0) and `serve_v07` (0.7.0), minirl's `doors` task as a Gym resources
server (`doors_resources_server`, `doors_v07`), and a Gym 0.7 Environment Server whose episodes fail.

Invariant: an entry-point floor (tests/unit/test_layering.py): nothing below imports from here;
importing this package imports none of its modules (three of them need `nemo_gym`).
"""
