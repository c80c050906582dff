"""Bad input against the real servers on loopback (issue N): every client error is a 400 naming the
field, in vLLM's OpenAI-style body from the model server and minirl.wire's `{"error", "type"}` from
the agent server; a huge request never stops either server from answering `/health`; a client that
leaves mid-generation stops the engine's work; the call log stays bounded. After each bad request
a normal one still succeeds on the same server."""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
import urllib.request

import aiohttp
import pytest

from minirl.agents.agent import chat_tools
from minirl.agents.env import TOOLS, DoorsEnv
from minirl.agents.items import items_to_messages
from minirl.data import prompt_row
from minirl.generation.server import CALL_LOG_STEPS
from minirl.wire import ROLLOUT_HEADER

CHAT = "/v1/chat/completions"
GOOD_CHAT = {"messages": items_to_messages(DoorsEnv(11, 2).initial_input()), "tools": chat_tools(TOOLS),
             "max_completion_tokens": 4}


def deep(depth: int = 100_000) -> str:
    return "[" * depth + "]" * depth


async def post(http, url, body=None, raw: bytes | None = None, headers=None) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    async with http.post(url, data=data, headers={"Content-Type": "application/json", **(headers or {})}) as r:
        return r.status, await r.json(content_type=None)


# ------------------------------------------------------------------------------- model server
MODEL_CASES = {  # name: (body changes or raw bytes, headers, message fragment, param)
    "max_tokens_negative": ({"max_tokens": -1, "max_completion_tokens": None}, None, "max_tokens must be at least 1",
                            "max_tokens"),
    "max_completion_tokens_zero": ({"max_completion_tokens": 0}, None, "max_completion_tokens must be at least 1",
                                   "max_completion_tokens"),
    "temperature_negative": ({"temperature": -1}, None, "temperature must be non-negative", "temperature"),
    "temperature_nan": ({"temperature": float("nan")}, None, "temperature must be a finite number", "temperature"),
    "top_p_zero": ({"top_p": 0}, None, "top_p must be in (0, 1]", "top_p"),
    "top_p_seven": ({"top_p": 7}, None, "top_p must be in (0, 1]", "top_p"),
    "top_logprobs_without_logprobs": ({"logprobs": False, "top_logprobs": 5}, None, "`logprobs` must be set to true",
                                      "top_logprobs"),
    "top_logprobs_negative": ({"logprobs": True, "top_logprobs": -2}, None,
                              "`top_logprobs` must be a positive value or -1", "top_logprobs"),
    # refused by vLLM inside add_request, on the engine thread: still vLLM's 400, not a 500
    "top_logprobs_above_max_logprobs": ({"logprobs": True, "top_logprobs": 50}, None, "greater than max allowed",
                                        "logprobs"),
    "prefix_not_a_list": ({"required_prefix_token_ids": "1 2 3"}, None, "required_prefix_token_ids must be a list",
                          "required_prefix_token_ids"),
    "prefix_not_ints": ({"required_prefix_token_ids": [1, 2.5]}, None, "required_prefix_token_ids must hold integers",
                        "required_prefix_token_ids"),
    "prefix_bool": ({"required_prefix_token_ids": [True]}, None, "required_prefix_token_ids must hold integers",
                    "required_prefix_token_ids"),
    "prefix_negative": ({"required_prefix_token_ids": [5, -1]}, None, "Token id -1 is out of vocabulary",
                        "required_prefix_token_ids"),
    "prefix_out_of_vocabulary": ({"required_prefix_token_ids": [5, 10**6]}, None,
                                 "Token id 1000000 is out of vocabulary", "required_prefix_token_ids"),
    "prefix_huge": ({"required_prefix_token_ids": [0] * 1_000_000}, None, "maximum context length is 1024 tokens",
                    "required_prefix_token_ids"),
    "messages_missing": ({"messages": None}, None, "messages", "messages"),
    "stream": ({"stream": True}, None, "does not stream", "stream"),
    "json_nested_too_deep": (deep().encode(), None, "nests deeper", None),
    "json_deep_inside_the_body": (('{"messages": ' + deep() + "}").encode(), None, "nests deeper", None),
    "body_not_an_object": (b"[1, 2]", None, "must be a JSON object, got list", None),
    "body_not_json": (b"{\"messages\": [", None, "not valid JSON", None),
    "rollout_header_garbage": ({}, {ROLLOUT_HEADER: "step-zero"}, f"{ROLLOUT_HEADER} must look like s0.g1.r0.a0.c2",
                               ROLLOUT_HEADER),
    "rollout_header_partial": ({}, {ROLLOUT_HEADER: "s0.g1.r0.a0"}, f"{ROLLOUT_HEADER} must look like", ROLLOUT_HEADER),
}


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_model_server_answers_a_bad_request_with_a_400_naming_the_field(stack, case):
    change, headers, fragment, param = MODEL_CASES[case]

    async def go():
        async with stack() as s, aiohttp.ClientSession() as http:
            if isinstance(change, bytes):
                bad = await post(http, s.model_url + CHAT, raw=change, headers=headers)
            else:
                body = {k: v for k, v in {**GOOD_CHAT, **change}.items() if v is not None}
                bad = await post(http, s.model_url + CHAT, body, headers=headers)
            good = await post(http, s.model_url + CHAT, GOOD_CHAT)
            return bad, good

    (status, body), (good_status, good) = asyncio.run(go())
    assert status == 400, body
    error = body["error"]
    assert fragment in error["message"], error
    assert error["code"] == 400 and error["type"] in ("BadRequestError", "Bad Request")  # vLLM's two spellings
    if param is not None:
        assert error["param"] == param
    assert good_status == 200 and good["choices"][0]["message"] is not None


