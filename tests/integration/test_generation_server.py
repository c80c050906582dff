"""The model server's edges, over the session's real vLLM engine on loopback: every keyed call leaves a
record with the status its client got, even one refused before the server read it (a body over
`max_request_bytes`), and the client gets vLLM's JSON error body; the
headerless calls' bound counts what it evicts; `continue_final_message` and `add_generation_prompt`
render the prompt as vLLM renders it; a choice names the stop string or token that ended it (`stop_reason`);
a tool request goes through vLLM's hermes `adjust_request` (a forced choice's structural tag, special tokens
kept in the text)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from test_bad_input import CHAT, GOOD_CHAT, post

from minirl.wire import ROLLOUT_HEADER


def test_a_body_over_max_request_bytes_is_recorded_and_answered_as_vllm_does(engine, tokenizer, base_cfg):
    """aiohttp refuses the body with a 413 when the handler reads it. Before, that escaped the handler:
    the call's record had no status (nor error) and the client got aiohttp's text/plain 413."""
    from aiohttp.test_utils import TestServer

    from minirl.generation.server import ModelServer

    model = ModelServer(engine, tokenizer, base_cfg.policy.model_name)
    big = {"messages": [{"role": "user", "content": "x" * 5000}], "max_completion_tokens": 2}

    async def go():
        async with TestServer(model.app(max_request_bytes=2000)) as server, aiohttp.ClientSession() as http:
            url = str(server.make_url(""))
            chat = await post(http, url + CHAT, big, headers={ROLLOUT_HEADER: "s0.g0.r0.a0.c0"})
            tokenize = await post(http, url + "/tokenize", big)
            return chat, tokenize

    chat, tokenize = asyncio.run(go())
    for status, body in (chat, tokenize):
        assert status == 413 and body["error"]["type"] == "Request Entity Too Large", (status, body)
        assert body["error"]["code"] == 413 and "Maximum request body size 2000" in body["error"]["message"]
    (record,) = model.take_calls(0)
    assert record["status"] == 413 and record["error"] == chat[1]["error"]["message"], record


def test_headerless_records_the_bound_evicts_are_counted(stack, monkeypatch):
    """Before, the deque's bound evicted the oldest unkeyed record silently. They are counted apart from
    `dropped`, which the run's books read as keyed records no ledger took."""
    import minirl.generation.server as server

    monkeypatch.setattr(server, "UNKEYED_CALLS", 2)

    async def go():
        async with stack() as s, aiohttp.ClientSession() as http:
            answers = [await post(http, s.model_url + CHAT, {**GOOD_CHAT, "seed": i}) for i in range(3)]
            return answers, s.model.calls

    answers, calls = asyncio.run(go())
    assert [status for status, _ in answers] == [200, 200, 200]
    assert calls.unkeyed_dropped == 1 and calls.dropped == 0
    assert len(calls.take_unkeyed()) == 2
    assert calls.finish()["unkeyed_dropped"] == 1


def test_continue_final_message_and_no_generation_prompt_render_as_vllm_does(stack, tokenizer):
    """The prompt is the chat template's with the request's `add_generation_prompt` and
    `continue_final_message` (the final message left open for the model to continue), in /v1/chat/completions
    and /tokenize alike; the reply's role is the final message's without a generation prompt (vLLM's
    `get_chat_request_role`); both at once is vLLM's 400. Before, both fields were ignored: the final
    message was closed and a new assistant turn opened."""
    messages = [{"role": "user", "content": "open door 3"}, {"role": "assistant", "content": "I will open"}]
    cases = {"continue": (messages, {"add_generation_prompt": False, "continue_final_message": True}, True),
             "no_prompt": (messages[:1], {"add_generation_prompt": False}, False)}

    async def go():
        async with stack() as s, aiohttp.ClientSession() as http:
            out = {}
            for name, (msgs, fields, _) in cases.items():
                body = {"messages": msgs, "max_completion_tokens": 2, "return_token_ids": True, **fields}
                out[name] = (await post(http, s.model_url + CHAT, body),
                             await post(http, s.model_url + "/tokenize", {"messages": msgs, **fields}))
            both = {"messages": messages, "add_generation_prompt": True, "continue_final_message": True}
            out["both"] = await post(http, s.model_url + CHAT, both)
            return out

    out = asyncio.run(go())
    for name, (msgs, fields, cont) in cases.items():
        (status, reply), (tok_status, tokenized) = out[name]
        assert status == 200 and tok_status == 200, (reply, tokenized)
        expected = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False,
                                                 add_generation_prompt=False, continue_final_message=cont)
        assert reply["prompt_token_ids"] == tokenized["tokens"] == list(expected), name
        assert reply["choices"][0]["message"]["role"] == msgs[-1]["role"], name
    ends = tokenizer.decode(out["continue"][0][1]["prompt_token_ids"], skip_special_tokens=False)
    assert ends.endswith("assistant\nI will open"), ends[-40:]
    status, body = out["both"]
    assert status == 400 and body["error"]["message"] == (
        "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")


