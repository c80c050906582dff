"""The summarizing compaction's text protocol, in one place: the request the agent appends when the
context fills, the marked block the model's reply must carry, and the handoff message the episode
continues from (`continuation`). The summarizing policy, the tiny model's warm start
(scripts/build_tiny_model.py) and the metrics' recall all read these, so they cannot drift apart.

Invariant: `summary_text(reply)` returns the text of exactly one closed block, or None; a handoff
built by `handoff_text(s)` parses back to `s` with `summary_text`; a continuation keeps the current
observation whenever the history it compacts holds one.
"""

from __future__ import annotations

SUMMARY_OPEN = "<summary>"
SUMMARY_CLOSE = "</summary>"
SUMMARY_REQUEST = f"Context full. Write what you must remember inside {SUMMARY_OPEN}{SUMMARY_CLOSE}, no tool call."
"""The user message appended to the history for the summary call (text only; the call sends no tools)."""
HANDOFF_PREFIX = "Summary of earlier rooms: "
"""The user message that replaces the compacted turns: this prefix, then the marked block."""


def summary_text(reply: str) -> str | None:
    """The text inside the reply's one closed summary block, stripped; None when the block is
    missing, unclosed or repeated. An empty block returns "" (the policy rejects it)."""
    if reply.count(SUMMARY_OPEN) != 1 or reply.count(SUMMARY_CLOSE) != 1:
        return None
    start = reply.index(SUMMARY_OPEN) + len(SUMMARY_OPEN)
    end = reply.index(SUMMARY_CLOSE)
    if end < start:
        return None
    return reply[start:end].strip()


def handoff_text(summary: str) -> str:
    """The handoff message's text for an accepted summary."""
    return f"{HANDOFF_PREFIX}{SUMMARY_OPEN}{summary}{SUMMARY_CLOSE}"


def continuation(history: list[dict], initial_len: int, summary: str) -> list[dict]:
    """The history an accepted summary leaves: the initial context (`history[:initial_len]`: system
    prompt and task), the handoff user message `handoff_text(summary)`, then the current observation
    re-rendered as a user message: the content parts of the newest tool reply (e.g. "Opened. Room 4."
    and that room's picture), verbatim, when the history ends in one (it does before every model call
    after the first), or that user message itself when the history is an earlier continuation (a
    guard's early compaction right after the scheduled one summarizes it before any new call)."""
    items = list(history[:initial_len])
    items.append({"type": "message", "role": "user", "content": handoff_text(summary)})
    last = history[-1] if len(history) > initial_len else None
    if last is not None and last.get("type") == "function_call_output":
        out = last["output"]
        items.append({"type": "message", "role": "user", "content": out if isinstance(out, str) else list(out)})
    elif last is not None and last.get("role") == "user" and not is_handoff(last):
        items.append(dict(last))  # the new handoff supersedes an old one; the observation stays current
    return items


def is_handoff(item: dict) -> bool:
    """Whether `item` is a continuation's handoff message."""
    content = item.get("content")
    return isinstance(content, str) and content.startswith(HANDOFF_PREFIX)
