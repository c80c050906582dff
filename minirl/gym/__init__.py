"""minirl's side of NeMo Gym: the request shape written down from Gym's models (`shapes`; a row's
sampling extras are `minirl.wire.extra_body`), a check of rows against the real models (`serve`),
and a Gym resources server for the `doors` task
(`doors_resources_server`; on nemo-gym 0.7.0's classes, `doors_v07`, and `episodes_v07`, an
Environment Server whose episodes fail: these import `nemo_gym` and run in a Gym venv; `serve_v07`
launches 0.7's servers). The command that starts minirl's generation side for a Gym deployment is
an entry point, `python -m minirl.gym_generation`.

Invariant: importing `minirl.gym` or any module here other than `doors_resources_server`,
`doors_v07` and `episodes_v07` needs no `nemo_gym` install.
"""
