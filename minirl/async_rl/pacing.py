"""Admission pacing (`async_rl.sampler.admission=paced`): the rollout pump starts a prompt group only
when it is expected to finish while its start weight can still be trained, so a slow group is not
generated only to be evicted as stale. docs/async.md ("Admission pacing") gives the rule in full;
`Pacer.decide` and `protects` apply it.

Invariant: `Pacer.decide` and `protects` are pure functions of what was observed and their arguments
(the clock is passed in); holding never loses or reorders a prompt, and the pump is never held by
the duration rule while the train pump starves.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Hashable

from minirl.data import difficulty


def prompt_class(row: dict) -> Hashable:
    """A `/run` row's prompt class for pacing: the difficulty the row states (a neutral top-level
    `difficulty`, else `data.difficulty`: a doors row's room count), or one class (None) for rows that
    state none (a stated object or array is refused with its row: `data.class_problem`). Like the manager,
    pacing reads no environment field itself."""
    if "difficulty" in row:
        return row["difficulty"]
    return difficulty(row)


def protects(inflight: dict[int, int], ready_in_window: int, version: int, s: int, n: int, pending: bool) -> bool:
    """An ungated sampler (windowed) fills a step with any N ready groups of the window, the oldest
    start weight first, so a slow group loses its place to fast groups started after it. May one
    more group start? Only if the oldest *live* group in flight (start weight v, still selectable by
    some step) keeps a place even if every other group in flight or ready finishes before it: the
    steps that can still take it select (v + S - version + pending) * N groups, and the others and
    the new group must leave it one. `inflight`: start weight -> groups in flight; `pending`: the
    step at `version` has not selected yet."""
    chances = {v: v + s - version + int(pending) for v, k in inflight.items() if k > 0}
    live = {v: c for v, c in chances.items() if c >= 1}
    if not live:
        return True
    others = ready_in_window + sum(inflight[v] for v in live) - 1
    return others + 2 <= chances[min(live)] * n


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

    def state(self) -> dict:
        """What was observed, for a checkpoint: the durations by class and the intervals between
        publishes (the clock itself does not survive a restart)."""
        times = list(self.publishes)
        return {"durations": {cls: list(d) for cls, d in self.durations.items()},
                "gaps": [b - a for a, b in zip(times, times[1:])]}

    def load(self, state: dict, now: float) -> None:
        """Resume from `state`: the same durations and step period, the last publish at `now`."""
        self.durations = {cls: deque(d, maxlen=self.history) for cls, d in state["durations"].items()}
        gaps = state["gaps"][-self.history:]
        self.publishes = deque([now - sum(gaps[k:]) for k in range(len(gaps))] + [now], maxlen=self.history + 1)

    def published(self, now: float) -> None:
        """A new version is served from `now`."""
        self.publishes.append(now)

    def observed(self, cls: Hashable, seconds: float) -> None:
        """A group of class `cls` committed `seconds` after it was dispatched."""
        self.durations.setdefault(cls, deque(maxlen=self.history)).append(seconds)

    def expected(self, cls: Hashable) -> float | None:
        """The class's quantile; for a class not seen yet `pacing_bound_s`, else the slowest class
        seen (conservative), else None (nothing seen: admit and learn)."""
        seen = self.durations.get(cls)
        if seen:
            return quantile(list(seen), self.q)
        if self.bound_s is not None:
            return self.bound_s
        return max((quantile(list(d), self.q) for d in self.durations.values()), default=None)

    def period(self) -> float | None:
        """The median interval between publishes (None before the first publish)."""
        times = list(self.publishes)
        gaps = [b - a for a, b in zip(times, times[1:])]
        return quantile(gaps, 0.5) if gaps else None

    def window_left(self, now: float) -> float | None:
        """Seconds from `now` until the window of a group started now closes (t_v + S * P)."""
        period = self.period()
        return None if period is None else self.publishes[-1] + self.s * period - now

    def decide(self, classes: list, now: float, starving: bool) -> Decision:
        """May groups of these classes (one group, or a gated sampler's whole batch) start at `now`?

        A group started under version v may train up to v + S, and the step that takes v + S selects
        when it is published, so its window closes at t_v + S * P (P: the median interval between
        publishes; conservative, as that step may wait longer). Admit when the slowest class's
        expected duration fits the window left (`fits`), when nothing has been observed yet (`unknown`:
        admit and learn), or when the train pump starves (`starving`: holding then would stall the
        version, and with it the window, for ever); else `hold`."""
        known = [e for e in map(self.expected, classes) if e is not None]
        expected, left = (max(known) if known else None), self.window_left(now)
        if expected is None and left is not None:
            return Decision(True, "unknown", expected, left)
        if left is not None and expected <= left:
            return Decision(True, "fits", expected, left)
        return Decision(starving, "starving" if starving else "hold", expected, left)
