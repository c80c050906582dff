"""Admission pacing (`async_rl.sampler.admission=paced`): the rollout pump starts a prompt group only
when it is expected to finish while its start weight can still be trained, so a slow group is not
generated only to be evicted as stale.

A group started under version v may train at versions v..v+S (S: `max_staleness_versions`); the
last step that can take it selects its groups when version v+S is published, S step periods after
v was. With P the median of the recent intervals between publishes and t_v the time v was
published, a group's window closes at t_v + S * P (a conservative bound: that step may also wait
for groups and select later). A group's expected duration is the `pacing_quantile` of the recent
dispatch-to-commit durations of its *prompt class* (`prompt_class`: the row's difficulty; for doors
the room count), or `pacing_bound_s` for a class not seen yet. The pump holds the group at the
head of the stream while now + expected > t_v + S * P, and admits it:
- when it fits (a publish opens a fresh window, or the estimates shrink);
- when its class has no observed duration and no bound: the pacer learns from what it admits
  (but before the first publish, with no step period known, only what the first step needs starts);
- when the train pump is starving (waiting for a step with fewer groups in flight or ready in the
  window than a step takes): holding then would stall the version, and with it the window, for ever.

Invariant: `Pacer.decide` is a pure function of what was observed and its arguments (the clock is
passed in); holding never loses a prompt (the stream order is kept), and the pump is never held
while the train pump starves.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Hashable


def prompt_class(row: dict) -> Hashable:
    """A `/run` row's prompt class for pacing: the difficulty the row states (a neutral top-level
    `difficulty`, else the doors task's room count), or one class (None) for rows that state none."""
    if "difficulty" in row:
        return row["difficulty"]
    task = row.get("task")
    return task.get("num_rooms") if isinstance(task, dict) else None


@dataclass(frozen=True)
class Decision:
    admit: bool
    reason: str  # fits | unknown | starving | hold
    expected_s: float | None
    window_left_s: float | None


def quantile(xs: list[float], q: float) -> float:
    """The q-quantile of `xs` (nearest rank, the upper one: conservative)."""
    ordered = sorted(xs)
    rank = min(len(ordered), max(1, math.ceil(q * len(ordered) - 1e-9)))
    return ordered[rank - 1]


class Pacer:
    """What the pump observed (durations by class, publish times) and the admission rule on it."""

    def __init__(self, max_staleness_versions: int, quantile_q: float = 0.9, bound_s: float | None = None,
                 started_at: float = 0.0, history: int = 16):
        self.s, self.q, self.bound_s = max_staleness_versions, quantile_q, bound_s
        self.durations: dict[Hashable, deque] = {}
        self.history = history
        self.publishes: deque = deque([started_at], maxlen=history + 1)

    def published(self, now: float) -> None:
        """A new version is served from `now`."""
        self.publishes.append(now)

    def observed(self, cls: Hashable, seconds: float) -> None:
        """A group of class `cls` committed `seconds` after it was dispatched."""
        self.durations.setdefault(cls, deque(maxlen=self.history)).append(seconds)

    def expected(self, cls: Hashable) -> float | None:
        seen = self.durations.get(cls)
        return quantile(list(seen), self.q) if seen else self.bound_s

    def period(self) -> float | None:
        """The median interval between publishes (None before the first publish)."""
        times = list(self.publishes)
        gaps = [b - a for a, b in zip(times, times[1:])]
        return quantile(gaps, 0.5) if gaps else None

    def window_left(self, now: float) -> float | None:
        """Seconds from `now` until the window of a group started now closes (t_v + S * P)."""
        period = self.period()
        return None if period is None else self.publishes[-1] + self.s * period - now

    def decide(self, cls: Hashable, now: float, starving: bool) -> Decision:
        expected, left = self.expected(cls), self.window_left(now)
        if expected is None and left is not None:
            return Decision(True, "unknown", expected, left)
        if left is not None and expected <= left:
            return Decision(True, "fits", expected, left)
        return Decision(starving, "starving" if starving else "hold", expected, left)
