"""The single controller (a Ray actor): the only place where an optimizer step's batch is assembled.
`Controller.collect` takes the step's prompt groups from the step source (sync dispatch, or the
async rollout buffer), checks them (the floor, the ledger), selects the calls that train, computes
each group's advantages and packs the batch (`assemble`).

Invariant: a batch holds every rollout of every kept group and nothing else, each from the one
attempt that succeeded, all generated under the step's policy version (async: within the
staleness window), with finite advantages; a step's counters are sums over the group outcomes it
took, lost or evicted, never another step's.
"""

from __future__ import annotations

import asyncio
import functools
import time

import numpy as np

from minirl.algo.grpo import group_advantages, rollout_votes, segment_weights, summary_advantages
from minirl.async_rl.source import BufferSource
from minirl.config import MinirlConfig, step_floor
from minirl.data import prompt_key
from minirl.generation.fleet import FleetWatch
from minirl.gym.failures import kind_counts, mask_facts
from minirl.rollout.evidence import SUMMARY_KIND, Ledger, summary_stats
from minirl.rollout.manager import RolloutManager, dominant_failure
from minirl.rollout.masking import ScoredGroup, baseline_members, masking_stats, rollout_stats
from minirl.rollout.selection import select_calls
from minirl.rollout.source import SyncSource
from minirl.timeline import EngineClocks, clocks, generation_lane
from minirl.types import GroupOutcome, Rollout, StepSource, StepTake, Trace, TrainBatch


