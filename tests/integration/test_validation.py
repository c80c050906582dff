"""Validation (issue M): held-out prompts that no training step uses, a validation that no
configured fault can touch, and `python -m minirl.evaluate` on a real checkpoint."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections import Counter

import pytest

from helpers import last_line, run_cli, serve_run
from minirl.agents.env import make_rooms
from minirl.config import REPO_ROOT, load_config
from minirl.faults import FAULT_KINDS
from minirl.data import prompt_row
from minirl.rollout.masking import PASS_REWARD
from minirl.validation import ValidationFailed, held_out_rows, held_out_seeds, summarize, training_seeds, validate


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


def test_a_held_out_row_refused_by_a_down_agent_server_is_sent_to_another(stack):
    """One agent server of two down (nothing listens at its port): the row refused there is sent again,
    after training's backoff, to the server training's pool picks (the other; the refused one is marked
    down), so the validation measures every row. Before, row i was pinned to agent_urls[i % 2] and re-sent
    to the same dead server until ValidationFailed ended the run, while the healthy one sat idle."""
    from minirl.cluster import free_port

    cfg = load_config(None, ["grpo.val_num_prompts=2", "async_rl.rollout_failure.nemo_gym.max_row_attempts=2",
                             "async_rl.rollout_failure.backoff_base_s=0.1"])

    async def go():
        async with stack(cfg) as s:
            down = f"http://127.0.0.1:{free_port('127.0.0.1')}"
            return await validate(cfg, [down, s.agent_url], version=0)  # the first pick is the down one

    metrics = asyncio.run(go())
    assert metrics["val_num_rollouts"] == 2 and metrics["val_num_masked"] == 0


def test_val_success_rate_counts_a_pass_as_training_does():
    """A pass is training's (`reward >= PASS_REWARD`, rollout/masking.py), overall and per room count: a
    Gym environment's score above 1 (a sum of rewards, 1 + 1e-12 from float arithmetic) passes in both;
    before, validation counted only `reward == 1.0`."""
    rows = [{"task": {"env": "doors", "seed": s, "num_rooms": 1 + s % 2}} for s in range(4)]
    results = [{"reward": r, "evidence": {}, "response": {"status": "completed"}, "mask": None, "fact_rooms": None}
               for r in (2.0, 1.0 + 1e-12, 1.0, 0.5)]
    out = summarize(rows, results)
    assert out["val_success_rate"] == sum(r["reward"] >= PASS_REWARD for r in results) / 4 == 0.75
    assert out["val_success_rate_rooms_1"] == 1.0 and out["val_success_rate_rooms_2"] == 0.5


def test_a_held_out_result_with_gym_failure_facts_is_read_as_training_reads_it():
    """Gym 0.7's failure facts on a held-out `/run` result, read first as training's parse_rollout reads
    them (`gym.failures.episode_failure`): a non-terminal EpisodeFailure and a row Gym's collector stamped
    `_ng_failure_class` (non-terminal, its response and reward 0 no measurement) are INFRA, sent again and
    scored on the answer that succeeded; a terminal EpisodeFailure ends the validation with the failure's
    own reason after one send. Before, the first was a malformed result (ValidationFailed), the second a
    measured 0 and the third ended naming a missing `response`. The shapes are Gym 0.7.0's, served as
    test_gym_failures.py serves them: no fault fires on a held-out row, and minirl's own pool sends none."""
    from aiohttp import web

    cfg = load_config(None, ["grpo.val_num_prompts=3", "async_rl.rollout_failure.backoff_base_s=0"])
    sends: Counter = Counter()
    terminal = []  # set: row 0 fails terminally on every send
    episode = {"episode_id": {"rollout_id": "val", "attempt": 0}, "task_id": {"taskset": "doors", "task_id": "0"}}

    def failure(final: bool) -> dict:
        reason = "the task's quota is spent" if final else "the sandbox provider did not answer"
        return {**episode, "failure": {"failure_reason": reason, "terminal": final,
                                       "failure_kind": "provider_unavailable", "stage": "seed"}}

    async def run(request):  # row 0: an EpisodeFailure first, row 1: a stamped failure first, row 2 never
        row = await request.json()
        i = row["_rowidx"]
        assert row["_ng_attempt_index"] == sends[i], "each send is its own Gym episode (`-a1` on a resend)"
        sends[i] += 1
        ok = {**row, "response": {"status": "completed", "output": []}, "reward": 1.0}
        if terminal and i == 0:
            return web.json_response(failure(True))
        if sends[i] == 1 and i == 0:
            return web.json_response(failure(False))
        if sends[i] == 1 and i == 1:
            return web.json_response({**ok, "reward": 0.0, "_ng_failure_class": "environment_server_failed",
                                      "_ng_failure_terminal": False, "_ng_failure_message": "env server crashed"})
        return web.json_response(ok)

    async def go():
        runner, url = await serve_run(run)
        try:
            return await validate(cfg, [url], version=0)
        finally:
            await runner.cleanup()

    metrics = asyncio.run(go())
    assert dict(sends) == {0: 2, 1: 2, 2: 1}
    assert metrics["val_num_rollouts"] == 3 and metrics["val_reward_mean"] == 1.0
    sends.clear()
    terminal.append(True)
    with pytest.raises(ValidationFailed, match=r"^held-out row 0 .*failed after 1 send\(s\): EpisodeFailedTerminal: "
                                               r".*the task's quota is spent$"):
        asyncio.run(go())
    assert sends[0] == 1, "a terminal failure is never sent again"


