"""The single controller (a Ray actor): the only place where optimizer steps are assembled.

`collect(step, version)` gets the step's prompt groups (sync: dispatched through the rollout
manager and awaited; async: selected from the buffer that the rollout pump fills, see
minirl/async_rl/), checks them against the ledger (the servers' call logs, or for an external
agent its calls matched by their tokens), and assembles the training batch:
- floor: a step that lost more groups than `min_step_batch_fraction` allows raises upstream's
  RuntimeError ("training step … lost … below the floor …");
- context compaction: every kept group must hold all its rollouts (masked ones with mask 0); with
  `allow_step_shrink=false` (upstream) the step must hold the full logical sample count;
- advantages per group (over the valid rollouts only with `grpo.baseline_excludes_masked`, the
  default; over all of them as upstream otherwise), shared by all the physical traces of a rollout.

Invariant: a batch holds every rollout of every kept group and nothing else, each from the one
attempt that succeeded, all generated under the step's policy version (async: within the
staleness window), with finite advantages.

Fleet health (`async_rl.generation_fleet_health.enabled`): while a step collects, the controller
polls the generation router every `probe_interval_s`, writes each quarantine and re-admission to
the event log (and counts them in the step's metrics), and ends the run with
GenerationFleetUnhealthy when fewer than `min_healthy_shards` workers are healthy, also when the
outage made the step fail first (its failure is the cause).
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import time

import numpy as np

from minirl.algo.grpo import group_advantages
from minirl.config import MinirlConfig, step_floor
from minirl.data import prompt_row
from minirl.rollout.evidence import Ledger, Rollout
from minirl.rollout.manager import GroupOutcome, RolloutManager
from minirl.wire import GenerationFleetUnhealthy

FLEET_COUNTS = {"worker_quarantined": "workers_quarantined", "worker_readmitted": "workers_readmitted"}
"""Fleet health: the router's transition events and the per-step metric that counts each."""


def _keys(record) -> list[tuple[int, int]]:
    """Async: the (step, group) of a buffer record's prompt and of the prompts its place gave up on."""
    return [(record.step, record.group)] + [(o.step, o.group) for o in record.lost]


def check_step(cfg: MinirlConfig, step: int, outcomes: list[GroupOutcome]) -> None:
    """Upstream's step checks, in upstream's order: the floor, then the CC sample count."""
    n = cfg.grpo.num_prompts_per_step
    g = cfg.grpo.num_generations_per_prompt
    kept = [o for o in outcomes if o.status == "committed"]
    lost = n - len(kept)
    floor = step_floor(cfg)
    if len(kept) < floor:
        fraction = cfg.async_rl.rollout_failure.min_step_batch_fraction
        raise RuntimeError(
            f"training step {step} lost {lost} of {n} prompt group(s), leaving {len(kept)}, below the floor of "
            f"{floor} set by async_rl.rollout_failure.min_step_batch_fraction={fraction}. Either the generation "
            "fleet is failing a whole step's worth of prompts, or the drop budgets are set too high to catch it: "
            "they are run-scoped and cannot bound how short a single step gets."
        )
    cc = cfg.context_compaction
    if not cc.enabled:
        return
    logical = sum(len(o.rollouts) for o in kept)
    if not cc.allow_step_shrink:
        if len(kept) != n or logical != cfg.policy.train_global_batch_size:
            raise ValueError("CC optimizer step requires the full logical sample count")
    elif any(sorted(o.rollouts) != list(range(g)) for o in kept):
        raise ValueError("CC optimizer step requires every rollout of every kept group")


