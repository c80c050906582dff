"""minirl as Gym's rollout collector (issue 51, items 3, 5 and 6), without a Gym install:

- every `/run` row carries Gym 0.7's collector keys (`_ng_task_index`, `_ng_rollout_index`,
  `_ng_attempt_index`, `_ng_rollout_id`), so a flat-row Environment Server (`single_agent_turn_legacy`)
  names one episode per rollout attempt: never shared by two rollouts of a row, by a re-send, or by
  the same row trained at two steps (`make gym-check` sends such rows through the real 0.7 server);
- `agent.name` names any Gym agent instance for an external agent (minirl's own pool has two);
- `python -m minirl.gym_servers.generation` refuses a bad key before Ray starts (exit 2);
- `make gym-check` on a fresh clone builds both Gym side venvs (the rule's prerequisites expand).
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from aiohttp import web

from helpers import serve_run
from minirl.config import ConfigError, load_config
from minirl.data import prompt_row
from minirl.gym.shapes import RunRequest
from minirl.rollout.manager import RolloutManager
from minirl.validation import held_out_rows

REPO = Path(__file__).resolve().parents[2]
ROLLOUT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # Gym 0.7's ROLLOUT_ID_PATTERN (EpisodeId.rollout_id)


def gym_episode_id(row: dict) -> tuple[str, int]:
    """The episode id Gym 0.7's `single_agent_turn_legacy` gives a flat row (`_episode_request_from_row`):
    the explicit `_ng_rollout_id`, else `{task}-{rollout}`, and the attempt; a KeyError where the keys
    are missing, as the server's."""
    rollout_id = row.get("_ng_rollout_id") or f"{row['_ng_task_index']}-{row['_ng_rollout_index']}"
    assert ROLLOUT_ID.match(rollout_id) and not re.search(r"-a[1-9][0-9]*$", rollout_id), rollout_id
    return rollout_id, row.get("_ng_attempt_index", 0)


def _serve_rows(cfg, rows_per_step: list[list[dict]], fail_first: set) -> list[dict]:
    """Run each step's rows through the real rollout manager against a `/run` server on 127.0.0.1
    that answers 503 to the first send of each (group, rollout) in `fail_first` (an INFRA failure:
    the row is re-sent), else a minimal trainable result; returns every body it received."""
    seen: list[dict] = []

    async def run(request: web.Request) -> web.Response:
        row = await request.json()
        seen.append(row)
        c = row["_minirl"]
        if (c["step"], c["group"], c["rollout"]) in fail_first and c["attempt"] == 0:
            return web.json_response({"error": "restarting"}, status=503)
        item = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x"}],
                "prompt_token_ids": [1, 2], "generation_token_ids": [3], "generation_log_probs": [-0.5]}
        return web.json_response({**row, "response": {"output": [item]}, "reward": 1.0})

    async def go():
        runner, url = await serve_run(run)
        manager = RolloutManager(cfg, [url], lambda event: None, vocab_size=100)
        try:
            return [await manager.run_step(step, rows) for step, rows in enumerate(rows_per_step)]
        finally:
            if manager.session is not None:
                await manager.session.close()
            await runner.cleanup()

    outcomes = asyncio.run(go())
    assert [[o.status for o in step] for step in outcomes] == [["committed"] * len(rows) for rows in rows_per_step]
    return seen


def test_each_rollout_attempt_is_its_own_gym_episode(base_cfg, tmp_path):
    """One row trained at two steps, two rollouts each, one rollout re-sent after a 503: every send
    carries Gym's collector keys, and the episode ids Gym 0.7's Environment Server derives from them
    are all distinct (before: no `_ng_*` key, the server's KeyError)."""
    cfg = copy.deepcopy(base_cfg)
    cfg.grpo.num_generations_per_prompt, cfg.grpo.num_prompts_per_step = 2, 1
    cfg.data.train_jsonl = str(tmp_path / "one.jsonl")
    (tmp_path / "one.jsonl").write_text(json.dumps({"responses_create_params": {"input": "hi"}}) + "\n")
    seen = _serve_rows(cfg, [[prompt_row(cfg, s, 0)] for s in (0, 1)], fail_first={(0, 0, 1)})
    assert len(seen) == 5  # 2 rollouts x 2 steps, one re-sent
    for row in seen:
        RunRequest.model_validate(row)  # still what Gym's request models take
        c = row["_minirl"]
        assert (row["_ng_task_index"], row["_ng_rollout_index"],
                row["_ng_attempt_index"]) == (0, c["rollout"], c["attempt"])
    ids = [gym_episode_id(row) for row in seen]
    assert len(set(ids)) == len(ids), ids
    assert ("s0.g0.r1", 1) in ids  # the re-send is the next attempt of the same rollout