def test_vllm_type_names_schema_errors_as_its_validation_handler_does(stack):
    """`vllm serve` answers a body that fails the schema with type "Bad Request" (FastAPI's
    validation handler) and every other client error with "BadRequestError"."""

    async def go():
        async with stack() as s, aiohttp.ClientSession() as http:
            return (await post(http, s.model_url + CHAT, {**GOOD_CHAT, "seed": "x"}),
                    await post(http, s.model_url + CHAT, {**GOOD_CHAT, "top_p": 0}))

    (s1, schema), (s2, semantic) = asyncio.run(go())
    assert s1 == s2 == 400
    assert schema["error"]["type"] == "Bad Request" and schema["error"]["param"] == "seed"
    assert "1 validation error" in schema["error"]["message"]
    assert semantic["error"]["type"] == "BadRequestError"


def test_tokenize_answers_a_bad_body_with_a_400(stack):
    async def go():
        async with stack() as s, aiohttp.ClientSession() as http:
            return (await post(http, s.model_url + "/tokenize", raw=deep().encode()),
                    await post(http, s.model_url + "/tokenize", {"prompt": 5}),
                    await post(http, s.model_url + "/tokenize", {"prompt": "door 7"}))

    (s1, nested), (s2, typed), (s3, good) = asyncio.run(go())
    assert s1 == 400 and "nests deeper" in nested["error"]["message"]
    assert s2 == 400 and typed["error"]["param"] == "prompt"
    assert s3 == 200 and good["count"] == len(good["tokens"]) > 0


class HealthWatch:
    """Polls `/health` of each url from a thread of its own (so a blocked event loop in the test's
    process cannot hide its own stall); `stop` returns the slowest answer seen, in seconds."""

    def __init__(self, urls: list[str]):
        self.urls, self.worst, self.answers = urls, 0.0, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._done.is_set():
            for url in self.urls:
                t0 = time.perf_counter()
                with urllib.request.urlopen(url + "/health", timeout=60) as r:
                    assert r.status == 200
                self.worst = max(self.worst, time.perf_counter() - t0)
                self.answers += 1
            time.sleep(0.05)

    def stop(self) -> float:
        self._done.set()
        self._thread.join(timeout=60)
        assert self.answers >= 2 * len(self.urls), "the watch saw too few answers to judge"
        return self.worst


