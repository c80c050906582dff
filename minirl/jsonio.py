"""JSON on minirl's HTTP hops (the agent server, the model server, their clients), through msgspec's
C codec (a vLLM dependency) with the standard library's results.

Per request each hop decodes and encodes a few kB of token ids and logprobs; `json` spends
3-10x the CPU msgspec does on them, and on a CPU machine that time is taken from the engine.

Invariants: `loads(raw)` returns what `json.loads(raw)` returns, or raises what it raises: any input
msgspec refuses (NaN or Infinity literals, a lone surrogate, a number out of float range, a BOM,
nesting past the interpreter's recursion limit) goes to `json.loads`. `dumps(obj)` is JSON that
parses back (by either) to the value `json.dumps(obj)` would parse back to, as compact UTF-8
(vLLM's own server writes its bodies compact and unescaped too). msgspec writes a non-finite float
as null where `json` writes NaN or Infinity, so an output holding a null is checked: if `obj` holds
a non-finite float (or a caller says it may, `finite=False`), or msgspec cannot encode it, the
answer is `json.dumps(obj)` itself.
"""

from __future__ import annotations

import json
import math

import msgspec

_decode = msgspec.json.decode
_encode = msgspec.json.encode


def loads(raw: bytes | str):
    """`json.loads(raw)`, faster."""
    try:
        return _decode(raw)
    except Exception:  # whatever msgspec refuses, json decides (and words its error)
        return json.loads(raw)


def dumps(obj, finite: bool = True) -> bytes:
    """`obj` as compact UTF-8 JSON; `finite=False`: the caller knows `obj` may hold NaN or infinity."""
    if finite:
        try:
            out = _encode(obj)
        except Exception:  # a type msgspec does not encode, a lone surrogate
            out = None
        if out is not None and (b"null" not in out or all_finite(obj)):
            return out
    return json.dumps(obj).encode()  # as before: NaN stays NaN, a lone surrogate is escaped


def all_finite(obj) -> bool:
    """Whether no float anywhere in `obj` (dicts, lists, tuples) is NaN or infinite; iterative, so
    nesting as deep as `json` accepts is walked without recursion."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return False
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return True
