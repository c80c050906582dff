"""Async steps count only their own groups, and a group is stamped by its true age (issues 50, 52).

Through the real rollout pump, buffer, samplers, train-pump source (`BufferSource`) and ledger, over
a real agent and model server on the session's vLLM engine, whose weights are re-published between
steps so that its call records carry the versions they ran under."""

from __future__ import annotations

import asyncio
import copy
import json
import os
from pathlib import Path

import pytest
from helpers import run_cli

from minirl.config import FaultSpec

VOCAB = 512


def async_cfg(base_cfg, sampler: str, faults: list[dict], staleness: int = 1, prompts: int = 1):
    cfg = copy.deepcopy(base_cfg)
    cfg.async_rl.enabled, cfg.grpo.max_num_steps = True, 8
    cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt = prompts, 2
    cfg.policy.train_global_batch_size = prompts * 2
    ar, rf = cfg.async_rl, cfg.async_rl.rollout_failure
    ar.sampler.name, ar.sampler.max_staleness_versions = sampler, staleness
    ar.max_inflight_prompts, ar.max_buffered_rollouts = 2, 4
    rf.max_consecutive_dropped_prompts = rf.max_skipped_prompts = 0
    rf.nemo_gym.max_row_attempts = 1  # a row's failure fails its group attempt: the retry keeps the other row
    cfg.faults.inject = [FaultSpec(**f) for f in faults]
    return cfg