def test_a_10mb_prompt_is_refused_before_rendering_while_health_answers(stack):
    text = "door 7 , lamp3 red blue " * 420_000  # 10 MB, ~4M tokens: 19 s to render and tokenize here

    async def go():
        async with stack() as s, aiohttp.ClientSession() as http:
            watch = HealthWatch([s.model_url])
            await asyncio.sleep(0.2)
            t0 = time.perf_counter()
            bad = await post(http, s.model_url + CHAT, {"messages": [{"role": "user", "content": text}]})
            took = time.perf_counter() - t0
            await asyncio.sleep(0.2)
            worst = await asyncio.to_thread(watch.stop)
            good = await post(http, s.model_url + CHAT, GOOD_CHAT)
            return bad, took, worst, good

    (status, body), took, worst_health, (good_status, _) = asyncio.run(go())
    assert status == 400 and body["error"]["param"] == "input_text"
    assert "maximum context length is 1024 tokens" in body["error"]["message"]  # the agent reads it as lane A
    # every printed field: the role too
    assert f"contains {len(text) + len('user')} characters" in body["error"]["message"]
    assert took < 10, f"a refused 10 MB prompt took {took:.1f}s"
    assert worst_health < 1.0, f"/health took {worst_health:.2f}s while a 10 MB prompt was handled"
    assert good_status == 200


def test_tokenizing_a_large_prompt_runs_off_the_event_loop(stack):
    """`/tokenize` has no length limit (as in vLLM), so 2 MB is rendered and tokenized in full (~4 s
    here): `/health` answers within a second throughout."""
    text = "door 7 , lamp3 red blue " * 84_000

    async def go():
        async with stack() as s, aiohttp.ClientSession() as http:
            watch = HealthWatch([s.model_url])
            await asyncio.sleep(0.2)
            result = await post(http, s.model_url + "/tokenize", {"messages": [{"role": "user", "content": text}]})
            await asyncio.sleep(0.2)
            return result, await asyncio.to_thread(watch.stop)

    (status, body), worst_health = asyncio.run(go())
    assert status == 200 and body["count"] > 500_000
    assert worst_health < 1.0, f"/health took {worst_health:.2f}s while 2 MB was tokenized"


def test_a_client_that_disconnects_mid_generation_is_aborted_in_the_engine(stack, engine):
    cap = 400
    long_reply = {**GOOD_CHAT, "max_completion_tokens": cap, "ignore_eos": True, "seed": 0}
    key = "s0.g0.r0.a0.c0"

    async def go():
        async with stack() as s, aiohttp.ClientSession() as http:
            # how long the whole reply takes when the client waits for it
            t0, steps0 = time.perf_counter(), engine.steps
            status, full = await post(http, s.model_url + CHAT, long_reply)
            full_s, full_steps = time.perf_counter() - t0, engine.steps - steps0
            assert status == 200 and full["usage"]["completion_tokens"] == cap
            # the same reply, but the client leaves a fifth of the way through
            steps0 = engine.steps
            with pytest.raises(asyncio.TimeoutError):
                async with http.post(s.model_url + CHAT, json=long_reply, headers={ROLLOUT_HEADER: key},
                                     timeout=aiohttp.ClientTimeout(total=full_s / 5)) as r:
                    await r.read()
            t_left, steps_left = time.perf_counter(), engine.steps
            while engine.in_flight and time.perf_counter() - t_left < full_s:
                await asyncio.sleep(0.01)
            emptied_s, left_steps, after_steps = time.perf_counter() - t_left, engine.steps - steps0, \
                engine.steps - steps_left
            good = await post(http, s.model_url + CHAT, GOOD_CHAT)
            return full_s, full_steps, emptied_s, left_steps, after_steps, s.model.take_calls(0), good

    full_s, full_steps, emptied_s, left_steps, after_steps, calls, (good_status, _) = asyncio.run(go())
    assert full_steps >= cap
    assert emptied_s < full_s / 2, \
        f"engine still busy {emptied_s:.2f}s after the client left (whole reply: {full_s:.2f}s)"
    # counted from when the client left, not from its request: how many steps the engine got through in
    # the fifth of a reply the client waited is the machine's load of the moment (262 of 400 under a stress)
    assert after_steps < cap / 2 and left_steps < cap, \
        f"the engine took {after_steps} steps ({left_steps} in all) for a client that left (whole reply: {full_steps})"
    assert [c["status"] for c in calls] == [499] and calls[0]["error"] == "client disconnected"
    assert good_status == 200