def assemble(cfg: MinirlConfig, outcomes: list[GroupOutcome], pad_id: int) -> tuple[dict, dict]:
    """Kept groups -> padded training arrays + the step's rollout statistics."""
    kept = [o for o in outcomes if o.status == "committed"]
    g = cfg.grpo
    rows: list[tuple[Rollout, object, float]] = []
    rewards = []
    for o in kept:
        rollouts = [o.rollouts[r] for r in sorted(o.rollouts)]
        adv = group_advantages([r.reward for r in rollouts], [r.sample_mask for r in rollouts],
                               g.use_leave_one_out_baseline, g.normalize_rewards, g.baseline_excludes_masked)
        if not np.isfinite(adv).all():  # parse_rollout bounds rewards, so this is a bug, never data to train on
            raise RuntimeError(f"group {o.group}: non-finite advantages {adv.tolist()} from rewards "
                               f"{[r.reward for r in rollouts]}")
        rewards += [r.reward for r in rollouts]
        for rollout, a in zip(rollouts, adv):
            rows += [(rollout, trace, float(a)) for trace in rollout.traces]
    width = max((len(t.tokens) for _, t, _ in rows), default=1)
    T = len(rows)
    batch = {
        "input_ids": np.full((T, width), pad_id, dtype=np.int64),
        "loss_mask": np.zeros((T, width), dtype=np.float32),
        "gen_logprobs": np.zeros((T, width), dtype=np.float32),
        "lengths": np.zeros(T, dtype=np.int64),
        "advantages": np.zeros(T, dtype=np.float32),
        "sample_mask": np.zeros(T, dtype=np.float32),
        "group": np.zeros(T, dtype=np.int64),
        "rollout": np.zeros(T, dtype=np.int64),
    }
    for i, (rollout, trace, adv) in enumerate(rows):
        n = len(trace.tokens)
        batch["input_ids"][i, :n] = trace.tokens
        batch["loss_mask"][i, :n] = trace.loss_mask
        batch["gen_logprobs"][i, :n] = trace.logprobs
        batch["lengths"][i] = n
        batch["advantages"][i] = adv
        batch["sample_mask"][i] = rollout.sample_mask
        batch["group"][i] = rollout.coords.group
        batch["rollout"][i] = rollout.coords.rollout
    valid = batch["loss_mask"] * batch["sample_mask"][:, None]
    batch["global_valid_tokens"] = float(valid.sum())
    batch["global_valid_samples"] = float((valid.sum(-1) > 0).sum())

    all_rollouts = [r for o in kept for r in o.rollouts.values()]
    trained = [r for r in all_rollouts if r.sample_mask]
    stats = {
        "groups_target": cfg.grpo.num_prompts_per_step,
        "groups_trained": len(kept),
        "dropped_prompt_groups": sum(o.status == "dropped" for o in outcomes),
        "skipped_prompt_groups": sum(o.status == "skipped" for o in outcomes),
        "redispatched_groups": sum(o.redispatched for o in outcomes),
        "redispatched_rows": sum(o.row_retries for o in outcomes),
        "group_attempts": sum(o.group_attempts for o in outcomes),
        "backoff_s": sum(o.backoff_s for o in outcomes),
        "rollouts_trained": len(trained),
        "rollouts_masked": len(all_rollouts) - len(trained),
        "traces_trained": sum(len(r.traces) for r in trained),
        "tokens_trained": int(batch["global_valid_tokens"]),
        "compactions": sum(r.evidence.get("compactions", 0) for r in all_rollouts),
        "reward_mean": float(np.mean(rewards)) if rewards else float("nan"),  # every kept rollout, masked ones too
        "reward_mean_trained": float(np.mean([r.reward for r in trained])) if trained else float("nan"),
        "episode_calls_mean": float(np.mean([len(r.calls) for r in all_rollouts])) if all_rollouts else 0.0,
    }
    return batch, stats


