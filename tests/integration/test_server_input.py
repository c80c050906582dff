"""The generation server against hostile or unusual input (issue 29), through a real generation
worker's front end: `FrontEnd` starts the HTTP front-end process over the session's real vLLM engine
and talks to it over ZMQ, as in training (no Ray needed for that).

- every field the chat template prints is counted before rendering, so a 10 MB tool name, role,
  tool-call name or parameter name is refused at once with vLLM's `input_text` 400, and `/health`
  stays fast meanwhile; a field the template does not print (a tool's description) is served;
- an unknown model name is vLLM's 404, naming the served path whole; `top_logprobs` and `logprob_token_ids` answer
  as vLLM does;
- a token id beyond 64 bits is vLLM's 400 naming its field, across the process boundary too;
- a `required_prefix_token_ids` that is not the messages' earlier turns is a 400 naming it, and the
  prefixes minirl's own agents send all pass;
- a temperature under vLLM's greedy threshold (1e-5) is greedy, as in vLLM.
"""

from __future__ import annotations

import asyncio
import copy
import json
import socket
import time

import aiohttp
import pytest

from test_bad_input import CHAT, GOOD_CHAT, HealthWatch, post, run_row

BIG = 10_000_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def front(engine, base_cfg):
    """A generation worker's real HTTP front end (its own process) over the session's engine: its URL."""
    from minirl.generation.frontend import FrontEnd

    return FrontEnd(engine, copy.deepcopy(base_cfg), 0, "127.0.0.1", free_port()).url


def ask(url: str, body: dict | None = None, path: str = CHAT, raw: bytes | None = None) -> tuple[int, dict]:
    async def go():
        async with aiohttp.ClientSession() as http:
            return await post(http, url + path, body, raw=raw)

    return asyncio.run(go())