async def train_steps(s, engine, weights, cfg, steps: int, until=None):
    """Play the train pump: each step takes its groups from a `BufferSource`, checks them against the
    ledger (the controller's window, `StepTake.oldest`) and publishes `weights` to the engine as the
    next version. Every INFRA backoff waits until step 1's publish. Stops after `steps`, or once
    `until(events)`. Returns (takes with their ledger counts, events, the first version, the manager)."""
    from minirl.async_rl.source import BufferSource
    from minirl.rollout.evidence import Ledger
    from minirl.rollout.manager import RolloutManager

    events, release, takes = [], asyncio.Event(), []

    async def backoff(seconds):
        await release.wait()

    async def drain(step):
        return s.model.take_calls(step)

    manager = RolloutManager(cfg, [s.agent_url], events.append, VOCAB, sleep=backoff)
    source, ledger = BufferSource(cfg, manager, drain), Ledger(None)
    base = engine.version
    try:
        for step in range(steps):
            version = base + step
            take = await asyncio.wait_for(source.take(step, version), 180)
            kept = [r for o in take.outcomes if o.status == "committed" for r in o.rollouts.values()]
            counts = ledger.close_step(step, take.calls, kept, version, oldest=take.oldest(version, source.window))
            takes.append((take, counts))
            manager.settle([*take.outcomes, *take.evicted])
            source.syncing()
            await asyncio.wrap_future(engine.update_weights(weights, version=version + 1))
            source.published(version + 1)
            if step == 1:
                release.set()
            if until is not None and until(events):
                break
    finally:
        pump = source.pump
        tasks = [t for t in [pump.main, pump.watchdog, pump.starved, *pump.tasks] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await manager.session.close()
        await asyncio.wrap_future(engine.update_weights(weights, version=base))
    return takes, events, base, manager


@pytest.fixture(scope="module")
def weights(base_cfg):
    """The policy's initial weights, re-published to the engine as each new version."""
    from minirl.trainer.policy_worker import PolicyWorker

    return PolicyWorker(base_cfg).get_weights()


@pytest.mark.parametrize("sampler", ["windowed", "ready_first"])
def test_a_retry_that_keeps_an_old_row_is_stamped_with_that_rows_version(stack, base_cfg, engine, weights, sampler):
    """Issue 50, item 1. Group (0, 0)'s row 0 comes back under weights v0; row 1 fails (a dropped
    connection, INFRA), and the group's retry waits until the train pump has published twice, so
    it re-runs row 1 alone under v2 and keeps row 0 (`keep_returned_rows`, the default). The group
    is stamped v0, the oldest version its kept rows ran under: `windowed` (S = 1) evicts it as stale
    at v2 or later, and `ready_first` trains it with the ledger's window reaching back to v0. Before,
    the group was stamped v2, the newest attempt's, and the ledger ended the run: "policy-version
    discipline: call s0.g0.r0.a0 ran under weights [0], but step 3 trains versions 2..3"."""
    cfg = async_cfg(base_cfg, sampler, [{"kind": "transport", "step": 0, "group": 0, "rollout": 1, "attempt": 0}])

    def consumed(events):
        return any(e["type"] == "evict" and (e["step"], e["group"]) == (0, 0) for e in events)

    async def go():
        async with stack(cfg) as s:
            return await train_steps(s, engine, weights, cfg, 6, until=consumed)

    takes, events, base, _ = asyncio.run(go())
    retried = [e for e in events if e["type"] == "failure" and (e["step"], e["group"]) == (0, 0)]
    assert [(e["rollout"], e["decision"]) for e in retried] == [(1, "retried")]
    trained = [(take, w) for take, _ in takes
               for o, w in zip(take.outcomes, take.start_weights) if (o.step, o.group) == (0, 0)]
    if sampler == "windowed":
        (evict,) = [e for e in events if e["type"] == "evict" and (e["step"], e["group"]) == (0, 0)]
        assert evict["start_weight"] == base and evict["reason"] == "stale" and evict["train_version"] >= base + 2
        assert not trained
        evicted = [o for take, _ in takes for o in take.evicted if (o.step, o.group) == (0, 0)]
        assert [o.group_attempts for o in evicted] == [2], "the step that evicted it has its outcome"
    else:
        (take, w), = trained
        assert w == base, "stamped with its kept row's version, not the retry's"
        (o,) = [o for o in take.outcomes if (o.step, o.group) == (0, 0)]
        assert o.group_attempts == 2 and sorted(o.rollouts) == [0, 1]
        assert o.rollouts[0].coords.attempt == 0 and o.rollouts[1].coords.attempt == 1
    assert all(counts.get("calls_trained", 0) > 0 for _, counts in takes)


def test_a_resume_from_a_checkpoint_taken_while_a_spare_stands_in_counts_the_lost_prompt(stack, base_cfg, engine):
    """`replace`: group (0, 0)'s prompt drops (a model server 500 on its row 0, one group attempt
    allowed) and spare (0, 1) takes its place. A checkpoint of the buffer (`BufferSource.snapshot`,
    pickled, and the manager's counters, as `Controller.snapshot` takes them) is taken as the spare is
    dispatched; a second source resumes from it and relaunches the place. Its step 0 counts what the
    uninterrupted step 0 counts: the lost prompt as `replaced`, its sends and its failure kinds, and its
    call records (retired by the ledger). Before, the checkpoint kept the place but not the prompt it
    gave up on: the resumed step took the spare alone, and the lost prompt's sends and failures were
    counted by no step (its drop still charged to the budget)."""
    from minirl.async_rl.source import BufferSource
    from minirl.gym.failures import kind_counts
    from minirl.rollout.evidence import Ledger
    from minirl.rollout.manager import RolloutManager

    cfg = async_cfg(base_cfg, "in_order", [{"kind": "model_error", "step": 0, "group": 0, "rollout": 0}])
    cfg.grpo.max_num_steps = 1  # the pump dispatches step 0's place, and nothing after it
    rf = cfg.async_rl.rollout_failure
    rf.on_dropped_prompt, rf.max_infra_attempts_per_prompt, rf.max_consecutive_dropped_prompts = "replace", 1, 1
    version = engine.version
    checkpoints = []

    async def step_0(s, events: list, checkpoint=None) -> dict:
        """Step 0 taken from a fresh manager and source (resumed from `checkpoint` as the controller's
        `load_state` resumes), then the run's end; what the step's metrics and ledger count of it."""
        async def drain(step):
            return s.model.take_calls(step)

        def emit(event):  # the event log; the checkpoint is taken as the spare goes out
            events.append(event)
            if checkpoint is None and event["type"] == "dispatch" and event["replacement"]:
                checkpoints.append((source.snapshot(), manager.state()))

        manager = RolloutManager(cfg, [s.agent_url], emit, VOCAB)
        source = BufferSource(cfg, manager, drain)
        if checkpoint is not None:
            source.restore(checkpoint[0])
            manager.load_state(checkpoint[1])
        try:
            take = await asyncio.wait_for(source.take(0, version), 120)
        finally:
            await source.close()
            await manager.session.close()
        kept = [r for o in take.outcomes if o.status == "committed" for r in o.rollouts.values()]
        ledger = Ledger(None).close_step(0, take.calls, kept, version, oldest=take.oldest(version, source.window))
        return {"places": sorted((o.step, o.group, o.status, o.group_attempts, o.row_sends) for o in take.outcomes),
                "rollout_attempts": sum(o.row_sends for o in take.outcomes), **kind_counts(take.outcomes, kept),
                "calls_retired": ledger["calls_retired"],
                "lost_calls": sorted(c["key"] for c in take.calls if (c["step"], c["group"]) == (0, 0))}

    async def go():
        async with stack(cfg) as s:
            events, resumed_events = [], []
            whole = await step_0(s, events)
            assert len(checkpoints) == 1
            resumed = await step_0(s, resumed_events, checkpoints[0])
            return whole, resumed, events, resumed_events

    whole, resumed, events, resumed_events = asyncio.run(go())
    (replace,) = [e for e in events if e["type"] == "replace"]
    assert (replace["decision"], replace["fresh_step"], replace["fresh_group"]) == ("fresh_prompt", 0, 1)
    assert whole["places"] == [(0, 0, "replaced", 1, 2), (0, 1, "committed", 1, 2)]
    assert whole["failures_by_kind"] and whole["calls_retired"] == len(whole["lost_calls"]) > 0
    (restored,) = [e for e in resumed_events if e["type"] == "buffer_restored"]
    assert restored["redispatched"] == [[0, 1]] and restored["kept"] == []
    assert resumed == whole


SYNC_RUN = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "grpo.max_num_steps=3",
            "checkpoint.enabled=false",
            "logger.tensorboard=false", "faults.rate={agent_exception: 0.15, guard_reject: 0.1}", "faults.seed=5",
            "agent.context_history.guards.on_reject=raise"]
