"""The train pump's half of async GRPO: `BufferSource.take(step, version)` hands the controller one
optimizer step's prompt groups from the buffer that the rollout pump (pump.py) fills. It is a
`types.StepSource`, as the synchronous `SyncSource` (minirl/rollout/source.py) is.

Invariant: every buffered group is taken by exactly one step or evicted once; every call record
drained from the servers reaches exactly one step's ledger (with its group, or as an orphan), or
the run's end (`close`: a step that failed after its take, or groups no step took); the checkpoint's
buffer carries the call records of exactly the groups it holds and the prompts its places in flight
gave up on (`replace`: the step that trains such a place ledgers them), the orphans no step has
ledgered yet, and the groups already taken or evicted (so a resumed run files their late records as
orphans, as the run it resumes would have).
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import time
from typing import Awaitable, Callable

from minirl.async_rl.buffer import GroupBuffer, GroupRecord
from minirl.async_rl.pump import RolloutPump
from minirl.async_rl.samplers import make_sampler
from minirl.config import MinirlConfig
from minirl.rollout.manager import RolloutManager
from minirl.types import SOURCE_COUNTS, StepTake


def _keys(record: GroupRecord) -> list[tuple[int, int]]:
    """The (step, group) of a buffer record's prompt and of the prompts its place gave up on."""
    return [(record.step, record.group)] + [(o.step, o.group) for o in record.lost]