def test_call_log_keeps_a_bounded_window_of_steps(stack):
    one_token = {**GOOD_CHAT, "max_completion_tokens": 1}

    async def go():
        async with stack() as s, aiohttp.ClientSession() as http:
            await post(http, s.model_url + CHAT, one_token, headers={ROLLOUT_HEADER: "s3.g0.r0.a0.c0"})
            for fake in range(CALL_LOG_STEPS + 4):  # made-up steps, far ahead
                await post(http, s.model_url + CHAT, one_token,
                           headers={ROLLOUT_HEADER: f"s{10**8 + fake}.g0.r0.a0.c0"})
            await post(http, s.model_url + CHAT, one_token, headers={ROLLOUT_HEADER: "s3.g0.r0.a0.c1"})
            held = len(s.model.calls.steps)
            taken = s.model.take_calls(3)
            late = await post(http, s.model_url + CHAT, one_token, headers={ROLLOUT_HEADER: "s3.g0.r0.a1.c0"})
            return held, taken, late[0], s.model.take_calls(3), s.model.calls

    held, taken, late_status, late, log = asyncio.run(go())
    assert held == CALL_LOG_STEPS
    assert [c["call"] for c in taken] == [1]  # step 3's first record was evicted while fakes arrived after it
    assert late_status == 200 and [c["attempt"] for c in late] == [1]  # a step may be taken again (async)
    # dropped: step 3's first record, then the 5 made-up steps written earliest
    assert log.dropped == 6 and len(log.steps) == CALL_LOG_STEPS - 1 and all(s > 3 for s in log.steps)


# ------------------------------------------------------------------------------- agent server
def run_row(cfg, **changes) -> dict:
    row = {**prompt_row(cfg, 0, 0), "_rowidx": 0, "_minirl": {"step": 0, "group": 0, "rollout": 0, "attempt": 0}}
    row["responses_create_params"]["max_output_tokens"] = 8
    for path, value in changes.items():  # "task.seed": [1]; a value of ... removes the key
        *parents, leaf = path.split(".")
        node = row
        for p in parents:
            node = node[p]
        if value is ...:
            node.pop(leaf)
        else:
            node[leaf] = value
    return row


AGENT_CASES = {  # name: (row changes or raw bytes, message fragment)
    "agent_ref_a_string": ({"agent_ref": "simple_agent"}, "agent_ref must be an object with a string name"),
    "agent_ref_without_name": ({"agent_ref": {}}, "agent_ref must be an object with a string name"),
    "minirl_block_missing_key": ({"_minirl.rollout": ...}, "_minirl.rollout must be a non-negative integer"),
    "minirl_block_negative": ({"_minirl.step": -1}, "_minirl.step must be a non-negative integer"),
    "minirl_block_a_list": ({"_minirl": [0, 0, 0, 0]}, "_minirl must be an object"),
    "task_without_seed": ({"task.seed": ...}, "task.seed must be an integer"),
    "seed_a_list": ({"task.seed": [1]}, "task.seed must be an integer"),
    "seed_a_bool": ({"task.seed": True}, "task.seed must be an integer"),
    "seed_a_string": ({"task.seed": "7"}, "task.seed must be an integer"),
    "num_rooms_zero": ({"task.num_rooms": 0}, "task.num_rooms must be in [1, 16]"),
    "num_rooms_negative": ({"task.num_rooms": -1}, "task.num_rooms must be in [1, 16]"),
    "num_rooms_a_string": ({"task.num_rooms": "2"}, "task.num_rooms must be an integer"),
    "num_rooms_above_max": ({"task.num_rooms": 20_000},
                            "task.num_rooms must be in [1, 16] (env.max_num_rooms), got 20000"),
    "input_a_string": ({"responses_create_params.input": "open the door"},
                       "responses_create_params.input must be a list"),
    "input_item_not_an_object": ({"responses_create_params.input": ["hi"]},
                                 "responses_create_params.input[0] must be an object"),
    "input_item_of_unknown_type": ({"responses_create_params.input": [{"type": "telepathy", "content": "7"}]},
                                   "responses_create_params.input[0]: unsupported input item type 'telepathy'"),
    "input_message_without_role": ({"responses_create_params.input": [{"type": "message", "content": "7"}]},
                                   "responses_create_params.input[0] lacks key 'role'"),
    "input_part_of_unknown_type": (
        {"responses_create_params.input": [{"type": "message", "role": "user", "content": [{"type": "audio"}]}]},
        "unsupported content part type 'audio'"),
    "tools_a_string": ({"responses_create_params.tools": "open_door"}, "responses_create_params.tools must be a list"),
    "sampling_seed_a_string": ({"responses_create_params.seed": "5"},
                               "responses_create_params.seed must be an integer"),
    # issue 29: Gym's per-request extras were read inside the episode, so a bad one answered 500 (INFRA)
    "extra_body_not_json": ({"responses_create_params.metadata": {"extra_body": "{"}},
                            "responses_create_params.metadata.extra_body must be a JSON object written as a string"),
    "extra_body_a_list": ({"responses_create_params.metadata": {"extra_body": "[1]"}},
                          "responses_create_params.metadata.extra_body must be a JSON object written as a string"),
    "extra_body_not_a_string": ({"responses_create_params.metadata": {"extra_body": {"seed": 1}}},
                                "responses_create_params.metadata.extra_body must be a JSON object written as a "
                                "string"),
    "extra_body_nested_too_deep": ({"responses_create_params.metadata": {"extra_body": deep()}},
                                   "responses_create_params.metadata.extra_body must be a JSON object"),
    "extra_body_seed_a_string": ({"responses_create_params.metadata": {"extra_body": '{"seed": "7"}'}},
                                 "responses_create_params.metadata.extra_body.seed must be an integer"),
    "metadata_a_string": ({"responses_create_params.metadata": "seed=7"},
                          "responses_create_params.metadata must be an object"),
    "json_nested_too_deep": (deep().encode(), "nests deeper"),
    "body_not_an_object": (b"[]", "must be a JSON object"),
    "body_not_json": (b"{", "not JSON"),
}


