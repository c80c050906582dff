"""List content (as Gym's `vllm_model` sends it) renders as vLLM renders it, identically for chat
completions and `/tokenize`."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from minirl.agents.agent import chat_tools
from minirl.agents.env import TOOLS
from minirl.generation.chat_format import normalize_content

PICTURE = "red blue\nlamp3\ndoor7"


def test_normalize_content_follows_vllm():
    parts = [{"type": "text", "text": "Room 1."},
             {"type": "image_url", "image_url": {"url": "data:text/plain," + PICTURE, "detail": "auto"}},
             {"type": "input_text", "text": "b"}, {"type": "text", "text": None}]
    assert normalize_content(parts) == f"Room 1.\n<image>{PICTURE}</image>\nb"
    assert normalize_content(None) == "" and normalize_content("x") == "x"
    with pytest.raises(ValueError, match="text stand-ins"):
        normalize_content([{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}])
    with pytest.raises(ValueError, match="Unsupported chat content part type: 'audio_url'"):
        normalize_content([{"type": "audio_url", "audio_url": {"url": "x"}}])


def test_list_content_renders_as_flattened_string_on_both_routes(stack):
    listed = [
        {"role": "system", "content": [{"type": "text", "text": "Open doors."}]},
        {"role": "user", "content": [{"type": "text", "text": "Room 1."},
                                     {"type": "image_url",
                                      "image_url": {"url": "data:text/plain," + PICTURE, "detail": "auto"}}]},
    ]
    flat = [{"role": m["role"], "content": normalize_content(m["content"])} for m in listed]
    tools = chat_tools(TOOLS)

    async def go():
        async with stack() as s, aiohttp.ClientSession() as http:
            async def post(path, body):
                async with http.post(s.model_url + path, json=body) as r:
                    return r.status, await r.json()
            _, tok_list = await post("/tokenize", {"messages": listed, "tools": tools})
            _, tok_flat = await post("/tokenize", {"messages": flat, "tools": tools})
            _, chat = await post("/v1/chat/completions",
                                 {"messages": listed, "tools": tools, "max_completion_tokens": 1,
                                                          "return_token_ids": True})
            web_image = [{"role": "user",
                          "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]
            refused = [(await post(path, {"messages": web_image}))[0] for path in ("/tokenize", "/v1/chat/completions")]
            return tok_list, tok_flat, chat, refused

    tok_list, tok_flat, chat, refused = asyncio.run(go())
    assert tok_list["tokens"] == tok_flat["tokens"] == chat["prompt_token_ids"]
    assert refused == [400, 400]


def test_reasoning_parser_switch(stack):
    from minirl.generation.chat_format import parse_reply

    text = "<think>door7</think><tool_call>{\"name\": \"open_door\", \"arguments\": {\"code\": 7}}</tool_call>"
    on, off = parse_reply(text), parse_reply(text, reasoning_parser=None)
    assert on["reasoning"] == "door7" and on["content"] is None
    assert (off["reasoning"] is None and off["content"] == "<think>door7</think>"
            and [c["function"] for c in off["tool_calls"]] == [c["function"] for c in on["tool_calls"]])

    messages = [{"role": "user", "content": "Room 1.<image>" + PICTURE + "</image>"}]

    async def go():
        async with stack() as s, aiohttp.ClientSession() as http:
            s.model.reasoning_parser = None
            body = {"messages": messages, "tools": chat_tools(TOOLS), "max_completion_tokens": 24, "seed": 0}
            async with http.post(s.model_url + "/v1/chat/completions", json=body) as r:
                return (await r.json())["choices"][0]["message"]

    message = asyncio.run(go())
    assert not message.get("reasoning") and "<think>" in (message.get("content") or "")
