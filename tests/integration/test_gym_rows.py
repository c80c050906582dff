"""Rows that Gym's `/run` accepts: checked against the request shape written down from
nemo-gym 0.4.0's models (minirl/gym/shapes.py; `make gym-check` checks the real models), and
minirl's own agent reading the seed from `metadata.extra_body` as Gym's `vllm_model` does; the
doors resources server's reply after the last door; a JSONL of doors rows through the real stack."""

from __future__ import annotations

import asyncio
import copy
import json

import aiohttp
import pytest
from aiohttp import web
from pydantic import ValidationError

from helpers import serve_run
from minirl import data
from minirl.agents.env import ALL_OPEN, TOOL_NAME, DoorsEnv, verify
from minirl.agents.items import parts_text
from minirl.data import prompt_row
from minirl.gym.shapes import RunRequest
from minirl.rollout.manager import RolloutManager
from minirl.wire import extra_body, with_extra_body


def test_shape_rejects_what_gym_rejects(base_cfg):
    row = prompt_row(base_cfg, 0, 0)
    RunRequest.model_validate(row)
    bad_seed = copy.deepcopy(row)
    bad_seed["responses_create_params"]["seed"] = 1
    no_strict = copy.deepcopy(row)
    del no_strict["responses_create_params"]["tools"][0]["strict"]
    no_detail = copy.deepcopy(row)
    del no_detail["responses_create_params"]["input"][1]["content"][1]["detail"]
    for bad, field in ((bad_seed, "seed"), (no_strict, "strict"), (no_detail, "detail")):
        with pytest.raises(ValidationError, match=field):
            RunRequest.model_validate(bad)


def test_extra_body_round_trip_keeps_other_keys():
    params = {"input": "hi", "metadata": {"k": "v", "extra_body": '{"top_k": 5}'}}
    out = with_extra_body(params, seed=3)
    assert extra_body(out) == {"top_k": 5, "seed": 3} and out["metadata"]["k"] == "v"
    assert isinstance(out["metadata"]["extra_body"], str) and extra_body({"input": "hi"}) == {}
    with pytest.raises(ValueError, match="metadata.extra_body"):
        extra_body({"metadata": {"extra_body": "[1]"}})


def test_rows_the_manager_sends_pass_the_gym_shape(base_cfg):
    """A Gym-shaped `/run` server on 127.0.0.1: 422 with pydantic's errors for a row Gym's models
    reject (as FastAPI answers), otherwise a minimal trainable result."""
    cfg = copy.deepcopy(base_cfg)
    cfg.grpo.num_generations_per_prompt = 2
    seen: list[dict] = []

    async def run(request: web.Request) -> web.Response:
        row = await request.json()
        try:
            RunRequest.model_validate(row)
        except ValidationError as exc:
            return web.json_response({"detail": exc.errors(include_url=False, include_context=False)}, status=422)
        seen.append(row)
        item = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x"}],
                "prompt_token_ids": [1, 2], "generation_token_ids": [3], "generation_log_probs": [-0.5]}
        return web.json_response({**row, "response": {"output": [item]}, "reward": 1.0})

    async def go():
        runner, url = await serve_run(run)
        manager = RolloutManager(cfg, [url], lambda event: None, vocab_size=100)
        try:
            return await manager.run_step(0, [prompt_row(cfg, 0, 0)])
        finally:
            if manager.session is not None:
                await manager.session.close()
            await runner.cleanup()

    outcomes = asyncio.run(go())
    assert [o.status for o in outcomes] == ["committed"] and len(seen) == 2
    seeds = [extra_body(row["responses_create_params"])["seed"] for row in seen]
    assert len(set(seeds)) == 2  # one sampling seed per rollout, carried where Gym forwards it


def test_agent_reads_the_seed_from_extra_body(stack, base_cfg):
    cfg = copy.deepcopy(base_cfg)
    cfg.agent.max_steps = 1
    base = {**prompt_row(cfg, 0, 0), "_rowidx": 0}

    def seeded(seed):
        return {**base, "responses_create_params": with_extra_body(base["responses_create_params"], seed=seed)}

    async def go():
        async with stack(cfg) as s, aiohttp.ClientSession() as http:
            out = []
            for row in (seeded(11), seeded(11), seeded(12)):
                async with http.post(s.agent_url + "/run", json=row) as r:
                    assert r.status == 200, await r.text()
                    body = await r.json()
                out.append([it["generation_token_ids"]
                            for it in body["response"]["output"] if "generation_token_ids" in it])
            return out

    a, b, c = asyncio.run(go())
    assert a == b and a != c


def test_doors_server_answers_a_call_after_the_last_door_as_the_environment():
    """minirl/gym_servers/doors_resources_server answers `/open_door` with `parts_text(env.step(...))`: after the
    last door it is the environment's own last word, never an exception's text (it was IndexError)."""
    env = DoorsEnv(seed=7, num_rooms=1)
    code = env.rooms[0].code
    calls = [(TOOL_NAME, json.dumps({"code": code})), (TOOL_NAME, json.dumps({"code": code})),
             (TOOL_NAME, '{"code": 999}'), (TOOL_NAME, "not json"), ("other_tool", "{}")]
    assert [parts_text(env.step(name, args)) for name, args in calls] == [ALL_OPEN] * len(calls)
    output = [{"type": "function_call", "name": name, "arguments": args} for name, args in calls]
    assert verify({"seed": 7, "num_rooms": 1}, output) == 1.0  # the calls after it change nothing


def test_a_jsonl_of_doors_rows_runs_as_the_doors_dataset(stack, base_cfg, tmp_path):
    """Through the real agent and engine: the doors rows written to a JSONL (`data.train_jsonl`) give
    the rollouts the doors dataset gives (same tokens, same rewards)."""
    cfg = copy.deepcopy(base_cfg)
    cfg.agent.max_steps, cfg.grpo.num_generations_per_prompt = 2, 2
    from_file = copy.deepcopy(cfg)
    from_file.data.train_jsonl = str(tmp_path / "doors.jsonl")
    (tmp_path / "doors.jsonl").write_text("".join(json.dumps(prompt_row(cfg, 0, g)) + "\n" for g in range(2)))
    from_file.data.shuffle = False
    data.prepare(from_file)

    async def go():
        async with stack(cfg) as s:
            out = []
            for c in (cfg, from_file):
                manager = RolloutManager(c, [s.agent_url], lambda event: None, 512)
                try:
                    outcomes = await manager.run_step(0, [prompt_row(c, 0, g) for g in range(2)])
                finally:
                    await manager.session.close()
                out.append([(r.reward, [call.gen for call in r.calls])
                            for o in outcomes for _, r in sorted(o.rollouts.items())])
            return out

    doors, jsonl = asyncio.run(go())
    assert len(doors) == 4 and all(calls for _, calls in doors) and doors == jsonl
