"""The rewriting compaction policies, plain data surgery that never calls the model: `recency`
(Gym's `simple_agent_with_compaction` history rewrite, by `compact`: old pictures and reasoning
dropped) and `identity` (never rewrites: the compaction agent's loop and guard with the history whole).

Invariant: `compact` never reorders, adds or alters anything but the dropped parts and items, and
compacting an already compacted history with the same settings changes nothing (it is idempotent).
It never mutates its input: an item it rewrites is a new dict, and every other item is the input's
own (shared, not copied: the history holds each call's token evidence, and copying it all before
every call cost the agent more than the rest of its turn).
"""

from __future__ import annotations

from dataclasses import dataclass

from minirl.agents.compaction.base import CompactionResult
from minirl.agents.episode import Episode, ModelClient
from minirl.config import ContextHistoryConfig


class IdentityPolicy:
    """`identity`: never rewrites; adds no counter."""

    COUNTERS: tuple[str, ...] = ()

    def __init__(self, cfg: ContextHistoryConfig) -> None:
        self.cfg = cfg

    async def compact(self, episode: Episode, client: ModelClient) -> CompactionResult:
        return CompactionResult(list(episode.history))


class RewritePolicy:
    """`recency`: drop old pictures and reasoning by `compact`."""

    COUNTERS: tuple[str, ...] = ("images_dropped", "reasoning_dropped")

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
    """Rewrite `items` under `cfg.policy.config`; `items[:initial_len]` is the episode's initial context.

    - images: keep the pictures of the last `keep_last_groups` items that carry any; older pictures
      become an `omission_marker` text part. Items of the initial context are exempt when
      `protect_initial_context` is set.
    - reasoning: drop reasoning items except the last `keep_last_blocks` (and the first, if
      `keep_first_block`).
    """
    items = list(items)  # rewritten items are replaced, never changed in place: the input stays as it was
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
            items[i] = {**items[i], key: new_parts}

    reasoning = cfg.policy.config.reasoning
    if reasoning.enabled:
        blocks = [i for i, it in enumerate(items) if it.get("type") == "reasoning"]
        # the last k blocks, all of them while there are fewer (a negative start would keep only k - n)
        keep = set(blocks[max(0, len(blocks) - reasoning.keep_last_blocks) :])
        if reasoning.keep_first_block and blocks:
            keep.add(blocks[0])
        drop = set(blocks) - keep
        result.reasoning_dropped = len(drop)
        result.items = [it for i, it in enumerate(items) if i not in drop]
    return result
