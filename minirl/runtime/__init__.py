"""The process and I/O helpers every server stands on: `child` (a helper process that lives exactly
as long as its Ray actor), `http_thread` (an aiohttp app served from its own thread and loop),
`jsonio` (JSON on the HTTP hops) and `files` (a failed write names its file).

Invariant: the ground floor (tests/unit/test_layering.py): nothing here imports any other minirl module,
and importing this package imports none of its modules.
"""
