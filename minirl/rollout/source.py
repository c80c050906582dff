"""The synchronous step source: `SyncSource.take(step, version)` dispatches one optimizer step's
prompt groups through the rollout manager, awaits them all, and hands them to the controller with
the generation servers' call records of that step. Its async twin, `BufferSource`, is in
minirl/async_rl/source.py; both are a `types.StepSource`.

Invariant: nothing outlives a step: every group of step s is dispatched, resolved and handed over
by step s's `take`, under the step's own policy version, so no trained call is older than it.
"""

from __future__ import annotations

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

    def snapshot(self) -> None:
        return None  # a sync checkpoint holds no buffer

    def restore(self, buffer: bytes | None) -> None:
        pass

    def published(self, version: int) -> None:
        pass

    def syncing(self) -> None:
        pass

    async def close(self) -> tuple[dict, list[dict]]:
        return {"buffered": [], "in_flight": []}, []  # nothing outlives a step

    async def take(self, step: int, version: int) -> StepTake:
        since = time.perf_counter()
        rows = [prompt_row(self.cfg, step, g) for g in range(self.cfg.grpo.num_prompts_per_step)]
        outcomes = await self.manager.run_step(step, rows)
        calls = await self.drain(step)
        return StepTake(outcomes, [version] * len(outcomes), calls, since, dict.fromkeys(SOURCE_COUNTS, 0))