def test_a_validation_that_fails_leaves_no_send_behind():
    """A terminal failure of one held-out row ends the validation; the other rows' sends end with it. Before,
    `asyncio.gather` raised the first failure and left its siblings running on the controller's loop (their
    `/run` calls still open on the agent servers, their resends to come after backoff) once the run was over."""
    from aiohttp import web

    cfg = load_config(None, ["grpo.val_num_prompts=3"])
    opened, released = Counter(), asyncio.Event()

    async def run(request):  # row 0 fails terminally once the others are waiting; they answer at the end
        row = await request.json()
        opened[row["_rowidx"]] += 1
        if row["_rowidx"] != 0:
            await released.wait()
            return web.json_response({})
        while len(opened) < 3:
            await asyncio.sleep(0.01)
        return web.json_response({"failure": {"failure_reason": "the task's quota is spent", "terminal": True,
                                              "failure_kind": "provider_unavailable", "stage": "seed"}})

    async def go():
        runner, url = await serve_run(run)
        try:
            with pytest.raises(ValidationFailed, match="the task's quota is spent"):
                await validate(cfg, [url], version=0)
            return [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and "_send" in repr(t)]
        finally:
            released.set()
            await runner.cleanup()

    assert asyncio.run(go()) == [], "a held-out row's send outlived the validation"
    assert dict(opened) == {0: 1, 1: 1, 2: 1}


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
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("ConfigError: --checkpoint")

    # a weights file with one byte changed, its size kept: refused before Ray by its hash, nothing written (it
    # passed the size check, started Ray and the engines, and failed inside after a minute: found by review)
    from minirl import evaluate

    damaged = tmp_path / "checkpoints" / "step_9"
    shutil.copytree(ckpt, damaged)
    weights = max(damaged.rglob("*.safetensors"), key=lambda f: f.stat().st_size)
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF
    weights.write_bytes(bytes(raw))
    assert evaluate.main(["--checkpoint", str(damaged)]) == 2
    assert not (tmp_path / "eval" / "step_9").exists()


