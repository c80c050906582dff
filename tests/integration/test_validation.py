"""Validation (issue M): held-out prompts that no training step uses, a validation that no
configured fault can touch, and `python -m minirl.evaluate` on a real checkpoint."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from helpers import run_cli
from minirl.agents.env import make_rooms
from minirl.config import REPO_ROOT, load_config
from minirl.faults import FAULT_KINDS
from minirl.data import prompt_row
from minirl.validation import ValidationFailed, held_out_rows, held_out_seeds, training_seeds, validate


@pytest.mark.parametrize("overrides", [
    [],
    ["env.num_rooms_choices=[1,2,3,4]", "grpo.val_num_prompts=64", "grpo.val_num_generations=2"],
    ["grpo.max_num_steps=500", "grpo.num_prompts_per_step=16", "env.data_seed=0", "grpo.val_num_prompts=256"],
])
def test_held_out_prompts_never_overlap_training_prompts(overrides):
    cfg = load_config(None, overrides)
    g = cfg.grpo
    train = [prompt_row(cfg, s, k)["task"] for s in range(g.max_num_steps) for k in range(g.num_prompts_per_step)]
    rows = held_out_rows(cfg)
    held = [r["task"] for r in rows]
    assert len(rows) == g.val_num_prompts * g.val_num_generations
    assert len({t["seed"] for t in held}) == g.val_num_prompts
    assert {t["seed"] for t in held}.isdisjoint(t["seed"] for t in train)
    assert {t["seed"] for t in train} == training_seeds(cfg)
    # by content too: no held-out episode starts in a room any trained episode starts in
    first_rooms = {make_rooms(t["seed"], 1)[0] for t in train}
    assert not any(make_rooms(t["seed"], 1)[0] in first_rooms for t in held)
    # no held-out row carries coordinates (so no fault site can key on it), and the set is reproducible
    assert all("_minirl" not in r for r in rows) and held_out_rows(cfg) == rows
    if cfg.env.num_rooms_choices:
        assert set(Counter(t["num_rooms"] for t in held)) == {1, 2, 3, 4}  # the training mix
    assert held_out_seeds(load_config(None, [*overrides, "faults.seed=9", "grpo.seed=3"])) == held_out_seeds(cfg)


def test_task_mix_draws_each_prompts_rooms_from_its_own_seed_and_keeps_the_default():
    plain = load_config()
    assert {prompt_row(plain, s, g)["task"]["num_rooms"] for s in range(5) for g in range(8)} == {2}
    mixed = load_config(None, ["env.num_rooms_choices=[1,3]"])
    tasks = [prompt_row(mixed, s, g)["task"] for s in range(20) for g in range(8)]
    assert [t["seed"] for t in tasks] == [prompt_row(plain, s, g)["task"]["seed"] for s in range(20) for g in range(8)]
    counts = Counter(t["num_rooms"] for t in tasks)
    assert set(counts) == {1, 3} and min(counts.values()) > 50
    assert [prompt_row(mixed, s, g)["task"] for s in range(20) for g in range(8)] == tasks


def test_a_fleet_that_cannot_answer_fails_the_validation_by_name_after_its_resends():
    """Nothing listens on the port: INFRA, re-sent up to max_row_attempts, then ValidationFailed
    naming the row; never a silently smaller validation."""
    cfg = load_config(None, ["grpo.val_num_prompts=2", "async_rl.rollout_failure.nemo_gym.max_row_attempts=2"])
    from minirl.cluster import free_port

    with pytest.raises(ValidationFailed, match=r"held-out row \d \(seed \d+, 2 rooms\) failed after 2 send\(s\): "
                                               r"AgentUnreachable"):
        asyncio.run(validate(cfg, [f"http://127.0.0.1:{free_port('127.0.0.1')}"], version=0))


def test_validation_runs_without_faults_even_at_fault_rate_one(stack):
    """Every fault kind that does not take a server out (kill or wedge it), at rate 1.0 and injected
    at every coordinate: a training row fails, the held-out rows all succeed and leave no rollout
    header behind."""
    kinds = [k for k in FAULT_KINDS if not k.endswith(("_kill", "_hang", "_crash"))]
    cfg = load_config(None, [
        *(f"faults.rate.{k}=1.0" for k in kinds),
        "faults.inject=[" + ",".join(f"{{kind: {k}}}" for k in kinds) + "]",
        "async_rl.rollout_failure.nemo_gym.rollout_timeout_s=20", "faults.hang_s=2",
        "env.num_rooms_choices=[1,2]", "grpo.val_num_prompts=4",
    ])

    async def go():
        async with stack(cfg) as s:
            import aiohttp

            coords = {"step": 0, "group": 0, "rollout": 0, "attempt": 0}
            training = {**prompt_row(cfg, 0, 0), "_rowidx": 0, "_minirl": coords}
            async with aiohttp.ClientSession() as http, http.post(s.agent_url + "/run", json=training) as r:
                status, text = r.status, await r.text()
            try:
                control = status == 200 and "reward" in json.loads(text)
            except ValueError:
                control = False
            s.model.calls.clear()
            metrics = await validate(cfg, [s.agent_url], version=0)
            return control, metrics, dict(s.model.calls.steps)

    control, metrics, calls = asyncio.run(go())
    assert not control, "the faults are really configured: a row with coordinates gets no usable result"
    assert metrics["val_num_rollouts"] == 4 and metrics["val_policy_version"] == 0
    assert 0 <= metrics["val_reward_mean"] <= 1 and 0 <= metrics["val_success_rate"] <= 1
    assert metrics["val_truncated_rate"] == 0, "no injected overflow or guard rejection ended a held-out episode"
    assert calls == {}, "held-out model calls carry no rollout header, so no keyed call log and no fault key"


def validate_with(stack, overrides: list[str]) -> dict:
    """One validation of the shared engine's weights through a stack built with `overrides`."""
    cfg = load_config(None, overrides)

    async def go():
        async with stack(cfg) as s:
            return await validate(cfg, [s.agent_url], version=0)

    return asyncio.run(go())


