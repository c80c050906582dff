"""Context compaction: the history rewrite that Gym's `simple_agent_with_compaction` applies before
model calls, the schedule that decides when, and the interface every compaction policy implements.

A policy is a class registered by name (`agent.context_history.policy.type`) whose async
`compact(episode, client)` returns a `CompactionResult` carrying its own counters, as Gym's
`ContextCompactionObservation` does; it may call the model through `client`. `compact_episode` is the
one place a result reaches the episode. The summarizing policy (`summarize`, which calls the model) is
agents/summarize.py. The two policies here (`identity`, `recency`) are plain data surgery by
`compact` and never call the model:
- images: keep the pictures of the last `keep_last_groups` items that carry any; older pictures
  become an `omission_marker` text part. Items of the initial context are exempt when
  `protect_initial_context` is set.
- reasoning: drop reasoning items except the last `keep_last_blocks` (and the first, if
  `keep_first_block`).

Invariant: `compact` never reorders, adds or alters anything but the dropped parts and items, and
compacting an already compacted history with the same settings changes nothing (it is idempotent).
A result whose `changed` is false leaves the episode's history, prefix and compaction count untouched
(its counters are still added: a failed summary's rejected attempts count).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Literal, Protocol

from minirl.agents.episode import Episode, ModelClient
from minirl.config import ContextHistoryConfig


@dataclass
class CompactionResult:
    """One compaction of an episode's history (Gym's `ContextCompactionObservation`)."""

    items: list[dict]
    """The history after compaction."""
    changed: bool = False
    """Whether `items` differs from the history; only then is it installed and counted."""
    outcome: Literal["completed", "failed", "aborted", "unknown"] = "completed"
    tokens_before: int | None = None
    """Prompt tokens before and after (None: the policy did not count them)."""
    tokens_after: int | None = None
    model_calls: int = 0
    """Model calls the compaction itself made (0 for the rewriting policies)."""
    counters: dict[str, int] = field(default_factory=dict)
    """Added by name to the episode's evidence (recency: images_dropped, reasoning_dropped)."""
    end_reason: str | None = None
    """Set when the compaction ends the episode (summarize: max_compactions, summary_failed)."""


class CompactionPolicy(Protocol):
    def __init__(self, cfg: ContextHistoryConfig) -> None: ...

    async def compact(self, episode: Episode, client: ModelClient) -> CompactionResult: ...


POLICIES: dict[str, type[CompactionPolicy]] = {}


def register(*names: str) -> Callable[[type], type]:
    """Register a policy class under the `agent.context_history.policy.type` values that select it."""

    def add(cls: type) -> type:
        for name in names:
            POLICIES[name] = cls
        return cls

    return add


def policy_for(cfg: ContextHistoryConfig) -> CompactionPolicy:
    return POLICIES[cfg.policy.type](cfg)


async def compact_episode(policy: CompactionPolicy, episode: Episode, client: ModelClient) -> CompactionResult:
    """Run `policy` on the episode; add its counters to the evidence; if it changed the history,
    install it, count the compaction and drop the token prefix (the history was rewritten); if it
    ends the episode, stop it with that end reason."""
    result = await policy.compact(episode, client)
    for name, n in result.counters.items():
        setattr(episode.ev, name, getattr(episode.ev, name, 0) + n)
    if result.changed:
        episode.history[:] = result.items
        episode.ev.compactions += 1
        episode.prefix = None
    if result.end_reason is not None:
        episode.ev.end_reason, episode.stopped = result.end_reason, True
    return result


@register("identity", "recency")
class RewritePolicy:
    """`recency` (drop old pictures and reasoning by `compact`) and `identity` (never rewrite)."""

    def __init__(self, cfg: ContextHistoryConfig) -> None:
        self.cfg = cfg

    async def compact(self, episode: Episode, client: ModelClient) -> CompactionResult:
        rewrite = compact(episode.history, self.cfg, episode.initial_len)
        counters = {"images_dropped": rewrite.images_dropped, "reasoning_dropped": rewrite.reasoning_dropped}
        return CompactionResult(rewrite.items, changed=rewrite.changed, counters=counters)


@dataclass
class Rewrite:
    """What `compact` returns: the rewritten items and what it dropped."""

    items: list[dict]
    images_dropped: int = 0
    reasoning_dropped: int = 0

    @property
    def changed(self) -> bool:
        return bool(self.images_dropped or self.reasoning_dropped)


def _image_parts(item: dict) -> list[dict]:
    content = item.get("output") if item.get("type") == "function_call_output" else item.get("content")
    if not isinstance(content, list):
        return []
    return [p for p in content if p.get("type") == "input_image"]


def compact(items: list[dict], cfg: ContextHistoryConfig, initial_len: int) -> Rewrite:
    """Rewrite `items` under `cfg.policy`; `items[:initial_len]` is the episode's initial context."""
    if cfg.policy.type == "identity":
        return Rewrite(list(items))
    items = copy.deepcopy(items)
    result = Rewrite(items)

    images = cfg.policy.config.images
    if images.enabled:
        first = initial_len if images.protect_initial_context else 0
        groups = [i for i in range(first, len(items)) if _image_parts(items[i])]
        for i in groups[: max(0, len(groups) - images.keep_last_groups)]:
            key = "output" if items[i].get("type") == "function_call_output" else "content"
            new_parts = []
            for part in items[i][key]:
                if part.get("type") == "input_image":
                    result.images_dropped += 1
                    part = {"type": "input_text", "text": images.omission_marker}
                new_parts.append(part)
            items[i][key] = new_parts

    reasoning = cfg.policy.config.reasoning
    if reasoning.enabled:
        blocks = [i for i, it in enumerate(items) if it.get("type") == "reasoning"]
        keep = set(blocks[len(blocks) - reasoning.keep_last_blocks :] if reasoning.keep_last_blocks else [])
        if reasoning.keep_first_block and blocks:
            keep.add(blocks[0])
        drop = set(blocks) - keep
        result.reasoning_dropped = len(drop)
        result.items = [it for i, it in enumerate(items) if i not in drop]
    return result


def scheduled(cfg: ContextHistoryConfig, actions_done: int) -> bool:
    """Whether the schedule compacts before the next model call, given the calls made so far."""
    if not cfg.enabled:
        return False
    if cfg.schedule.type == "rolling_recency":
        return True
    return actions_done > 0 and actions_done % cfg.schedule.actions_per_chunk == 0