def check_step(cfg: MinirlConfig, step: int, outcomes: list[GroupOutcome]) -> None:
    """Upstream's step checks, in upstream's order: the floor, then the CC sample count.

    A step that lost more groups than `min_step_batch_fraction` allows raises upstream's RuntimeError
    ("training step … lost … below the floor …"). Under context compaction every kept group must
    hold all its rollouts (masked ones with mask 0), and with `allow_step_shrink=false` (upstream)
    the step must hold the full logical sample count."""
    n = cfg.grpo.num_prompts_per_step
    g = cfg.grpo.num_generations_per_prompt
    kept = [o for o in outcomes if o.status == "committed"]
    lost = n - len(kept)
    floor = step_floor(cfg)
    if len(kept) < floor:  # the shortfall's failures: a replaced prompt's spare filled its place
        failures = [o.reason or o.status for o in outcomes if o.status in ("dropped", "skipped")]
        fraction = cfg.async_rl.rollout_failure.min_step_batch_fraction
        raise RuntimeError(  # upstream's text, with the cause named before upstream's guess at it
            f"training step {step} lost {lost} of {n} prompt group(s), leaving {len(kept)}, below the floor of "
            f"{floor} set by async_rl.rollout_failure.min_step_batch_fraction={fraction}. "
            + dominant_failure(failures).rstrip(".")
            + ". Either the generation fleet is failing a whole step's worth of prompts, or the drop budgets are "
            "set too high to catch it: they are run-scoped and cannot bound how short a single step gets."
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


def assemble(cfg: MinirlConfig, outcomes: list[GroupOutcome], pad_id: int) -> tuple[TrainBatch, dict]:
    """Kept groups -> padded training arrays + the step's rollout statistics.

    Advantages are per group (`_scored`), shared by all the physical traces of a rollout (but under
    `grpo.summary_credit=next_segment` a summary trace's own, `_credited`). A masked
    trace masks its rollout (`grpo.segment_validity=all`) or only itself (`any`, while another
    segment is valid), and `loss_fn.segment_weighting` gives each trained trace its loss weight
    (none under `token_mean`, the default arithmetic)."""
    kept = [o for o in outcomes if o.status == "committed"]
    for r in (r for o in kept for r in o.rollouts.values()):
        settle_segments(r, cfg.grpo.segment_validity)
    scored = [_scored(cfg, o) for o in kept]
    rows = [_credited(cfg, g) for g in scored]
    slot = {id(o): i for i, o in enumerate(outcomes)}  # a prompt group's own, where async mixes prompt steps
    batch = _pack([(slot[id(o)], *row) for o, (g_rows, _) in zip(kept, rows) for row in g_rows], pad_id)
    if cfg.loss_fn.segment_weighting != "token_mean":
        _weigh(batch, cfg.loss_fn.segment_weighting)
    stats = _rollout_stats(cfg, outcomes, kept, batch)
    stats["summary_credit_fallbacks"] = sum(n for _, n in rows)
    stats.update(masking_stats(scored))  # NeMo's train/masking/* and rollout stats (minirl/rollout/masking.py)
    stats.update(rollout_stats(scored, batch.lengths, cfg.policy.max_total_sequence_length))
    return batch, stats


def settle_segments(r: Rollout, validity: str) -> None:
    """A rollout with masked segments takes the first one's reason as its own when `rollout_votes`
    says it no longer counts (any masked one under `all`, every one under `any`); then its mask
    event, counters and ledger status follow. Idempotent."""
    if r.mask_reason is None and not rollout_votes([t.mask_reason is None for t in r.traces], validity):
        r.mask_reason = next(t.mask_reason for t in r.traces if t.mask_reason)


def _weigh(batch: TrainBatch, weighting: str) -> None:
    """Each trained row's `segment_weights` (1 on the rows that train nothing). A rollout is named by its
    group's slot, not its group index: an async step can take group g of two prompt steps."""
    tokens = batch.valid_mask().sum(-1)
    trained = np.flatnonzero(tokens > 0)
    batch.loss_weight = np.ones(len(tokens), dtype=np.float32)
    batch.loss_weight[trained] = segment_weights(batch.slot[trained] * (1 << 32) + batch.rollout[trained],
                                                 tokens[trained], weighting)


def _scored(cfg: MinirlConfig, o: GroupOutcome) -> ScoredGroup:
    """One kept group's rollouts in index order, their baseline membership (the three baseline
    policies, `baseline_members`: the valid rollouts only with `grpo.baseline_excludes_masked`, the
    default, plus the incomplete ones with `grpo.masked_sample_rewards_in_baseline`; all of them as
    upstream otherwise) and advantages; every trace of a rollout carries its advantage."""
    g, rollouts = cfg.grpo, _in_order(o)
    members = baseline_members(rollouts, g.baseline_excludes_masked, g.masked_sample_rewards_in_baseline)
    adv = group_advantages([r.reward for r in rollouts], [r.sample_mask for r in rollouts],
                           g.use_leave_one_out_baseline, g.normalize_rewards, g.baseline_excludes_masked,
                           in_baseline=members)
    if not np.isfinite(adv).all():  # parse_rollout bounds rewards, so this is a bug, never data to train on
        raise RuntimeError(f"group {o.group}: non-finite advantages {adv.tolist()} from rewards "
                           f"{[r.reward for r in rollouts]}")
    return ScoredGroup(rollouts, members, adv)


def _credited(cfg: MinirlConfig, g: ScoredGroup) -> tuple[list[tuple[Rollout, Trace, float]], int]:
    """Each trace of a kept group with the advantage it trains with: its rollout's, but under
    `grpo.summary_credit=next_segment` a summary trace's own (`summary_advantages` over the group's
    summaries at the same place; a masked summary trace or an unscored segment is no member). Also
    the fallbacks: rollouts whose summary traces have no matching `segment_rewards` evidence (an
    external agent), which keep their rollout's advantage."""
    rows = [(r, t, float(a)) for r, a in zip(g.rollouts, g.advantages) for t in r.traces]
    if cfg.grpo.summary_credit == "rollout":
        return rows, 0
    summaries = [[t for t in r.traces if t.kind == SUMMARY_KIND] for r in g.rollouts]
    segments = [r.evidence.get("segment_rewards", []) for r in g.rollouts]
    scored = [s if len(s) == len(seg) else None for s, seg in zip(summaries, segments)]
    rewards = [[None if t.mask_reason else v for t, v in zip(s, seg)] if s is not None else []
               for s, seg in zip(scored, segments)]
    gp = cfg.grpo
    adv = summary_advantages(rewards, [r.sample_mask for r in g.rollouts], gp.use_leave_one_out_baseline,
                             gp.normalize_rewards)
    own = {id(t): a for s, a_list in zip(scored, adv) if s is not None for t, a in zip(s, a_list)}
    fallbacks = sum(s is None for s in scored)
    return [(r, t, own.get(id(t), a)) for r, t, a in rows], fallbacks


def _pack(rows: list[tuple[int, Rollout, Trace, float]], pad_id: int) -> TrainBatch:
    """One padded batch row per (slot, rollout, trace, advantage), its valid-token totals counted."""
    batch = TrainBatch.zeros(len(rows), max((len(t.tokens) for _, _, t, _ in rows), default=1), pad_id)
    for i, (slot, rollout, trace, adv) in enumerate(rows):
        n = len(trace.tokens)
        batch.input_ids[i, :n] = trace.tokens
        batch.loss_mask[i, :n] = trace.loss_mask
        batch.gen_logprobs[i, :n] = trace.logprobs
        batch.lengths[i] = n
        batch.advantages[i] = adv
        batch.sample_mask[i] = rollout.sample_mask if trace.mask_reason is None else 0
        batch.group[i] = rollout.coords.group
        batch.rollout[i] = rollout.coords.rollout
        batch.slot[i] = slot
    return batch.count_valid()


def _rollout_stats(cfg: MinirlConfig, outcomes: list[GroupOutcome], kept: list[GroupOutcome],
                   batch: TrainBatch) -> dict:
    """The step's group and rollout counters, from its group outcomes."""
    all_rollouts = [r for o in kept for r in o.rollouts.values()]
    trained = [r for r in all_rollouts if r.sample_mask]
    return {
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
        "traces_trained": sum(t.mask_reason is None for r in trained for t in r.traces),
        "segments_masked": sum(t.mask_reason is not None for r in all_rollouts for t in r.traces),
        "loss_mass_by_group": _loss_mass(batch, len(outcomes)),
        "tokens_trained": int(batch.global_valid_tokens),
        "compactions": sum(r.evidence.get("compactions", 0) for r in all_rollouts),
        **summary_stats(all_rollouts),  # summarizing compaction (a step's summaries_failed: from outcomes)
        # every kept rollout, masked ones too
        "reward_mean": float(np.mean([r.reward for o in kept for r in _in_order(o)])) if all_rollouts else float("nan"),
        "reward_mean_trained": float(np.mean([r.reward for r in trained])) if trained else float("nan"),
        "episode_calls_mean": float(np.mean([len(r.calls) for r in all_rollouts])) if all_rollouts else 0.0,
    }


def _kept(outcomes: list[GroupOutcome]) -> list[Rollout]:
    """The rollouts of the committed groups, masked ones included."""
    return [r for o in outcomes if o.status == "committed" for r in o.rollouts.values()]


def _loss_mass(batch: TrainBatch, groups: int) -> list[float]:
    """Each prompt group's share of the step's loss mass (its trained tokens x their segment weight), one
    per group outcome the step took, in `prompt_seeds`' order (a sync step: indexed by group; a lost group
    places none): what `loss_fn.segment_weighting` moves between easy and hard prompts."""
    mass = batch.valid_mask().sum(-1) * (1.0 if batch.loss_weight is None else batch.loss_weight)
    total = float(mass.sum())
    by_group = np.bincount(batch.slot, weights=mass, minlength=groups)
    return [round(float(m) / total, 6) if total else 0.0 for m in by_group]


def _in_order(o: GroupOutcome) -> list[Rollout]:
    return [o.rollouts[r] for r in sorted(o.rollouts)]


class Controller:
    """Composes the step source (sync dispatch, or the async train pump's half), the fleet watch,
    the ledger (with an external agent's pool of call records not matched yet) and `assemble`."""

    def __init__(self, cfg: MinirlConfig, run_dir: str, agent_urls: list[str], gen_workers: list, vocab_size: int,
                 pad_id: int, fleet=None):
        from pathlib import Path

        from minirl.metrics import EventLog

        self.cfg, self.gen_workers, self.pad_id = cfg, gen_workers, pad_id
        self.events = EventLog(Path(run_dir) / "events.jsonl")
        self.metrics_path = Path(run_dir) / "metrics.jsonl"  # the driver's: read only by run_failed
        self.ledger = Ledger(Path(run_dir) / "ledger", cfg.grpo.segment_validity)
        self.manager = RolloutManager(cfg, agent_urls, self.events.write, vocab_size)
        self.source: StepSource = (BufferSource if cfg.async_rl.enabled else SyncSource)(cfg, self.manager, self._drain)
        # `fleet`: the generation router's actor when fleet health is on, else None (then nothing is watched)
        self.fleet = FleetWatch(fleet, cfg.async_rl.generation_fleet_health.probe_interval_s, self.events.write)
        self.pool: list[dict] = []  # external agents: headerless records not matched yet
        self.salvaged: list[dict] = []  # records of a drain that failed on another worker: retired at the run's end
        self.unlogged: list = []  # the last step's group outcomes, in no metrics line until the next collect
        self.step: int | None = None  # the step last collected (a later failure is that step's)
        self.failed = False  # the run's run_failed event is written
        self.finished = False  # the run's run_end event is written
        self.mark: tuple | None = None  # minirl.timeline's clocks at the last publish (the cycle's start)
        self.engine_clocks = EngineClocks()  # the workers' totals, continuous across their restarts

    async def snapshot(self) -> dict:
        """The controller's part of a checkpoint, taken between two awaits (a consistent cut): the
        failure policy's run-scoped counters and, async, the pump's buffer with the call records
        of its groups (pickled: `Cluster.save_checkpoint` writes it into the checkpoint). A checkpoint
        follows its step's metrics line (minirl.train), so that step's groups are settled here."""
        self._settle()
        return {"rollout_manager": self.manager.state(), "async_buffer": self.source.snapshot()}

    def load_state(self, state: dict, async_buffer: bytes | None = None) -> None:
        """Resume: the counters, and (async) the buffer that the pump restores when it starts."""
        self.manager.load_state(state)
        self.source.restore(async_buffer)

    def note(self, event: dict) -> None:
        """Write an event from outside the step (e.g. the loop's `resumed`)."""
        self.events.write(event)

    async def published(self, version: int, engines: list[dict]) -> dict:
        """The generation workers now serve `version`: admissions and start_weights follow it. Returns
        the generation lane of the cycle this publish ends (minirl.timeline; empty for the first).
        `engines`: each worker's clock as its update ended (`GenerationWorker.update_weights`)."""
        self.source.published(version)
        reading = clocks(self.engine_clocks.read(engines), self.manager.occupancy.read())
        lane = {} if self.mark is None else generation_lane(self.mark, reading, self.cfg.async_rl.enabled)
        self.mark = reading
        return lane

    async def syncing(self) -> None:
        """A weight sync begins: the pump dispatches nothing until `published` (upstream's pause)."""
        self.source.syncing()

    async def validate(self, version: int) -> dict:
        """Held-out validation of the weights the generation workers serve (minirl.validation)."""
        from minirl.validation import validate

        return await validate(self.cfg, self.manager.agent_urls, version)

    def _ask_clocks(self) -> list:
        """Each generation worker's clock (`GenerationWorker.clock`), asked of all at once: the readings
        are taken now, whenever they are awaited."""
        return [w.clock.remote() for w in self.gen_workers]

    async def _engine_s(self, asked: list) -> tuple[float, float]:
        """The engines' run totals of stepping and of gathering bursts before a step, summed over the
        workers, from `_ask_clocks`."""
        readings = self.engine_clocks.read([await ref for ref in asked])
        return sum(c["busy_s"] for c in readings), sum(c["gather_s"] for c in readings)

    async def _clocks(self) -> tuple[float, ...]:
        readings = self.engine_clocks.read([await ref for ref in self._ask_clocks()])
        return clocks(readings, self.manager.occupancy.read())

    async def _drain(self, step: int | None) -> list[dict]:
        """Every worker's call records of `step`, asked of all at once, in worker order. A worker's take
        that fails fails the drain, after every other has answered: the records those handed over are no
        longer on their servers, so they go to the run's end (`salvaged`)."""
        asked = [w.take_calls.remote(step) for w in self.gen_workers]
        answers = await asyncio.gather(*asked, return_exceptions=True)
        records = [c for a in answers if not isinstance(a, BaseException) for c in a]
        errors = [a for a in answers if isinstance(a, BaseException)]
        if errors:
            self.salvaged += records
            raise errors[0]
        return records

    def run_failed(self, error: str) -> None:
        """The run ends with `error` (`ExceptionClass: message`): its one `run_failed` event, with the
        step and what the step spent (its groups, when its update, weight sync or metrics line failed after
        its collect); a second call (the driver's, for a failure already written) is a no-op."""
        if self.failed:
            return
        self.failed = True
        from minirl.metrics import last_record

        if self.unlogged and (last_record(self.metrics_path) or {}).get("step") == self.step:
            self._settle()  # its metrics line was written before the failure (its TensorBoard write, a SIGTERM)
        sends, returned = self.manager.spent()  # the groups no step's metrics counted yet
        self.events.write({"type": "run_failed", "step": self.step, "error": error,
                           "rollout_attempts": sends, "rollouts_generated": returned})

    async def finish(self) -> dict:
        """The run ends (its last step trained, or it failed): close the books the steps left open. The
        source stops; the groups it leaves unfinished are named and counted in one `run_end` event; the
        call records no step's ledger took (the source's, and each server's leftovers) are retired into
        ledger/run_end.jsonl, and each server's own list of the calls it served this run goes to
        ledger/served.jsonl (`Ledger.close_run`). Returns the event; a second call does nothing."""
        if self.finished:
            return {}
        self.finished = True
        unfinished, held = await self.source.close()
        accounts = []
        for rank, worker in enumerate(self.gen_workers):
            try:
                accounts.append(await worker.finish_run.remote())
            except Exception as exc:  # a worker that died (and was restarted) lost its log: its line says so
                accounts.append({"rank": rank, "left": [], "served_count": 0, "dropped": 0, "served": [],
                                 "error": f"{type(exc).__name__}: {exc}"[:500]})
        # with the records drained and never ledgered: a failed drain's, and an external agent's unmatched ones
        left = held + self.salvaged + self.pool + [rec for a in accounts for rec in a.pop("left")]
        self.salvaged, self.pool = [], []
        self.ledger.close_run(left, accounts)
        event = {"type": "run_end", "step": self.step, "unfinished": unfinished,
                 "groups_unfinished": sum(map(len, unfinished.values())), "calls_retired_at_end": len(left),
                 "calls_served": sum(a["served_count"] for a in accounts),
                 "calls_evicted_from_log": sum(a["dropped"] for a in accounts),
                 "unkeyed_calls_evicted": sum(a.get("unkeyed_dropped", 0) for a in accounts)}
        self.events.write(event)
        return event

    async def stacks(self) -> str:
        """Where each of this actor's asyncio tasks waits now (for a `finish` that did not end: the
        driver prints this before it gives up on the books)."""
        import io

        out = io.StringIO()
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.print_stack(limit=12, file=out)
        return out.getvalue()

    async def collect(self, step: int, version: int) -> tuple[TrainBatch, dict]:
        """Rollouts for `step` under the failure policy, then the assembled batch and its stats. Any
        failure on the way (the rollouts, the step checks, the ledger, the assembly) writes run_failed.

        In order: the step source hands over the step's prompt groups (`SyncSource`, rollout/source.py:
        dispatched through the rollout manager and awaited; `BufferSource`, async_rl/source.py: selected
        from the buffer the rollout pump fills), under the fleet watch (generation/fleet.py) when fleet
        health is on; then `check_step`, the ledger (`_check_ledger`), the call selection
        (`context_compaction.call_selection`: which captured calls train), `assemble`, and the step's
        statistics."""
        self.step = step
        self._settle()  # the driver wrote the last step's metrics line before it asked for this one
        try:
            return await self._collect(step, version)
        except BaseException as exc:  # the run ends here: leave its reason and its cost in the log
            self.run_failed(f"{type(exc).__name__}: {exc}")
            raise

    async def _collect(self, step: int, version: int) -> tuple[TrainBatch, dict]:
        before = self._ask_clocks()  # read as the take begins, awaited after it (no round trip ahead of the dispatch)
        self.mark = self.mark or await self._clocks()  # the first cycle starts here
        waited = time.perf_counter()
        take = await self.fleet.watched(step, self.source.take(step, version))
        busy0, gather0 = await self._engine_s(before)
        gen_s, waited = time.perf_counter() - take.since, time.perf_counter() - waited
        after = self._ask_clocks()  # read as the take ends, awaited once the batch is packed
        check_step(self.cfg, step, take.outcomes)
        ledger, generated = await self._check_ledger(step, version, take, _kept(take.outcomes))
        self.source.ledgered()  # until here a failure leaves the take's records to the run's end
        kept = _kept(take.outcomes)  # less the groups the ledger's masks left with no valid owner (`_ledger_drops`)
        selection = self.cfg.context_compaction.call_selection  # which captured calls train (rollout/selection.py)
        reselected = 0 if selection == "returned_history" else select_calls(
            selection, kept, take.calls, self.cfg.policy.max_total_sequence_length)
        batch, stats = assemble(self.cfg, take.outcomes, self.pad_id)
        stats["rollouts_reselected"] = reselected
        for r in kept:
            if r.mask_reason:
                self.events.write({"type": "mask", **r.coords.as_dict(), "reason": r.mask_reason, "decision": "masked",
                                   **mask_facts(r.mask_reason, r.evidence), "errors": r.evidence.get("errors", [])})
            for k, t in enumerate(r.traces):  # a masked segment, alone (segment_validity=any) or with its rollout's
                if t.mask_reason:  # own `mask` line (a `mask` line is one rollout: stats.rooms_mix counts them)
                    self.events.write({"type": "segment_mask", **r.coords.as_dict(), "trace": k, "kind": t.kind,
                                       "reason": t.mask_reason, "decision": "masked",
                                       "rollout_masked": bool(r.mask_reason)})
        busy1, gather1 = await self._engine_s(after)
        stats.update(self._step_stats(version, take, ledger, generated, gen_s, busy1 - busy0, gather1 - gather0))
        stats["timing/train/exposed_generation"] = waited
        spent = [*take.outcomes, *take.evicted]
        stats.update(kind_counts(spent, kept))
        # failed summaries of every row that returned or failed, as guard_rejections: not only the kept rows'
        stats["summaries_failed"] = sum(o.summaries_failed for o in spent)
        self.unlogged = spent  # counted by run_failed until its metrics line is written (`_settle`)
        return batch, stats

    def _settle(self) -> None:
        """The last collected step's metrics line is written: its groups leave the manager's unsettled."""
        self.manager.settle(self.unlogged)
        self.unlogged = []

    async def _check_ledger(self, step: int, version: int, take: StepTake, kept: list[Rollout]) -> tuple[dict, int]:
        """The kept rollouts against the ledger: the servers' call logs, or for an external agent (no
        rollout header) its calls matched by their tokens; under CC, the groups its masks leave with no valid
        owner are dropped (`_ledger_drops`). Returns the ledger's counts and the tokens generated."""
        window = self.source.window
        oldest = take.oldest(version, window)
        drop = functools.partial(self._ledger_drops, step, take)
        if not self.cfg.agent.external_url:
            ledger = self.ledger.close_step(step, take.calls, kept, version, oldest=oldest, drop=drop)
            return ledger, sum(len(c.get("generation_token_ids") or []) for c in take.calls)
        records = self.pool + await self._drain(None)
        ledger, left = self.ledger.match_external(step, records, kept, version, oldest=oldest, drop=drop)
        keep = step - 1 - window  # a record is kept for the window's steps (async runs ahead), then retired
        self.pool = [rec for rec in left if rec.setdefault("drained_step", step) >= keep]
        aged = [rec for rec in left if rec["drained_step"] < keep]
        self.ledger.retire(step, aged, "external: no rollout returned it within the window's steps")
        ledger["calls_retired"] += len(aged)
        return ledger, ledger["tokens_matched"]

    def _ledger_drops(self, step: int, take: StepTake) -> set[tuple[int, int]]:
        """The ledger's masks are set: under CC the groups they left with no valid owner are dropped (the
        manager's budget), and the step is checked again without them (the floor, upstream's full count)."""
        dropped = self.manager.drop_unowned(take.outcomes)
        if dropped:
            check_step(self.cfg, step, take.outcomes)
        return dropped

    def _step_stats(self, version: int, take: StepTake, ledger: dict, generated: int,
                    gen_s: float, engine_busy_s: float, engine_gather_s: float) -> dict:
        """The step's counters beyond `assemble`'s: sends, the ledger's counts, timing, staleness.
        What its groups cost counts the groups it evicted too (async)."""
        outcomes, spent = take.outcomes, [*take.outcomes, *take.evicted]
        staleness = [version - w for o, w in zip(outcomes, take.start_weights) if o.status == "committed"] or [0]
        return dict(
            rollout_attempts=sum(o.row_sends for o in spent),
            rollouts_generated=sum(o.rows_returned for o in spent),
            guard_rejections=sum(o.guard_rejections for o in spent),  # raised and ended episodes alike
            calls_retired=ledger.get("calls_retired", 0),
            calls_unrecorded=ledger.get("calls_unrecorded", 0),
            calls_stale=ledger.get("calls_stale", 0),  # external agents: masked, see Ledger.match_external
            calls_logprob_mismatch=ledger.get("calls_logprob_mismatch", 0),
            calls_matched=ledger.get("calls_matched", 0),
            # rows found to fail the same way every time (skipped as DATA)
            deterministic_failures=sum(o.deterministic_failures for o in spent),
            gen_time_s=gen_s,
            engine_busy_s=engine_busy_s,
            # the engines holding a burst before their first step (vllm_cfg.gather_gap_s)
            engine_gather_s=engine_gather_s,
            gen_tokens=generated,
            gen_tokens_per_s=generated / gen_s if gen_s > 0 else 0.0,
            policy_version=version,
            staleness_mean=float(np.mean(staleness)),
            staleness_max=int(max(staleness)),
            **take.counts,
            **self.fleet.stats,
            **self.manager.agent_stats(),  # agent servers up, and each one's /run sends
            prompt_seeds=[prompt_key(self.cfg, o.step, o.group) for o in outcomes],
        )