class Controller:
    """Sync (`async_rl.enabled=false`): `collect` dispatches the step's groups and waits for them.
    Async: a rollout pump (minirl.async_rl.pump) runs ahead under the staleness sampler, and
    `collect` is the train pump's half: evict stale groups, wait for the sampler's selection."""

    def __init__(self, cfg: MinirlConfig, run_dir: str, agent_urls: list[str], gen_workers: list, vocab_size: int, pad_id: int,
                 fleet=None):
        from pathlib import Path

        from minirl.metrics import EventLog

        self.cfg, self.gen_workers, self.pad_id = cfg, gen_workers, pad_id
        self.events = EventLog(Path(run_dir) / "events.jsonl")
        self.ledger = Ledger(Path(run_dir) / "ledger")
        self.manager = RolloutManager(cfg, agent_urls, self.events.write, vocab_size)
        self.pump = None  # async only: started by the first `collect`
        self.calls: dict[tuple[int, int], list[dict]] = {}  # async: drained server records by (step, group)
        self.orphans: list[dict] = []  # async: records of groups evicted or already trained (retired attempts)
        self.pool: list[dict] = []  # external agents: headerless records not matched yet
        self.consumed: set[tuple[int, int]] = set()
        self.async_stats = {"stale_groups_evicted": 0, "promoted_prompt_groups": 0, "replaced_prompt_groups": 0}
        self.last_collect = time.perf_counter()  # async: when the previous step's batch was handed over
        self.counters = (0, 0, 0)  # the manager's run totals (sends, returned, guard rejections) at the last step
        self.restored: dict | None = None  # async resume: the checkpoint's buffer, until the pump starts
        self.fleet = fleet  # the generation router's actor when fleet health is on, else None
        self.fleet_stats: dict = {}  # fleet health: this step's quarantines, re-admissions, healthy workers
        self.step: int | None = None  # the step last collected (a later failure is that step's)
        self.failed = False  # the run's run_failed event is written

    async def snapshot(self) -> dict:
        """The controller's part of a checkpoint, taken between two awaits (a consistent cut): the
        failure policy's run-scoped counters and, async, the pump's buffer with the call records
        of its groups (pickled: `Cluster.save_checkpoint` writes it into the checkpoint)."""
        snap = {"rollout_manager": self.manager.state(), "async_buffer": None}
        if self.pump is not None:
            pump = self.pump.snapshot()
            calls = {k: self.calls[k] for k in (k for r in pump["ready"] for k in _keys(r)) if k in self.calls}
            snap["async_buffer"] = pickle.dumps({"pump": pump, "calls": calls})
        return snap

    def load_state(self, state: dict, async_buffer: bytes | None = None) -> None:
        """Resume: the counters, and (async) the buffer that the pump restores when it starts."""
        self.manager.load_state(state)
        self.restored = pickle.loads(async_buffer) if async_buffer is not None and self.cfg.async_rl.enabled else None

    def note(self, event: dict) -> None:
        """Write an event from outside the step (e.g. the loop's `resumed`)."""
        self.events.write(event)

    async def published(self, version: int) -> None:
        """The generation workers now serve `version`: admissions and start_weights follow it."""
        if self.pump is not None:
            self.pump.set_version(version)

    async def validate(self, version: int) -> dict:
        """Held-out validation of the weights the generation workers serve (minirl.validation)."""
        from minirl.validation import validate

        return await validate(self.cfg, self.manager.agent_urls, version)

    async def _engine_busy_s(self) -> float:
        return sum([(await w.stats.remote())["busy_s"] for w in self.gen_workers])

    async def _drain(self, step: int) -> list[dict]:
        return [c for w in self.gen_workers for c in await w.take_calls.remote(step)]

    def run_failed(self, error: str) -> None:
        """The run ends with `error` (`ExceptionClass: message`): its one `run_failed` event, with the
        step and what the step spent; a second call (the driver's, for a failure already written) is a no-op."""
        if self.failed:
            return
        self.failed = True
        sends, returned, _ = self._step_counters()
        self.events.write({"type": "run_failed", "step": self.step, "error": error,
                           "rollout_attempts": sends, "rollouts_generated": returned})

    async def collect(self, step: int, version: int) -> tuple[dict, dict]:
        """Rollouts for `step` under the failure policy, then the assembled batch and its stats. Any
        failure on the way (the rollouts, the step checks, the ledger, the assembly) writes run_failed."""
        self.step = step
        try:
            return await self._collect(step, version)
        except BaseException as exc:  # the run ends here: leave its reason and its cost in the log
            self.run_failed(f"{type(exc).__name__}: {exc}")
            raise

    async def _collect(self, step: int, version: int) -> tuple[dict, dict]:
        t0 = time.perf_counter()
        busy0 = await self._engine_busy_s()
        if self.fleet is not None:
            self.fleet_stats = dict.fromkeys(FLEET_COUNTS.values(), 0)
        if self.cfg.async_rl.enabled:
            outcomes, starts, server_calls = await self._fleet_watched(step, self._from_buffer(step, version))
        else:
            rows = [prompt_row(self.cfg, step, g) for g in range(self.cfg.grpo.num_prompts_per_step)]
            outcomes = await self._fleet_watched(step, self.manager.run_step(step, rows))
            starts, server_calls = [version] * len(outcomes), await self._drain(step)
        # async: generation overlaps training, so its rate is over the whole period since the last step
        gen_s = time.perf_counter() - (self.last_collect if self.cfg.async_rl.enabled else t0)
        engine_busy_s = await self._engine_busy_s() - busy0
        check_step(self.cfg, step, outcomes)
        kept = [r for o in outcomes if o.status == "committed" for r in o.rollouts.values()]
        # the oldest weights a trained call may have run under: the window's, or an older group's start (ready_first)
        oldest = min([version - self._window()] + [w for o, w in zip(outcomes, starts) if o.status == "committed"])
        if self.cfg.agent.external_url:  # no rollout header: match the calls by their tokens
            ledger, left = self.ledger.match_external(step, self.pool + await self._drain(None), kept, version,
                                                      oldest=oldest)
            keep = step - 1 - self._window()  # a record is kept for the window's steps (async runs ahead), then retired
            self.pool = [rec for rec in left if rec.setdefault("drained_step", step) >= keep]
            ledger["calls_retired"] = len(left) - len(self.pool)
        else:
            ledger = self.ledger.close_step(step, server_calls, kept, version, oldest=oldest)
        batch, stats = assemble(self.cfg, outcomes, self.pad_id)
        for r in kept:
            if r.mask_reason:
                self.events.write({"type": "mask", **r.coords.as_dict(), "reason": r.mask_reason,
                                   "errors": r.evidence.get("errors", [])})
        generated = ledger["tokens_matched"] if self.cfg.agent.external_url else \
            sum(len(c.get("generation_token_ids") or []) for c in server_calls)
        staleness = [version - w for o, w in zip(outcomes, starts) if o.status == "committed"] or [0]
        _, _, guard_failed = self._step_counters()
        self.counters = (self.manager.sends, self.manager.returned, self.manager.guard_rejections)
        self.last_collect = time.perf_counter()
        stats.update(
            rollout_attempts=sum(o.row_sends for o in outcomes),
            rollouts_generated=sum(o.rows_returned for o in outcomes),
            guard_rejections=guard_failed + sum(g.get("decision") == "reject" for r in kept for g in r.evidence.get("guard", [])),
            calls_retired=ledger.get("calls_retired", 0),
            calls_unrecorded=ledger.get("calls_unrecorded", 0),
            calls_stale=ledger.get("calls_stale", 0),  # external agents: masked, see Ledger.match_external
            calls_logprob_mismatch=ledger.get("calls_logprob_mismatch", 0),
            calls_matched=ledger.get("calls_matched", 0),
            gen_time_s=gen_s,
            engine_busy_s=engine_busy_s,
            gen_tokens=generated,
            gen_tokens_per_s=generated / gen_s if gen_s > 0 else 0.0,
            policy_version=version,
            staleness_mean=float(np.mean(staleness)),
            staleness_max=int(max(staleness)),
            **self.async_stats,
            **self.fleet_stats,
            prompt_seeds=[prompt_row(self.cfg, o.step, o.group)["task"]["seed"] for o in outcomes],
        )
        return batch, stats

    async def _fleet_watched(self, step: int, body):
        """Await `body` while the fleet is watched (without fleet health, just await it)."""
        if self.fleet is None:
            return await body
        task, watch = asyncio.ensure_future(body), asyncio.ensure_future(self._watch_fleet(step))
        try:
            await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (task, watch):
                t.cancel()
            await asyncio.gather(task, watch, return_exceptions=True)
        if task.cancelled():  # the watcher ended the step
            watch.result()
        try:
            await self._poll_fleet(step)  # the transitions since the watcher's last poll
        except GenerationFleetUnhealthy as exc:
            raise exc from task.exception()
        return task.result()

    async def _watch_fleet(self, step: int) -> None:
        while True:
            await self._poll_fleet(step)
            await asyncio.sleep(self.cfg.async_rl.generation_fleet_health.probe_interval_s)

    async def _poll_fleet(self, step: int) -> None:
        report = await self.fleet.poll_health.remote()
        for event in report["events"]:
            self.events.write({**event, "step": step})
            self.fleet_stats[FLEET_COUNTS[event["type"]]] += 1
        self.fleet_stats["healthy_generation_workers"] = report["healthy"]
        if report["error"] is not None:
            raise GenerationFleetUnhealthy(report["error"])

    def _step_counters(self) -> tuple[int, int, int]:
        sends, returned, guard = self.counters
        return self.manager.sends - sends, self.manager.returned - returned, self.manager.guard_rejections - guard

    def _window(self) -> int:
        return self.cfg.async_rl.sampler.max_staleness_versions if self.cfg.async_rl.enabled else 0

    # -- async: the train pump's half ------------------------------------------------------------
    async def _from_buffer(self, step: int, version: int) -> tuple[list[GroupOutcome], list[int], list[dict]]:
        """Evict stale groups, then wait until the sampler selects `step`'s groups; take them."""
        from minirl.async_rl.buffer import GroupBuffer
        from minirl.async_rl.pump import RolloutPump
        from minirl.async_rl.samplers import make_sampler

        ar = self.cfg.async_rl
        if self.pump is None:
            self.manager.open()
            self.buffer = GroupBuffer(ar.max_buffered_rollouts)
            self.sampler = make_sampler(ar.sampler.name, self.cfg.grpo.num_prompts_per_step, ar.sampler.max_staleness_versions)
            restored, self.restored = self.restored, None
            self.pump = RolloutPump(self.cfg, self.manager, self.buffer, self.sampler, step, version, self._resolved,
                                    restored and restored["pump"])
            self.calls.update(restored["calls"] if restored else {})
            self.pump.start()

        def pick(ready):
            self.pump.check()
            stale = self.sampler.stale(version, ready, self.pump.inflight)
            for r in stale:  # evicted now, even if the wait goes on (or ends the run): its event now
                self.events.write({"type": "evict", "step": r.step, "group": r.group, "start_weight": r.start_weight,
                                   "train_version": version, "max_staleness_versions": self.sampler.s,
                                   "reason": "stale" if r.start_weight < version - self.sampler.s else "short_weight"})
                for key in _keys(r):
                    self.orphans += self.calls.pop(key, [])
            return stale, self.sampler.select(step, version, ready, self.pump.inflight)

        self.pump.train_waiting = step  # the pump's watchdog: a wait with nothing in flight is a stall
        try:
            stale, chosen = await self.buffer.take_when(pick)
        finally:
            self.pump.train_waiting = None
        # upstream's counters: a place whose spare committed is replaced (counted in the step it filled),
        # a group re-stamped into the step promoted; `dropped_prompt_groups` is the shortfall left
        self.async_stats = {"stale_groups_evicted": len(stale), "promoted_prompt_groups": sum(r.promoted for r in chosen),
                            "replaced_prompt_groups": sum(r.replacement and r.outcome.status == "committed" for r in chosen)}
        self.consumed.update(key for r in stale + chosen for key in _keys(r))
        calls, self.orphans = [c for r in chosen for key in _keys(r) for c in self.calls.pop(key, [])] + self.orphans, []
        # the prompts a place gave up on (replaced): counted in the step's attempts and costs, never as groups
        lost = [dataclasses.replace(o, status="replaced") for r in chosen for o in r.lost]
        return [r.outcome for r in chosen] + lost, [r.start_weight for r in chosen] + [version] * len(lost), calls

    async def syncing(self) -> None:
        """A weight sync begins: the pump dispatches nothing until `published` (upstream's pause)."""
        if self.pump is not None:
            self.pump.pause()

    async def _resolved(self, step: int, group: int) -> None:
        """A group resolved: move its step's call records from the servers into `self.calls` (those
        of groups already trained or evicted, late records of retired attempts, into `self.orphans`)."""
        for c in await self._drain(step):
            key = (c["step"], c["group"])
            (self.orphans if key in self.consumed else self.calls.setdefault(key, [])).append(c)
