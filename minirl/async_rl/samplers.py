"""Staleness samplers: which prompt groups the rollout pump may dispatch now, and which finished
groups the next optimizer step takes, as NeMo-RL's Single-Controller samplers decide it.

A group is trainable at policy version `w` only if its `start_weight` (the version it was
dispatched under) lies in [w - max_staleness_versions, w]; committed groups outside the window are
evicted (counted, never trained).
- `in_order`: the prompt groups of step s are stamped `target_step = s` at admission and admitted
  only once s - version <= max_staleness_versions; step s trains exactly those groups, once all of
  them have resolved (committed, dropped or skipped), so a drop shrinks its own step as in sync
  (with `on_dropped_prompt=replace`, a dropped group's place waits for its replacement, and a
  group re-stamped from a later step counts in this one).
  At max_staleness_versions=0 this is the synchronous loop, step for step.
- `windowed`: dispatch is ungated (only the buffer and max_inflight_prompts bound it); a step takes
  the `num_prompts_per_step` oldest committed groups in the window, whatever their prompt step.
- `weight_fifo`: as windowed, but a step waits until the oldest start_weight in the window has
  filled the batch, or nothing of that weight is still in flight.

Invariant: `select` returns the records of one optimizer step or None (wait), and never a
committed record outside the window; `stale` names exactly the committed records outside it.
"""

from __future__ import annotations

from collections import Counter

from minirl.async_rl.buffer import GroupRecord


class Sampler:
    name = "base"

    def __init__(self, num_prompts_per_step: int, max_staleness_versions: int):
        self.n, self.s = num_prompts_per_step, max_staleness_versions

    def in_window(self, r: GroupRecord, version: int) -> bool:
        return version - self.s <= r.start_weight <= version

    def admit(self, prompt_step: int, version: int) -> bool:
        return True

    def stale(self, version: int, ready: list[GroupRecord]) -> list[GroupRecord]:
        return [r for r in ready if r.outcome.status == "committed" and r.start_weight < version - self.s]

    def select(self, step: int, version: int, ready: list[GroupRecord], inflight: Counter) -> list[GroupRecord] | None:
        raise NotImplementedError


class InOrder(Sampler):
    name = "in_order"

    def admit(self, prompt_step: int, version: int) -> bool:
        return prompt_step - version <= self.s

    def select(self, step, version, ready, inflight):
        mine = [r for r in ready if r.target_step == step]
        places = sum(not r.replaced for r in mine)  # a replaced drop's place is filled by its replacement
        return sorted(mine, key=lambda r: (r.step, r.group)) if places == self.n else None


class Windowed(Sampler):
    name = "windowed"

    def _batch(self, version, ready):
        lost = [r for r in ready if r.outcome.status != "committed"]  # reported with the step, never trained
        ok = sorted((r for r in ready if r.outcome.status == "committed" and self.in_window(r, version)),
                    key=lambda r: (r.start_weight, r.step, r.group))
        return ok, lost

    def select(self, step, version, ready, inflight):
        ok, lost = self._batch(version, ready)
        return ok[: self.n] + lost if len(ok) >= self.n else None


class WeightFifo(Windowed):
    name = "weight_fifo"

    def select(self, step, version, ready, inflight):
        ok, lost = self._batch(version, ready)
        if len(ok) < self.n:
            return None
        oldest = ok[0].start_weight
        same = [r for r in ok if r.start_weight == oldest]
        if len(same) < self.n and inflight.get(oldest, 0) > 0:
            return None  # that weight's batch is still filling
        return ok[: self.n] + lost


SAMPLERS = {cls.name: cls for cls in (InOrder, Windowed, WeightFifo)}


def make_sampler(name: str, num_prompts_per_step: int, max_staleness_versions: int) -> Sampler:
    return SAMPLERS[name](num_prompts_per_step, max_staleness_versions)
