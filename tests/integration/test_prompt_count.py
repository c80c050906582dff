"""The context guard and the summarizing trigger count the prompt the next call sends: the
model server's `/tokenize` takes the chat call's `required_prefix_token_ids` and splices it as the chat
path does, and the agent sends the episode's token prefix with each count, to the worker its calls go to.

A reply not in the chat template's canonical form (here a tool call written with extra whitespace, as an
untrained model may write it) keeps its generated tokens verbatim in the next call's prompt, while the
template re-renders the parsed call shorter: a count of the re-rendered messages is then not the length
of the prompt the engine sees.
"""

from __future__ import annotations

import asyncio
import copy
import socket
import zlib

import aiohttp

from test_agent import row
from test_bad_input import CHAT, post
from test_summarize import Scripted, enc, play, render, summarize_cfg

from minirl.agents.agent import chat_tools, run_episode
from minirl.agents.env import TOOLS, DoorsEnv
from minirl.agents.episode import ModelReply
from minirl.agents.items import items_to_messages, reply_to_items
from minirl.agents.model_client import HttpModelClient
from minirl.generation.chat_format import parse_reply


def spaced_reply(code: int) -> str:
    """A doors reply whose tool call is valid JSON but not the template's canonical serialisation."""
    return ('<think>door ' + str(code) + '</think><tool_call>{"name":    "open_door",      "arguments":'
            '    {"code":          ' + str(code) + '    }}</tool_call>')


class FirstReplySpaced:
    """The real model client, except that the first turn's reply is `spaced_reply` (its tokens on the real
    prompt the server built): every later call, and every count, goes to the real server."""

    def __init__(self, real: HttpModelClient, tokenizer, code: int):
        self.real, self.tokenizer, self.code = real, tokenizer, code
        self.messages: dict[str, list[dict]] = {}

    async def chat(self, messages, tools, params, key, required_prefix):
        self.messages[key] = copy.deepcopy(messages)
        reply = await self.real.chat(messages, tools, params, key, required_prefix)
        if not key.endswith(".c0"):
            return reply
        text = spaced_reply(self.code)
        gen = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        evidence = {"prompt_token_ids": reply.evidence["prompt_token_ids"], "generation_token_ids": gen,
                    "generation_log_probs": [0.0] * len(gen)}
        return ModelReply(parse_reply(text), "tool_calls", evidence)

    async def count_tokens(self, *args):
        return await self.real.count_tokens(*args)


def guarded(base_cfg, limit: int):
    cfg = copy.deepcopy(base_cfg)
    ch = cfg.agent.context_history
    ch.schedule.type, ch.schedule.actions_per_chunk = "turn_chunked_recency", 8  # no compaction: the prefix stays
    ch.guards.max_total_tokens, ch.guards.reserved_generation_tokens = limit, 0
    cfg.agent.max_steps = 3
    return cfg


def wrong_code(r: dict) -> int:
    env = DoorsEnv(r["task"]["seed"], r["task"]["num_rooms"], r["task"].get("env", "doors"))
    return (env.rooms[0].code + 1) % 10  # a wrong door: the episode goes on to call 1


def test_the_guard_counts_the_prompt_the_server_receives(stack, base_cfg, tokenizer):
    async def episode(cfg):
        async with stack(cfg) as s, aiohttp.ClientSession() as http:
            r = row(cfg)
            client = FirstReplySpaced(HttpModelClient([s.model_url], cfg.policy.model_name, http), tokenizer,
                                      wrong_code(r))
            result = await run_episode(r, cfg.agent, client)
            calls = {c["key"].rsplit(".", 1)[1]: c for c in s.model.take_calls(0)}
            # the call-1 messages as the template renders them, without the prefix (None: no call 1 was sent)
            messages = client.messages.get("s0.g0.r0.a0.c1")
            rendered = None if messages is None else len(s.model.render(messages, chat_tools(TOOLS)))
            return result, calls, rendered

    result, calls, rendered = asyncio.run(episode(guarded(base_cfg, 1000)))
    guard = result["evidence"]["guard"]
    assert [g["decision"] for g in guard] == ["admit"] * len(guard) and len(guard) >= 2
    for g in guard:  # each admitted call's count is the length of the prompt the server then received
        assert g["prompt_tokens"] == len(calls[f"c{g['call']}"]["prompt_token_ids"]), (g, calls.keys())
    sent = len(calls["c1"]["prompt_token_ids"])
    assert rendered < sent, "the spaced reply should re-render shorter than its generated tokens"

    # a limit the re-rendered messages fit and the prompt sent does not: the guard rejects the call
    result, calls, _ = asyncio.run(episode(guarded(base_cfg, sent - 1)))
    guard = result["evidence"]["guard"]
    assert [g["decision"] for g in guard] == ["admit", "reject"] and guard[1]["prompt_tokens"] == sent
    assert result["evidence"]["end_reason"] == "guard_reject" and sorted(calls) == ["c0"]


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_count_goes_to_the_worker_of_the_episodes_calls(stack, base_cfg):
    """Two generation workers, the first one down: an episode whose calls stick to the live one counts on
    it too (before, every count went to the first worker and failed the episode)."""
    cfg = guarded(base_cfg, 1000)
    urls = [dead_url(), None]
    group = next(g for g in range(64) if zlib.crc32(f"s0.g{g}.r0.a0".encode()) % 2 == 1)

    async def go():
        async with stack(cfg) as s, aiohttp.ClientSession() as http:
            urls[1] = s.model_url
            result = await run_episode(row(cfg, group=group), cfg.agent, HttpModelClient(urls, cfg.policy.model_name,
                                                                                         http))
            return result, s.model.take_calls(0)

    result, calls = asyncio.run(go())
    guard = result["evidence"]["guard"]
    assert guard and all(g["decision"] == "admit" and g["prompt_tokens"] > 0 for g in guard)
    assert len(calls) == result["evidence"]["calls"] >= 1
    assert [g["prompt_tokens"] for g in guard] == [len(c["prompt_token_ids"]) for c in calls]