class BufferSource:
    """Async (`async_rl.enabled=true`): the step's groups, as the sampler selects them from the buffer.

    The first `take` opens the manager and starts the pump (from a resumed checkpoint's buffer if there
    is one). Each `take` evicts the committed groups the sampler can no longer select (an `evict` event
    each, written at once even if the wait goes on or ends the run), waits until the sampler selects the
    step's groups, and takes them with their servers' call records. Call records are moved from the
    generation workers as each group resolves (`resolved`) and kept by (step, group) until their group
    is taken; records of groups already taken or evicted (late records of retired attempts) are orphans,
    handed to the next step's ledger, which retires them. The groups a `take` evicted ride on its
    StepTake (`evicted`), so the step that lost them counts what they cost."""

    def __init__(self, cfg: MinirlConfig, manager: RolloutManager,
                 drain: Callable[[int | None], Awaitable[list[dict]]]):
        self.cfg, self.manager, self.drain = cfg, manager, drain
        self.window = cfg.async_rl.sampler.max_staleness_versions
        self.pump: RolloutPump | None = None  # started by the first `take`
        self.calls: dict[tuple[int, int], list[dict]] = {}  # drained server records by (step, group)
        self.orphans: list[dict] = []  # records of groups evicted or already taken (retired attempts)
        self.unledgered: list[dict] = []  # the last take's records, until its step's ledger has them
        self.consumed: set[tuple[int, int]] = set()
        self.restored: dict | None = None  # a resumed checkpoint's buffer, until the pump starts
        self.handed_over = time.perf_counter()  # when the previous step's groups were taken
        self.moving: set[asyncio.Future] = set()  # call-record moves under way (`resolved`)

    def snapshot(self) -> bytes | None:
        """The buffer with the call records of its groups and of the prompts its places in flight gave
        up on, the orphans, and the groups taken or evicted, pickled (taken between two awaits)."""
        if self.pump is None:
            return None
        pump = self.pump.snapshot()
        held = [k for r in pump["ready"] for k in _keys(r)] + [(o.step, o.group) for job in pump["in_flight"]
                                                                for o in job[5]]
        calls = {k: self.calls[k] for k in held if k in self.calls}
        return pickle.dumps({"pump": pump, "calls": calls, "orphans": self.orphans, "consumed": self.consumed})

    def restore(self, buffer: bytes | None) -> None:
        """Resume: the buffer that the pump restores when it starts; the orphans the next take ledgers, and
        the groups whose late records are orphans (a checkpoint of before 2026-12-07 has neither)."""
        self.restored = pickle.loads(buffer) if buffer is not None else None
        if self.restored is not None:
            self.orphans = list(self.restored.get("orphans", []))
            self.consumed = set(self.restored.get("consumed", ()))

    def published(self, version: int) -> None:
        if self.pump is not None:
            self.pump.set_version(version)

    def syncing(self) -> None:
        if self.pump is not None:
            self.pump.pause()

    async def close(self) -> tuple[dict, list[dict]]:
        """The run ends: stop the pump. The groups it leaves unfinished (in the buffer, taken by no step;
        in flight, cancelled now) and the call records drained for them, or orphaned, that no ledger took."""
        in_flight = [] if self.pump is None else await self.pump.stop()
        await asyncio.gather(*self.moving, return_exceptions=True)  # records a cancelled place was filing
        buffered = [] if self.pump is None else sorted([r.step, r.group] for r in self.buffer.ready)
        if self.pump is None and self.restored:  # a resumed run that ended before its first take (its pump never
            restored, self.restored = self.restored, None  # started): the checkpoint's groups are the unfinished
            buffered = sorted([r.step, r.group] for r in restored["pump"]["ready"])
            in_flight = sorted([job[0], job[1]] for job in restored["pump"]["in_flight"])
            self.calls.update(restored["calls"])
        held = [c for records in self.calls.values() for c in records] + self.orphans + self.unledgered
        self.calls, self.orphans, self.unledgered = {}, [], []
        return {"buffered": buffered, "in_flight": in_flight}, held

    def ledgered(self) -> None:
        self.unledgered = []

    def _start(self, step: int, version: int) -> None:
        ar = self.cfg.async_rl
        self.manager.open()
        self.buffer = GroupBuffer(ar.max_buffered_rollouts)
        self.sampler = make_sampler(ar.sampler.name, self.cfg.grpo.num_prompts_per_step,
                                    ar.sampler.max_staleness_versions)
        restored, self.restored = self.restored, None
        self.pump = RolloutPump(self.cfg, self.manager, self.buffer, self.sampler, step, version, self.resolved,
                                restored and restored["pump"])
        self.calls.update(restored["calls"] if restored else {})
        self.pump.start()

    async def take(self, step: int, version: int) -> StepTake:
        """Evict stale groups, then wait until the sampler selects `step`'s groups; take them."""
        if self.pump is None:
            self._start(step, version)
        self.pump.train_waiting = step  # the pump's watchdog: a wait with nothing in flight is a stall
        self.pump.train_step = step  # the step the run is on: the manager's `stall` events name it
        try:
            stale, chosen = await self.buffer.take_when(lambda ready: self._pick(step, version, ready))
        finally:
            self.pump.train_waiting = None
        self.pump.selected = version  # the step at `version` has its groups (pacing counts on it)
        # upstream's counters: a place whose spare committed is replaced (counted in the step it filled),
        # a group re-stamped into the step promoted; `dropped_prompt_groups` is the shortfall left
        counts = dict(zip(SOURCE_COUNTS, (len(stale), sum(r.promoted for r in chosen),
                                         sum(r.replacement and r.outcome.status == "committed" for r in chosen))))
        self.consumed.update(key for r in stale + chosen for key in _keys(r))
        calls = [c for r in chosen for key in _keys(r) for c in self.calls.pop(key, [])] + self.orphans
        self.orphans, self.unledgered = [], calls
        # the prompts a place gave up on (replaced): counted in the step's attempts and costs, never as groups
        lost = [dataclasses.replace(o, status="replaced") for r in chosen for o in r.lost]
        since, self.handed_over = self.handed_over, time.perf_counter()  # generation overlaps training
        evicted = tuple(o for r in stale for o in [r.outcome, *r.lost])
        return StepTake([r.outcome for r in chosen] + lost, [r.start_weight for r in chosen] + [version] * len(lost),
                        calls, since, counts, evicted)

    def _pick(self, step: int, version: int, ready: list[GroupRecord]):
        self.pump.check()
        stale = self.sampler.stale(version, ready, self.pump.inflight)
        for r in stale:  # evicted now, even if the wait goes on (or ends the run): its event now
            self.consumed.update(_keys(r))  # a late record of it (a retired attempt's) is an orphan from now
            calls = [c for key in _keys(r) for c in self.calls.pop(key, [])]
            self.orphans += calls
            self.manager.emit({"type": "evict", "step": r.step, "group": r.group, "rollout": None, "attempt": None,
                               "decision": "evicted", "start_weight": r.start_weight,
                               "train_version": version, "max_staleness_versions": self.sampler.s,
                               "reason": "stale" if r.start_weight < version - self.sampler.s else "short_weight",
                               "gen_tokens": sum(len(c.get("generation_token_ids") or []) for c in calls)})
        # select among what stays: a weight it evicted (weight_fifo's short weight) is no step's oldest
        gone = {id(r) for r in stale}
        left = [r for r in ready if id(r) not in gone]
        return stale, self.sampler.select(step, version, left, self.pump.inflight)

    async def resolved(self, step: int, group: int) -> None:
        """A group resolved: move its step's call records from the servers into `calls` (those of
        groups already taken or evicted, late records of retired attempts, into `orphans`). The move is
        shielded: a place cancelled mid-move (the run's end, `close`) would otherwise drop the records a
        server already handed over; `close` waits for the moves under way."""
        move = asyncio.ensure_future(self._move(step))
        self.moving.add(move)
        move.add_done_callback(self.moving.discard)
        await asyncio.shield(move)

    async def _move(self, step: int) -> None:
        for c in await self.drain(step):
            key = (c["step"], c["group"])
            (self.orphans if key in self.consumed else self.calls.setdefault(key, [])).append(c)
