"""The async single controller end to end (issue K): `python -m minirl.train async_rl.enabled=true`
with real Ray actors, the vLLM engine, the agent servers and the torch policy worker. The review
table in async mode is in test_train_cli, the SIGKILL resume in test_reliability."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_cli

pytestmark = pytest.mark.slow

SMALL = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=2", "checkpoint.enabled=false",
         "logger.tensorboard=false"]
ASYNC = ["async_rl.enabled=true", "loss_fn.use_importance_sampling_correction=true"]
NO_DROP_BUDGETS = ["async_rl.rollout_failure.max_skipped_prompts=0",
                   "async_rl.rollout_failure.max_consecutive_dropped_prompts=0"]
"""A sampler that stamps no target step (all but in_order) takes no drop budget, as upstream."""


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line]


def test_in_order_at_staleness_0_is_the_synchronous_loop_exactly(tmp_path, shared_engine):
    runs = {}
    for mode, extra in (("sync", []),
                        ("async", ["async_rl.enabled=true", "async_rl.sampler.max_staleness_versions=0"])):
        proc = run_cli(*SMALL, "grpo.max_num_steps=2", *extra, f"run_dir={tmp_path / mode}", *shared_engine)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[mode] = metrics(tmp_path / mode)
    keys = ("step", "prompt_seeds", "reward_mean", "loss", "tokens_trained", "rollouts_trained", "traces_trained")
    assert [{k: r[k] for k in keys} for r in runs["sync"]] == [{k: r[k] for k in keys} for r in runs["async"]]
    assert all(r["staleness_max"] == 0 for r in runs["async"])


def test_windowed_evicts_groups_that_fell_out_of_the_window_and_never_trains_them(tmp_path, shared_engine):
    """windowed at staleness 0: the pump dispatches 16 groups under weights 0; step 0 trains 4 of
    them and the other 12 are stale under weights 1: evicted, counted, logged, never trained."""
    proc = run_cli(*SMALL, "grpo.max_num_steps=2", "async_rl.enabled=true", "async_rl.sampler.name=windowed",
                   "async_rl.sampler.max_staleness_versions=0", "async_rl.max_inflight_prompts=16",
                   "async_rl.max_buffered_rollouts=16", *NO_DROP_BUDGETS, f"run_dir={tmp_path}", *shared_engine)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path)
    assert all(r["staleness_max"] == 0 and r["groups_trained"] == 4 for r in rows)
    evicted = [e for e in events(tmp_path) if e["type"] == "evict"]
    assert sum(r["stale_groups_evicted"] for r in rows) == len(evicted) > 0
    assert all(e["start_weight"] < e["train_version"] for e in evicted)
    trained = {s for r in rows for s in r["prompt_seeds"]}
    from minirl.config import load_config
    from minirl.data import prompt_row

    cfg = load_config(None, SMALL)
    assert not trained & {prompt_row(cfg, e["step"], e["group"])["task"]["seed"] for e in evicted}


def test_mixed_faults_under_async_defaults_stay_in_the_window_and_the_log_matches_the_metrics(tmp_path, shared_engine):
    """Issue K's acceptance: agent_exception, transport and guard_reject at 4% each on the defaults."""
    proc = run_cli("grpo.max_num_steps=3", "checkpoint.enabled=false", "logger.tensorboard=false", *ASYNC,
                   "faults.rate={agent_exception: 0.04, transport: 0.04, guard_reject: 0.04}", "faults.seed=3",
                   f"run_dir={tmp_path}", *shared_engine)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows, evs = metrics(tmp_path), events(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(0 <= r["staleness_max"] <= 1 for r in rows), "no trained group outside the window"
    faults = [e for e in evs if e["type"] == "fault"]
    assert {e["kind"] for e in faults} >= {"agent_exception", "guard_reject"}
    assert sum(r["dropped_prompt_groups"] for r in rows) == sum(e["type"] == "drop" for e in evs)
    assert sum(r["rollouts_masked"] for r in rows) == sum(e["type"] == "mask" for e in evs)
    assert sum(r["stale_groups_evicted"] for r in rows) == sum(e["type"] == "evict" for e in evs)
    assert sum(r["redispatched_rows"] for r in rows) == \
        sum(e["type"] == "failure" and e.get("scope") == "row" for e in evs)


UPSTREAM_REPLACE = ["--config", "configs/upstream_pr4124.yaml", "async_rl.enabled=true",
                    "async_rl.rollout_failure.on_dropped_prompt=replace",
                    "async_rl.rollout_failure.max_consecutive_dropped_prompts=5", "grpo.max_num_steps=2",
                    "async_rl.rollout_failure.nemo_gym.rollout_timeout_s=60"]
"""The preset has no group deadline (upstream's): 60 s bounds a hang, and no healthy group of a loaded
machine reaches it (at 6 s one did, and its extra drop and replacement changed the counts)."""


def test_replace_keeps_a_step_whole_through_two_drops_in_it_and_a_skip(tmp_path, shared_engine):
    """Issue 28's acceptance, upstream's `replace` through the real pump, buffer, sampler and rollout
    manager: two groups of step 0 drop (guard rejections, HTTP 500, INFRA, never re-sent under CC)
    and one group of step 1 is skipped (malformed output, DATA). Each lost place takes a spare from
    the pool (one batch of spare prompts, refilled below its low-water mark of 1), so both steps
    train 4 of 4, which the preset's floor of 1.0 demands: before, the second drop found the one
    replacement `in flight` and shrank the step, and a skip was never replaced."""
    faults = ("[{kind: guard_reject, step: 0, group: 1, rollout: 0, attempt: 0},"
              " {kind: guard_reject, step: 0, group: 2, rollout: 1, attempt: 0},"
              " {kind: bad_output, step: 1, group: 0, rollout: 0, attempt: 0}]")
    proc = run_cli(*UPSTREAM_REPLACE, *SMALL, "async_rl.sampler.max_lookahead_versions=0",
                   "async_rl.rollout_failure.max_skipped_prompts=1", f"faults.inject={faults}",
                   f"run_dir={tmp_path}", *shared_engine)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows, evs = metrics(tmp_path), events(tmp_path)
    assert [(r["groups_target"], r["groups_trained"]) for r in rows] == [(4, 4), (4, 4)]
    assert [(r["dropped_prompt_groups"], r["skipped_prompt_groups"], r["replaced_prompt_groups"],
             r["promoted_prompt_groups"])
            for r in rows] == [(0, 0, 2, 0), (0, 0, 1, 0)]  # only the shortfall counts as dropped: none is left
    replaced = sorted((e["target_step"], e["step"], e["group"], e["status"], e["decision"], e["fresh_step"],
                       e["fresh_group"])
                      for e in evs if e["type"] == "replace")
    assert [r[:5] for r in replaced] == [(0, 0, 1, "dropped", "fresh_prompt"), (0, 0, 2, "dropped", "fresh_prompt"),
                                         (1, 1, 0, "skipped", "fresh_prompt")]
    assert sorted(r[5:] for r in replaced) == [(0, 4), (0, 5), (0, 6)]  # spare batch 0: groups N.. of prompt step 0
    (pool,) = [e for e in evs if e["type"] == "spare_pool"]
    assert (pool["batch"], pool["prompts"], pool["low_water"]) == (0, [[0, 4], [0, 5], [0, 6], [0, 7]], 1)
    assert sum(e["type"] == "drop" for e in evs) == 2 and sum(e["type"] == "skip" for e in evs) == 1
    assert sum(e["type"] == "failure" and e["decision"] == "skipped" for e in evs) == 1
    seeds = [set(r["prompt_seeds"]) for r in rows]  # every prompt the step's places held, the lost ones too
    from minirl.config import load_config
    from minirl.data import prompt_row

    cfg = load_config(None, SMALL)
    seed = lambda s, g: prompt_row(cfg, s, g)["task"]["seed"]  # noqa: E731
    assert seeds[0] == {seed(0, g) for g in range(6)} and seeds[1] == {seed(1, g) for g in range(4)} | {seed(0, 6)}


def test_replace_borrows_from_the_furthest_step_and_the_spare_repays_it(tmp_path, shared_engine):
    """At lookahead 2 steps 1 and 2 finish while step 0's group 1 hangs to its deadline and drops:
    a group of the furthest step (2) is promoted into step 0, and the spare repays step 2."""
    proc = run_cli(*UPSTREAM_REPLACE, *SMALL, *ASYNC, "async_rl.sampler.max_lookahead_versions=2",
                   "grpo.max_num_steps=3",
                   "async_rl.rollout_failure.nemo_gym.rollout_timeout_s=15",
                   "faults.inject=[{kind: timeout, step: 0, group: 1, rollout: 0}]", f"run_dir={tmp_path}",
                   *shared_engine)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [(r["groups_trained"], r["promoted_prompt_groups"], r["replaced_prompt_groups"], r["dropped_prompt_groups"])
            for r in rows] == [(4, 1, 0, 0), (4, 0, 0, 0), (4, 0, 1, 0)]
    (ev,) = [e for e in events(tmp_path) if e["type"] == "replace"]
    assert (ev["decision"], ev["lender_step"], ev["lender_group"][0], ev["fills_step"]) == ("promoted", 2, 2, 2)
    assert (ev["fresh_step"], ev["fresh_group"]) == (0, 4)
    assert all(r["staleness_max"] <= 2 for r in rows)


def test_weight_fifo_is_gated_and_never_mixes_versions_in_a_step(tmp_path, shared_engine):
    """Upstream's gate (batch k only while k <= w + S): at S = 1, 4 steps of 4 groups dispatch 8
    groups under weights 0 (ungated, the pump put 68 there and 60 were evicted), each step trains
    groups of one start weight, and nothing is evicted."""
    proc = run_cli(*SMALL, *ASYNC, *NO_DROP_BUDGETS, "grpo.max_num_steps=4", "async_rl.sampler.name=weight_fifo",
                   f"run_dir={tmp_path}", *shared_engine)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows, evs = metrics(tmp_path), events(tmp_path)
    assert [r["groups_trained"] for r in rows] == [4, 4, 4, 4]
    assert all(r["staleness_mean"] == r["staleness_max"] for r in rows), "one start weight per step"
    dispatched = [e for e in evs if e["type"] == "dispatch"]
    # batches 0..w+S, w up to 4 once step 3's weights are out (the pump draws past the last step)
    assert sum(e["start_weight"] == 0 for e in dispatched) == 8 and len(dispatched) <= 4 * (4 + 1 + 1)
    assert sum(r["stale_groups_evicted"] for r in rows) == 0 and not [e for e in evs if e["type"] == "evict"]


def test_a_retried_group_is_restamped_and_nothing_is_dispatched_during_a_weight_sync(stack, base_cfg):
    """The real pump, buffer, sampler and rollout manager over a real agent and model server. While
    paused (a weight sync) the pump dispatches nothing; a group whose first attempt fails (a dropped
    connection, INFRA) and whose retry starts after a sync to weights 1 is stamped start_weight 1,
    as upstream re-stamps every attempt (before: its first dispatch's 0, so it could be evicted as
    stale though it ran under the fresh weights)."""
    import asyncio
    import copy
    from collections import Counter

    from minirl.async_rl.buffer import GroupBuffer
    from minirl.async_rl.pump import RolloutPump
    from minirl.async_rl.samplers import make_sampler
    from minirl.config import FaultSpec
    from minirl.rollout.manager import RolloutManager

    cfg = copy.deepcopy(base_cfg)
    cfg.async_rl.enabled, cfg.grpo.max_num_steps = True, 2
    cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt, cfg.policy.train_global_batch_size = 1, 2, 2
    cfg.async_rl.rollout_failure.nemo_gym.max_row_attempts = 1
    # the retry re-runs every row (upstream), so nothing older than it is kept: a kept row's older
    # version is the group's stamp instead (tests/integration/test_async_counts.py)
    cfg.async_rl.rollout_failure.nemo_gym.keep_returned_rows = False
    cfg.faults.inject = [FaultSpec(kind="transport", step=0, group=0, rollout=0, attempt=0)]
    events, inflight_seen = [], []

    async def go():
        async with stack(cfg) as s:
            async def backoff(seconds):  # the retry's backoff spans a weight sync to version 1
                inflight_seen.append(dict(pump.inflight))
                pump.pause()
                await asyncio.sleep(0.2)
                pump.set_version(1)

            manager = RolloutManager(cfg, [s.agent_url], events.append, 512, sleep=backoff)
            manager.open()

            async def resolved(step, group):
                pass

            pump = RolloutPump(cfg, manager, GroupBuffer(4), make_sampler("in_order", 1, 1), 0, 0, resolved)
            pump.pause()
            pump.start()
            await asyncio.sleep(0.5)
            paused = [e for e in events if e["type"] == "dispatch"]
            pump.set_version(0)  # the sync ends (to the same weights, here)
            taken = []
            while len(taken) < 2:
                _, chosen = await asyncio.wait_for(pump.buffer.take_when(lambda ready: ([], ready[:1] or None)), 120)
                taken += chosen
            for t in [pump.main, pump.watchdog, pump.starved, *pump.tasks]:
                t.cancel()
            await manager.session.close()
            return paused, taken, Counter(pump.inflight)

    paused, taken, inflight = asyncio.run(go())
    assert paused == []
    by = {(r.step, r.group): r for r in taken}
    assert (by[0, 0].start_weight, by[0, 0].outcome.group_attempts) == (1, 2)
    assert by[1, 0].start_weight == 0  # dispatched and finished under weights 0
    assert [(e["step"], e["start_weight"]) for e in events if e["type"] == "dispatch"] == [(0, 0), (1, 0)]
    assert inflight_seen and inflight_seen[0].get(0, 0) >= 1 and all(v == 0 for v in inflight.values())


def test_a_promotion_lets_the_short_step_train_before_its_spare_returns(stack, base_cfg):
    """The real pump, buffer, in_order sampler and rollout manager over a real agent and model
    server: step 0's group 1 hangs to its group deadline (a `timeout` fault) and drops while steps 1
    and 2 have finished. A group of step 2 is promoted into step 0, which the waiting train pump
    takes at once, while the spare that repays step 2 is still in flight (the re-stamp wakes it)."""
    import asyncio
    import copy

    from minirl.async_rl.buffer import GroupBuffer
    from minirl.async_rl.pump import RolloutPump
    from minirl.async_rl.samplers import make_sampler
    from minirl.config import FaultSpec
    from minirl.rollout.manager import RolloutManager

    cfg = copy.deepcopy(base_cfg)
    cfg.async_rl.enabled, cfg.grpo.max_num_steps = True, 3
    cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt, cfg.policy.train_global_batch_size = 2, 2, 4
    rf = cfg.async_rl.rollout_failure
    rf.on_dropped_prompt, rf.max_infra_attempts_per_prompt, rf.max_consecutive_dropped_prompts = "replace", 1, 1
    rf.nemo_gym.rollout_timeout_s = 10.0
    cfg.faults.inject = [FaultSpec(kind="timeout", step=0, group=1, rollout=0)]
    events = []

    async def go():
        async with stack(cfg) as s:
            manager = RolloutManager(cfg, [s.agent_url], events.append, 512)
            manager.open()

            async def resolved(step, group):
                pass

            sampler = make_sampler("in_order", 2, 2)
            pump = RolloutPump(cfg, manager, GroupBuffer(8), sampler, 0, 0, resolved)
            pump.start()
            _, chosen = await asyncio.wait_for(
                pump.buffer.take_when(lambda ready: ([], sampler.select(0, 0, ready, None))), 120)
            spare_in_flight = [job for task, job in pump.tasks.items() if job[3] and not task.done()]
            for t in [pump.main, pump.watchdog, pump.starved, *pump.tasks]:
                t.cancel()
            await asyncio.gather(pump.main, pump.watchdog, pump.starved, *pump.tasks, return_exceptions=True)
            await manager.session.close()
            return chosen, spare_in_flight

    chosen, spare_in_flight = asyncio.run(go())
    assert sorted((r.step, r.group, r.promoted) for r in chosen) == [(0, 0, False), (2, 0, True)]
    # spare batch 0's first prompt, now aimed at step 2, with the dropped prompt it stands in for
    assert [(*job[:5], [(o.step, o.group, o.status) for o in job[5]]) for job in spare_in_flight] == \
        [(0, 2, 2, True, 1, [(0, 1, "dropped")])]
    (ev,) = [e for e in events if e["type"] == "replace"]
    assert (ev["decision"], ev["lender_step"], ev["lender_group"]) == ("promoted", 2, [2, 0])
