"""Reliability end to end: a killed driver resumes from its checkpoint with nothing lost, a killed
generation worker or agent server is recovered by redispatch, and the run goes on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import connect, run_cli, serve_run_in_thread
from minirl.config import REPO_ROOT, load_config
from minirl.data import prompt_row

pytestmark = pytest.mark.slow

SMALL = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=2", "logger.tensorboard=false"]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line]


ASYNC = ["async_rl.enabled=true", "loss_fn.use_importance_sampling_correction=true"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkilled_driver_resumes_from_its_checkpoint_with_nothing_lost(tmp_path, shared_engine, mode):
    """Async too: the checkpoint holds the pump's buffer. On resume its finished groups are trained
    without being generated again, the groups that were in flight are re-dispatched, and only
    the missing ones are generated; none is trained twice."""
    args = [*SMALL, *(ASYNC if mode == "async" else []), "grpo.max_num_steps=5", "checkpoint.save_period=2",
            f"run_dir={tmp_path}", *shared_engine]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen([sys.executable, "-m", "minirl.train", *args], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    marker = tmp_path / "checkpoints" / "step_1" / "state.json"
    deadline = time.time() + 300
    try:
        while not marker.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.5)
        assert marker.exists(), "no checkpoint after step 1"
        # let it get into step 2 or 3, then kill the driver and everything it started
        while len(metrics(tmp_path)) < 3 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
    finally:  # also when an assertion failed: leave no driver behind
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    before = metrics(tmp_path)
    assert len(before) >= 3

    done = run_cli(*args, "checkpoint.resume=auto")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4], "consecutive steps, no duplicates"
    # the kill follows step 2's metrics line by the test's poll; whether step 3's checkpoint (save_period 2)
    # was whole by then is the run's pace, not the test's: the resume starts after the newest one that is
    resumed = [e for e in events(tmp_path) if e["type"] == "resumed"]
    assert resumed and resumed[-1]["from_step"] in (2, 4)
    start = resumed[-1]["from_step"]
    assert Path(resumed[-1]["checkpoint"]).name == f"step_{start - 1}" and len(before) >= start
    assert rows[:start] == before[:start], "steps before the checkpoint are kept as they were"
    cfg = load_config(None, args[:-len(shared_engine)])
    for r in rows:  # every step trained the prompts an uninterrupted run would have seen
        assert r["prompt_seeds"] == [prompt_row(cfg, r["step"], g)["task"]["seed"] for g in range(4)]
    if mode == "async":
        log = events(tmp_path)
        after = log[max(i for i, e in enumerate(log) if e["type"] == "resumed"):]
        (restored,) = [e for e in after if e["type"] == "buffer_restored"]
        kept = {tuple(g) for g in restored["kept"]}
        again = [(e["step"], e["group"]) for e in after if e["type"] == "dispatch"]
        assert kept or restored["redispatched"], "the checkpoint held the groups the pump had run ahead for"
        assert not kept & set(again) and len(again) == len(set(again)), "nothing generated twice"
        assert kept | set(again) >= {(s, g) for s in range(start, 5) for g in range(4)}, "nothing lost"


def test_killed_generation_worker_restarts_and_the_run_goes_on(tmp_path, shared_engine):
    """On the shared workers too (a sweep's cells, these tests): the restarted worker catches up from the
    shared weights store with the run's current weights, or the ledger's policy-version discipline
    would end the run. On the default backoff: the worker's restart (its engine's start-up, 20 s or
    more) outlasts the 7.5 s of backoff of 5 attempts, and the groups wait it out in the generation
    restart window (before it, the run ended: every group of step 1 dropped). Restarted again after
    the run has ended, it serves the model's own weights rather than failing on the ended run's weights."""
    import asyncio

    import aiohttp

    proc = run_cli(*SMALL, "grpo.max_num_steps=3", f"run_dir={tmp_path}", "checkpoint.enabled=false", *shared_engine,
                   "faults.inject=[{kind: worker_kill, step: 1, group: 0, rollout: 0, attempt: 0}]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    retried = [e for e in events(tmp_path) if e["type"] == "failure" and e["step"] == 1 and e["decision"] == "retried"]
    assert retried, "the killed worker's in-flight rollouts were retried"
    assert {e["class"] for e in retried} == {"infra"}
    assert any(e.get("restart_window_s") == 120.0 for e in retried), "past the 5 attempts, in the restart window"
    assert rows[1]["redispatched_groups"] >= 1 and rows[1]["groups_trained"] >= 3
    assert rows[2]["policy_version"] == 2
    # the restarted worker's engine counts from 0: its clocks continue the killed one's, never negative
    clocks = ["engine_busy_s", "engine_gather_s", *(k for k in rows[1] if k.startswith("timing/generation/"))]
    assert all(r[k] >= 0 for r in rows for k in clocks), [{k: r[k] for k in clocks} for r in rows]
    calls = [json.loads(line) for line in (tmp_path / "ledger" / "step_1.jsonl").read_text().splitlines()]
    assert {(c["version_start"], c["version_end"])
            for c in calls if c["ledger_status"] in ("trained", "matched")} == {(1, 1)}, \
        "the restarted worker served step 1 under the weights of step 1"

    ray = connect(shared_engine)
    try:
        worker = ray.get_actor(shared_engine[-1].split("=", 1)[1] + "-0", namespace="minirl")
        url, pid = ray.get(worker.start.remote()), ray.get(worker.pid.remote())
        ray.kill(worker, no_restart=False)
        deadline = time.time() + 300
        while True:
            try:
                if ray.get(worker.pid.remote(), timeout=300) != pid:
                    break
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError):  # Ray is restarting it
                pass
            assert time.time() < deadline, "the shared worker did not come back"
            time.sleep(1.0)
        assert ray.get(worker.start.remote()) == url

        async def health():
            async with aiohttp.ClientSession() as http, http.get(url + "/health") as r:
                return r.status, await r.json()

        assert asyncio.run(health()) == (200, {"status": "ok", "version": 0})
    finally:
        ray.shutdown()


def test_killed_agent_server_mid_group_is_recovered_by_redispatch(tmp_path, shared_engine):
    proc = run_cli(*SMALL, "grpo.max_num_steps=2", f"run_dir={tmp_path}", "checkpoint.enabled=false", *shared_engine,
                   "faults.inject=[{kind: agent_kill, step: 0, group: 1, rollout: 0, attempt: 0}]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = metrics(tmp_path)[0]
    assert first["groups_trained"] == 4 and first["dropped_prompt_groups"] == 0 and first["rollouts_masked"] == 0
    assert first["redispatched_groups"] >= 1
    retried = [e for e in events(tmp_path) if e["type"] == "failure" and e["decision"] == "retried"]
    assert retried and {e["class"] for e in retried} == {"infra"}


def test_an_external_agent_returning_bad_numbers_is_never_trained(tmp_path, shared_engine):
    """Issue N: an external agent answers group 1 with reward=1e39, group 2 with +inf logprobs and
    group 3 with positive logprobs (group 0 is good). The run never trains on them: each is a DATA
    failure naming the field, no metrics row has a null loss, and the engine's weights stay finite.
    Without CC: the ledger masks group 0's made-up tokens (no server recorded them), and under CC a group
    masked whole has no valid owner, so every group of the step would be lost and the run would end at
    the floor (tests/integration/test_train_cli.py's `ledger_*` rows)."""

    from aiohttp import web

    def answer(row):
        group, step = row["_minirl"]["group"], row["_minirl"]["step"]
        lps = {2: [-0.1, float("inf")], 3: [-0.1, 0.5]}.get(group, [-0.1, -0.2]) if step == 0 else [-0.1, -0.2]
        item = {"type": "function_call", "name": "open_door", "arguments": '{"code": 1}', "call_id": "c",
                "prompt_token_ids": [5, 6, 7], "generation_token_ids": [8, 9], "generation_log_probs": lps}
        reward = 1e39 if group == 1 else 0.25 * row["_minirl"]["rollout"]
        if step == 1:  # issue 29: shapes that ended the run with a bare TypeError / OverflowError
            reward = 10**400 if group == 1 else reward
            evidence = {"guard": 5} if group == 2 else {}
            output = [item,
                      {"type": "message", "role": "assistant", "content": [{"text": None}]}] if group == 3 else [item]
            return {**row, "response": {"output": output}, "reward": reward, "evidence": evidence}
        return {**row, "response": {"output": [item]}, "reward": reward}

    async def run_handler(request):  # json.dumps writes inf as Infinity, which Python's json reads back
        return web.Response(text=json.dumps(answer(await request.json())), content_type="application/json")

    url, loop = serve_run_in_thread(run_handler)
    try:
        proc = run_cli(*SMALL, "grpo.max_num_steps=2", "checkpoint.enabled=false", f"agent.external_url={url}",
                       "context_compaction.enabled=false", "async_rl.rollout_failure.max_skipped_prompts=6",
                       "async_rl.rollout_failure.max_data_attempts_per_prompt=1",
                       "async_rl.rollout_failure.min_step_batch_fraction=0.25", f"run_dir={tmp_path}", *shared_engine)
    finally:
        loop.call_soon_threadsafe(loop.stop)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["loss"] is not None and r["groups_trained"] == 1 and r["skipped_prompt_groups"] == 3 for r in rows), \
        rows
    # the good group's made-up tokens were never generated by the engine: the ledger's content
    # match (J item 5) finds no record of them, so they are masked too
    assert all(r["calls_unrecorded"] == 2 and r["rollouts_masked"] == 2 for r in rows), rows
    failures = [e for e in events(tmp_path) if e["type"] == "failure"]
    by_group = {(e["step"], e["group"]): e["error"] for e in failures}
    assert ("reward must be a finite number with |reward| <= 9.223e+08" in by_group[0, 1]
            and "got 1e+39" in by_group[0, 1])
    assert "generation_log_probs must be finite and <= 0, got inf" in by_group[0, 2]
    assert "generation_log_probs must be finite and <= 0, got 0.5" in by_group[0, 3]
    assert ("reward must be a finite number with |reward| <= 9.223e+08" in by_group[1, 1]
            and "an integer of 1329 bits" in by_group[1, 1])
    assert "evidence.guard must be a list of flat objects" in by_group[1, 2]
    assert "response.output[1].content must be a string or a list of parts" in by_group[1, 3]
    assert {e["decision"] for e in failures} == {"skipped"} and {g for _, g in by_group} == {1, 2, 3}
    assert {e["class"] for e in failures} == {"data"} and len(failures) == 2 * 3 * 2  # both rows of 3 groups, 2 steps
    ray = connect(shared_engine)
    try:
        assert ray.get(ray.get_actor("shared-gen-0").weights_finite.remote())
    finally:
        ray.shutdown()


