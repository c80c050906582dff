"""The synchronous step source: `SyncSource.take(step, version)` dispatches one optimizer step's
prompt groups through the rollout manager, awaits them all, and hands them to the controller with
the generation servers' call records of that step (taken as its groups resolve: `Trickle`). Its
async twin, `BufferSource`, is in minirl/async_rl/source.py; both are a `types.StepSource`.

Invariant: nothing outlives a step: every group of step s is dispatched, resolved and handed over
by step s's `take`, under the step's own policy version, so no trained call is older than it. Every
call record taken from a server is handed over once: in the step's take, kept until the step's ledger
has it (`ledgered`), or (a take that failed, a step that failed after its take, a take the run's end
cut short) to `close`, for the ledger's run_end. A take under way when the run ends (a SIGTERM: the
driver stops waiting, the controller's step does not) is stopped by `close`, and its groups are
named in flight there, as the async source names the places its pump cancels.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from minirl.config import MinirlConfig
from minirl.data import prompt_row
from minirl.rollout.manager import RolloutManager
from minirl.types import SOURCE_COUNTS, StepTake


class SyncSource:
    """Sync (`async_rl.enabled=false`): the step's prompt groups, dispatched and awaited."""

    window = 0  # every trained call runs under the step's own version

    def __init__(self, cfg: MinirlConfig, manager: RolloutManager,
                 drain: Callable[[int | None], Awaitable[list[dict]]]):
        self.cfg, self.manager, self.drain = cfg, manager, drain
        self.held: list[dict] = []  # records taken by a take that then failed: no step's, retired at close
        self.unledgered: list[dict] = []  # the last take's records, until its step's ledger has them
        # the last take: its step, its groups' run and whether the take has ended (its records handed on)
        self.taking: tuple[int, asyncio.Task, asyncio.Event] | None = None

    def snapshot(self) -> None:
        return None  # a sync checkpoint holds no buffer

    def restore(self, buffer: bytes | None) -> None:
        pass

    def published(self, version: int) -> None:
        pass

    def syncing(self) -> None:
        pass

    def ledgered(self) -> None:
        self.unledgered = []

    async def close(self) -> tuple[dict, list[dict]]:
        """The run ends. A take still under way (the driver left it: a SIGTERM) is stopped as the async
        pump stops its places: its groups' run is cancelled and its groups, but those given up on (their
        drop or skip is their fate), are named in flight; once the take has ended, what its trickle took
        is in `held` (or, had its groups all resolved, in `unledgered`). Nothing is buffered: no group
        outlives a step."""
        in_flight = []
        if self.taking is not None:
            step, run, ended = self.taking
            if not run.done():
                in_flight = sorted([s, g] for (s, g), o in self.manager.unsettled.items()
                                   if s == step and o.status == "committed")
                run.cancel()
            await ended.wait()  # a drain under way is awaited: the servers have handed its records over
        held, self.held, self.unledgered = self.held + self.unledgered, [], []
        return {"buffered": [], "in_flight": in_flight}, held

    async def take(self, step: int, version: int) -> StepTake:
        """The step's groups, and the servers' records of their calls: taken as the groups resolve
        (`Trickle`), then the rest once every group has, so the take on the step's path carries only
        the records of the step's last calls rather than the whole step's."""
        since = time.perf_counter()
        rows = [prompt_row(self.cfg, step, g) for g in range(self.cfg.grpo.num_prompts_per_step)]
        trickle = Trickle(lambda: self.drain(step))
        # a task of its own, so that `close` can stop the groups while this take still hands on its records
        run = asyncio.ensure_future(self.manager.run_step(step, rows, trickle.poke))
        ended = asyncio.Event()
        self.taking = step, run, ended
        try:
            outcomes = await run
            calls = await trickle.finish()
            self.unledgered = calls
        except BaseException:  # what the takes so far hold goes to no step: the run's end retires it
            self.held += await trickle.taken()
            raise
        finally:
            ended.set()
        return StepTake(outcomes, [version] * len(outcomes), calls, since, dict.fromkeys(SOURCE_COUNTS, 0))


class Trickle:
    """A step's call records, taken from the servers while its groups run: `poke` (a group resolved)
    starts a take, one at a time (a poke while one runs asks for one more after it); `finish` waits
    for the take in flight, then takes the rest. Every take's records are kept in the order taken;
    one in flight is always awaited, never cancelled, since the servers have already handed it over.
    A take that fails stays the last: no poke starts another, and `finish` raises its error."""

    def __init__(self, drain: Callable[[], Awaitable[list[dict]]]):
        self.drain, self.parts = drain, []
        self.task: asyncio.Task | None = None
        self.again = False

    def poke(self) -> None:
        if self.task is not None and not self.task.done():
            self.again = True
        elif self.task is None or self.task.exception() is None:
            self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        self.again = True
        while self.again:
            self.again = False
            self.parts.append(await self.drain())

    async def finish(self) -> list[dict]:
        if self.task is not None:
            await asyncio.shield(self.task)
        self.parts.append(await self.drain())
        return self._records()

    async def taken(self) -> list[dict]:
        """What the takes so far handed over (the take in flight awaited; a failed one took nothing)."""
        if self.task is not None:
            await asyncio.gather(self.task, return_exceptions=True)
        return self._records()

    def _records(self) -> list[dict]:
        return [c for part in self.parts for c in part]
