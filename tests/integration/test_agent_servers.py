"""Issue 31 items 2-4: several agent servers behind one run, run-ending errors that name their
cause, and the retry window for an agent restart.

Real parts only: minirl's own agent pool (Ray actors, HTTP on loopback) killed by the seeded
`agent_kill` fault; a real reasoning-parser mismatch (`agent.uses_reasoning_parser=false` against the
model server's `think` parser, which makes minirl's agent fail each call as Gym's `vllm_model`
does); a stand-in `/run` server on loopback whose port really refuses connections while it is down.
"""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import pytest
from aiohttp import web

from helpers import last_line, run_cli, serve_run
from minirl.data import prompt_row
from minirl.rollout.agent_pool import AgentPool
from minirl.rollout.manager import RolloutManager
from minirl.wire import RolloutRedispatchExhausted

SMALL = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=2", "logger.tensorboard=false",
         "checkpoint.enabled=false"]
GOOD_ITEM = {"type": "function_call", "name": "open_door", "arguments": "{}", "call_id": "c",
             "prompt_token_ids": [1, 2, 3], "generation_token_ids": [5, 6], "generation_log_probs": [-0.1, -0.2]}


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def test_the_pool_picks_the_least_busy_up_server_and_passes_over_a_down_one():
    pool = AgentPool(["a", "b", "c"], "least_busy")
    pool.acquire("a")
    assert pool.pick() in ("b", "c") and pool.pick(avoid="b") == "c"
    pool.failed("b", "refused", 0.0)  # b refused a connection: passed over while another is up
    assert {pool.pick() for _ in range(6)} == {"c"}  # a is busy
    pool.release("a"), pool.answered("a")
    assert {pool.pick() for _ in range(6)} == {"a", "c"}
    for u in ("a", "c"):
        pool.failed(u, "refused", 0.0)
    assert pool.pick() == "b", "every server down: the one down longest is tried"
    pool.answered("b")
    assert pool.down() == ["a", "c"] and pool.pick() == "b" and pool.in_flight == {"a": 0, "b": 0, "c": 0}
    rr = AgentPool(["a", "b"], "round_robin")
    assert [rr.pick() for _ in range(4)] == ["a", "b", "a", "b"]


def test_the_agent_server_runs_in_a_process_of_its_own_and_a_failed_start_names_its_cause(base_cfg):
    import os
    import re
    import socket
    import urllib.request

    import psutil

    from minirl.agents.process import AgentProcess

    with socket.socket() as taken:  # a port someone holds: a clear error, and no child left behind
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"the agent server at 127.0.0.1:{port} \(pid (\d+)\) failed to start: "
                                               r"OSError: .*address already in use") as failed:
            AgentProcess(base_cfg, ["http://127.0.0.1:9"], "127.0.0.1", port)
        pid = int(re.search(r"\(pid (\d+)\)", str(failed.value)).group(1))
        assert not psutil.pid_exists(pid), "the failed child is gone, and reaped"
    agent = AgentProcess(base_cfg, ["http://127.0.0.1:9"], "127.0.0.1", 0)
    try:
        assert agent.pid() != os.getpid() and psutil.Process(agent.pid()).ppid() == os.getpid()
        with urllib.request.urlopen(agent.start() + "/health", timeout=30) as r:
            assert json.loads(r.read()) == {"status": "ok", "in_flight": 0}
    finally:
        agent.stop()  # ends the child, not this process
    assert not psutil.pid_exists(agent.pid()) or psutil.Process(agent.pid()).status() == psutil.STATUS_ZOMBIE


