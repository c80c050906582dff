"""The rollout pump: dispatches prompt groups ahead of training, in prompt-stream order, and commits
each one's resolution to the group buffer with the policy versions it ran under. Each group runs
through `RolloutManager.run_group`, so the whole failure policy applies unchanged. docs/async.md
covers its admission rules, `on_dropped_prompt: replace`, pacing and resume.

Invariant: every place (a dispatched group's slot in its step) is dispatched once and resolves once
into the buffer, with the prompt that last held it (or the run ends; after a resume, once more only
if it was in flight at the checkpoint); a prompt it gave up on rides on the place (`lost`, in its job
and so in a checkpoint's) and then on its record, never in the buffer; a run-ending failure (drop
budget, DATA re-raise, stall, an exception in the dispatch loop itself) stops the pump and is raised
to the train pump by `check`, never swallowed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from typing import Awaitable, Callable

from minirl.async_rl.buffer import GroupBuffer, GroupRecord
from minirl.async_rl.pacing import Decision, Pacer, prompt_class, protects
from minirl.async_rl.samplers import Sampler
from minirl.config import MinirlConfig
from minirl.data import prompt_row
from minirl.rollout.manager import RolloutManager
from minirl.wire import RolloutStall


class RolloutPump:
    """Walks the prompt stream in order ((step, group) from `first_step`, group 0..N-1 per step) and
    dispatches the next group once the sampler admits it at the current policy version, fewer than
    `async_rl.max_inflight_prompts` groups are in flight, the buffer has a free place, and no weight
    sync is under way (`pause` .. `set_version`: the version changes only after the new weights are
    served; a group's retry waits out a sync too). A dispatched group holds one *place* of its step
    (and one buffer place) until a record commits; under `on_dropped_prompt: replace` a lost prompt's
    place takes a spare (`_substitute`).
    Besides the manager's stall watchdog, `_starvation_watch` ends a wait no arriving group can end."""

    def __init__(self, cfg: MinirlConfig, manager: RolloutManager, buffer: GroupBuffer, sampler: Sampler,
                 first_step: int, version: int, on_resolved: Callable[[int, int], Awaitable[None]],
                 restored: dict | None = None):
        self.cfg, self.manager, self.buffer, self.sampler = cfg, manager, buffer, sampler
        self.on_resolved = on_resolved
        self.next = (first_step, 0)
        self.version = version
        self.permitted = asyncio.Event()  # cleared while the weights sync: nothing is dispatched
        self.permitted.set()
        self.inflight: Counter = Counter()  # start_weight of each place's current attempt -> places
        # in flight -> its job: [step, group, target_step, replacement, attempts used, lost outcomes]
        self.tasks: dict[asyncio.Task, list] = {}
        # a place whose prompt was lost for good, while it moves the prompt's call records: id(job) -> its record
        self.parked: dict[int, GroupRecord] = {}
        self.error: BaseException | None = None
        self.wake = asyncio.Event()
        self.main: asyncio.Task | None = None
        self.watchdog: asyncio.Task | None = None
        self.pool: list[tuple[int, int]] = []  # spare prompts (on_dropped_prompt=replace)
        self.spare_batches = 0  # batches of spare prompts drawn so far (stream: training batches diverted)
        self.stamped = False  # a stamped batch was admitted: the pool may be filled (as upstream)
        self.relaunch: list[list] = []  # places in flight at the checkpoint resumed from
        self.train_waiting: int | None = None  # the step the train pump waits for (set by the controller)
        self.train_step = first_step  # the step the train pump is on, waiting or training (set by its source)
        sc = cfg.async_rl.sampler
        self.pacer = (Pacer(sampler.s, sc.pacing_quantile, sc.pacing_bound_s, time.monotonic())
                      if sc.admission == "paced" else None)
        self.held: list | None = None  # paced: [step, group, since] of the group held at the head
        self.selected = -1  # the last version whose step took its groups (set by the train pump's source)
        if restored is not None:
            self._restore(restored, first_step)

    def snapshot(self) -> dict:
        """The pump's part of a checkpoint. Take it on the event loop (no await inside): a
        consistent cut of the cursor, the groups in flight and the buffer. A group's task commits
        its record and ends in one loop step, but `_done` drops it from `tasks` a loop iteration
        later, so a task that is done is not in flight: its record is in the buffer already (or
        it failed, and the run ends). A place in flight is its job, the outcomes of the prompts it
        gave up on (`lost`) included, so the step that trains it after a resume counts them. A place
        whose prompt was lost for good (its drop or skip charged already) is its record, parked while
        it moves the prompt's call records: in flight, a resume would send the prompt again and charge
        it twice. (One that committed is still in flight then: its call records are on their way.)"""
        live = [job for task, job in self.tasks.items() if not task.done()]
        # each job with a copy of its `lost`, which the place goes on appending to
        in_flight = sorted(((*job[:5], list(job[5])) for job in live if id(job) not in self.parked),
                           key=lambda job: job[:2])
        parked = [self.parked[id(job)] for job in live if id(job) in self.parked]
        return {"next": self.next, "in_flight": in_flight, "ready": [*self.buffer.ready, *parked],
                "pool": list(self.pool), "spare_batches": self.spare_batches,
                "pacer": None if self.pacer is None else self.pacer.state()}

    def _restore(self, snap: dict, first_step: int) -> None:
        stamps = self.sampler.stamps_target_steps
        past = [r for r in snap["ready"] if stamps and r.target_step < first_step]
        self.buffer.ready = [r for r in snap["ready"] if r not in past]
        jobs = [_job(job) for job in snap["in_flight"]]
        self.relaunch = [job for job in jobs if not (stamps and job[2] < first_step)]
        self.next, self.pool = tuple(snap["next"]), [tuple(p) for p in snap.get("pool", [])]
        self.spare_batches = snap.get("spare_batches", 0)
        # what they spent counts in a run_failed until a step's metrics take them, as the groups begun here
        self.manager.unsettle([o for r in self.buffer.ready for o in (r.outcome, *r.lost)]
                              + [o for job in self.relaunch for o in job[5]])
        if self.pacer is not None and snap.get("pacer"):  # paced before the stop: what it observed
            self.pacer.load(snap["pacer"], time.monotonic())
        self.manager.emit({"type": "buffer_restored", "step": first_step, "version": self.version,
                           "kept": [[r.step, r.group] for r in self.buffer.ready],
                           "dropped_past_target": [[r.step, r.group] for r in past],
                           "redispatched": [job[:2] for job in self.relaunch]})

    def start(self) -> None:
        """The dispatch loop and the two watchdogs (the manager's `stall` events name the step the train
        pump is on when they are written); an exception in any of them ends the run (`_fail`)."""
        self.main = self._task(self._run())
        self.watchdog = self._task(self.manager.watchdog(lambda: self.train_step))
        self.starved = self._task(self._starvation_watch())

    def _task(self, coro) -> asyncio.Task:
        """A task of the pump's own whose exception is handed to the train pump (`_fail`); a cancel or a
        clean return (the dispatch loop's, once every step's prompts are out) is not a failure."""
        task = asyncio.create_task(coro)
        task.add_done_callback(lambda t: t.cancelled() or t.exception() is None
                               or asyncio.ensure_future(self._fail(t.exception())))
        return task

    async def _starvation_watch(self) -> None:
        """RolloutStall (or a warning) when the train pump has waited `stall_timeout_s` with no group
        in flight: nothing can arrive to end the wait (e.g. the sampler needs a group the pump will
        never dispatch)."""
        wd = self.cfg.async_rl.stall_watchdog
        if wd.stall_timeout_s is None:
            await asyncio.Event().wait()
        since = None
        while True:
            await asyncio.sleep(min(1.0, wd.stall_timeout_s / 4))
            if self.train_waiting is None or any(not t.done() for t in self.tasks):
                since = None
                continue
            since = since or time.monotonic()
            if (idle := time.monotonic() - since) <= wd.stall_timeout_s:
                continue
            held = sorted((r.step, r.group, r.target_step) for r in self.buffer.ready)
            message = (f"the train pump has waited {idle:.1f}s for step {self.train_waiting} "
                       f"with no prompt group in flight "
                       f"(async_rl.stall_watchdog.stall_timeout_s={wd.stall_timeout_s}): "
                       f"the {self.sampler.name} sampler selects nothing "
                       f"from the buffer's {len(held)} group(s) {held[:8]} (step, group, target_step), "
                       f"and the pump's next group is {self.next}")
            self.manager.emit({"type": "stall", "step": self.train_waiting, "in_flight": 0, "decision": wd.action,
                               "message": message})
            if wd.action == "raise":
                raise RolloutStall(message)
            print(f"warning: {message}", flush=True)
            since = None

    async def stop(self) -> list[list[int]]:
        """The run ends: dispatch nothing more and cancel the places in flight (their reservations go
        back); returns each cancelled place's [step, group], the prompt it held last."""
        in_flight = sorted([job[0], job[1]] for task, job in self.tasks.items() if not task.done())
        tasks = [t for t in (self.main, self.watchdog, getattr(self, "starved", None), *self.tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return in_flight

    def pause(self) -> None:
        """A weight sync begins: dispatch nothing until `set_version`."""
        self.permitted.clear()

    def set_version(self, version: int) -> None:
        """The generation workers serve `version`: attempts that start now are stamped with it; dispatch resumes."""
        self.version = version
        if self.pacer is not None:
            self.pacer.published(time.monotonic())
        self.permitted.set()
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
        n, stamps = self.cfg.grpo.num_prompts_per_step, self.sampler.stamps_target_steps
        for job in self.relaunch:  # resumed: what was in flight at the checkpoint
            await self.buffer.reserve()
            await self.permitted.wait()
            self._launch(job)
        while self.error is None:
            step, group = self.next
            if group == 0 and self.stamped:
                self._refill()
            if stamps and step >= self.cfg.grpo.max_num_steps:
                return  # every step's prompts are out (the other samplers draw prompts past the end)
            while not (self.permitted.is_set() and self.sampler.admit(step, self.version) and len(self.tasks) < limit
                       and self._paced(step + self._diverted(), group)):
                self.wake.clear()
                # paced: the clock and the train pump's wait move too. Not wait_for: on Python 3.11 it swallows a
                # cancel that meets a wake already set (CPython gh-86296), and `stop` then waited for ever
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(None if self.pacer is None else 0.2):
                        await self.wake.wait()
            await self.buffer.reserve()
            await self.permitted.wait()  # a sync may have begun while the place was reserved
            self._launch([step + self._diverted(), group, step, False, 0, []])
            self.stamped |= stamps
            self.next = (step + (group + 1) // n, (group + 1) % n)

    def _paced(self, step: int, group: int) -> bool:
        """`admission=paced`: may prompt (step, group) start now (pacing.py)? A gated sampler's batch
        is paced whole at its first group; an ungated sampler's group also waits for `protects`."""
        if self.pacer is None or (self.sampler.gated and group > 0):
            return True
        n, gated = self.cfg.grpo.num_prompts_per_step, self.sampler.gated
        classes = [prompt_class(prompt_row(self.cfg, step, g)) for g in (range(n) if gated else [group])]
        ready = sum(self.sampler.in_window(r, self.version)
                    for r in self.buffer.ready if r.outcome.status == "committed")
        starving = self.train_waiting is not None and (not self.tasks or len(self.tasks) + ready < n)
        d = self.pacer.decide(classes, time.monotonic(), starving)
        if d.admit and not gated and not protects(self.inflight, ready, self.version, self.sampler.s, n,
                                                  self.selected != self.version):
            d = Decision(False, "protect", d.expected_s, d.window_left_s)
        self._pace_event(step, group, classes, d)
        return d.admit

    def _pace_event(self, step: int, group: int, classes: list, d: Decision) -> None:
        """A hold's first decision and the admission that ends it, as `pace` events."""
        event = {"type": "pace", "step": step, "group": group, "prompt_classes": classes, "version": self.version,
                 "expected_s": d.expected_s, "window_left_s": d.window_left_s, "reason": d.reason}
        if not d.admit and self.held is None:
            self.held = [step, group, time.monotonic()]
            self.manager.emit({**event, "decision": "hold"})
        elif d.admit and self.held is not None:
            self.manager.emit({**event, "decision": f"admit_{d.reason}", "held_s": time.monotonic() - self.held[2]})
            self.held = None

    def _diverted(self) -> int:
        """Training batches diverted into the pool so far (`replacement_prompt_source=stream`): step s
        trains the prompt step s + this."""
        return self.spare_batches if self.cfg.async_rl.rollout_failure.replacement_prompt_source == "stream" else 0

    def _refill(self) -> None:
        """Below the low-water mark, divert a whole batch of spare prompts into the pool: the groups
        N..2N-1 of prompt step b (`spare_groups`), or the batch the next step would have trained
        (`stream`)."""
        rf, n = self.cfg.async_rl.rollout_failure, self.cfg.grpo.num_prompts_per_step
        while rf.on_dropped_prompt == "replace" and len(self.pool) < rf.replacement_reserve_prompts:
            stream = rf.replacement_prompt_source == "stream"
            b = self.next[0] + self._diverted() if stream else self.spare_batches
            prompts = [(b, g) for g in range(n)] if stream else [(b, n + g) for g in range(n)]
            self.spare_batches += 1
            self.pool += prompts
            self.manager.emit({"type": "spare_pool", "step": self.next[0], "batch": b,
                               "prompts": [list(p) for p in prompts], "pool": len(self.pool),
                               "low_water": rf.replacement_reserve_prompts})

    def _launch(self, job: list) -> None:
        task = asyncio.create_task(self._place(job))
        self.tasks[task] = job
        task.add_done_callback(self._done)
        self._dispatched(job)

    def _dispatched(self, job: list) -> None:
        step, group, target, replacement = job[:4]
        self.manager.emit({"type": "dispatch", "step": step, "group": group, "target_step": target,
                           "start_weight": self.version, "replacement": replacement})

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.pop(task, None)
        self.wake.set()

    async def _place(self, job: list) -> None:
        """One place of a step: its prompt's group, and under `replace` the spares that stand in for
        it, until a record commits (or the run ends). The outcomes of the prompts it gave up on
        ride on the job (`lost`), where a checkpoint finds them."""
        lost, start, dispatched = job[5], [], time.monotonic()

        async def attempt(kept: int | None) -> int:
            """A group attempt starts once no weight sync is under way (a retry is a dispatch too, and
            dispatch pauses during a sync), under the version served then; the place's stamp is the oldest
            version its rows ran under: this one, or an older kept row's (keep_returned_rows)."""
            await self.permitted.wait()
            if start:
                self.inflight[start.pop()] -= 1
            start.append(self.version if kept is None else min(kept, self.version))
            self.inflight[start[0]] += 1
            return self.version

        try:
            while True:
                step, group = job[0], job[1]
                row = prompt_row(self.cfg, step, group)
                outcome = await self.manager.run_group(step, group, row, on_attempt=attempt)
                # decided before the records move, with no await: a checkpoint meanwhile sees the place as it
                # will be (re-aimed at a spare with this prompt in `lost`, or parked as its lost record)
                substituted = outcome.status != "committed" and self._substitute(job, outcome)
                if substituted:
                    lost.append(outcome)
                elif outcome.status != "committed":
                    self.parked[id(job)] = GroupRecord(step, group, start[0], outcome, target_step=job[2],
                                                       replacement=job[3], lost=lost)
                await self.on_resolved(step, group)
                if not substituted:
                    break
                await self.buffer.touched()  # a promotion may have completed the short step: it trains now
                await self.permitted.wait()  # a substitute is a fresh dispatch: it waits out a weight sync
                self._dispatched(job)
        except asyncio.CancelledError:
            self.parked.pop(id(job), None)
            await self.buffer.release()
            raise
        except BaseException as exc:  # a run-ending failure: stop dispatching, hand it to the train pump
            self.parked.pop(id(job), None)
            await self.buffer.release()
            await self._fail(exc)
            return
        finally:
            if start:
                self.inflight[start[0]] -= 1
        step, group, target, replacement = job[:4]
        if self.pacer is not None and outcome.status == "committed":
            self.pacer.observed(prompt_class(prompt_row(self.cfg, step, group)), time.monotonic() - dispatched)
        record = self.parked.pop(id(job), None) or GroupRecord(step, group, start[0], outcome, target_step=target,
                                                               replacement=replacement, lost=lost)
        await self.buffer.commit(record)

    def _substitute(self, job: list, outcome) -> bool:
        """The place's prompt was lost: under `replace`, aim the place at a spare prompt (promoting
        the furthest later step's lowest finished group into this step when there is one, and re-aiming
        the place at that step); False: the place keeps its lost record and the step shrinks. No
        await between the choice and the re-stamp, so the train pump cannot interleave."""
        rf = self.cfg.async_rl.rollout_failure
        if rf.on_dropped_prompt != "replace" or not self.sampler.stamps_target_steps:
            return False
        step, group, target, _, used = job[:5]
        event = {"type": "replace", "step": step, "group": group, "status": outcome.status, "target_step": target,
                 "attempt": used + 1, "max_replacement_attempts": rf.max_replacement_attempts}
        if used >= rf.max_replacement_attempts or not self.pool:
            reason = "max_replacement_attempts" if used >= rf.max_replacement_attempts else "pool_empty"
            self.manager.emit({**event, "decision": "shrink", "pool": len(self.pool), "reason": reason})
            return False
        spare = self.pool.pop(0)
        later = [r for r in self.buffer.ready if r.outcome.status == "committed" and r.target_step > target]
        # the furthest step's lowest group, not the first to commit: the choice must not hang on timing
        # (two spares of different batches can hold the same group index: then the older prompt step)
        lender = min(later, key=lambda r: (-r.target_step, r.group, r.step), default=None)
        if lender is not None:
            event.update(decision="promoted", lender_step=lender.target_step, lender_group=[lender.step, lender.group])
            target, lender.target_step, lender.promoted = lender.target_step, target, True
        else:
            event["decision"] = "fresh_prompt"
        job[:5] = [spare[0], spare[1], target, True, used + 1]
        self.manager.emit({**event, "fresh_step": spare[0], "fresh_group": spare[1], "fills_step": target,
                           "pool": len(self.pool)})
        return True


def _job(saved) -> list:
    """A checkpoint's place in flight as a job: [step, group, target_step, replacement, attempts used,
    lost outcomes]; an older checkpoint holds the first five, or (step, group, replacement)."""
    if len(saved) == 3:
        saved = (saved[0], saved[1], saved[0], saved[2], 0)
    return [*saved[:5], list(saved[5]) if len(saved) > 5 else []]
