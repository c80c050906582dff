"""The hot path's shortcuts give what the slow path gave (issue 35 item 5), without an engine:

- `minirl.runtime.jsonio.loads` returns what `json.loads` returns or raises what it raises, on inputs
  msgspec refuses too; `dumps` parses back to the same value, and writes NaN as `json` does
  (msgspec would write null); its `all_finite` answers as a walk over every float, and
  `loads_body(raw, encoding)` as `loads` of the text decoded with errors replaced;
- the front end's chat completion (`ModelServer._response`, its per-token logprobs built as dicts)
  is exactly `ChatCompletionResponse(...).model_dump(exclude_none=True)` as built from vLLM's
  classes, for every logprob option the server honours;
- `ModelServer.render` (the template's text, then the Rust tokenizer stretch by stretch between the
  added tokens, `minirl.generation.segments`) gives the ids of
  `apply_chat_template(tokenize=True)`, on a short prompt and one past `INLINE_BYTES`.
"""

from __future__ import annotations

import json
import math

import pytest

from minirl.runtime import jsonio
from minirl.agents.agent import chat_tools
from minirl.agents.items import items_to_messages
from minirl.generation.engine import GenResult
from minirl.generation.server import ModelServer
from minirl.runtime.http_thread import INLINE_BYTES

ODD_JSON = [b'{"a": 1180591620717411303424}', b'{"a":1,"a":2}', b'[NaN, Infinity, -Infinity]', b'"\\ud800"', b"1e400",
            b'{"a": -0.0}', b"\xef\xbb\xbf{}", b" {} ", b"[1.0000000000000002]", b"-9223372036854775809", b"", b"{",
            b'{"a": 1} x', b"[" * 5000 + b"]" * 5000, '{"é": "\u2028"}'.encode(), b'"\\u00e9"']


def outcome(fn, raw):
    try:
        return "ok", fn(raw)
    except BaseException as exc:
        return type(exc), str(exc)


@pytest.mark.parametrize("raw", ODD_JSON, ids=range(len(ODD_JSON)))
def test_loads_is_json_loads(raw):
    mine, theirs = outcome(jsonio.loads, raw), outcome(json.loads, raw)
    assert repr(mine) == repr(theirs)  # repr: nan != nan


@pytest.mark.parametrize("encoding", ["utf-8", "latin-1"])
def test_loads_body_is_loads_of_the_replaced_text(encoding):
    """The model client's reply parsing: as `loads(resp.text(errors="replace"))` was, invalid UTF-8 included."""
    for raw in ODD_JSON + [b'"\xff"', b'{"a": "\xed\xa0\x80"}', '{"é": 1}'.encode("utf-16")]:
        assert repr(outcome(lambda r: jsonio.loads_body(r, encoding), raw)) == \
            repr(outcome(jsonio.loads, raw.decode(encoding, errors="replace")))


def test_dumps_round_trips_and_keeps_nan():
    value = {"ids": [1, 2**70], "lp": [-0.5, -9999.0], "text": "é\u2028\x00", "none": None, "nested": [{"a": True}]}
    assert json.loads(jsonio.dumps(value)) == value
    assert json.loads(jsonio.dumps({1: 2})) == json.loads(json.dumps({1: 2}))
    assert jsonio.dumps({"lp": [math.nan, math.inf]}, finite=False) == json.dumps({"lp": [math.nan, math.inf]}).encode()
    deep = {"none": None, "x": [[{"lp": (0.5, -math.inf)}]]}  # found however deep it sits
    assert jsonio.dumps(deep) == json.dumps(deep).encode()
    assert json.loads(jsonio.dumps({"s": "\ud800"})) == {"s": "\ud800"}  # msgspec refuses it: json's escape


def walked(obj) -> bool:
    """all_finite as first written: every float visited, one by one."""
    if isinstance(obj, float):
        return math.isfinite(obj)
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return all(walked(v) for v in items)


FLOATY = [[1.0, math.nan], [math.inf, -math.inf], [1e308, 1e308], [1e308, 1e308, math.nan], [2**2000, 1.0],
          [2**2000, -math.inf],
          [True, math.nan], [[math.nan]], ["a", math.inf], (1, 2, math.nan), [1, {"a": math.nan}], [], [-math.inf],
          [None, 0.5],
          {"lp": [-0.5] * 48, "ids": list(range(200)), "text": "null", "x": None},
          {"deep": [[{"lp": (0.5, math.nan)}]]}]