def _outage_run(base_cfg, window_s: float, back_after_s: float | None):
    """One group of 2 rows through one stand-in agent server that is down (its port refuses) until the
    group has backed off `back_after_s` seconds (None: never back). The backoff is recorded, not slept."""
    cfg = copy.deepcopy(base_cfg)
    cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt = 1, 2
    cfg.policy.train_global_batch_size = 2
    rf = cfg.async_rl.rollout_failure
    rf.agent_restart_window_s, rf.max_consecutive_dropped_prompts = window_s, 0
    events, slept = [], []

    async def run_handler(request):
        return web.json_response({**(await request.json()), "response": {"output": [GOOD_ITEM]}, "reward": 1.0})

    async def go():
        runner, url = await serve_run(run_handler)
        port = int(url.rsplit(":", 1)[1])
        await runner.cleanup()  # the server dies: its port refuses connections
        back = {}

        async def sleep(s):
            slept.append(s)
            if back_after_s is not None and sum(slept) >= back_after_s and not back:  # it restarts at its port
                app = web.Application()
                app.router.add_post("/run", run_handler)
                back["runner"] = web.AppRunner(app)
                await back["runner"].setup()
                await web.TCPSite(back["runner"], "127.0.0.1", port, reuse_address=True).start()

        m = RolloutManager(cfg, [url], events.append, 512, sleep=sleep)
        try:
            return await m.run_step(0, [prompt_row(cfg, 0, 0)]), url
        finally:
            await m.session.close()
            if back:
                await back["runner"].cleanup()

    return asyncio.run(go()), events, slept


def test_a_restarting_agent_server_has_the_restart_window_and_one_that_stays_down_is_named(base_cfg):
    """Item 4: with configs/default.yaml's backoff (0.5 s doubling to 8 s, 5 attempts) a group used to
    give up after 7.5 s of backoff. An agent server that is back after 20 s now finds its group still
    retrying (the default window, 60 s); with the window at 0 (upstream) the same outage drops the
    group after 5 attempts, and the run-ending error names the unreachable agent server."""
    assert base_cfg.async_rl.rollout_failure.agent_restart_window_s == 60.0
    (outcomes, url), events, slept = _outage_run(base_cfg, 60.0, back_after_s=20.0)
    assert [o.status for o in outcomes] == ["committed"] and sorted(outcomes[0].rollouts) == [0, 1]
    assert sum(slept) >= 20 > 7.5 and slept[:5] == [0.5, 1.0, 2.0, 4.0, 8.0]
    retried = [e for e in events if e["type"] == "failure"]
    assert (retried
            and {(e["reason"], e["agent"], e["decision"]) for e in retried} == {("AgentUnreachable", url, "retried")})
    assert any("restart_window_s" in e for e in retried), "retries past max_infra_attempts_per_prompt say why"

    with pytest.raises(RolloutRedispatchExhausted) as err:
        _outage_run(base_cfg, 0.0, back_after_s=None)
    message = str(err.value)
    assert "after 5 attempt(s)" in message and "Dominant failure (all 1 lost group(s)): AgentUnreachable" in message
    assert "likely cause: no agent server accepted a connection" in message

    with pytest.raises(RolloutRedispatchExhausted):  # never back: the window ends too, after ~60 s of backoff
        _outage_run(base_cfg, 60.0, back_after_s=None)


