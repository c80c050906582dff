"""The synchronous step source: `SyncSource.take(step, version)` dispatches one optimizer step's
prompt groups through the rollout manager, awaits them all, and hands them to the controller with
the generation servers' call records of that step. Its async twin, `BufferSource`, is in
minirl/async_rl/source.py; both are a `types.StepSource`.

Invariant: nothing outlives a step: every group of step s is dispatched, resolved and handed over
by step s's `take`, under the step's own policy version, so no trained call is older than it. Every
call record taken from a server is handed over once: in the step's take, or (a take that failed) to
`close`, for the ledger's run_end.
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

    def snapshot(self) -> None:
        return None  # a sync checkpoint holds no buffer

    def restore(self, buffer: bytes | None) -> None:
        pass

    def published(self, version: int) -> None:
        pass

    def syncing(self) -> None:
        pass

    async def close(self) -> tuple[dict, list[dict]]:
        held, self.held = self.held, []
        return {"buffered": [], "in_flight": []}, held  # no group outlives a step

    async def take(self, step: int, version: int) -> StepTake:
        """The step's groups, and the servers' records of their calls: those taken while the last group
        ran alone (`RolloutManager.run_step`'s `on_tail`), then the rest once every group resolved, so
        the take on the step's path carries one group's records rather than the whole step's."""
        since = time.perf_counter()
        rows = [prompt_row(self.cfg, step, g) for g in range(self.cfg.grpo.num_prompts_per_step)]
        early: list[asyncio.Future] = []
        try:
            outcomes = await self.manager.run_step(step, rows, lambda: early.append(asyncio.ensure_future(
                self.drain(step))))
            parts = await asyncio.gather(*map(asyncio.shield, early), self.drain(step))
        except BaseException:  # what the early take holds goes to no step: the run's end retires it
            for part in await asyncio.gather(*early, return_exceptions=True):
                self.held += part if isinstance(part, list) else []
            raise
        calls = [c for part in parts for c in part]
        return StepTake(outcomes, [version] * len(outcomes), calls, since, dict.fromkeys(SOURCE_COUNTS, 0))