@pytest.mark.parametrize("value", FLOATY, ids=range(len(FLOATY)))
def test_all_finite_is_the_walk(value):
    """The sum shortcut and the type checks answer as visiting every float does, inside and outside containers."""
    for v in (value, {"x": [value]}, [value, 1.0]):
        assert jsonio.all_finite(v) is walked(v)


@pytest.fixture(scope="module")
def server(tokenizer, base_cfg):
    return ModelServer(None, tokenizer, base_cfg.policy.model_name)  # neither method below reaches the engine


def reference(server, body, req, prompt, result) -> dict:
    """The response as the front end built it before: from vLLM's protocol classes, dumped."""
    from vllm.entrypoints.generate.base.protocol import FunctionCall, ToolCall
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionLogProb, ChatCompletionLogProbs, ChatCompletionLogProbsContent,
        ChatCompletionNamedToolChoiceParam, ChatCompletionResponse, ChatCompletionResponseChoice, ChatMessage)
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    from minirl.generation.chat_format import parse_reply

    as_ids, k = req.return_tokens_as_token_ids, req.top_logprobs
    every = bool(req.logprob_token_ids) or k == -1

    def name(tok, text):
        return f"token_id:{tok}" if as_ids else (text if text is not None else server.tokenizer.decode([tok]))

    def top(entries):
        return [ChatCompletionLogProb(token=(t := name(tok, text)), logprob=max(lp, -9999.0),
                                      bytes=list(t.encode("utf-8", errors="replace")))
                for j, (tok, lp, text) in enumerate(entries) if every or (k is not None and j < k)]

    logprobs = ChatCompletionLogProbs(content=[
        ChatCompletionLogProbsContent(token=name(tok, text), logprob=max(lp, -9999.0),
                                      bytes=None if text is None else list(text.encode("utf-8", errors="replace")),
                                      top_logprobs=top(result.top[i] if result.top else [(tok, lp, text)]))
        for i, (tok, lp,
                text) in enumerate(zip(result.token_ids, result.logprobs, result.decoded))]) if req.logprobs else None
    tools = body.get("tools")
    parsed = parse_reply(result.text,
                         tools_enabled=bool(tools) and body.get("tool_choice", "auto" if tools else "none") != "none",
                         reasoning_parser=server.reasoning_parser)
    message = ChatMessage(role="assistant", content=parsed["content"], reasoning=parsed["reasoning"],
                          tool_calls=[ToolCall(id=tc["id"], function=FunctionCall(**tc["function"]))
                                      for tc in parsed["tool_calls"]])
    finish = "tool_calls" if parsed["tool_calls"] and result.finish_reason == "stop" else result.finish_reason
    if tools and (req.tool_choice == "required" or isinstance(req.tool_choice, ChatCompletionNamedToolChoiceParam)):
        # vLLM's parser: text besides the calls that is only whitespace is None; serving: `content or ""`, and
        # "tool_calls" only for a required call that stopped
        content = parsed["content"] if parsed["content"] and parsed["content"].strip() else None
        message = ChatMessage(role="assistant", content=content or "", reasoning=parsed["reasoning"],
                              tool_calls=message.tool_calls)
        finish = "tool_calls" if req.tool_choice == "required" and result.finish_reason == "stop" \
            else result.finish_reason
    choice = ChatCompletionResponseChoice(index=0, message=message, logprobs=logprobs, finish_reason=finish,
                                          stop_reason=result.stop_reason,
                                          token_ids=result.token_ids if req.return_token_ids else None)
    usage = UsageInfo(prompt_tokens=len(prompt), completion_tokens=len(result.token_ids),
                      total_tokens=len(prompt) + len(result.token_ids))
    return ChatCompletionResponse(
        model=req.model or server.model_name, choices=[choice], usage=usage,
        prompt_token_ids=result.prompt_token_ids if req.return_token_ids else None).model_dump(exclude_none=True)