@pytest.mark.slow
def test_two_agent_servers_one_killed_mid_step_the_run_goes_on(tmp_path, shared_engine):
    """Item 2: two agent servers of minirl's pool behind one run; `agent_kill` kills the one that
    receives s0.g1.r0.a0 with every row in flight on it. Those rows are re-sent at once on the other
    server (no group backoff, nothing dropped or masked), every trained call is in the generation
    server's record (the ledger's check), each failure event names the killed server, and the run
    trains its later steps too.
    Issue 51 (Y) item 2: Ray restarts the killed server at its port; it used to get no `/run` again
    while the other was up (0 of 8 later sends). Now its probe finds it back (`agent_up`), and the
    last step gives it a fair share of the sends with both servers up (probed each second here: Ray's
    restart takes a few seconds, the steps about two)."""
    proc = run_cli(*SMALL, "grpo.max_num_steps=6", "cluster.num_agent_servers=2", "agent.down_retry_s=0.5",
                   "agent.down_retry_max_s=1", f"run_dir={tmp_path}", *shared_engine,
                   "faults.inject=[{kind: agent_kill, step: 0, group: 1, rollout: 0, attempt: 0}]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    agents = json.loads((tmp_path / "endpoints.json").read_text())["agents"]
    assert len(agents) == 2
    rows = jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    for r in rows:
        assert r["groups_trained"] == 4 and r["dropped_prompt_groups"] == 0 and r["rollouts_masked"] == 0, r
        assert r["calls_unrecorded"] == 0, r
        ledger = jsonl(tmp_path / "ledger" / f"step_{r['step']}.jsonl")  # each call against the server's record
        trained = {(c["group"], c["rollout"], c["attempt"]) for c in ledger if c["ledger_status"] == "trained"}
        assert {(g, ro) for g, ro, _ in trained} == {(g, ro) for g in range(4) for ro in range(2)}, \
            "every rollout's calls"
        assert len(trained) == 8 and {c["ledger_status"] for c in ledger} <= {"trained", "retired"}
    assert rows[0]["backoff_s"] == 0 and rows[0]["redispatched_rows"] >= 1
    ev = jsonl(tmp_path / "events.jsonl")
    assert [e for e in ev if e["type"] == "fault" and e["kind"] == "agent_kill"]
    failed = [e for e in ev if e["type"] == "failure"]
    assert failed and {(e["reason"], e["decision"], e.get("scope")) for e in failed} <= {
        ("AgentUnreachable", "retried", "row"), ("GymTransportError", "retried", "row")}
    killed = {e["agent"] for e in failed}
    assert len(killed) == 1 and killed <= set(agents), (killed, agents)
    (down,) = [e for e in ev if e["type"] == "agent_down"]
    assert (down["agent"], down["reason"], down["agent_servers_up"]) == (*killed, "refused", 1)
    ups = [e for e in ev if e["type"] == "agent_up"]
    print([(r["step"], r["agent_servers_up"], r["agent_sends"]) for r in rows], ups)  # pytest -rP shows it
    assert ups and {(e["agent"], e["via"]) for e in ups} <= {(*killed, "probe"), (*killed, "run")}, ups
    assert rows[0]["agent_sends"][down["agent"]] >= 1 and rows[-1]["agent_servers_up"] == 2
    assert rows[-1]["agent_sends"] == {u: 4 for u in agents}, "back in the last step: its fair share of 8 sends"


@pytest.mark.slow
def test_a_mismatched_reasoning_parser_ends_the_run_in_a_few_attempts_naming_it(tmp_path, shared_engine):
    """Item 3: Gym's `uses_reasoning_parser: false` against a model server that splits `<think>` out
    (minirl's default `reasoning_parser: think`): every call fails with Gym's AssertionError, /run
    answers 500 with the same text every time. It used to be retried as INFRA to the end of the budget
    (60 sends in Gym's setup) and end with the floor's arithmetic alone. Now each row stops after
    `max_identical_failures` (3) identical answers, no group is retried or backed off, and the last
    line names the assertion and its likely cause."""
    proc = run_cli(*SMALL, "grpo.max_num_steps=1", "agent.uses_reasoning_parser=false", f"run_dir={tmp_path}",
                   *shared_engine)
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = last_line(proc.stderr)
    print(line)  # pytest -rP shows it
    assert line.startswith("RuntimeError: training step 0 lost 4 of 4 prompt group(s)"), line
    assert "Dominant failure (all 4 lost group(s)): DeterministicFailure: the same failure 3 times in a row" in line
    assert "HTTP 500: AssertionError('NeMo Gym server `policy_model` config has explicitly been set to not use a " \
           "reasoning parser i.e. `uses_reasoning_parser: false`" in line
    assert "likely cause: the model server's reasoning parser and the agent's uses_reasoning_parser disagree" in line
    ev = jsonl(tmp_path / "events.jsonl")
    failed = [e for e in ev if e["type"] == "failure"]
    assert len([e for e in ev if e["type"] == "deterministic"]) == 8  # every row of the 4 groups, once
    assert len(failed) == 8 * 3, "3 sends per row, then no more"
    assert all(e.get("backoff_s", 0) == 0 for e in failed) and {e["decision"] for e in failed} == {"retried", "skipped"}
