"""The chat format of minirl's tiny models: a Qwen2-style template and the reply parser.

A reply is `<think>…</think>` (optional), free text (optional), then `<tool_call>{json}</tool_call>`
blocks, then `<|im_end|>`. The server parses replies the way vLLM's hermes tool parser
(`Hermes2ProToolParser.extract_tool_calls`, `parse_reply`) and its think-tag reasoning parser do,
so a standard OpenAI client gets `tool_calls` and `reasoning`: all blocks become calls or none do
(one block that fails leaves the whole text in `content`), `content` is the text before the first
`<tool_call>`, and a call's `arguments` is `json.dumps(arguments, ensure_ascii=False)`.
(tests/integration/test_model_build.py runs vLLM's parser beside `parse_reply`.)

Invariant: for a reply in canonical form (each block `{"name": "…", "arguments": …}` with its
arguments as `json.dumps(…, ensure_ascii=False)` prints them, non-ASCII text unescaped, and nothing
after the last block), rendering the parsed message back through the template reproduces the
reply's text exactly (`render(parse(text)) == text`), so a history that is not rewritten
re-renders as a prefix of the next prompt; and list content renders exactly as the string
`normalize_content` makes of it.
"""

from __future__ import annotations

import json
import re
import uuid

# tools render compactly as `name(arg, ...)`: a tiny model needs no JSON schema to read
_TOOLS = (
    "<tools>{% for t in tools %}{% set f = t.function or t %}"
    "{{ f.name }}({{ (f.parameters or {}).properties | default({}) | join(', ') }}){% endfor %}</tools>"
)
CHAT_TEMPLATE = (
    "{% if tools and (not messages or messages[0].role != 'system') %}"
    "<|im_start|>system\n" + _TOOLS + "<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'system' %}"
    "{{ m.content }}{% if tools %}{{ '\\n' }}" + _TOOLS + "{% endif %}"
    "{% elif m.role == 'assistant' %}"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content or '' }}"
    "{% for tc in (m.tool_calls or []) %}"
    '<tool_call>{"name": "{{ tc.function.name }}", "arguments": '
    "{% if tc.function.arguments is string %}{{ tc.function.arguments }}"
    "{% else %}{{ tc.function.arguments | tojson }}{% endif %}"
    "}</tool_call>"
    "{% endfor %}"
    "{% else %}"
    "{{ m.content }}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<image>", "</image>"]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

IMAGE_TEXT_PREFIX = "data:text/plain,"
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
               "thinking": "thinking"}


def normalize_content(content):
    """A message's content as the chat template reads it: vLLM's rules (renderers/chat_utils.py).

    None becomes ""; a string stays as is; a list of parts becomes its parts' strings joined with
    "\n". Text parts (`text`, `input_text`, `output_text`, `refusal`, `thinking`) give their text
    (a part whose text is null is skipped, as vLLM skips it). Image parts (`image_url`,
    `input_image`) are rendered in this model's own format, `<image>…</image>`, in place: the
    model reads an image as text, so only a text stand-in (`data:text/plain,…`) can be shown; any
    other image is refused (ValueError), as vLLM refuses an image for a text-only model. Any other
    part type is refused with vLLM's message.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            text = part.get(_TEXT_PARTS[kind])
            if text is not None:
                texts.append(text)
        elif kind in ("image_url", "input_image"):
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url.startswith(IMAGE_TEXT_PREFIX):
                raise ValueError(
                    f"this model reads images only as text stand-ins ({IMAGE_TEXT_PREFIX}…); "
                    f"got an image part with url {str(url)[:80]!r}"
                )
            texts.append("<image>" + url[len(IMAGE_TEXT_PREFIX):] + "</image>")
        else:
            raise ValueError(f"Unsupported chat content part type: {kind!r}. "
                             f"Supported types: image_url, input_image, {', '.join(_TEXT_PARTS)}.")
    return "\n".join(texts)


def _strings(value) -> int:
    """Characters in every string inside a JSON value, keys included: no more than `str(value)`
    holds, so a lower bound on what the template prints for it (iterative: any nesting depth)."""
    n, todo = 0, [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            n += len(v)
        elif isinstance(v, dict):
            n += sum(len(k) for k in v if isinstance(k, str))
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
    return n


def _content_chars(content) -> int:
    if isinstance(content, list):  # the parts' text, as `normalize_content` joins it
        keys = (_TEXT_PARTS.get(p.get("type")) if isinstance(p, dict) and isinstance(p.get("type"), str) else None
                for p in content)
        return sum(_strings(p.get(k)) for p, k in zip(content, keys) if k is not None)
    return _strings(content) if isinstance(content, str) else 0


def rendered_chars(messages: list, tools: list | None) -> int:
    """A lower bound on the length of the text CHAT_TEMPLATE renders from `messages` and `tools`,
    counted without rendering: every field the template prints (each message's role and content;
    an assistant's reasoning and its tool calls' names and arguments; each tool's name and
    parameter names), never one it skips (a tool's description, a field the template does not
    read). A value that is not a string is printed as its `str()`, which holds at least its strings.
    So the server can refuse a prompt too long to tokenize before the template runs."""
    n = 0
    for m in messages if isinstance(messages, list) else ():
        if not isinstance(m, dict):
            continue
        n += _strings(m.get("role")) + _content_chars(m.get("content"))
        if m.get("role") == "assistant":
            n += _strings(m["reasoning_content"] if "reasoning_content" in m else m.get("reasoning"))
            calls = m.get("tool_calls")
            for call in calls if isinstance(calls, list) else ():
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict):
                    n += _strings(fn.get("name")) + _strings(fn.get("arguments"))
    for t in tools if isinstance(tools, list) and tools else ():
        f = (t.get("function") or t) if isinstance(t, dict) else None
        if not isinstance(f, dict):
            continue
        props = (f.get("parameters") or {}).get("properties") if isinstance(f.get("parameters") or {}, dict) else None
        n += _strings(f.get("name")) + (sum(len(k) for k in props) if isinstance(props, dict) else _strings(props))
    return n


_THINK = re.compile(r"^\s*<think>(.*?)</think>", re.DOTALL)
TOOL_CALL_START = "<tool_call>"
# vLLM's `Hermes2ProToolParser.tool_call_regex`: a closed block, or an unclosed one to the end of the text
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def _tool_calls(text: str) -> list[dict] | None:
    """Every `<tool_call>` block's call, as vLLM's `Hermes2ProToolParser.extract_tool_calls` reads
    them; None, as there, when any block fails (not JSON, not an object, no string `name`, no
    `arguments`). The arguments are `json.dumps(arguments, ensure_ascii=False)`, vLLM's string."""
    calls = []
    for closed, unclosed in _TOOL_CALL.findall(text):
        try:
            obj = json.loads(closed or unclosed)
            name, args = obj["name"], json.dumps(obj["arguments"], ensure_ascii=False)
        except (ValueError, KeyError, TypeError, IndexError, RecursionError):
            return None
        if not isinstance(name, str):  # vLLM's `FunctionCall(name=...)` refuses it
            return None
        calls.append({"id": f"call_{uuid.uuid4().hex[:16]}", "type": "function",
                      "function": {"name": name, "arguments": args}})
    return calls


