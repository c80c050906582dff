"""Staleness samplers: which prompt groups the rollout pump may dispatch now, and which finished
groups the next optimizer step takes, as NeMo-RL's Single-Controller samplers decide it. A group
started under policy version v may train at w only if w - S <= v <= w (S: `max_staleness_versions`);
a *gated* sampler also dispatches prompt batch k only while k <= w + S. One class per sampler.

Invariant: `select` returns the records of one optimizer step or None (wait), and never a
committed record outside the sampler's window; `stale` names exactly the committed records that
can no longer be selected.
"""

from __future__ import annotations

from collections import Counter

from minirl.async_rl.buffer import GroupRecord
from minirl.config import SAMPLER_TRAITS


class Sampler:
    """A sampler's traits (`gated`, `stamps_target_steps`, `needs_is_correction`, `capacity`) are its
    row of `config.SAMPLER_TRAITS`, copied onto the class when it is defined: the config, which
    imports no runtime code, checks the same facts that the pump and the source read here."""

    name = "base"
    gated = stamps_target_steps = needs_is_correction = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        traits = SAMPLER_TRAITS[cls.name]
        cls.gated, cls.stamps_target_steps = traits.gated, traits.stamps_target_steps
        cls.needs_is_correction = traits.needs_is_correction

    def __init__(self, num_prompts_per_step: int, max_staleness_versions: int):
        self.n, self.s = num_prompts_per_step, max_staleness_versions

    @classmethod
    def capacity(cls, num_prompts_per_step: int, s: int) -> int:
        return SAMPLER_TRAITS[cls.name].capacity(num_prompts_per_step, s)

    def in_window(self, r: GroupRecord, version: int) -> bool:
        return version - self.s <= r.start_weight <= version

    def admit(self, prompt_step: int, version: int) -> bool:
        return not self.gated or prompt_step - version <= self.s

    def stale(self, version: int, ready: list[GroupRecord], inflight: Counter | None = None) -> list[GroupRecord]:
        return [r for r in ready if r.outcome.status == "committed" and r.start_weight < version - self.s]

    def select(self, step: int, version: int, ready: list[GroupRecord], inflight: Counter) -> list[GroupRecord] | None:
        raise NotImplementedError


class InOrder(Sampler):
    """Gated, stamps target steps: batch s's groups are stamped `target_step = s`; step s trains exactly
    the groups stamped for it once every place has resolved (committed, or lost and reported), so a drop
    shrinks its own step as in sync, or is replaced (`on_dropped_prompt=replace`). Eviction keeps
    [w - S, w] by start weight. At S = 0 it is the synchronous loop, step for step."""

    name = "in_order"

    def select(self, step, version, ready, inflight):
        mine = [r for r in ready if r.target_step == step]
        return sorted(mine, key=lambda r: (r.step, r.group)) if len(mine) == self.n else None


class Windowed(Sampler):
    """Ungated: a step takes the `num_prompts_per_step` oldest committed groups whose start weight lies
    in [w - S, w]; the committed groups outside it are evicted (wasted compute)."""

    name = "windowed"

    def _batch(self, version, ready):
        lost = [r for r in ready if r.outcome.status != "committed"]  # reported with the step, never trained
        ok = sorted((r for r in ready if r.outcome.status == "committed" and self.in_window(r, version)),
                    key=lambda r: (r.start_weight, r.step, r.group))
        return ok, lost

    def select(self, step, version, ready, inflight):
        ok, lost = self._batch(version, ready)
        return ok[: self.n] + lost if len(ok) >= self.n else None


class WeightFifo(Sampler):
    """Gated: a step waits for the single oldest start weight over every in-window group, in flight or
    ready, and takes `num_prompts_per_step` groups of that weight only: it never mixes versions. A weight
    below w that can no longer fill a step (nothing of it in flight, fewer than a step's groups ready: a
    batch split across a version change by the in-flight cap or by a retry's re-stamp) is evicted whole,
    where upstream's select would wait for it."""

    name = "weight_fifo"

    def _oldest(self, version, ready, inflight) -> int | None:
        weights = [r.start_weight for r in ready if self.in_window(r, version)]
        weights += [w for w, k in (inflight or {}).items() if k > 0 and version - self.s <= w <= version]
        return min(weights, default=None)

    def stale(self, version, ready, inflight=None):
        out = super().stale(version, ready)
        oldest = self._oldest(version, ready, inflight)
        while oldest is not None and oldest < version and not (inflight or {}).get(oldest):
            same = [r for r in ready if r.start_weight == oldest and r not in out]
            if len(same) >= self.n:
                break
            out += same  # this weight can never fill a step of its own
            oldest = self._oldest(version, [r for r in ready if r not in out], inflight)
        return out

    def select(self, step, version, ready, inflight):
        oldest = self._oldest(version, ready, inflight)
        same = sorted((r for r in ready if r.start_weight == oldest), key=lambda r: (r.step, r.group))
        return same[: self.n] if oldest is not None and len(same) >= self.n else None


class ReadyFirst(Sampler):
    """Gated: a step takes the first `num_prompts_per_step` ready groups with start weight <= w, however
    old, in dispatch order (upstream's reservation order: the prompt stream's (step, group); it stamps no
    target step, so it has no spares out of that order): a slow group trains as soon as it is ready.
    Nothing is evicted, so the config requires the importance sampling correction with it."""

    name = "ready_first"

    def stale(self, version, ready, inflight=None):
        return []  # every admitted group stays selectable

    def select(self, step, version, ready, inflight):
        ok = sorted((r for r in ready if r.start_weight <= version), key=lambda r: (r.step, r.group))
        return ok[: self.n] if len(ok) >= self.n else None


SAMPLERS = {cls.name: cls for cls in (InOrder, Windowed, WeightFifo, ReadyFirst)}


def make_sampler(name: str, num_prompts_per_step: int, max_staleness_versions: int) -> Sampler:
    return SAMPLERS[name](num_prompts_per_step, max_staleness_versions)
