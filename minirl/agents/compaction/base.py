"""What every compaction policy implements (`CompactionPolicy`: a `COUNTERS` tuple and an async
`compact(episode, client)` returning a `CompactionResult`), the one place its result reaches the
episode (`compact_episode`), and the schedule that decides when the agent compacts.

Invariant: `compact_episode` is the only writer of a policy's result into the episode. A result whose
`changed` is false leaves the history, the token prefix and the compaction count untouched (its
counters are still added: a failed summary's rejected attempts count); a counter the policy did not
declare is an error, never silently added.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal, Protocol

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
    """Added by name to the episode's evidence; each name is one of the policy's `COUNTERS`."""
    end_reason: str | None = None
    """Set when the compaction ends the episode (summarize: max_compactions, summary_failed)."""


class CompactionPolicy(Protocol):
    """A compaction policy: it declares its counters (as Gym's `ContextCompactionObservation` carries
    its own) and may call the model through `client` while it compacts."""

    COUNTERS: ClassVar[tuple[str, ...]]
    """The counter names this policy's results may carry (they become keys of the rollout's evidence)."""

    def __init__(self, cfg: ContextHistoryConfig) -> None: ...

    async def compact(self, episode: Episode, client: ModelClient) -> CompactionResult: ...


async def compact_episode(policy: CompactionPolicy, episode: Episode, client: ModelClient) -> CompactionResult:
    """Run `policy` on the episode; add its counters to the evidence; if it changed the history,
    install it, count the compaction and drop the token prefix (the history was rewritten); if it
    ends the episode, stop it with that end reason."""
    result = await policy.compact(episode, client)
    undeclared = sorted(set(result.counters) - set(policy.COUNTERS))
    if undeclared:
        raise ValueError(f"compaction policy {type(policy).__name__} returned counters {undeclared} "
                         f"not in its COUNTERS {list(policy.COUNTERS)}")
    episode.ev.add(result.counters)
    if result.changed:
        episode.history[:] = result.items
        episode.ev.compactions += 1
        episode.prefix = None
    if result.end_reason is not None:
        episode.ev.end_reason, episode.stopped = result.end_reason, True
    return result


def scheduled(cfg: ContextHistoryConfig, actions_done: int) -> bool:
    """Whether the schedule compacts before the next model call, given the calls made so far."""
    if not cfg.enabled:
        return False
    if cfg.schedule.type == "rolling_recency":
        return True
    return actions_done > 0 and actions_done % cfg.schedule.actions_per_chunk == 0