def test_a_held_out_episode_the_guard_ends_scores_zero_under_either_on_reject(stack):
    """The guard's limit is the task's: validation scores the same weights the same way whether the
    guard ends the episode (a masked 200 with partial credit) or raises (a 500)."""
    base = ["env.num_rooms_choices=[1,4]", "agent.max_steps=6", "grpo.val_num_prompts=8",
            "agent.context_history.guards.max_total_tokens=140"]
    key = "agent.context_history.guards.on_reject"
    ended, raised = (validate_with(stack, [*base, f"{key}={v}"]) for v in ("end_episode", "raise"))
    assert ended["val_guard_ended_rate"] > 0 and ended["val_guard_ended_rate"] == raised["val_guard_ended_rate"]
    for key in ("val_reward_mean", "val_success_rate", "val_reward_mean_rooms_1", "val_reward_mean_rooms_4"):
        assert ended[key] == pytest.approx(raised[key]), key


def test_a_held_out_episode_without_a_usable_summary_scores_zero_and_the_validation_goes_on(stack):
    """Summarizing compaction whose every attempt is rejected (one token allowed: `too_long`, or no
    closed block): under `on_summary_failure=raise` each such row answered 500 SummaryFailed, a
    retryable INFRA failure in training, but a held-out row's fixed seed draws the same attempts on
    every send, so the validation ended the run (ValidationFailed). It scores 0, as a guard's end does,
    the same under `raise`, `end_episode` and `end_episode_scored` (a training rollout's partial
    credit is not a held-out score), and is counted."""
    base = ["env.num_rooms_choices=[1,3]", "grpo.val_num_prompts=6", "agent.context_history.policy.type=summarize",
            "agent.context_history.policy.summarize.threshold_tokens=[150,150]",
            "agent.context_history.policy.summarize.max_summary_tokens=1"]
    key = "agent.context_history.policy.summarize.on_summary_failure"
    raised, ended, scored = (validate_with(stack, [*base, f"{key}={v}"])
                             for v in ("raise", "end_episode", "end_episode_scored"))
    assert raised["val_num_rollouts"] == ended["val_num_rollouts"] == scored["val_num_rollouts"] == 6
    assert 0 < raised["val_summary_failed_rate"] == ended["val_summary_failed_rate"] == \
        scored["val_summary_failed_rate"] < 1, "the 1-room rows need no summary"
    for key in ("val_reward_mean", "val_success_rate", "val_reward_mean_rooms_1", "val_reward_mean_rooms_3"):
        assert raised[key] == pytest.approx(ended[key]) == pytest.approx(scored[key]), key
    assert raised["val_reward_mean_rooms_3"] < raised["val_reward_mean_rooms_1"]


