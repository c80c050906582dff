"""Seeded fault injection: which fault fires at which rollout coordinates.

Faults fire only at named sites in the real components (the generation server's engine boundary,
the agent's guard and loop, the agent server's HTTP layer); this module only decides *whether*
and *where*. A rate draw is a pure function of (faults.seed, kind, step, group, rollout, attempt),
never of how many draws came before.

Invariant: the same FaultsConfig gives the same fault stream under every training policy, because
coordinates (dispatch order, counted from 0) do not depend on what earlier rollouts did.
"""

from __future__ import annotations

import hashlib
import struct

from minirl.config import FaultsConfig
from minirl.wire import Coords


def _uniform(seed: int, kind: str, c: Coords) -> float:
    digest = hashlib.blake2b(f"{seed}|{kind}|{c.key}".encode(), digest_size=8).digest()
    return struct.unpack(">Q", digest)[0] / 2**64


class FaultPlan:
    """Answers `call_of(kind, coords)`: the model-call index at which `kind` fires, or None."""

    def __init__(self, cfg: FaultsConfig):
        self.cfg = cfg

    def call_of(self, kind: str, c: Coords) -> int | None:
        for spec in self.cfg.inject:
            if spec.kind == kind and all(
                want is None or want == have
                for want, have in (
                    (spec.step, c.step),
                    (spec.group, c.group),
                    (spec.rollout, c.rollout),
                    (spec.attempt, c.attempt),
                )
            ):
                return spec.call
        p = self.cfg.rate.get(kind, 0.0)
        if p > 0 and _uniform(self.cfg.seed, kind, c) < p:
            return 0
        return None

    def fires(self, kind: str, c: Coords, call: int) -> bool:
        return self.call_of(kind, c) == call