def with_tool(name="open_door", params=("door",), description="open a door") -> dict:
    return {**GOOD_CHAT, "tools": [{"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {p: {"type": "integer"} for p in params}}}}]}


def assistant_call(name="open_door", arguments='{"door": 3}') -> dict:
    msgs = GOOD_CHAT["messages"] + [
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "locked"},
    ]
    return {**GOOD_CHAT, "messages": msgs}


# ------------------------------------------------------------------------------- the pre-render bound
def test_rendered_chars_is_a_lower_bound_on_the_template_text(tokenizer):
    from minirl.generation.chat_format import rendered_chars

    msgs = GOOD_CHAT["messages"]
    cases = [
        (msgs, GOOD_CHAT["tools"]),
        (msgs, None),
        (assistant_call()["messages"], GOOD_CHAT["tools"]),
        (assistant_call(arguments={"door": ["a", {"b": "c"}]})["messages"], None),
        ([{"role": "assistant", "content": "x", "reasoning": "why", "tool_calls": []}], None),
        ([{"role": "user", "content": "hi", "reasoning": "not printed for a user"}], None),
        ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_text", "text": "bc"}]}], None),
        ([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], with_tool("f", ("p", "qq"))["tools"]),
        (msgs, [{"type": "function", "function": {"name": "f", "parameters": {"properties": ["x", "yy"]}}}]),
    ]
    for messages, tools in cases:
        from minirl.generation.chat_format import normalize_content

        rendered_msgs = [dict(m, content=normalize_content(m.get("content"))) for m in copy.deepcopy(messages)]
        for m in rendered_msgs:
            if "reasoning" in m and "reasoning_content" not in m:
                m["reasoning_content"] = m.pop("reasoning")
        text = tokenizer.apply_chat_template(rendered_msgs, tools=tools, tokenize=False, add_generation_prompt=True)
        counted = rendered_chars(messages, tools)
        assert 0 < counted <= len(text), (messages, tools, counted, len(text))
    # a printed field counts in full; a skipped one (a tool's description) not at all
    assert rendered_chars(msgs,
                          with_tool(name="n" * 1000)["tools"]) - rendered_chars(
                              msgs, with_tool()["tools"]) == 1000 - len("open_door")
    assert rendered_chars(msgs,
                          with_tool(description="d" * 1000)["tools"]) == rendered_chars(msgs, with_tool()["tools"])


HUGE_FIELDS = {  # name: a request whose one field holds 10 MB of text
    "tool_name": lambda: with_tool(name="t" * BIG),
    "parameter_name": lambda: with_tool(params=("p" * BIG,)),
    "role": lambda: {**GOOD_CHAT, "messages": [{"role": "r" * BIG, "content": "hi"}]},
    "tool_call_name": lambda: assistant_call(name="f" * BIG),
    "tool_call_arguments": lambda: assistant_call(arguments="a" * BIG),
    "reasoning": lambda: {**GOOD_CHAT, "messages": GOOD_CHAT["messages"]
                          + [{"role": "assistant", "content": "x", "reasoning": "w" * BIG}]},
}


def test_10mb_in_any_printed_field_is_refused_at_once_while_health_answers(front):
    """Each refusal is well under a second (rendering and tokenizing one took 12-15 s), three at once
    too, and `/health` never slows past a second, so fleet health cannot quarantine the worker."""
    bodies = {name: json.dumps(make()).encode() for name, make in HUGE_FIELDS.items()}

    async def go():
        async with aiohttp.ClientSession() as http:
            watch = HealthWatch([front])
            await asyncio.sleep(0.2)
            one_by_one = {}
            for name, raw in bodies.items():
                t0 = time.perf_counter()
                one_by_one[name] = (*await post(http, front + CHAT, raw=raw), time.perf_counter() - t0)
            t0 = time.perf_counter()
            together = await asyncio.gather(*(post(http, front + CHAT, raw=bodies[n])
                                              for n in ("tool_name", "role", "parameter_name")))
            together_s = time.perf_counter() - t0
            await asyncio.sleep(0.2)
            worst = await asyncio.to_thread(watch.stop)
            return one_by_one, together, together_s, worst, await post(http, front + CHAT, GOOD_CHAT)

    one_by_one, together, together_s, worst_health, (good_status, _) = asyncio.run(go())
    for name, (status, body, took) in one_by_one.items():
        assert status == 400 and body["error"]["param"] == "input_text", (name, status, str(body)[:300])
        assert ("maximum context length is 1024 tokens" in body["error"]["message"]
                and "characters" in body["error"]["message"]), name
        assert took < 1.0, f"{name}: refused after {took:.2f}s"
    assert [s for s, _ in together] == [400, 400, 400] and together_s < 2.0, together_s
    assert worst_health < 1.0, f"/health took {worst_health:.2f}s while 10 MB fields were refused"
    assert good_status == 200


def test_a_field_the_template_does_not_print_is_served(front):
    """A 2 MB tool description is never rendered, so vLLM would serve the request: so does minirl."""
    status, body = ask(front, with_tool(description="d" * 2_000_000))
    assert status == 200, str(body)[:300]


# ------------------------------------------------------------------------------- vLLM's answers
def test_an_unknown_model_is_vllms_404_and_the_served_one_or_none_is_served(front, base_cfg):
    served = base_cfg.policy.model_name
    chat_unknown = ask(front, {**GOOD_CHAT, "model": "gpt-nope"})
    tok_unknown = ask(front, {"model": "gpt-nope", "prompt": "door 7"}, path="/tokenize")
    named, unnamed = ask(front, {**GOOD_CHAT, "model": served}), ask(front, GOOD_CHAT)
    # vLLM's wording, with the served path whole (vLLM's sanitize_message would print `<path>` from a
    # clone under /tmp or /home) and the trailing parts it also answers to (issue 49 LOW, issue 51 item 4)
    message = (f"The model `gpt-nope` does not exist. Valid aliases: {served}, or a trailing part of that path "
               "(models/tiny-doors, tiny-doors).")
    for status, body in (chat_unknown, tok_unknown):
        assert status == 404, body
        assert body["error"] == {"message": message, "type": "NotFoundError", "param": "model", "code": 404}
    assert named[0] == unnamed[0] == 200 and named[1]["model"] == unnamed[1]["model"] == served


def test_what_vllm_would_do_and_minirl_does_not_is_a_400_naming_it(front):
    """vLLM's server refuses a request's own chat template (without --trust-request-chat-template), and runs
    beam search, prompt logprobs, prompt truncation and `include_reasoning: false`; minirl's served them all
    with 200, silently ignoring each (found by review). Now each is a 400: the template vLLM's, the others
    naming their field."""
    template = "Chat template is passed with request, but --trust-request-chat-template is not set. " \
               "Refused request with untrusted chat template."
    for extra in ({"chat_template": "{{ messages }}"}, {"chat_template_kwargs": {"chat_template": "x"}}):
        for path, body in ((CHAT, {**GOOD_CHAT, **extra}), ("/tokenize", {"messages": GOOD_CHAT["messages"], **extra})):
            status, answer = ask(front, body, path=path)
            assert status == 400 and answer["error"]["message"] == template, (path, extra, answer)
    for field, value in (("use_beam_search", True), ("prompt_logprobs", 1), ("truncate_prompt_tokens", 5),
                         ("include_reasoning", False)):
        status, answer = ask(front, {**GOOD_CHAT, field: value})
        assert status == 400 and answer["error"]["param"] == field, (field, answer)
        assert answer["error"]["message"].startswith(f"minirl's model server does not do {field}="), answer
    served = {**GOOD_CHAT, "chat_template_kwargs": {}, "use_beam_search": False, "include_reasoning": True}
    assert ask(front, served)[0] == 200


def test_top_logprobs_20_gives_20_per_token_sampled_first_as_vllm_orders_them(front):
    status, body = ask(front, {**GOOD_CHAT, "logprobs": True, "top_logprobs": 20, "max_completion_tokens": 6, "seed": 3,
                               "return_tokens_as_token_ids": True, "return_token_ids": True})
    assert status == 200, body
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == len(body["choices"][0]["token_ids"]) >= 1
    for entry in content:
        top = entry["top_logprobs"]
        assert len(top) == 20
        # vLLM: the sampled token first
        assert top[0]["token"] == entry["token"] and top[0]["logprob"] == entry["logprob"]
        rest = [t["logprob"] for t in top[1:]]
        assert rest == sorted(rest, reverse=True) and len({t["token"] for t in top}) == 20


def test_logprob_token_ids_is_accepted_as_vllm_accepts_it(front):
    base = {**GOOD_CHAT, "logprobs": True, "max_completion_tokens": 6, "seed": 3, "return_tokens_as_token_ids": True}
    status, body = ask(front, {**base, "logprob_token_ids": [5, 6]})
    plain_status, plain = ask(front, base)
    assert status == plain_status == 200, body
    content, plain_content = body["choices"][0]["logprobs"]["content"], plain["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [c["token"] for c in plain_content]  # the same draw
    assert [c["logprob"] for c in content] == pytest.approx([c["logprob"] for c in plain_content], abs=1e-5)
    for entry in content:
        tokens = [t["token"] for t in entry["top_logprobs"]]
        assert tokens[0] == entry["token"] and {"token_id:5", "token_id:6"} <= set(tokens)
        assert len(tokens) == len({entry["token"], "token_id:5", "token_id:6"})
    refused = ask(front, {**GOOD_CHAT, "logprob_token_ids": [5]})  # vLLM's own check: needs logprobs=true
    assert refused[0] == 400 and refused[1]["error"]["param"] == "logprob_token_ids"


@pytest.mark.parametrize("field, value", [
    ("stop_token_ids", [2**70]), ("allowed_token_ids", [2**70]), ("logit_bias", {str(2**70): 1.0}),
    ("logprob_token_ids", [2**70]), ("required_prefix_token_ids", [2**70]),
])
def test_a_token_id_beyond_64_bits_is_a_400_naming_its_field(front, field, value):
    extra = {"logprobs": True} if field == "logprob_token_ids" else {}
    status, body = ask(front, {**GOOD_CHAT, field: value, **extra})
    assert status == 400, body
    assert body["error"]["param"] == field and str(2**70) in body["error"]["message"], body
    assert ask(front, GOOD_CHAT)[0] == 200


def test_a_temperature_below_vllms_greedy_threshold_is_greedy(front):
    """vLLM treats a temperature under 1e-5 (`_SAMPLING_EPS`) as greedy; so does the server, which
    builds vLLM's own SamplingParams. At temperature 1 the seeds draw differently, so the equality is
    not a coincidence of a peaked model."""
    def tokens(temperature: float, seed: int) -> list[int]:
        status, body = ask(front, {**GOOD_CHAT, "temperature": temperature, "seed": seed, "max_completion_tokens": 16,
                                   "ignore_eos": True, "return_token_ids": True})
        assert status == 200, body
        return body["choices"][0]["token_ids"]

    greedy = tokens(0.0, 0)
    assert all(tokens(1e-6, seed) == greedy for seed in (1, 2, 3))
    assert len({tuple(tokens(1.0, seed)) for seed in (1, 2, 3)}) > 1


# ------------------------------------------------------------------------------- required_prefix_token_ids
def test_a_prefix_that_is_not_the_messages_earlier_turns_is_a_400(front, tokenizer):
    first = {**GOOD_CHAT, "max_completion_tokens": 64, "seed": 0, "return_token_ids": True}
    status, reply = ask(front, first)
    assert status == 200
    prompt, gen = reply["prompt_token_ids"], reply["choices"][0]["token_ids"]
    assert gen[-1] == tokenizer.eos_token_id, "the first reply should end its turn"
    prefix = prompt + gen
    msg = reply["choices"][0]["message"]
    history = GOOD_CHAT["messages"] + [{"role": "assistant", "content": msg.get("content") or "",
                                        "reasoning": msg.get("reasoning"),
                                        "tool_calls": msg.get("tool_calls") or []},
                                       {"role": "user", "content": "door 4"}]
    second = {**GOOD_CHAT, "messages": history, "return_token_ids": True}
    eos = tokenizer.eos_token_id
    other = tokenizer.encode("something else entirely")
    cases = {
        "no_end_of_turn": prefix[:-1],
        "more_turns_than_the_messages": prefix + [eos] * 8,
        "a_user_turn_differs": other + prefix[prefix.index(eos):],
    }
    answers = {name: ask(front, {**second, "required_prefix_token_ids": p}) for name, p in cases.items()}
    spliced = ask(front, {**second, "required_prefix_token_ids": prefix})
    for name, (status, body) in answers.items():
        assert status == 400, (name, body)
        assert body["error"]["param"] == "required_prefix_token_ids", name
        assert "required_prefix_token_ids does not match the messages" in body["error"]["message"], name
    assert spliced[0] == 200 and spliced[1]["prompt_token_ids"][: len(prefix)] == prefix


def test_the_prefixes_minirls_agents_send_all_match(stack, base_cfg):
    """Whole multi-turn episodes through the agent server at temperature 1 (replies in any form, not
    only the canonical one): every call of every episode is served, none refused by the prefix check."""
    cfg = copy.deepcopy(base_cfg)

    async def go():
        async with stack(cfg) as s, aiohttp.ClientSession() as http:
            results = []
            for seed in range(6):
                row = run_row(cfg)
                row["task"]["seed"] = 100 + seed
                row["responses_create_params"]["max_output_tokens"] = 48
                row["_minirl"]["rollout"] = seed
                results.append(await post(http, s.agent_url + "/run", row))
            return results, s.model.take_calls(0)

    results, calls = asyncio.run(go())
    assert all(status == 200 for status, _ in results), results
    assert sum(r["evidence"]["calls"] for _, r in results) >= 8, "too few multi-turn calls to judge"
    assert calls and all(c["status"] == 200 for c in calls), [c.get("error") for c in calls if c["status"] != 200]