def parse_reply(text: str, tools_enabled: bool = True, reasoning_parser: str | None = "think") -> dict:
    """Reply text -> `{"content", "reasoning", "tool_calls"}` (OpenAI message fields).

    The tool calls are vLLM's hermes parser's (`Hermes2ProToolParser.extract_tool_calls`): all
    `<tool_call>` blocks or none. When every block parses (`_tool_calls`; an unclosed last block
    counts), `content` is the text before the first `<tool_call>` and whatever follows the last
    block is dropped; when any block fails, there are no tool calls and the whole text is
    `content`. With `reasoning_parser=None` (`vllm serve` without `--reasoning-parser`) a
    `<think>` block stays in `content` and `reasoning` is None.
    """
    reasoning = None
    m = _THINK.match(text) if reasoning_parser else None
    if m:
        reasoning = m.group(1)
        text = text[m.end():]
    tool_calls = None
    if tools_enabled and TOOL_CALL_START in text:
        tool_calls = _tool_calls(text)
        if tool_calls is not None:
            text = text[:text.index(TOOL_CALL_START)]
    return {"content": text or None, "reasoning": reasoning, "tool_calls": tool_calls or []}


ASSISTANT_HEADER = "<|im_start|>assistant\n"


class PrefixMismatch(ValueError):
    """`required_prefix_token_ids` that are not the tokens of the messages' earlier turns."""


def splice_prefix(prefix: list[int], rendered: list[int], eos_id: int, decode) -> list[int]:
    """Keep the exact tokens of earlier turns: `prefix` (last prompt + reply) + the new tail.

    Re-tokenizing a rendered history need not reproduce the tokens the model generated, which
    would break the trace. The reply ends with EOS; the new turn starts right after the same
    number of EOS tokens in the re-rendered prompt.

    The prefix must be the messages' earlier turns: it ends with EOS, the messages render at least
    as many turns, and turn by turn (each ending at an EOS) the prefix's tokens equal the rendered
    ones, except where both are assistant turns (`decode(ids)` tells: they open with
    ASSISTANT_HEADER), whose generated tokens may re-tokenize differently, or re-render
    differently from a reply that was not in canonical form. Otherwise PrefixMismatch says where.
    """
    if not prefix or prefix[-1] != eos_id:
        raise PrefixMismatch(
            f"must end with the end-of-turn token {eos_id} (the last reply's), got {str(prefix[-1:])[:80]}")
    ends_p = [i for i, t in enumerate(prefix) if t == eos_id]
    ends_r = [i for i, t in enumerate(rendered) if t == eos_id]
    if len(ends_r) < len(ends_p):
        raise PrefixMismatch(f"holds {len(ends_p)} turns, but the messages render only {len(ends_r)}")

    def assistant(ids: list[int]) -> bool:
        return decode(ids[:16]).lstrip("\n").startswith(ASSISTANT_HEADER)

    start_p = start_r = 0
    for turn, (end_p, end_r) in enumerate(zip(ends_p, ends_r)):
        seg_p, seg_r = prefix[start_p:end_p + 1], rendered[start_r:end_r + 1]
        if seg_p != seg_r and not (assistant(seg_p) and assistant(seg_r)):
            raise PrefixMismatch(
                f"turn {turn} (tokens {start_p}-{end_p}) differs from the messages' turn {turn}, and they are not both "
                f"assistant turns: {decode(seg_p)[:80]!r} vs {decode(seg_r)[:80]!r}"
            )
        start_p, start_r = end_p + 1, end_r + 1
    return prefix + rendered[start_r:]