REPLY = '<think>door 3?</think>Trying.<tool_call>{"name": "open_door", "arguments": {"code": 3}}</tool_call>'
OPTIONS = [
    # minirl's agents
    {"logprobs": True, "top_logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True},
    {"logprobs": True, "top_logprobs": 2},
    {"logprobs": True, "top_logprobs": -1},
    {"logprobs": True, "logprob_token_ids": [5, 7]},
    {"logprobs": True},
    {"logprobs": False, "return_token_ids": True},
    {},
]


@pytest.mark.parametrize("options", OPTIONS, ids=range(len(OPTIONS)))
@pytest.mark.parametrize("tools", [False, True, "required", "named"])
def test_response_is_vllm_classes_dump(server, tokenizer, options, tools):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    body = {"model": server.model_name, "messages": [{"role": "user", "content": "Room 1."}], **options}
    if tools:
        body["tools"] = [{"type": "function",
                          "function": {"name": "open_door",
                                       "parameters": {"type": "object", "properties": {"code": {}}}}}]
    if tools in ("required", "named"):  # a forced call
        body["tool_choice"] = "required" if tools == "required" else {"type": "function",
                                                                       "function": {"name": "open_door"}}
    req = ChatCompletionRequest.model_validate(body)
    ids = tokenizer(REPLY, add_special_tokens=False)["input_ids"]
    decoded = [tokenizer.decode([t]) for t in ids]
    decoded[1] = None  # a token the detokenizer left without text
    lps = [-0.25 * i for i in range(len(ids))]
    lps[2] = -math.inf  # clamped to -9999 as vLLM clamps it
    top = [[(t, lp, text), (t + 1, lp - 1.0, "x"), (t + 2, lp - 2.0, None)] for t, lp, text in zip(ids, lps, decoded)]
    for tops in (None, top):
        for finish, stop_reason in (("stop", None), ("length", None), ("stop", "</tool_call>"), ("stop", ids[-1])):
            result = GenResult([1, 2, 3], ids, lps, decoded, REPLY, finish, 0, 1, tops, stop_reason)
            mine, finite = server._response(body, req, [1, 2, 3], result)
            theirs = reference(server, body, req, [1, 2, 3], result)
            for d in (mine, theirs):  # fresh ids and the clock
                d.pop("id"), d.pop("created")
                for call in d["choices"][0]["message"].get("tool_calls", []):
                    call["id"] = "call"
            assert finite and json.loads(jsonio.dumps(mine)) == mine
            assert mine == theirs and list(mine) == list(theirs)
    nan = GenResult([1], ids[:1], [math.nan], decoded[:1], REPLY[:1], "length", 0, 0, None)
    assert server._response(body, req, [1], nan)[1] is (not req.logprobs)  # a NaN logprob: json writes it, as before


def test_render_ids_are_apply_chat_templates(server, tokenizer, base_cfg):
    from minirl.data import prompt_row

    params = prompt_row(base_cfg, 0, 3)["responses_create_params"]
    messages, tools = items_to_messages(params["input"]), chat_tools(params["tools"])
    turns = messages + [{"role": "assistant", "content": "Trying.", "reasoning_content": "door 3?",
                         "tool_calls": [{"id": "c1", "type": "function",
                                         "function": {"name": "open_door", "arguments": '{"code": 3}'}}]},
                        {"role": "tool", "tool_call_id": "c1", "content": "Room 2. " + "door7 lamp3 " * 2000}]
    for msgs in (messages, turns):
        expected = list(tokenizer.apply_chat_template(msgs, tools=tools, tokenize=True, add_generation_prompt=True,
                                                      return_dict=False))
        assert server.render(json.loads(json.dumps(msgs)), tools) == expected
    # the encode_batch branch ran
    assert len(tokenizer.apply_chat_template(turns, tools=tools, tokenize=False)) > INLINE_BYTES


def test_stretches_encode_as_the_whole_text(server, tokenizer):
    """Texts mixing every added token with spaces, newlines and non-ASCII around them: the
    stretch-by-stretch ids are the tokenizer's own, cached or not."""
    import random

    assert server.segments.split is not None  # the committed model's tokenizer qualifies
    rng = random.Random(0)
    pieces = [t.content for t in tokenizer.added_tokens_decoder.values()] + [
        " ", "  ", "\n", "\n\n", "Room 1.", "door7 ", "é", "<tool", "call>", "{\"code\": 3}", "\t", "’s", "lamp3\n"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 30)))
        assert server.segments.encode(text) == list(tokenizer(text, add_special_tokens=False)["input_ids"]), repr(text)


