"""The async single controller end to end (issue K): `python -m minirl.train async_rl.enabled=true`
with real Ray actors, the vLLM engine, the agent servers and the torch policy worker. The review
table in async mode is in test_train_cli, the SIGKILL resume in test_reliability."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli

pytestmark = pytest.mark.slow

SMALL = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=2", "checkpoint.enabled=false",
         "logger.tensorboard=false"]
ASYNC = ["async_rl.enabled=true", "loss_fn.use_importance_sampling_correction=true"]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line]


def test_in_order_at_staleness_0_is_the_synchronous_loop_exactly(tmp_path, shared_engine):
    runs = {}
    for mode, extra in (("sync", []), ("async", ["async_rl.enabled=true", "async_rl.sampler.max_staleness_versions=0"])):
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
                   "async_rl.max_buffered_rollouts=16", f"run_dir={tmp_path}", *shared_engine)
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
    assert sum(r["redispatched_rows"] for r in rows) == sum(e["type"] == "failure" and e.get("scope") == "row" for e in evs)


UPSTREAM_REPLACE = ["--config", "configs/upstream_pr4124.yaml", "async_rl.enabled=true",
                    "async_rl.rollout_failure.on_dropped_prompt=replace",
                    "async_rl.rollout_failure.max_consecutive_dropped_prompts=5", "grpo.max_num_steps=2",
                    "async_rl.rollout_failure.nemo_gym.rollout_timeout_s=6"]


def test_replace_draws_a_fresh_prompt_so_the_step_keeps_its_size(tmp_path, shared_engine):
    """Upstream's CC preset (a step needs every group) survives a dropped group under `replace`:
    with nothing finished ahead to borrow (staleness 0), a fresh prompt fills the place."""
    proc = run_cli(*UPSTREAM_REPLACE, *SMALL, "async_rl.sampler.max_staleness_versions=0",
                   "faults.inject=[{kind: guard_reject, step: 0, group: 1, rollout: 0, attempt: 0}]",
                   f"run_dir={tmp_path}", *shared_engine)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = metrics(tmp_path)[0]
    assert (row["groups_target"], row["groups_trained"], row["dropped_prompt_groups"]) == (4, 4, 1)
    assert (row["replaced_prompt_groups"], row["promoted_prompt_groups"]) == (1, 0)
    fresh = [e for e in events(tmp_path) if e["type"] == "replace" and e["decision"] == "fresh_prompt"]
    assert [(e["fresh_step"], e["fresh_group"]) for e in fresh] == [(0, 4)]


def test_replace_borrows_a_finished_group_from_the_next_step_and_repays_it(tmp_path, shared_engine):
    """At staleness 1 step 1's groups finish while step 0's group 1 hangs to its 6 s deadline and
    drops: one of them is promoted into step 0, and a fresh prompt repays step 1."""
    proc = run_cli(*UPSTREAM_REPLACE, *SMALL, *ASYNC, "faults.inject=[{kind: timeout, step: 0, group: 1, rollout: 0}]",
                   f"run_dir={tmp_path}", *shared_engine)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [(r["groups_trained"], r["promoted_prompt_groups"], r["replaced_prompt_groups"]) for r in rows] == [(4, 1, 0), (4, 0, 1)]
    evs = [e for e in events(tmp_path) if e["type"] == "replace"]
    assert [e["decision"] for e in evs] == ["promoted", "fresh_prompt"]
    assert evs[0]["lender_step"] == 1 and (evs[1]["fresh_step"], evs[1]["fresh_group"]) == (1, 4)
    assert rows[0]["staleness_max"] <= 1 and rows[1]["staleness_max"] <= 1
