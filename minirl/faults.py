"""Seeded fault injection: which fault fires at which rollout coordinates.

Faults fire only at named sites in the real components (the generation server's engine boundary,
the agent's guard and loop, the agent server's HTTP layer); this module only decides *whether*
and *where*. A rate draw is a pure function of (faults.seed, kind, step, group, rollout, attempt),
never of how many draws came before.

Two kinds of rate:
- `faults.rate.{kind}` = p: a coin per rollout attempt, independent of the episode;
- `faults.rate_per_room.{kind}` = q: correlated with difficulty. Each room of the episode carries
  an independent hazard q, so a rollout attempt of an n-room episode fails with
  p_n = 1 - (1 - q)**n: a 4-room episode fails about four times as often as a 1-room one while q
  is small, and p_n stays a probability however many rooms there are. n is the row's
  `task.num_rooms`, so only the agent-side kinds (config.AGENT_SIDE_KINDS), whose sites see the row,
  take a per-room rate. With both rates set, the attempt fails with 1 - (1 - p)(1 - q)**n.
Either way one uniform draw per (kind, attempt) decides, so a fault that fires at rate r also fires
at every higher rate.

Invariant: the same FaultsConfig gives the same fault stream under every training policy, because
coordinates (dispatch order, counted from 0) and a prompt's room count (a function of its seed) do
not depend on what earlier rollouts did.
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

    def call_of(self, kind: str, c: Coords, num_rooms: int | None = None) -> int | None:
        """`num_rooms`: the row's room count, required where `faults.rate_per_room.{kind}` is set."""
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
        q = self.cfg.rate_per_room.get(kind, 0.0)
        if q > 0:
            if num_rooms is None:
                raise ValueError(f"faults.rate_per_room.{kind} needs the row's num_rooms at this fault site")
            p = 1 - (1 - p) * (1 - q) ** num_rooms
        if p > 0 and _uniform(self.cfg.seed, kind, c) < p:
            return 0
        return None

    def fires(self, kind: str, c: Coords, call: int, num_rooms: int | None = None) -> bool:
        return self.call_of(kind, c, num_rooms) == call
