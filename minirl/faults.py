"""Seeded fault injection: the fault kinds, the site that fires each (`SITES`), and which fault fires
at which rollout coordinates (`FaultPlan`; docs/faults.md). This module only decides *whether* and
*where*: the real components fire at their named sites, each asking `fault_site` once per rollout
attempt. A new kind is a row of `SITES` and its `if fires(...)` at its site. Imports nothing of
minirl's at run time (minirl.config reads the table to check `faults.*`).

Invariant: a draw is a pure function of (faults.seed, kind, step, group, rollout, attempt) and the
prompt's room count, never of earlier draws or what earlier rollouts did, so the same FaultsConfig
gives the same fault stream under every training policy.
"""

from __future__ import annotations

import hashlib
import struct
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from minirl.wire import Coords

ENGINE = "engine boundary (generation/server.py)"
"""The generation server, just before the request reaches the engine."""
WORKER = "generation worker process (generation/server.py)"
"""The generation worker's own process: killed, or its front end hung."""
AGENT = "agent episode (agents/agent.py)"
"""The agent's context guard and loop, per model call."""
AGENT_HTTP = "agent server's HTTP layer (agents/server.py)"
"""The agent server's `/run` handler, around the whole episode."""
SUMMARIZE = "summarizing compaction (agents/compaction/summarize.py)"
"""The summarizing policy's summary requests, per compaction of the episode."""
VERIFY = "the verifier, after the episode (agents/server.py)"
"""Where a finished episode is scored (also the Gym 0.7 doors server's `/verify`, minirl/gym_servers/doors_v07.py):
`session_lost` makes it report `mask_sample: true`, Gym 0.7's "the reward is not a measurement"."""

SITES: dict[str, str] = {
    "context_overflow": ENGINE,
    "model_error": ENGINE,
    "call_log_lost": ENGINE,
    "guard_reject": AGENT,
    "agent_exception": AGENT,
    "timeout": AGENT_HTTP,
    "transport": AGENT_HTTP,
    "bad_output": AGENT_HTTP,
    "worker_kill": WORKER,
    "worker_hang": WORKER,
    "engine_hang": ENGINE,
    "engine_crash": ENGINE,
    "engine_loop_crash": ENGINE,
    "agent_kill": AGENT_HTTP,
    "session_lost": VERIFY,
    "summary_empty": SUMMARIZE,
    "summary_tool_call": SUMMARIZE,
    "summary_overflow": SUMMARIZE,
}
"""Every fault kind and the site that fires it (the order is the kinds' order in messages and
events). `call_log_lost` fires at the generation server after the call is answered: its record never
reaches the server's call log (as a restarted server loses its log), so the controller's ledger finds
that attempt's record short by one call. The summary kinds fire in the summarizing policy
(agents/compaction/summarize.py) at the rollout's compaction number `call` (from 0): `summary_empty`
and `summary_tool_call` on every attempt of that compaction (the real reply, recorded by the server,
is read as an empty block / as carrying a tool call: rejected, so the attempts run out),
`summary_overflow` on its first, untrimmed request (read as the server's context-length refusal, so
the middle of the history is trimmed and the request retried)."""
FAULT_KINDS = tuple(SITES)
AGENT_SIDE_KINDS = tuple(kind for kind, site in SITES.items()
                         if site in (AGENT, AGENT_HTTP, SUMMARIZE, VERIFY))
"""Kinds that fire in the agent pool, where the row (and so its task's room count) is known
(minirl's own verifier included, and the Gym 0.7 doors server's, which reads the row's task too)."""


def _uniform(seed: int, kind: str, c: Coords) -> float:
    digest = hashlib.blake2b(f"{seed}|{kind}|{c.key}".encode(), digest_size=8).digest()
    return struct.unpack(">Q", digest)[0] / 2**64


class FaultPlan:
    """Answers `call_of(kind, coords)`: the model-call index at which `kind` fires, or None.

    Two kinds of rate:
    - `faults.rate.{kind}` = p: a coin per rollout attempt, independent of the episode;
    - `faults.rate_per_room.{kind}` = q: correlated with difficulty. Each room of the episode carries
      an independent hazard q, so an attempt of an n-room episode fails with p_n = 1 - (1 - q)**n: a
      4-room episode fails about four times as often as a 1-room one while q is small, and p_n stays
      a probability however many rooms there are. n is the row's `task.num_rooms`, so only the
      agent-side kinds (AGENT_SIDE_KINDS), whose sites see the row, take a per-room rate.
    With both set, the attempt fails with 1 - (1 - p)(1 - q)**n. Either way one uniform draw per
    (kind, attempt) decides, so a fault that fires at rate r also fires at every higher rate.
    A kind fires at one call of an attempt: an attempt that a `faults.inject` spec matches takes that
    spec's `call`, not the rate's draw, and FaultsConfig.check refuses two specs of a kind that one
    attempt matches (the second would be ignored there)."""

    def __init__(self, cfg: Any):
        """`cfg`: the run's `faults` section (minirl.config.FaultsConfig, which imports this module's table)."""
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


def fault_site(plan: FaultPlan | None, coords: Coords | None, num_rooms: int | None = None,
               call: int | None = None) -> Callable[..., bool]:
    """A fault site's predicate for one rollout attempt: `fires(kind)` (or `fires(kind, call)`) is
    True when `kind` is planned for this attempt at that model call (the site's `call` by default;
    at any call when there is none, for the kinds that fire once per attempt). Never without a plan
    or coordinates (a request from outside a run)."""

    def fires(kind: str, at: int | None = call) -> bool:
        if plan is None or coords is None:
            return False
        planned = plan.call_of(kind, coords, num_rooms)
        return planned is not None and (at is None or planned == at)

    return fires
