"""JSON on minirl's HTTP hops (the agent server, the model server, their clients), through msgspec's
C codec (a vLLM dependency): `json` spends 3-10x its CPU on each hop's few kB of token ids and
logprobs, and on a CPU machine that time is taken from the engine.

Invariant: the standard library's results: `loads(raw)` returns what `json.loads(raw)` returns, or
raises what it raises; `dumps(obj)` parses back (by either) to the value `json.dumps(obj)` would.
"""

from __future__ import annotations

import json
import math

import msgspec

_decode = msgspec.json.decode
_encode = msgspec.json.encode


def loads(raw: bytes | str):
    """`json.loads(raw)`, faster: any input msgspec refuses (NaN or Infinity literals, a lone
    surrogate, a number out of float range, a BOM, nesting past the interpreter's recursion limit)
    goes to `json.loads`."""
    try:
        return _decode(raw)
    except Exception:  # whatever msgspec refuses, json decides (and words its error)
        return json.loads(raw)


def loads_body(raw: bytes, encoding: str):
    """`loads(raw.decode(encoding, errors="replace"))`, what an HTTP client's `text(errors="replace")`
    then `loads` gives, without the decode when msgspec parses the UTF-8 bytes themselves (it
    accepts only valid UTF-8, which decodes the same with or without "replace")."""
    if encoding == "utf-8":
        try:
            return _decode(raw)
        except Exception:
            pass
    return loads(raw.decode(encoding, errors="replace"))


def dumps(obj, finite: bool = True) -> bytes:
    """`obj` as compact UTF-8 JSON (vLLM's own server writes its bodies compact and unescaped too);
    `finite=False`: the caller knows `obj` may hold NaN or infinity.

    msgspec writes a non-finite float as null where `json` writes NaN or Infinity, so an output
    holding a null is checked: if `obj` holds a non-finite float (or `finite=False`), or msgspec
    cannot encode it, the answer is `json.dumps(obj)` itself."""
    if finite:
        try:
            out = _encode(obj)
        except Exception:  # a type msgspec does not encode, a lone surrogate
            out = None
        if out is not None and (b"null" not in out or all_finite(obj)):
            return out
    return json.dumps(obj).encode()  # NaN stays NaN, a lone surrogate is escaped


def all_finite(obj) -> bool:
    """Whether no float anywhere in `obj` (dicts, lists, tuples) is NaN or infinite; iterative, so
    nesting as deep as `json` accepts is walked without recursion. Strings, ints and None are
    passed over by their exact type, and a list of numbers (token ids, logprobs) is settled by its
    sum, in C: a NaN or an infinity among numbers makes their sum NaN or infinite, so a finite sum
    proves them all finite (a sum that is not, or a list that does not sum, is walked)."""
    stack = [obj]
    pop, push = stack.pop, stack.extend
    while stack:
        item = pop()
        kind = type(item)
        if kind is str or kind is int or kind is bool or item is None:
            continue
        if kind is dict:
            push(item.values())
        elif isinstance(item, (list, tuple)):
            try:
                if math.isfinite(sum(item)):
                    continue
            except (TypeError, OverflowError):  # not all numbers, or an int past float's range
                pass
            push(item)
        elif isinstance(item, float):
            if not math.isfinite(item):
                return False
        elif isinstance(item, dict):
            push(item.values())
    return True