@pytest.mark.parametrize("make", [None, "file", "folder"])
def test_evaluate_names_a_checkpoint_that_is_no_directory_as_the_flag(tmp_path, capsys, make):
    """It was refused naming `checkpoint.resume`, the override evaluate sets itself, not the flag typed; a
    folder that is no checkpoint (no state.json) started Ray and vLLM first, and ended in a CheckpointError."""
    from minirl import evaluate

    ckpt = tmp_path / "run" / "checkpoints" / "step_3"
    if make == "file":
        ckpt.parent.mkdir(parents=True)
        ckpt.write_text("")
    elif make == "folder":
        ckpt.mkdir(parents=True)
    assert evaluate.main(["--checkpoint", str(ckpt)]) == 2
    what = {None: ": no such directory (give a run's checkpoints/step_N)",
            "file": ": is not a directory (give a run's checkpoints/step_N)",
            "folder": " is no checkpoint that can be trusted: state.json unreadable ("}[make]
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"ConfigError: --checkpoint: {ckpt}{what}"), line
    assert not (tmp_path / "run" / "eval").exists()  # every check runs before anything is written


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


def test_evaluate_refuses_an_out_it_cannot_write_before_anything_starts(tmp_path, capsys):
    """An `--out` in a folder that does not exist, or a folder itself: one line naming --out and exit 2,
    before Ray. Before, it was found only after the whole evaluation, whose metrics were lost to a
    FileNotFoundError (`cluster.num_generation_workers=64` ends at once an evaluation that goes on)."""
    from minirl import evaluate

    ckpt = tmp_path / "run" / "checkpoints" / "step_0"
    ckpt.mkdir(parents=True)
    for out in (tmp_path / "no" / "such" / "metrics.json", tmp_path):
        assert evaluate.main(["--checkpoint", str(ckpt), "--out", str(out), "cluster.num_generation_workers=64"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"ConfigError: --out: cannot write {out}: "), err
    assert not (tmp_path / "no").exists()


def test_evaluate_refuses_a_model_of_another_shape_than_the_checkpoints_before_anything_starts(tmp_path, capsys):
    """`policy.model_name` overridden with a model the checkpoint's weights cannot load into: one line naming
    the key and both models, exit 2, before Ray, as a resume is refused (`checkpoint.check_model`). Before,
    evaluate started the cluster and ended with exit 1 on torch's size mismatch."""
    import shutil

    from minirl import evaluate

    ckpt = tmp_path / "run" / "checkpoints" / "step_0"
    (ckpt / "policy").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "models" / "tiny-doors" / "config.json", ckpt / "policy" / "config.json")
    (ckpt / "state.json").write_text(json.dumps({"config": {"policy": {"model_name": "models/tiny-doors"}}}))
    assert evaluate.main(["--checkpoint", str(ckpt), "policy.model_name=models/tiny-summarize",
                          "cluster.num_generation_workers=64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"ConfigError: policy.model_name: {REPO_ROOT / 'models' / 'tiny-summarize'} is not the model of the "
        f"checkpoint resumed ({ckpt}, written with policy.model_name=models/tiny-doors): vocab_size 512 there, "
        "576 here"), err


def test_evaluate_exits_2_on_a_config_error_as_train_does(tmp_path):
    """As `minirl.train`: a ConfigError exits 2 with its one line, whether `cluster.ray_address` is
    probed before Ray and nothing answers there, or it comes from inside the cluster (workers beyond
    what Ray offers). Before, both exited 1."""
    from minirl.cluster import free_port

    ckpt = tmp_path / "run" / "checkpoints" / "step_0"
    ckpt.mkdir(parents=True)
    (ckpt / "w").write_bytes(b"w")  # a manifest its file matches, size and hash: evaluate's last check before Ray
    digest = hashlib.sha256(b"w").hexdigest()
    (ckpt / "state.json").write_text(json.dumps({"manifest": {"w": {"size": 1, "sha256": digest}}}))
    for override, start in ((f"cluster.ray_address=127.0.0.1:{free_port('127.0.0.1')}",
                             "ConfigError: cluster.ray_address: nothing answers at"),
                            ("cluster.num_generation_workers=64", "ConfigError: cluster.num_cpus: the workers need")):
        proc = subprocess.run([sys.executable, "-m", "minirl.evaluate", "--checkpoint", str(ckpt), override],
                              capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
                              env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        assert proc.returncode == 2 and last_line(proc.stderr).startswith(start), proc.stderr[-3000:]


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
        assert row["_ng_attempt_index"] == sends[i], "each send is its own Gym episode (`-a1` on a resend)"
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
