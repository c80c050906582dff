"""The rollout pump: dispatches prompt groups ahead of training, and commits each one's resolution
to the group buffer with its weight versions.

It walks the prompt stream in order ((step, group) from `first_step`, group 0..N-1 per step), and
dispatches the next group once the sampler admits it at the current policy version, fewer than
`async_rl.max_inflight_prompts` groups are in flight, and the buffer has a free place. Each group
runs through `RolloutManager.run_group`: the whole failure policy (retry, backoff, row and group
redispatch, drop budget) applies unchanged, and keeps the group's `start_weight`.

`on_dropped_prompt: replace` (in_order): a dropped group's step keeps its batch size. If a later
step already holds a finished group, that group is re-stamped into the short step (promoted) and
a fresh prompt is dispatched for the lender's step; otherwise the fresh prompt fills the short
step itself (replaced). Fresh prompts take the prompt stream's groups past `num_prompts_per_step`
((s, N), (s, N+1), ...). At most `max_replacement_attempts` fresh prompts per step and
`replacement_reserve_prompts` in flight at once; beyond either, the step shrinks.

Checkpoint (`snapshot`, `restored`): a checkpoint keeps the cursor, the finished groups not yet
trained (with their weight versions and target steps), the groups in flight and the replacement
counters. On resume the pump drops kept groups whose target step has passed (in_order), leaves the
stale ones to the train pump's eviction, re-dispatches the groups that were in flight (under the
resumed version: the prompt stream and the fault stream are functions of the coordinates) and
goes on from the cursor: only what is missing is generated again.

Invariant: every prompt group is dispatched once and resolves once into the buffer (or the run
ends; after a resume, once more only if it was in flight at the checkpoint); a run-ending failure
(drop budget, DATA re-raise, stall) stops the pump and is raised to the train pump by `check`,
never swallowed.
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
                 first_step: int, version: int, on_resolved: Callable[[int, int], Awaitable[None]],
                 restored: dict | None = None):
        self.cfg, self.manager, self.buffer, self.sampler = cfg, manager, buffer, sampler
        self.on_resolved = on_resolved
        self.next = (first_step, 0)
        self.version = version
        self.inflight: Counter = Counter()  # start_weight -> groups in flight
        self.tasks: dict[asyncio.Task, tuple[int, int, bool]] = {}  # in flight -> (step, group, replacement)
        self.error: BaseException | None = None
        self.wake = asyncio.Event()
        self.main: asyncio.Task | None = None
        self.watchdog: asyncio.Task | None = None
        self.fresh: Counter = Counter()  # prompt step -> fresh prompts drawn for it
        self.replacements: Counter = Counter()  # step -> replacements dispatched for its drops
        self.reserve_in_flight = 0
        self.relaunch: list[tuple[int, int, bool]] = []  # groups in flight at the checkpoint resumed from
        if restored is not None:
            self._restore(restored, first_step)

    def snapshot(self) -> dict:
        """The pump's part of a checkpoint. Take it on the event loop (no await inside): a
        consistent cut of the cursor, the groups in flight and the buffer. A group's task commits
        its record and ends in one loop step, but `_done` drops it from `tasks` a loop iteration
        later, so a task that is done is not in flight: its record is in the buffer already (or
        it failed, and the run ends)."""
        return {"next": self.next, "in_flight": sorted(job for task, job in self.tasks.items() if not task.done()),
                "ready": list(self.buffer.ready), "fresh": dict(self.fresh), "replacements": dict(self.replacements)}

    def _restore(self, snap: dict, first_step: int) -> None:
        past = [r for r in snap["ready"] if self.sampler.name == "in_order" and r.target_step < first_step]
        self.buffer.ready = [r for r in snap["ready"] if r not in past]
        self.relaunch = [job for job in snap["in_flight"] if not (self.sampler.name == "in_order" and job[0] < first_step)]
        self.next, self.fresh, self.replacements = tuple(snap["next"]), Counter(snap["fresh"]), Counter(snap["replacements"])
        self.manager.emit({"type": "buffer_restored", "step": first_step, "version": self.version,
                           "kept": [[r.step, r.group] for r in self.buffer.ready],
                           "dropped_past_target": [[r.step, r.group] for r in past],
                           "redispatched": [[s, g] for s, g, _ in self.relaunch]})

    def start(self) -> None:
        self.main = asyncio.create_task(self._run())
        self.watchdog = asyncio.create_task(self.manager.watchdog(self.next[0]))
        self.watchdog.add_done_callback(lambda t: t.cancelled() or asyncio.ensure_future(self._fail(t.exception())))

    def set_version(self, version: int) -> None:
        self.version = version
        self.wake.set()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    async def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        async with self.buffer.changed:
            self.buffer.changed.notify_all()  # wake the train pump: it raises the error

    async def _run(self) -> None:
        limit = self.cfg.async_rl.max_inflight_prompts
        for step, group, replacement in self.relaunch:  # resumed: what was in flight at the checkpoint
            self.reserve_in_flight += replacement
            await self.buffer.reserve(over=self.cfg.async_rl.rollout_failure.replacement_reserve_prompts if replacement else 0)
            self._launch(step, group, replacement)
        while self.error is None:
            step, group = self.next
            if self.sampler.name == "in_order" and step >= self.cfg.grpo.max_num_steps:
                return  # every step's prompts are out (the other samplers draw spares past the end)
            while not (self.sampler.admit(step, self.version) and len(self.tasks) < limit):
                self.wake.clear()
                await self.wake.wait()
            await self.buffer.reserve()
            self._launch(step, group)
            n = self.cfg.grpo.num_prompts_per_step
            self.next = (step + (group + 1) // n, (group + 1) % n)

    def _launch(self, step: int, group: int, replacement: bool = False) -> None:
        task = asyncio.create_task(self._dispatch(step, group, self.version, replacement))
        self.tasks[task] = (step, group, replacement)
        task.add_done_callback(self._done)
        self.manager.emit({"type": "dispatch", "step": step, "group": group, "start_weight": self.version,
                           "replacement": replacement})

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.pop(task, None)
        self.wake.set()

    async def _dispatch(self, step: int, group: int, start: int, replacement: bool) -> None:
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
            self.reserve_in_flight -= replacement
        record = GroupRecord(step, group, start, self.version, outcome, target_step=step, replacement=replacement)
        if outcome.status == "dropped" and self.cfg.async_rl.rollout_failure.on_dropped_prompt == "replace":
            await self._replace(record)
        await self.buffer.commit(record)

    async def _replace(self, dropped: GroupRecord) -> None:
        """Keep the dropped group's step at full size: promote a later step's finished group into
        it and draw a fresh prompt for that step, or draw one for this step; or shrink."""
        rf, s = self.cfg.async_rl.rollout_failure, dropped.target_step
        event = {"type": "replace", "step": dropped.step, "group": dropped.group, "target_step": s}
        if self.replacements[s] >= rf.max_replacement_attempts or self.reserve_in_flight >= rf.replacement_reserve_prompts:
            self.manager.emit({**event, "decision": "shrink", "replacements": self.replacements[s],
                               "reserve_in_flight": self.reserve_in_flight})
            return
        self.replacements[s] += 1
        dropped.replaced = True
        lender = next((r for r in self.buffer.ready if r.outcome.status == "committed" and r.target_step > s
                       and not r.promoted), None)
        fill = s
        if lender is not None:  # no await between the choice and the re-stamp: the train pump cannot interleave
            fill, lender.target_step, lender.promoted = lender.target_step, s, True
            self.manager.emit({**event, "decision": "promoted", "lender_step": lender.step, "lender_group": lender.group})
        group = self.cfg.grpo.num_prompts_per_step + self.fresh[fill]
        self.fresh[fill] += 1
        self.manager.emit({**event, "decision": "fresh_prompt", "fresh_step": fill, "fresh_group": group})
        self.reserve_in_flight += 1
        await self.buffer.reserve(over=rf.replacement_reserve_prompts)
        self._launch(fill, group, replacement=True)