@pytest.mark.slow
def test_training_validates_and_evaluate_reproduces_it_from_the_checkpoint(tmp_path, shared_engine):
    val = ["grpo.val_at_start=true", "grpo.val_period=1", "grpo.val_num_prompts=4", "env.num_rooms_choices=[1,2]"]
    proc = run_cli("grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=2", "grpo.max_num_steps=1",
                   "logger.tensorboard=false", f"run_dir={tmp_path}", *val, *shared_engine)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "validation.jsonl").read_text().splitlines()]
    assert [(x["step"], x["val_policy_version"]) for x in lines] == [(-1, 0), (0, 1)]
    (row,) = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row["val_reward_mean"] == lines[1]["val_reward_mean"] and row["val_policy_version"] == 1
    assert {"val_success_rate", "val_reward_mean_rooms_1", "val_reward_mean_rooms_2"} <= set(row)

    ckpt = tmp_path / "checkpoints" / "step_0"
    out = tmp_path / "eval.json"
    ev = subprocess.run([sys.executable, "-m", "minirl.evaluate", "--checkpoint", str(ckpt), "--out", str(out),
                         *shared_engine], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
                        env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert ev.returncode == 0, ev.stderr[-3000:]
    printed = json.loads([x for x in ev.stdout.splitlines() if x.startswith("{")][-1])
    written = json.loads(out.read_text())
    assert printed == written and written["checkpoint"] == str(ckpt) and written["val_policy_version"] == 1
    assert written["val_num_rollouts"] == 4
    # same weights, same held-out rows, same per-rollout seeds: the numbers of the training-time validation
    assert written["val_reward_mean"] == pytest.approx(lines[1]["val_reward_mean"])
    assert (tmp_path / "eval" / "step_0").is_dir(), "the evaluation's own run directory"
    assert not (tmp_path / "eval" / "step_0" / "metrics.json").exists(), "--out was given"

    bad = subprocess.run([sys.executable, "-m", "minirl.evaluate", "--checkpoint", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("ConfigError: checkpoint.resume")


def test_evaluate_checks_the_data_as_training_does_with_validation_on(tmp_path, capsys):
    """Before, `minirl.evaluate` of a run trained on data.train_jsonl validated it on the doors task's
    held-out prompts (it never called data.prepare); now the checks training makes with validation on,
    before Ray: exit 2 with one line naming the key, and nothing written."""
    from minirl import evaluate
    from minirl.config import to_yaml
    from minirl.data import task_row

    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_0"
    ckpt.mkdir(parents=True)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(task_row(load_config(None, []), seed)) + "\n" for seed in range(3)))
    (run / "config.yaml").write_text(to_yaml(load_config(None, [f"data.train_jsonl={rows}"])))  # val_period 0
    for extra, start in (
        ([], "ConfigError: data.validation_jsonl: must be set to validate a run on data.train_jsonl"),
        ([f"data.validation_jsonl={rows}"], "ConfigError: data.validation_jsonl: holds 3 rows, fewer than "
                                            "grpo.val_num_prompts=8 (minirl.evaluate always validates)"),
    ):
        assert evaluate.main(["--checkpoint", str(ckpt), *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(start), err
    assert not (run / "eval").exists(), "refused before anything is written"


@pytest.mark.slow
def test_a_resumed_run_measures_each_policy_version_once(tmp_path, shared_engine):
    args = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "grpo.max_num_steps=2",
            "logger.tensorboard=false", "checkpoint.save_period=1", "grpo.val_at_start=true", "grpo.val_period=1",
            "grpo.val_num_prompts=2", f"run_dir={tmp_path}", *shared_engine]
    assert (first := run_cli(*args)).returncode == 0, first.stderr[-3000:]
    again = run_cli(*args, f"checkpoint.resume={tmp_path / 'checkpoints' / 'step_0'}")
    assert again.returncode == 0, again.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "validation.jsonl").read_text().splitlines()]
    assert [(x["step"], x["val_policy_version"]) for x in lines] == [(-1, 0), (0, 1), (1, 2)]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["val_policy_version"]) for r in rows] == [(0, 1), (1, 2)]


def test_a_held_out_result_with_mask_sample_is_sent_again_then_counted_not_scored():
    """Gym 0.7's `mask_sample` (the reward is not a measurement) on a held-out row: the row is sent
    again while attempts remain; one still masked after its last send is left out of the means and
    counted in val_num_masked, so a failed judge's reward 0 never reads as the policy's."""
    from aiohttp import web

    from minirl.cluster import free_port

    cfg = load_config(None, ["grpo.val_num_prompts=3", "async_rl.rollout_failure.nemo_gym.max_row_attempts=2"])
    sends: Counter = Counter()

    async def run(request):  # row 0 is masked once, row 1 on every send, row 2 never
        row = await request.json()
        i = row["_rowidx"]
        sends[i] += 1
        masked = (i == 0 and sends[i] == 1) or i == 1
        body = {"response": {"status": "completed", "output": []}, "reward": 0.0 if masked else 1.0}
        return web.json_response({**body, "mask_sample": True, "failure_kind": "judge_failed"} if masked else body)

    async def go():
        app = web.Application()
        app.router.add_post("/run", run)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port("127.0.0.1")
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            return await validate(cfg, [f"http://127.0.0.1:{port}"], version=0)
        finally:
            await runner.cleanup()

    metrics = asyncio.run(go())
    assert dict(sends) == {0: 2, 1: 2, 2: 1}
    assert metrics["val_num_masked"] == 1 and metrics["val_num_rollouts"] == 2
    assert metrics["val_reward_mean"] == 1.0 and metrics["val_success_rate"] == 1.0