CALL = '<tool_call>{"name": "open_door", "arguments": {"code": 3}}</tool_call>'


@pytest.mark.parametrize("text", ["\n" + CALL, "  \n" + CALL + "\n", "Trying. " + CALL, "", "  ", "no call"])
@pytest.mark.parametrize("choice", [None, "auto", "none", "required", "named"])
def test_the_message_is_vllms_parser_and_serving(server, tokenizer, monkeypatch, text, choice):
    """The reply's message as `vllm serve --tool-call-parser hermes --enable-auto-tool-choice` (no reasoning
    parser) makes it: vLLM's own parser's `parse`, then serving's message rules (a forced choice says
    `content or ""`). Whitespace-only text besides the calls is None, an empty reply's content is ""."""
    from vllm.entrypoints.generate.base.protocol import ToolCall
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest, ChatMessage

    monkeypatch.setattr(server, "reasoning_parser", None)
    body = {"model": server.model_name, "messages": [{"role": "user", "content": "Room 1."}]}
    if choice is not None:
        body["tools"] = [{"type": "function", "function": {"name": "open_door", "parameters": {
            "type": "object", "properties": {"code": {}}}}}]
        body["tool_choice"] = choice if choice != "named" else {"type": "function", "function": {"name": "open_door"}}
    req = ChatCompletionRequest.model_validate(body)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    result = GenResult([1], ids, [0.0] * len(ids), [None] * len(ids), text, "stop", 0, 0, None)
    mine = server._response(body, req, [1], result)[0]["choices"][0]["message"]
    for call in mine.get("tool_calls", []):
        call["id"] = "call"

    parser = server.hermes(tokenizer, req.tools)
    _, content, calls = parser.parse(text, req, enable_auto_tools=True, model_output_token_ids=ids)
    forced = choice in ("required", "named")
    message = ChatMessage(role="assistant", content=(content or "") if forced else content,
                          tool_calls=[ToolCall(id="call", function=c) for c in calls or []])
    assert mine == message.model_dump(exclude_none=True), (mine, content, calls)


@pytest.mark.parametrize("parallel", [None, True, False])
def test_two_calls_in_one_reply_are_one_when_parallel_tool_calls_is_false(server, tokenizer, monkeypatch, parallel):
    """vLLM's serving keeps a reply's first tool call only when the request says `parallel_tool_calls: false`
    (`maybe_filter_parallel_tool_calls`, run here on vLLM's own choice); Gym rows carry the field. minirl
    returned every call (found by review)."""
    from vllm.entrypoints.generate.base.protocol import ToolCall
    from vllm.entrypoints.openai.chat_completion.protocol import (ChatCompletionRequest,
                                                                  ChatCompletionResponseChoice, ChatMessage)
    from vllm.entrypoints.serve.utils.tool_calls_utils import maybe_filter_parallel_tool_calls

    monkeypatch.setattr(server, "reasoning_parser", None)
    body = {"model": server.model_name, "messages": [{"role": "user", "content": "Room 1."}],
            "tools": [{"type": "function", "function": {"name": "open_door", "parameters": {
                "type": "object", "properties": {"code": {}}}}}]}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    req = ChatCompletionRequest.model_validate(body)
    text = CALL + "\n" + CALL.replace("3", "4")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    result = GenResult([1], ids, [0.0] * len(ids), [None] * len(ids), text, "stop", 0, 0, None)
    mine = server._response(body, req, [1], result)[0]["choices"][0]["message"]
    for call in mine.get("tool_calls", []):
        call["id"] = "call"
    _, content, calls = server.hermes(tokenizer, req.tools).parse(text, req, enable_auto_tools=True,
                                                                  model_output_token_ids=ids)
    choice = ChatCompletionResponseChoice(index=0, message=ChatMessage(
        role="assistant", content=content, tool_calls=[ToolCall(id="call", function=c) for c in calls]))
    theirs = maybe_filter_parallel_tool_calls(choice, req).message.model_dump(exclude_none=True)
    assert mine == theirs and len(mine["tool_calls"]) == (1 if parallel is False else 2), (mine, theirs)
