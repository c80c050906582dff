"""The rollout pump: dispatches prompt groups ahead of training, and commits each one's resolution
to the group buffer with its weight versions.

It walks the prompt stream in order ((step, group) from `first_step`, group 0..N-1 per step), and
dispatches the next group once the sampler admits it at the current policy version, fewer than
`async_rl.max_inflight_prompts` groups are in flight, and the buffer has a free place. Each group
runs through `RolloutManager.run_group`: the whole failure policy (retry, backoff, row and group
redispatch, drop budget) applies unchanged, and keeps the group's `start_weight`.

Invariant: every prompt group is dispatched once and resolves once into the buffer (or the run
ends); a run-ending failure (drop budget, DATA re-raise, stall) stops the pump and is raised to the
train pump by `check`, never swallowed.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Awaitable, Callable

from minirl.async_rl.buffer import GroupBuffer, GroupRecord
from minirl.async_rl.samplers import Sampler
from minirl.config import MinirlConfig
from minirl.data import prompt_row
from minirl.rollout.manager import RolloutManager


class RolloutPump:
    def __init__(self, cfg: MinirlConfig, manager: RolloutManager, buffer: GroupBuffer, sampler: Sampler,
                 first_step: int, version: int, on_resolved: Callable[[int, int], Awaitable[None]]):
        self.cfg, self.manager, self.buffer, self.sampler = cfg, manager, buffer, sampler
        self.on_resolved = on_resolved
        self.next = (first_step, 0)
        self.version = version
        self.inflight: Counter = Counter()  # start_weight -> groups in flight
        self.tasks: set[asyncio.Task] = set()
        self.error: BaseException | None = None
        self.wake = asyncio.Event()
        self.main: asyncio.Task | None = None

    def start(self) -> None:
        self.main = asyncio.create_task(self._run())

    def set_version(self, version: int) -> None:
        self.version = version
        self.wake.set()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    async def stop(self) -> None:
        pending = [t for t in [self.main, *self.tasks] if t is not None]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        async with self.buffer.changed:
            self.buffer.changed.notify_all()  # wake the train pump: it raises the error

    async def _run(self) -> None:
        limit = self.cfg.async_rl.max_inflight_prompts
        watchdog = asyncio.create_task(self.manager.watchdog(self.next[0]))
        watchdog.add_done_callback(lambda t: t.cancelled() or asyncio.ensure_future(self._fail(t.exception())))
        try:
            while self.error is None:
                step, group = self.next
                if self.sampler.name == "in_order" and step >= self.cfg.grpo.max_num_steps:
                    return  # every step's prompts are out (the other samplers draw spares past the end)
                while not (self.sampler.admit(step, self.version) and len(self.tasks) < limit):
                    self.wake.clear()
                    await self.wake.wait()
                await self.buffer.reserve()
                task = asyncio.create_task(self._dispatch(step, group, self.version))
                self.tasks.add(task)
                task.add_done_callback(self._done)
                n = self.cfg.grpo.num_prompts_per_step
                self.next = (step + (group + 1) // n, (group + 1) % n)
        finally:
            watchdog.cancel()

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        self.wake.set()

    async def _dispatch(self, step: int, group: int, start: int) -> None:
        self.inflight[start] += 1
        try:
            outcome = await self.manager.run_group(step, group, prompt_row(self.cfg, step, group))
            await self.on_resolved(step, group)
        except asyncio.CancelledError:
            await self.buffer.release()
            raise
        except BaseException as exc:  # a run-ending failure: stop dispatching, hand it to the train pump
            await self.buffer.release()
            await self._fail(exc)
            return
        finally:
            self.inflight[start] -= 1
        await self.buffer.commit(GroupRecord(step, group, start, self.version, outcome, target_step=step))