def test_a_rows_own_task_index_wins_and_doors_rows_carry_the_task_seed(base_cfg, tmp_path):
    cfg = copy.deepcopy(base_cfg)
    cfg.grpo.num_generations_per_prompt, cfg.grpo.num_prompts_per_step = 2, 1
    doors = _serve_rows(cfg, [[prompt_row(cfg, 0, 0)]], fail_first=set())
    assert {row["_ng_task_index"] for row in doors} == {prompt_row(cfg, 0, 0)["task"]["seed"]}
    cfg.data.train_jsonl = str(tmp_path / "own.jsonl")
    (tmp_path / "own.jsonl").write_text(json.dumps({"responses_create_params": {"input": "hi"},
                                                    "_ng_task_index": 41}) + "\n")
    own = _serve_rows(cfg, [[prompt_row(cfg, 0, 0)]], fail_first=set())
    assert [row["_ng_task_index"] for row in own] == [41, 41]
    assert len({gym_episode_id(row) for row in own}) == 2


def test_held_out_rows_carry_distinct_collector_keys(base_cfg):
    cfg = copy.deepcopy(base_cfg)
    cfg.grpo.val_num_prompts, cfg.grpo.val_num_generations = 2, 2
    rows = held_out_rows(cfg)
    ids = [gym_episode_id(row) for row in rows]
    assert len(rows) == 4 and len(set(ids)) == 4
    # two validations (of versions 1 and 2) share no episode: Gym freezes a rollout id's token capture
    episodes = [{gym_episode_id(row) for row in held_out_rows(cfg, version)} for version in (1, 2)]
    assert not episodes[0] & episodes[1]


def test_an_external_agent_name_is_any_gym_agent_instance():
    """`agent.name` is what a row without `agent_ref` is sent with; Gym 0.7's `single_agent_turn_legacy`
    refuses any name but its configured agent's, so for an external agent it is free."""
    cfg = load_config(overrides=["agent.external_url=http://127.0.0.1:1",
                                 "agent.name=example_single_tool_call_session_agent"])
    assert prompt_row(cfg, 0, 0)["agent_ref"] == {"name": "example_single_tool_call_session_agent"}
    with pytest.raises(ConfigError, match=r"^agent.name: must be simple_agent or compaction_agent, got 'other_agent'$"):
        load_config(overrides=["agent.name=other_agent"])  # minirl's own pool serves only its two agents


def test_generation_side_refuses_a_bad_key_before_ray(capsys):
    from minirl.gym_servers.generation import main

    assert main(["grpo.no_such_key=1"]) == 2
    assert capsys.readouterr().err.startswith("ConfigError: grpo.no_such_key")


def test_generation_side_stops_at_a_ctrl_c_during_start_up():
    """Ctrl-C while the generation side starts (Ray, then vLLM: minutes) stops it at once: exit 1, one
    `KeyboardInterrupt` line, nothing announced ready, and no process of its Ray cluster left behind. Before,
    the handler only set an Event read after start-up, so the command could not be stopped while starting
    and then printed `generation-ready` for a stop already asked, and exited 0."""
    proc = subprocess.Popen([sys.executable, "-m", "minirl.gym_servers.generation", "--name", "stop-test"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            start_new_session=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        while not lines.get(timeout=60).startswith("minirl: starting"):
            pass
        time.sleep(1.0)  # into start-up: Ray's start
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=20)  # at once: vLLM's start alone takes longer
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + 10
    while True:  # Ray's GCS and raylet run in its process group (the raylet takes its workers with it)
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "a process of its Ray cluster outlived it"
        time.sleep(0.2)
    stderr, printed = proc.stderr.read(), "".join(lines.queue)
    assert rc == 1, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == "KeyboardInterrupt: stopped during start-up, before anything was ready"
    assert "generation-ready" not in printed, printed


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_gym_check_on_a_fresh_clone_builds_both_gym_venvs(tmp_path):
    """`make -n gym-check` where neither side venv exists lists both installs (before: the rule
    named `$(GYM07_STAMP)` before the Makefile defined it, so nemo-gym 0.7.0 was never installed)."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO / name, tmp_path / name)
    out = subprocess.run(["make", "-n", "gym-check"], cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert "nemo-gym==0.4.0" in out and "--ignore-requires-python nemo-gym==0.7.0" in out
    assert out.index("nemo-gym==0.7.0") < out.index("scripts/gym_check.py")