SYNC_BEFORE = Path(__file__).parents[1] / "data" / "sync_metrics_before_counts_from_outcomes.json"
"""The run's per-step metrics as main's code wrote them before the counters came from the outcomes
(b857a62), less their clocks and float noise (`comparable`). The test compares
the metrics named here, so a metric added later does not break it; a change meant to alter one of
them rewrites the file (MINIRL_RECORD_SYNC=1)."""


NOISE = ("logprob_abs_error", "token_mult_prob_error")
"""The trainer's and the engine's logprobs differ by ~1e-8, and by another ~1e-8 in a rerun."""

REL = 1e-5
"""A float metric (grad_norm, loss) is a float32 reduction whose last bit follows the reduction order:
step 0's grad_norm is 0.1170877218 in this file, was 0.1170876995 on CI's machine and in a rerun here
without the shared engine, and 0.1170876846 with ATEN_CPU_CAPABILITY=avx2 (1-2 float32 ulps apart).
Counters and everything else compare exactly."""


def same(a, b) -> bool:
    """a == b, floats to REL (ints, strings, None, lists and dicts element by element)."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and a == pytest.approx(b, rel=REL)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def comparable(row: dict) -> dict:
    """A metrics line without its clocks (timing, rates, seconds) and float noise (NOISE), a NaN as
    "nan" (NaN != NaN)."""
    return {k: "nan" if v != v else v for k, v in row.items()
            if not (k.startswith("timing/") or k.endswith(("_s", "_per_s")) or k in NOISE)}


@pytest.mark.slow
def test_a_seeded_sync_run_writes_the_same_metrics_as_before(tmp_path, shared_engine):
    """Issue 52, item 1: the step's counters now come from its group outcomes; in a sync run (a
    step's groups are all its own) every metric stays what main's code wrote, faults included
    (guard rejections raised as failures, agent exceptions re-sent)."""
    proc = run_cli(*SYNC_RUN, f"run_dir={tmp_path}", *shared_engine)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [comparable(json.loads(line)) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line]
    if os.environ.get("MINIRL_RECORD_SYNC"):
        SYNC_BEFORE.parent.mkdir(exist_ok=True)
        SYNC_BEFORE.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
    assert (sum(r["guard_rejections"] for r in rows) > 0
            and sum(r["rollout_attempts"] > r["rollouts_generated"] for r in rows) > 0)
    before = json.loads(SYNC_BEFORE.read_text())
    assert len(rows) == len(before)
    differ = [(i, k, r.get(k, "missing"), v) for i, (r, b) in enumerate(zip(rows, before)) for k, v in b.items()
              if not same(r.get(k, "missing"), v)]
    assert not differ, f"(step, metric, now, before): {differ}"


def test_a_spare_prompts_drop_message_names_the_spare_not_the_next_steps_group(stack, base_cfg):
    """Issue 50, item 9: spare batch 0 is the groups N..2N-1 of prompt step 0 (`spare_groups`); its
    group N + 1, given up on, is named by its own coordinates. Before, the message said `prompt
    idx=3`, the stream index of step 1's group 1, another prompt."""
    from minirl.data import prompt_row
    from minirl.rollout.manager import RolloutManager
    from minirl.wire import RolloutRedispatchExhausted

    cfg = async_cfg(base_cfg, "in_order", [{"kind": "agent_exception", "step": 0, "group": 3, "rollout": 0}], prompts=2)
    cfg.context_compaction.redispatch_dropped_groups = False  # upstream under CC: the first failure drops the group

    async def go():
        async with stack(cfg) as s:
            manager = RolloutManager(cfg, [s.agent_url], [].append, VOCAB)
            manager.open()
            try:
                await manager.run_group(0, 3, prompt_row(cfg, 0, 3))
            except RolloutRedispatchExhausted as exc:
                return str(exc)
            finally:
                await manager.session.close()

    message = asyncio.run(go())
    assert message.startswith("spare prompt (step 0, group 3) exhausted its infrastructure retry budget after 1 "
                              "attempt(s)"), message


