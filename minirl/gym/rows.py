"""Per-request sampling extras in a `/run` row, where Gym carries them.

Gym's `responses_create_params` is the Responses API's create-params, which has no `seed`; Gym's
`vllm_model` merges `metadata.extra_body`, a JSON object written as a string (metadata values are
strings), into each chat-completions request it sends. So a row's seed travels there, and
minirl's own agent reads it from the same place.

Invariant: `with_extra_body` never drops an extra or a metadata key that was already there, and
`extra_body` returns exactly what `with_extra_body` wrote; a malformed `extra_body` raises
ValueError naming `responses_create_params.metadata.extra_body`.
"""

from __future__ import annotations

import json

WHERE = "responses_create_params.metadata.extra_body"


def extra_body(params: dict) -> dict:
    """The per-request extras of a row's `responses_create_params` ({} when there are none)."""
    metadata = params.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise ValueError(f"responses_create_params.metadata must be an object, got {type(metadata).__name__}")
    raw = (metadata or {}).get("extra_body")
    if raw is None:
        return {}
    try:
        extras = json.loads(raw) if isinstance(raw, str) else None
    except (ValueError, RecursionError):
        extras = None
    if not isinstance(extras, dict):
        raise ValueError(f"{WHERE} must be a JSON object written as a string, got {raw!r}")
    return extras


def with_extra_body(params: dict, **extras) -> dict:
    """A copy of `params` whose `metadata.extra_body` also holds `extras` (later keys win)."""
    metadata = dict(params.get("metadata") or {})
    metadata["extra_body"] = json.dumps({**extra_body(params), **extras}, sort_keys=True)
    return {**params, "metadata": metadata}