@pytest.mark.parametrize("case", list(AGENT_CASES))
def test_agent_server_refuses_a_bad_row_with_a_400_before_the_episode(stack, base_cfg, case):
    change, fragment = AGENT_CASES[case]

    async def go():
        async with stack() as s, aiohttp.ClientSession() as http:
            if isinstance(change, bytes):
                bad = await post(http, s.agent_url + "/run", raw=change)
            else:
                bad = await post(http, s.agent_url + "/run", run_row(base_cfg, **change))
            calls_after_bad = s.model.take_calls(0)
            good = await post(http, s.agent_url + "/run", run_row(base_cfg))
            return bad, calls_after_bad, good

    (status, body), calls, (good_status, good) = asyncio.run(go())
    assert status == 400, body
    assert fragment in body["error"], body
    assert body["type"] in ("BadRow", "BadCoordinates")
    assert calls == [], "a bad row started an episode"
    assert good_status == 200 and 0.0 <= good["reward"] <= 1.0


def test_a_7_8mb_row_gets_its_answer_while_both_servers_answer_health(stack, base_cfg):
    cfg = copy.deepcopy(base_cfg)
    huge = {"type": "message", "role": "user", "content": "door 7 , lamp3 red blue " * 325_000}  # 7.8 MB
    row = run_row(cfg)
    row["responses_create_params"]["input"].append(huge)
    size = len(json.dumps(row))
    assert 7_700_000 < size < cfg.agent.max_request_bytes

    async def go():
        async with stack(cfg) as s, aiohttp.ClientSession() as http:
            watch = HealthWatch([s.agent_url, s.model_url])
            await asyncio.sleep(0.2)
            t0 = time.perf_counter()
            result = await post(http, s.agent_url + "/run", row)
            took = time.perf_counter() - t0
            await asyncio.sleep(0.2)
            worst = await asyncio.to_thread(watch.stop)
            good = await post(http, s.agent_url + "/run", run_row(cfg))
            return result, took, worst, good

    (status, body), took, worst_health, (good_status, _) = asyncio.run(go())
    assert status == 200, body
    assert body["evidence"]["end_reason"] == "context_length" and body["evidence"]["capture_failed"]  # lane A
    assert took < 20, f"a 7.8 MB row took {took:.1f}s"
    assert worst_health < 1.0, f"/health took {worst_health:.2f}s while a 7.8 MB row was handled"
    assert good_status == 200