@pytest.mark.slow
def test_an_async_steps_counters_cover_its_own_groups_and_sum_to_the_runs(tmp_path, shared_engine):
    """Issue 50 item 11, issue 52 item 1. `windowed` dispatches ungated, 8 groups in flight for
    steps of 2: groups of later steps fail (guard rejections raised as HTTP 500, re-sent) while a
    step is taken. Each step's `guard_rejections` is exactly the rejections of the groups it took,
    lost or evicted (their `failure` events, by prompt), so is its `failures_by_kind`, and the
    steps' counts add up to the run's over the groups the steps consumed. Before, the counters were
    run totals (the rollout manager's, the failure-kind tally's) taken between steps: a step
    counted the failures of whatever groups the pump had running meanwhile."""
    from minirl.config import load_config
    from minirl.data import prompt_key

    args = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "grpo.max_num_steps=4",
            "checkpoint.enabled=false", "logger.tensorboard=false", "async_rl.enabled=true",
            "loss_fn.use_importance_sampling_correction=true", "async_rl.sampler.name=windowed",
            "async_rl.max_inflight_prompts=8", "async_rl.max_buffered_rollouts=8",
            "async_rl.rollout_failure.max_skipped_prompts=0",
            "async_rl.rollout_failure.max_consecutive_dropped_prompts=0",
            "agent.context_history.guards.on_reject=raise", "faults.rate={guard_reject: 0.15}", "faults.seed=2"]
    proc = run_cli(*args, f"run_dir={tmp_path}", *shared_engine)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line]
    evs = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines() if line]
    cfg = load_config(None, args)

    def seed(e):
        return prompt_key(cfg, e["step"], e["group"])

    rejected = [seed(e) for e in evs if e["type"] == "failure" and e.get("error_type") == "ContextGuardRejected"]
    failed = [seed(e) for e in evs if e["type"] == "failure"]
    per_step, consumed = [], set()
    for r in rows:
        mine = set(r["prompt_seeds"]) | {seed(e) for e in evs
                                         if e["type"] == "evict" and e["train_version"] == r["policy_version"]}
        consumed |= mine
        per_step.append(((r["guard_rejections"], sum(r["failures_by_kind"].values())),
                         (sum(s in mine for s in rejected), sum(s in mine for s in failed))))
    assert [got for got, _ in per_step] == [want for _, want in per_step], per_step
    assert sum(got[0] for got, _ in per_step) == sum(s in consumed for s in rejected) > 0
    assert sum(got[1] for got, _ in per_step) == sum(s in consumed for s in failed)
    ahead = [e for e in evs if e["type"] == "dispatch" and e["step"] > e["start_weight"] + 1]
    assert ahead, "the pump ran more than a step ahead"
