"""Fleet watching (`async_rl.generation_fleet_health.enabled`): the consumer side of the generation
router's health report. While a step collects, `FleetWatch.watched` polls the router, logs and
counts each quarantine and re-admission, and ends the step with GenerationFleetUnhealthy when fewer
than `min_healthy_shards` workers are healthy.

Invariant: every transition the router reports is written once, with the step being collected, and
counted once in that step's `stats`; a step whose collection ends is polled once more, so no
transition before its end is left for the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Awaitable, Callable, TypeVar

from minirl.wire import GenerationFleetUnhealthy

FLEET_COUNTS = {"worker_quarantined": "workers_quarantined", "worker_readmitted": "workers_readmitted"}
"""The router's transition events and the per-step metric that counts each."""

T = TypeVar("T")


class FleetWatch:
    def __init__(self, router, probe_interval_s: float, write: Callable[[dict], None]):
        self.router, self.interval, self.write = router, probe_interval_s, write
        self.stats: dict = {}  # this step's quarantines, re-admissions, healthy workers (empty: not watched)

    async def watched(self, step: int, body: Awaitable[T]) -> T:
        """Await `body` while the fleet is watched (without a router, just await it)."""
        if self.router is None:
            return await body
        self.stats = dict.fromkeys(FLEET_COUNTS.values(), 0)
        stop = asyncio.Event()
        task, watch = asyncio.ensure_future(body), asyncio.ensure_future(self._watch(step, stop))
        try:
            await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            # the watcher is stopped between polls, never cancelled inside one: the router hands its
            # transitions over once (`poll_health` clears them), so a poll cut off would lose them
            stop.set()
            task.cancel()
            await asyncio.gather(task, watch, return_exceptions=True)
        if task.cancelled():  # the watcher ended the step
            watch.result()
        try:
            await self._poll(step)  # the transitions since the watcher's last poll
        except GenerationFleetUnhealthy as exc:
            raise exc from task.exception()
        return task.result()

    async def _watch(self, step: int, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self._poll(step)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)

    async def _poll(self, step: int) -> None:
        report = await self.router.poll_health.remote()
        for event in report["events"]:
            self.write({**event, "step": step})
            self.stats[FLEET_COUNTS[event["type"]]] += 1
        self.stats["healthy_generation_workers"] = report["healthy"]
        if report["error"] is not None:
            raise GenerationFleetUnhealthy(report["error"])