def test_async_resume_keeps_the_step_shape_and_a_starved_train_pump_cannot_hang(tmp_path, shared_engine):
    """Issue 29. A checkpoint holds its run's resolved config: resuming it with another step shape or
    staleness window is refused at once (exit 2, one line naming the keys, old and new values).
    A checkpoint written before configs were saved cannot be checked: resumed with
    num_prompts_per_step 2 -> 3, the restored buffer's cursor is past the third group step 1 now
    needs, and in_order waits for it with nothing in flight. That wait used to hang silently; the
    pump's watchdog now ends it with RolloutStall (a `stall` event, a `run_failed` event), and a kept
    group that the lowered staleness window evicts inside the wait has its `evict` event."""
    base = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "logger.tensorboard=false", *ASYNC,
            "checkpoint.save_period=1", "checkpoint.keep_last_k=0", f"run_dir={tmp_path}", *shared_engine]
    first = run_cli(*base, "grpo.max_num_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "Unclosed client session" not in first.stderr, "the run's router closes its session at shutdown"
    step0 = tmp_path / "checkpoints" / "step_0"
    state = json.loads((step0 / "state.json").read_text())
    assert state["config"]["grpo"]["num_prompts_per_step"] == 2 and state["config"]["async_rl"]["enabled"] is True

    changed = ["grpo.num_prompts_per_step=3", "async_rl.sampler.max_staleness_versions=0", f"checkpoint.resume={step0}"]
    refused = run_cli(*base, "grpo.max_num_steps=2", *changed, timeout=60)
    assert refused.returncode == 2 and refused.stdout == "", refused.stderr[-3000:]
    assert [x for x in refused.stderr.splitlines() if x.strip()] == [
        "ConfigError: grpo.num_prompts_per_step: differs from the checkpoint resumed (grpo.num_prompts_per_step: 2 -> "
        "3, "
        f"async_rl.sampler.max_staleness_versions: 1 -> 0; {step0}): a resume must keep the step's shape and the "
        "staleness "
        "window; set them back, or start a new run_dir"]

    del state["config"]  # as written before this round (state.json is not in its own manifest: it still verifies)
    (step0 / "state.json").write_text(json.dumps(state))
    before = len(events(tmp_path))
    stalled = run_cli(*base, "grpo.max_num_steps=2", *changed, "async_rl.stall_watchdog.stall_timeout_s=4", timeout=300)
    tail = [x for x in stalled.stderr.splitlines() if x.strip()][-1]
    assert stalled.returncode == 1, stalled.stderr[-3000:]
    assert (tail.startswith("RolloutStall: the train pump has waited ")
            and "for step 1 with no prompt group in flight" in tail), tail
    after = events(tmp_path)[before:]
    (stall,) = [e for e in after if e["type"] == "stall"]
    (failed,) = [e for e in after if e["type"] == "run_failed"]
    assert stall["step"] == 1 and stall["in_flight"] == 0 and failed["error"] == tail and failed["step"] == 1
    (restored,) = [e for e in after if e["type"] == "buffer_restored"]
    assert restored["kept"] or restored["redispatched"], "the checkpoint held step 1's groups"
    first_starts = {(e["step"], e["group"]): e["start_weight"]
                    for e in events(tmp_path)[:before] if e["type"] == "dispatch"}
    evicted = {(e["step"], e["group"]) for e in after if e["type"] == "evict"}
    assert {tuple(g) for g in restored["kept"] if first_starts[tuple(g)] < 1} <= evicted, \
        "every group evicted in the wait has its event"
