"""The compaction agent through real `/run` calls: the guard's three decisions, both lanes, and
how a rejection's switch (`on_reject`) changes what the controller sees."""

from __future__ import annotations

import asyncio
import copy

import aiohttp
import pytest

from minirl.agents.agent import _guard
from minirl.agents.compaction import policy_for
from minirl.agents.env import TOOLS, DoorsEnv, image_part
from minirl.agents.episode import Episode
from minirl.agents.items import items_to_messages
from minirl.agents.model_client import HttpModelClient
from minirl.config import FaultSpec
from minirl.data import prompt_row
from minirl.wire import with_extra_body


def row(cfg, group=0, rollout=0, attempt=0):
    r = {**prompt_row(cfg, 0, group), "_rowidx": rollout,
         "_minirl": {"step": 0, "group": group, "rollout": rollout, "attempt": attempt}}
    r["responses_create_params"] = with_extra_body(r["responses_create_params"], seed=7)
    return r


async def post(url, body):
    async with aiohttp.ClientSession() as http, http.post(url + "/run", json=body) as r:
        return r.status, await r.json(content_type=None)


def with_faults(base_cfg, *specs, **changes):
    cfg = copy.deepcopy(base_cfg)
    cfg.faults.inject = [FaultSpec(**s) for s in specs]
    for key, value in changes.items():
        obj = cfg
        *path, last = key.split(".")
        for p in path:
            obj = getattr(obj, p)
        setattr(obj, last, value)
    return cfg


def test_guard_reject_with_raise_is_http_500_lane_b(stack, base_cfg):
    cfg = with_faults(base_cfg, {"kind": "guard_reject", "step": 0, "group": 0, "rollout": 0},
                      **{"agent.context_history.guards.on_reject": "raise"})

    async def go():
        async with stack(cfg) as s:
            return await post(s.agent_url, row(cfg))

    status, body = asyncio.run(go())
    assert status == 500
    # Gym's agent counts its steps from 1 (`step += 1` before the call's guard)
    assert ("Context guard rejected model call at complete action boundary: step=1 guards=max_total_tokens"
            in body["error"])


def test_guard_reject_with_end_episode_is_a_masked_200_fix_2(stack, base_cfg):
    cfg = with_faults(base_cfg, {"kind": "guard_reject", "step": 0, "group": 0, "rollout": 0})

    async def go():
        async with stack(cfg) as s:
            return await post(s.agent_url, row(cfg))

    status, body = asyncio.run(go())
    assert status == 200
    ev = body["evidence"]
    assert ev["capture_failed"] and ev["end_reason"] == "guard_reject" and ev["calls"] == 0
    # the rollout's `mask` event names the guard (it read as lane A's overflow: capture_failed, no error)
    assert ev["errors"] == ["Context guard rejected model call at complete action boundary: step=1 "
                            "guards=max_total_tokens"]
    assert ev["guard"] == [{"call": 0, "limit": None, "reserved": 0, "injected": True, "decision": "reject"}]
    assert body["response"]["status"] == "incomplete"


def test_lane_a_overflow_is_an_empty_reply_and_a_200(stack, base_cfg):
    cfg = with_faults(base_cfg, {"kind": "context_overflow", "step": 0, "group": 0, "rollout": 0})

    async def go():
        async with stack(cfg) as s:
            return await post(s.agent_url, row(cfg)), s.model.take_calls(0)

    (status, body), calls = asyncio.run(go())
    assert status == 200
    assert body["evidence"]["capture_failed"] and body["evidence"]["end_reason"] == "context_length"
    last = body["response"]["output"][-1]
    assert last["type"] == "message" and "generation_token_ids" not in last
    assert "maximum context length" in body["evidence"]["errors"][0]
    # as Gym's vllm_model answers an overflow: `incomplete`, reason max_output_tokens (scripts/gym_check.py)
    assert body["response"]["status"] == "incomplete"
    assert body["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert calls[0]["status"] == 400  # the server recorded the refused call


def test_a_model_error_fails_run_with_500_as_gyms_simple_agent_does(stack, base_cfg):
    cfg = with_faults(base_cfg, {"kind": "model_error", "step": 0, "group": 0, "rollout": 0})

    async def go():
        async with stack(cfg) as s:
            return await post(s.agent_url, row(cfg))

    status, body = asyncio.run(go())
    assert status == 500 and body["type"] == "ModelCallFailed"
    assert "model call failed with HTTP 500: injected model_error at s0.g0.r0.a0.c0" in body["error"]


def test_a_tokenize_4xx_stays_data_across_the_hop(stack, base_cfg):
    from minirl.wire import DATA, ModelCallFailed, classify, run_error_status

    async def go():
        async with stack() as s, aiohttp.ClientSession() as http:
            client = HttpModelClient([s.model_url], base_cfg.policy.model_name, http)
            with pytest.raises(ModelCallFailed) as info:
                await client.count_tokens([{"role": 5, "content": "x"}], [], "c0", None)
            good = await client.count_tokens([{"role": "user", "content": "hello"}], [], "c0", None)
            return info.value, good

    exc, good = asyncio.run(go())
    assert exc.status == 400 and "/tokenize failed with HTTP 400" in str(exc) and good > 0
    assert classify(exc) == DATA and run_error_status(exc) == 400


def history_with_pictures(n: int) -> list[dict]:
    env = DoorsEnv(3, 3)
    items = env.initial_input()
    for k in range(n):
        items += [
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": f"lamp {k}"}]},
            {"type": "function_call", "call_id": f"c{k}", "name": "open_door", "arguments": f'{{"code": {k}}}'},
            {"type": "function_call_output", "call_id": f"c{k}",
             "output": [{"type": "input_text", "text": "Wrong code."}, image_part(env.rooms[0].picture())]},
        ]
    return items


@pytest.mark.parametrize("schedule", ["turn_chunked_recency", "rolling_recency"])
def test_guard_admit_admit_after_compaction_and_reject(stack, base_cfg, schedule):
    cfg = copy.deepcopy(base_cfg)
    ch = cfg.agent.context_history
    ch.schedule.type, ch.schedule.actions_per_chunk = schedule, (8 if schedule == "turn_chunked_recency" else 1)
    tools = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]

    async def decide(limit):
        from minirl.agents.compaction import compact

        async with stack(cfg) as s, aiohttp.ClientSession() as session:
            client = HttpModelClient([s.model_url], cfg.policy.model_name, session)  # the served name: another is a 404
            full = history_with_pictures(3)
            n_full = await client.count_tokens(items_to_messages(full), tools, "c0", None)
            n_small = await client.count_tokens(items_to_messages(compact(full, ch, 2).items), tools, "c0", None)
            if limit is None:
                return n_full, n_small
            ch.guards.max_total_tokens = limit
            ep = Episode(history=list(full), tools=tools, initial_len=2)
            decision = await _guard(ep, ch, policy_for(ch), client, False)
            return decision, ep.ev.guard[-1], len(ep.history) < len(full)

    n_full, n_small = asyncio.run(decide(None))
    assert n_small < n_full
    assert asyncio.run(decide(n_full))[0] == "admit"
    decision, record, compacted = asyncio.run(decide((n_full + n_small) // 2))
    if schedule == "turn_chunked_recency":
        assert decision == "admit_after_compaction" and compacted
        assert record["prompt_tokens"] == n_full and record["prompt_tokens_after_compaction"] == n_small
    else:  # rolling_recency: the history is already compacted, a hit rejects at once
        assert decision == "reject" and not compacted
    assert asyncio.run(decide(n_small - 1))[0] == "reject"