def test_tokenize_with_a_required_prefix_is_the_chat_calls_prompt(stack, base_cfg, tokenizer):
    """`/tokenize` (chat form) with `required_prefix_token_ids` answers the tokens of the prompt the chat
    call with that prefix receives; a prefix the chat call refuses, `/tokenize` refuses with the same 400."""
    model = base_cfg.policy.model_name
    env = DoorsEnv(11, 2)
    tools = chat_tools(TOOLS)
    first = {"model": model, "messages": items_to_messages(env.initial_input()), "tools": tools,
             "max_completion_tokens": 4, "return_token_ids": True}

    async def go():
        async with stack() as s, aiohttp.ClientSession() as http:
            status, reply = await post(http, s.model_url + CHAT, first)
            assert status == 200
            text = spaced_reply(env.rooms[0].code)
            gen = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            prefix = reply["prompt_token_ids"] + gen
            history = env.initial_input() + reply_to_items(parse_reply(text), None)
            call = next(it for it in history if it["type"] == "function_call")
            history.append({"type": "function_call_output", "call_id": call["call_id"],
                            "output": env.step(call["name"], call["arguments"])})
            second = {"model": model, "messages": items_to_messages(history), "tools": tools}
            counted = await post(http, s.model_url + "/tokenize", {**second, "required_prefix_token_ids": prefix})
            plain = await post(http, s.model_url + "/tokenize", second)
            sent = await post(http, s.model_url + CHAT, {**second, "required_prefix_token_ids": prefix,
                                                         "max_completion_tokens": 2, "return_token_ids": True})
            eos = tokenizer.eos_token_id
            bad = {"not_a_list": "1 2", "no_end_of_turn": prefix[:-1], "more_turns": prefix + [eos] * 8,
                   "too_long": [0] * s.engine.max_model_len}
            refused = {}
            for name, p in bad.items():
                body = {**second, "required_prefix_token_ids": p}
                refused[name] = (await post(http, s.model_url + "/tokenize", body),
                                 await post(http, s.model_url + CHAT, {**body, "max_completion_tokens": 2}))
            return prefix, counted, plain, sent, refused

    prefix, (status, counted), (_, plain), (sent_status, sent), refused = asyncio.run(go())
    assert status == 200 and sent_status == 200, (counted, sent)
    assert counted["tokens"] == sent["prompt_token_ids"] and counted["count"] == len(sent["prompt_token_ids"])
    assert counted["tokens"][: len(prefix)] == prefix
    assert plain["count"] != counted["count"], "the spaced reply should re-render to another length"
    for name, ((t_status, t_body), (c_status, c_body)) in refused.items():
        assert t_status == c_status == 400 and t_body == c_body, (name, t_body, c_body)
        assert t_body["error"]["param"] == "required_prefix_token_ids", name
    assert "maximum context length" in refused["too_long"][0][1]["error"]["message"]


class Counting(Scripted):
    """The summarize tests' scripted model, recording what each count was asked with."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.counts: list[tuple] = []
        self.last_prefix: list[int] | None = None

    async def chat(self, messages, tools, params, key, required_prefix):
        reply = await super().chat(messages, tools, params, key, required_prefix)
        if tools:  # a turn call: the prefix the next turn call sends, while the history is only appended to
            self.last_prefix = reply.evidence["prompt_token_ids"] + reply.evidence["generation_token_ids"]
        return reply

    async def count_tokens(self, messages, tools, *args):
        self.counts.append((*args, self.last_prefix))
        return len(enc(render(messages)))


def test_the_summarize_trigger_counts_with_the_episodes_prefix_and_the_continuation_without():
    model = Counting()
    result = play(summarize_cfg(), model)
    assert result["evidence"]["summaries"] >= 1
    turns = [k for k in model.keys if ".c" in k]
    assert all(len(c) == 3 for c in model.counts), model.counts[:2]  # key, prefix, and the episode's last prefix
    # the trigger's count before each turn call after the first: that call's key, the episode's prefix
    befores = [(key, prefix) for key, prefix, last in model.counts if prefix is not None]
    assert len(befores) >= 2 and all(prefix == last for key, prefix, last in model.counts if prefix is not None)
    assert all(key in turns for key, _ in befores)
    # a count of a continuation (the history the accepted summary installs) goes without one
    afters = [key for key, prefix, _ in model.counts if prefix is None]
    marked = [it["compaction"] for it in result["response"]["output"] if it.get("compaction")]
    assert len(afters) >= len(marked) and all(key in turns for key in afters)
    # a count before every turn call but the first, on its key: the initial context alone is never summarized
    assert {key for key, _, _ in model.counts} == set(turns) - {turns[0]}