def test_a_request_the_engine_finishes_with_error_is_vllms_500(stack, tokenizer):
    """A request whose grammar (`structured_outputs`) allows none of its `allowed_token_ids`: vLLM's
    sampler draws from no allowed token, the grammar rejects what it drew, and the engine's scheduler
    ends the request with FinishReason.ERROR, the engine itself unharmed. `vllm serve` answers that 500
    (`_raise_if_error`: GenerationError, "Internal server error"). Before, minirl's server answered 200
    with `finish_reason: "error"` and a NaN logprob, and the agent took it as a reply. Now its body is
    vLLM's, the call is recorded failed with the engine's evidence, and the agent's model client reads
    it as a failed call of the fleet's (INFRA), as an injected `model_error`'s 500."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.exceptions import GenerationError

    from minirl.agents.model_client import HttpModelClient
    from minirl.wire import INFRA, classify

    (b,) = tokenizer.encode("b")
    bad = {"messages": [{"role": "user", "content": "open door 3"}], "max_completion_tokens": 4, "seed": 1,
           "structured_outputs": {"choice": ["a"]}, "allowed_token_ids": [b]}

    async def go():
        async with stack() as s, aiohttp.ClientSession() as http:
            failed = await post(http, s.model_url + CHAT, bad, headers={ROLLOUT_HEADER: "s0.g0.r0.a0.c0"})
            grammar_only = {k: v for k, v in bad.items() if k != "allowed_token_ids"}
            fine = await post(http, s.model_url + CHAT, grammar_only, headers={ROLLOUT_HEADER: "s0.g0.r0.a0.c1"})
            return failed, fine, s.model.take_calls(0)

    (status, body), (fine_status, fine), records = asyncio.run(go())
    assert status == 500 and body == create_error_response(GenerationError()).model_dump(), body
    assert body["error"] == {"message": "Internal server error", "type": "InternalServerError", "param": None,
                             "code": 500}
    assert fine_status == 200 and fine["choices"][0]["message"]["content"] == "a"  # the engine serves on
    failed = next(r for r in records if r["call"] == 0)
    assert failed["status"] == 500 and failed["error"] == "Internal server error", failed
    assert failed["finish_reason"] == "error" and len(failed["generation_token_ids"]) == 1, failed
    assert classify(HttpModelClient._error(status, body, "model call")) == INFRA


def test_stop_reason_names_the_stop_string_or_token_as_vllm_does(stack):
    """`vllm serve`'s choice carries vLLM's `stop_reason`: the stop string or `stop_token_ids` token that
    ended the reply, absent (None, dropped) when it ended otherwise. Before, minirl's choices never had it.
    One seeded reply run to its length, then the same request stopped at one of its tokens and at a piece of
    its text: the same tokens up to the stop, and the stop named."""
    body = {"messages": [{"role": "user", "content": "open door 3"}], "max_completion_tokens": 16, "seed": 5,
            "ignore_eos": True, "return_token_ids": True}

    async def go():
        async with stack() as s, aiohttp.ClientSession() as http:
            free = (await post(http, s.model_url + CHAT, body))[1]["choices"][0]
            ids, text = free["token_ids"], free["message"]["content"]
            token = ids[5]
            by_token = (await post(http, s.model_url + CHAT, {**body, "stop_token_ids": [token]}))[1]["choices"][0]
            stop = next(text[k:k + 3] for k in range(2, len(text)) if text.find(text[k:k + 3]) == k)  # text before it
            by_string = (await post(http, s.model_url + CHAT, {**body, "stop": [stop]}))[1]["choices"][0]
            return free, token, by_token, stop, by_string

    free, token, by_token, stop, by_string = asyncio.run(go())
    assert free["finish_reason"] == "length" and "stop_reason" not in free, free
    assert by_token["finish_reason"] == "stop" and by_token["stop_reason"] == token, by_token
    assert by_token["token_ids"] == free["token_ids"][:free["token_ids"].index(token) + 1]
    assert by_string["finish_reason"] == "stop" and by_string["stop_reason"] == stop, by_string
    assert by_string["message"]["content"] == free["message"]["content"].split(stop)[0] != ""


def test_a_forced_tool_choice_is_constrained_to_a_call_as_vllm_serve_does(stack):
    """`tool_choice: "required"` or a named function: `vllm serve --tool-call-parser hermes` constrains the
    reply with the hermes parser's structural tag, so it is a `<tool_call>` block of a listed function (with
    arguments of its schema when the function is `strict`), and says `finish_reason: tool_calls` for a
    required call (a named one keeps `stop`), `content: ""`. Before, minirl sent no constraint: the tiny
    model, trained to call `open_door`, answered a forced `lookup` as it answers an unconstrained `auto`,
    with no call of it."""
    tools = [{"type": "function", "function": {"name": "lookup", "strict": True, "parameters": {
        "type": "object", "properties": {"q": {"type": "integer"}}, "required": ["q"]}}}]
    body = {"messages": [{"role": "user", "content": "open door 3"}], "max_completion_tokens": 48, "seed": 2,
            "tools": tools}
    named = {"type": "function", "function": {"name": "lookup"}}
    loose = [{"type": "function", "function": {k: v for k, v in tools[0]["function"].items() if k != "strict"}}]

    async def go():  # auto with a function that is not strict: no constraint (a strict one gets vLLM's tag too)
        async with stack() as s, aiohttp.ClientSession() as http:
            return [(await post(http, s.model_url + CHAT, {**body, "tool_choice": c, "tools": t}))
                    for c, t in (("auto", loose), ("required", tools), (named, tools))]

    (auto_status, auto), (req_status, required), (named_status, by_name) = asyncio.run(go())
    assert auto_status == req_status == named_status == 200
    unforced = auto["choices"][0]["message"].get("tool_calls", [])
    assert all(c["function"]["name"] != "lookup" for c in unforced), auto  # the model's own habit
    for answer, finish in ((required, "tool_calls"), (by_name, "stop")):
        choice = answer["choices"][0]
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "lookup" and isinstance(
            json.loads(call["function"]["arguments"])["q"], int), choice
        assert choice["message"]["content"] == "" and choice["finish_reason"] == finish, choice


def test_a_tool_request_keeps_special_tokens_in_its_text_as_vllm_serve_does(stack, tokenizer):
    """vLLM's hermes parser decodes a tool request's reply with `skip_special_tokens=False` (a model whose
    tool tokens are special keeps them for the parser); a request without tools, or with `tool_choice:
    "none"`, keeps vLLM's default and skips them. Before, minirl skipped them in every reply. The reply is
    held to a special token (`<|im_start|>`) with `allowed_token_ids`."""
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    body = {"messages": [{"role": "user", "content": "open door 3"}], "max_completion_tokens": 3, "seed": 1,
            "ignore_eos": True, "allowed_token_ids": [special]}
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]

    async def go():
        async with stack() as s, aiohttp.ClientSession() as http:
            return [(await post(http, s.model_url + CHAT, {**body, **extra}))[1]["choices"][0]["message"]
                    for extra in ({"tools": tools}, {"tools": tools, "tool_choice": "none"}, {})]

    with_tools, none_chosen, without = asyncio.run(go())
    assert with_tools["content"] == "<|im_start|>" * 3, with_tools
    assert not none_chosen.get("content") and not without.get("content"), (none_chosen, without)  # skipped
