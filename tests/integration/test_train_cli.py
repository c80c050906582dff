"""`python -m minirl.train` end to end, as a user runs it: Ray actors, vLLM, HTTP servers, torch.

The failure table is the review's (cc-dropped-group-review.txt): one step of 4 groups x 2
rollouts with one bad rollout, group 1 rollout 0, under the upstream preset and each fix; its
`ledger_*` rows are minirl's own lane (every rollout of group 1 loses a call's record)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import connect, last_line, run_cli
from minirl.config import load_config
from minirl.experiments.invariants import check_run
from minirl.metrics import REQUIRED_FIELDS

pytestmark = pytest.mark.slow


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def test_two_step_default_run_writes_the_contract(tmp_path):
    proc = run_cli("grpo.max_num_steps=2", f"run_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        missing = [k for k in REQUIRED_FIELDS if k not in r]
        assert not missing, missing
        assert r["groups_trained"] == 8 and r["tokens_trained"] > 0 and r["gen_tokens_per_s"] > 0
        # NeMo's masking and rollout stats (issue 50): 8 groups x 4 rollouts, every one trained or masked
        assert (r["train/masking/rows"], r["train/masking/groups"]) == (32, 8)
        assert r["train/masking/trained_frac"] + r["train/masking/masked_frac"] == pytest.approx(1.0)
        assert r["train/rollouts/gen_tokens/max"] >= r["train/rollouts/gen_tokens/p90"] > 0
    assert (tmp_path / "config.yaml").exists() and (tmp_path / "events.jsonl").exists()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = EventAccumulator(str(tmp_path / "tensorboard")).Reload().Tags()["scalars"]
    assert {"train/masking/rows", "train/masking/trained_frac", "train/rollouts/groups/mixed_frac"} <= set(scalars)
    assert (tmp_path / "checkpoints" / "step_1" / "state.json").exists()
    assert "step    2/2" in proc.stdout


def test_cc_config_compacts_and_splits_rollouts_into_traces(tmp_path, shared_engine):
    proc = run_cli("--config", "configs/cc.yaml", "grpo.max_num_steps=3", f"run_dir={tmp_path}",
                   "checkpoint.enabled=false",
                   *shared_engine)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path)
    assert len(rows) == 3
    assert any(r["compactions"] > 0 and r["traces_trained"] > r["rollouts_trained"] for r in rows), rows
    assert any(e["type"] == "compaction" for e in events(tmp_path))


UPSTREAM = ["--config", "configs/upstream_pr4124.yaml", "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=2",
            "grpo.max_num_steps=1", "checkpoint.enabled=false", "logger.tensorboard=false",
            "async_rl.rollout_failure.nemo_gym.rollout_timeout_s=60"]


WHOLE_GROUP = {"call_log_lost"}
"""Kinds injected in every rollout of group 1: the ledger's lane needs every rollout's record of call 0 lost."""


def bad(kind: str) -> str:
    rollout = "" if kind in WHOLE_GROUP else " rollout: 0,"
    return f"faults.inject=[{{kind: {kind}, step: 0, group: 1,{rollout} attempt: 0}}]"


FLOOR = re.compile(r"^RuntimeError: training step \S+ lost 1 of 4 prompt group\(s\), leaving 3, below the floor of 4")
CASES = {
    "lane_a": (["context_overflow"], [], ("ok", 4, 1)),
    "lane_b_budget_0": (["guard_reject"], [], ("exhausted",)),
    "lane_b_budget_5": (["guard_reject"], ["async_rl.rollout_failure.max_consecutive_dropped_prompts=5"], ("floor",)),
    "fix_1": (["guard_reject"], ["async_rl.rollout_failure.max_consecutive_dropped_prompts=5",
                                 "context_compaction.allow_step_shrink=true",
                                 "async_rl.rollout_failure.min_step_batch_fraction=0.75"], ("ok", 3, 0)),
    "fix_2": (["guard_reject"], ["agent.context_history.guards.on_reject=end_episode"], ("ok", 4, 1)),
    # issue D: fix 3 alone recovers an agent crash by re-sending the one row
    "fix_3": (["agent_exception"], ["context_compaction.redispatch_dropped_groups=true"], ("ok", 4, 0)),
    # issue I: a model error other than lane A's 400 fails /run with HTTP 500, as lane B does
    "model_error_upstream": (["model_error"], [], ("exhausted",)),
    # minirl's ledger masks every rollout of a committed group (their call records lost): no valid owner, a drop
    "ledger_budget_0": (["call_log_lost"], [], ("exhausted",)),
    "ledger_fix_1": (["call_log_lost"], ["async_rl.rollout_failure.max_consecutive_dropped_prompts=5",
                                         "context_compaction.allow_step_shrink=true",
                                         "async_rl.rollout_failure.min_step_batch_fraction=0.75"], ("ok", 3, 0)),
}
# The table's `transport` / `timeout` rows ("same outcomes as lane B") run in-process, through the
# same servers and policy: tests/integration/test_failure_policy.py::test_transport_and_timeout_end_like_lane_b


ASYNC = ["async_rl.enabled=true", "loss_fn.use_importance_sampling_correction=true", "grpo.max_num_steps=2"]
ASYNC_CASES = ["lane_b_budget_0", "fix_1", "ledger_fix_1"]  # the rest share their code paths; each run costs ~30 s


@pytest.mark.parametrize("case,mode", [(c, "sync") for c in CASES] + [(c, "async") for c in ASYNC_CASES])
def test_review_failure_table(tmp_path, case, mode, shared_engine):
    """Async (issue K): the same outcomes and texts with the rollout pump running a step ahead (the
    fault is in step 0; step 1's prompts are in flight when step 0 is assembled)."""
    (kind,), extra, expect = CASES[case]
    proc = run_cli(*UPSTREAM, bad(kind), *extra, *(ASYNC if mode == "async" else []), f"run_dir={tmp_path}",
                   *shared_engine)
    tail = last_line(proc.stderr)
    if expect[0] == "ok":
        assert proc.returncode == 0, proc.stderr[-3000:]
        row = metrics(tmp_path)[0]
        assert (row["groups_trained"], row["rollouts_masked"]) == expect[1:]
        assert row["dropped_prompt_groups"] == 4 - expect[1] and row["groups_target"] == 4
        if case == "fix_3":
            assert row["redispatched_groups"] == 1 and row["redispatched_rows"] == 1
        if case == "fix_2":  # the ended episode's rejection, counted once (its group's outcome, not its rollout too)
            assert row["guard_rejections"] == 1
        if case == "ledger_fix_1":  # before: trained with zero loss, in groups_trained, no drop charged
            (drop,) = [e for e in events(tmp_path) if e["type"] == "drop"]
            assert (drop["step"], drop["group"], drop["decision"], drop["reason"]) == (
                0, 1, "dropped", "RolloutDataFailure: no valid owner: every rollout of the group is masked by the "
                "step's ledger (unrecorded_calls)") and row["calls_unrecorded"] == 2
            lines = [json.loads(x) for x in (tmp_path / "ledger" / "step_0.jsonl").read_text().splitlines()]
            assert {x["ledger_status"] for x in lines if (x["step"], x["group"]) == (0, 1)} == {"retired"}
    elif expect[0] == "exhausted":
        assert proc.returncode != 0
        assert (tail.startswith("RolloutRedispatchExhausted:")
                and "exceeding max_consecutive_dropped_prompts=0" in tail), tail
        if kind in WHOLE_GROUP:
            assert "prompt idx=1 has no valid owner (every rollout masked by the step's ledger" in tail, tail
    else:
        assert proc.returncode != 0
        assert FLOOR.match(tail), tail
    # the books close whatever the outcome: at the floor, the step's call records were taken and its
    # ledger never written, so they are retired at the run's end (before, they were in no ledger line)
    assert check_run(tmp_path, proc.returncode, tail, load_config(str(tmp_path / "config.yaml"))) is None
    faults = [e for e in events(tmp_path) if e["type"] == "fault"]
    assert faults and all((e["kind"], e["step"], e["group"]) == (kind, 0, 1) for e in faults)
    assert {e["rollout"] for e in faults} == ({0, 1} if kind in WHOLE_GROUP else {0})


def test_a_model_error_on_the_default_config_is_redispatched_not_masked(tmp_path, shared_engine):
    """Issue I's acceptance: the default run (all fixes) re-sends the row; nothing is masked."""
    proc = run_cli("grpo.max_num_steps=1", "checkpoint.enabled=false", "logger.tensorboard=false",
                   "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=2", bad("model_error"),
                   f"run_dir={tmp_path}", *shared_engine)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = metrics(tmp_path)
    assert row["rollouts_masked"] == 0 and row["groups_trained"] == 4 and row["redispatched_rows"] == 1
    (failure,) = [e for e in events(tmp_path) if e["type"] == "failure"]
    assert failure["decision"] == "retried" and failure["error_type"] == "ModelCallFailed"


def run_failed(run_dir: Path) -> list[dict]:
    return [e for e in events(run_dir) if e["type"] == "run_failed"]


def test_a_diverging_update_ends_the_run_naming_the_lr_before_weights_are_published(tmp_path, shared_engine):
    """Issue 29: lr=1e30 leaves finite weights whose forward pass overflows. The run ends after that
    optimizer step with NonFiniteUpdate naming the step and the lr (not blaming the generation fleet
    one step later), writes run_failed, and the engine never serves the diverged weights."""
    proc = run_cli("policy.optimizer.lr=1e30", "grpo.max_num_steps=3", "grpo.num_prompts_per_step=2",
                   "grpo.num_generations_per_prompt=2", "checkpoint.enabled=false", "logger.tensorboard=false",
                   f"run_dir={tmp_path}", *shared_engine)
    tail = last_line(proc.stderr)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert (tail.startswith("NonFiniteUpdate: after optimizer step 0 (policy.optimizer.lr=1e+30) ")
            and "not finite" in tail), tail
    (failed,) = run_failed(tmp_path)
    assert failed["error"] == tail and failed["step"] == 0
    assert not (tmp_path / "metrics.jsonl").read_text().strip(), "no step completed"
    # step 0's sends are in no metrics line, so run_failed counts them (before: 0, they were settled at collect)
    assert (failed["rollout_attempts"], failed["rollouts_generated"]) == (4, 4)
    ray = connect(shared_engine)
    try:
        assert ray.get(ray.get_actor("shared-gen-0").weights_finite.remote())
    finally:
        ray.shutdown()


def test_a_checkpoint_that_cannot_be_written_mid_run_ends_it_with_run_failed(tmp_path, shared_engine):
    """The directory is checked at start; one that breaks later (here: replaced by a file after
    step 0) ends the run at the save with CheckpointError naming the step and the path, and a
    run_failed event, as every run-ending failure outside the collect path does."""
    import os
    import subprocess
    import sys
    import time

    from minirl.config import REPO_ROOT

    args = ["grpo.max_num_steps=3", "checkpoint.save_period=3", "grpo.num_prompts_per_step=2",
            "grpo.num_generations_per_prompt=2",
            "logger.tensorboard=false", f"run_dir={tmp_path}", *shared_engine]
    proc = subprocess.Popen([sys.executable, "-m", "minirl.train", *args], cwd=REPO_ROOT, text=True,
                            env={**os.environ, "RAY_AUTH_MODE": "disabled"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 240
        ckpt = tmp_path / "checkpoints"
        while time.time() < deadline and proc.poll() is None and not (
                (tmp_path / "metrics.jsonl").exists() and (tmp_path / "metrics.jsonl").read_text().strip()):
            time.sleep(0.1)
        assert ckpt.is_dir(), "the start-up check made the directory"
        ckpt.rmdir()
        ckpt.write_text("not a directory any more")
        _, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    tail = last_line(stderr)
    assert proc.returncode == 1, stderr[-3000:]
    assert tail.startswith(f"CheckpointError: cannot write the checkpoint of step 2 under "
                           f"{tmp_path / 'checkpoints'}: "), tail
    (failed,) = run_failed(tmp_path)
    assert failed["error"] == tail and failed["step"] == 2
    assert [r["step"] for r in metrics(tmp_path)] == [0, 1, 2]
    assert failed["rollout_attempts"] == 0, "step 2's sends are in its metrics line, not counted twice"


def test_a_sigterm_mid_step_is_reported_as_terminated_and_the_steps_groups_close_the_books(tmp_path, shared_engine):
    """`scancel` while step 1's groups are in flight (its group 3 hangs): the driver, blocked in ray.get,
    gets the SIGTERM as a bare KeyboardInterrupt, yet its last line and its run_failed event name the
    SIGTERM, exit 1 as any run-ending failure; and the run's end stops the step's take, names its four
    groups in flight and retires the call records taken while it ran (check_run's `_served`). Before:
    `KeyboardInterrupt: interrupted`, no group unfinished and the trickled records in no ledger line."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from minirl.config import REPO_ROOT

    args = ["grpo.max_num_steps=3", "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=2",
            "checkpoint.enabled=false", "logger.tensorboard=false", "faults.hang_s=60",
            "faults.inject=[{kind: timeout, step: 1, group: 3}]", f"run_dir={tmp_path}", *shared_engine]
    proc = subprocess.Popen([sys.executable, "-m", "minirl.train", *args], cwd=REPO_ROOT, text=True,
                            env={**os.environ, "RAY_AUTH_MODE": "disabled"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        deadline, hung = time.time() + 240, False
        while time.time() < deadline and proc.poll() is None and not hung:
            time.sleep(0.2)
            hung = (tmp_path / "events.jsonl").exists() and any(
                e["type"] == "fault" and e["step"] == 1 for e in events(tmp_path))
        assert hung, "step 1's group 3 did not start"
        time.sleep(3)  # its other groups resolve, and their records are taken, while it hangs (60 s)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    tail = last_line(stderr)
    assert proc.returncode == 1, stderr[-3000:]
    assert tail.startswith("Terminated: SIGTERM: "), tail
    assert "minirl: stopped: last logged step 0" in stdout
    (failed,) = run_failed(tmp_path)
    assert failed["error"] == tail and failed["step"] == 1
    (end,) = [e for e in events(tmp_path) if e["type"] == "run_end"]
    assert end["unfinished"] == {"buffered": [], "in_flight": [[1, g] for g in range(4)]}, end
    assert end["groups_unfinished"] == 4
    # the books close (check_run's checks after `_exit`, which passes no exit but a budget's)
    from minirl.experiments import invariants as inv

    cfg, rows, evs = load_config(str(tmp_path / "config.yaml")), metrics(tmp_path), events(tmp_path)
    for check in (inv._fates, inv._events, inv._ledger, inv._served):
        assert check(tmp_path, proc.returncode, tail, cfg, rows, evs, None) is None, check.__name__


def test_workers_beyond_what_ray_offers_end_at_once_naming_the_keys(tmp_path):
    """Not Ray's GetTimeoutError after 120 s: with cluster.num_cpus unset, Ray detects the machine's
    CPUs, and the bundles are checked against them before anything is placed."""
    import time

    t0 = time.perf_counter()
    proc = run_cli("cluster.num_generation_workers=64", f"run_dir={tmp_path}", timeout=120)
    elapsed = time.perf_counter() - t0
    tail = last_line(proc.stderr)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert tail.startswith("ConfigError: cluster.num_cpus: the workers need 65 CPUs (cluster.num_generation_workers=64 "
                           "x "
                           "cluster.cpus_per_generation_worker=1 + cluster.num_policy_workers=1 x "
                           "cluster.cpus_per_policy_worker=1), "
                           "more than Ray offers (ray.cluster_resources() "), tail
    assert elapsed < 60, f"took {elapsed:.0f}s"
    (failed,) = run_failed(tmp_path)
    assert failed["error"] == tail
