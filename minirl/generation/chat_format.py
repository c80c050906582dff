"""The chat format of minirl's tiny models: a Qwen2-style template and the reply parser.

A reply is `<think>…</think>` (optional), free text (optional), then `<tool_call>{json}</tool_call>`
blocks, then `<|im_end|>`. The server parses replies the way vLLM's hermes tool parser and its
think-tag reasoning parser do, so a standard OpenAI client gets `tool_calls` and `reasoning`.

Message content sent as a list of parts (as Gym's `vllm_model` sends it) is flattened the way
vLLM flattens it for a text-only chat template (`normalize_content`), before the template runs.

Invariant: for a reply in canonical form, rendering the parsed message back through the template
reproduces the reply's text exactly (`render(parse(text)) == text`), so a history that is not
rewritten re-renders as a prefix of the next prompt; and list content renders exactly as the
string `normalize_content` makes of it.
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
    "{% if tc.function.arguments is string %}{{ tc.function.arguments }}{% else %}{{ tc.function.arguments | tojson }}{% endif %}"
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
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}


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
                    f"this model reads images only as text stand-ins ({IMAGE_TEXT_PREFIX}…); got an image part with url {str(url)[:80]!r}"
                )
            texts.append("<image>" + url[len(IMAGE_TEXT_PREFIX):] + "</image>")
        else:
            raise ValueError(f"Unsupported chat content part type: {kind!r}. Supported types: image_url, input_image, {', '.join(_TEXT_PARTS)}.")
    return "\n".join(texts)


_THINK = re.compile(r"^\s*<think>(.*?)</think>", re.DOTALL)
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_reply(text: str, tools_enabled: bool = True, reasoning_parser: str | None = "think") -> dict:
    """Reply text -> `{"content", "reasoning", "tool_calls"}` (OpenAI message fields).

    A `<tool_call>` block that is not valid JSON with a `name` stays in `content`, as vLLM's
    hermes parser leaves it. With `reasoning_parser=None` (`vllm serve` without
    `--reasoning-parser`) a `<think>` block stays in `content` and `reasoning` is None.
    """
    reasoning = None
    m = _THINK.match(text) if reasoning_parser else None
    if m:
        reasoning = m.group(1)
        text = text[m.end():]
    tool_calls = []
    if tools_enabled:
        rest = []
        pos = 0
        for call in _TOOL_CALL.finditer(text):
            try:
                obj = json.loads(call.group(1))
                name, args = obj["name"], obj.get("arguments", {})
                if not isinstance(name, str):
                    raise TypeError
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
            rest.append(text[pos:call.start()])
            pos = call.end()
            tool_calls.append(
                {
                    "id": f"call_{uuid.uuid4().hex[:16]}",
                    "type": "function",
                    "function": {
                        "name": name,
                        "arguments": args if isinstance(args, str) else json.dumps(args),
                    },
                }
            )
        rest.append(text[pos:])
        text = "".join(rest)
    return {"content": text or None, "reasoning": reasoning, "tool_calls": tool_calls}


def splice_prefix(prefix: list[int], rendered: list[int], eos_id: int) -> list[int] | None:
    """Keep the exact tokens of earlier turns: `prefix` (last prompt + reply) + the new tail.

    Re-tokenizing a rendered history need not reproduce the tokens the model generated, which
    would break the trace. The reply ends with EOS; the new turn starts right after the same
    number of EOS tokens in the re-rendered prompt. Returns None when the structure does not line
    up (then the caller uses `rendered` as is, and the call starts a new trace).
    """
    if not prefix or prefix[-1] != eos_id:
        return None
    want = prefix.count(eos_id)
    seen = 0
    for pos, tok in enumerate(rendered):
        if tok == eos_id:
            seen += 1
            if seen == want:
                return prefix + rendered[pos + 1 :]
    return None
