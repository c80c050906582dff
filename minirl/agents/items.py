"""Conversions between OpenAI Responses items (what `/run` speaks) and chat messages (what the model
server speaks).

Invariant: `items_to_messages` is lossless for everything the model sees (media are flattened to
`<image>…</image>` text, reasoning to `reasoning_content`), and `reply_to_items` yields the items a
model call produced with the call's token evidence on exactly one of them (the last), so a consumer
that counts items carrying `generation_token_ids` counts model calls.
"""

from __future__ import annotations

import os

TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


def new_id(prefix: str) -> str:
    """`prefix` + "_" + the first 16 hex digits of a fresh uuid4 (its version nibble included),
    without building the UUID object: ~2 us instead of ~6, a few ids per model call."""
    head = bytearray(os.urandom(8))
    head[6] = (head[6] & 0x0F) | 0x40
    return f"{prefix}_{head.hex()}"


def parts_text(content) -> str:
    """Flatten a message's content (a string or a list of parts) to the text the model reads."""
    if isinstance(content, str):
        return content
    out = []
    for part in content:
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            out.append(part["text"])
        elif kind == "input_image":
            out.append("<image>" + part["image_url"].split(",", 1)[-1] + "</image>")
        else:
            raise ValueError(f"unsupported content part type {kind!r}")
    return "".join(out)


def reasoning_text(item: dict) -> str:
    parts = item.get("summary") or item.get("content") or []
    return "".join(p.get("text", "") for p in parts)


def items_to_messages(items: list[dict]) -> list[dict]:
    """Responses items -> chat messages.

    Consecutive assistant-side items (reasoning, assistant message, function calls) merge into one
    assistant message; the item that carries a call's token evidence closes it.
    """
    messages: list[dict] = []
    open_assistant = False

    def assistant() -> dict:
        nonlocal open_assistant
        if not open_assistant:
            messages.append({"role": "assistant", "content": ""})
            open_assistant = True
        return messages[-1]

    for item in items:
        kind = item.get("type", "message")
        if kind == "message" and item["role"] != "assistant":
            messages.append({"role": item["role"], "content": parts_text(item["content"])})
            open_assistant = False
        elif kind == "function_call_output":
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": parts_text(item["output"])}
            )
            open_assistant = False
        elif kind == "message":
            assistant()["content"] += parts_text(item["content"])
        elif kind == "reasoning":
            msg = assistant()
            msg["reasoning_content"] = msg.get("reasoning_content", "") + reasoning_text(item)
        elif kind == "function_call":
            assistant().setdefault("tool_calls", []).append(
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                }
            )
        else:
            raise ValueError(f"unsupported input item type {kind!r}")
        if "generation_token_ids" in item:
            open_assistant = False
    return messages


def reply_to_items(message: dict, evidence: dict | None) -> list[dict]:
    """One chat-completion reply -> its Responses output items, token evidence on the last one.

    An empty reply (the overflow case) still yields one empty assistant message, without tokens.
    """
    items: list[dict] = []
    if message.get("reasoning"):
        items.append(
            {
                "type": "reasoning",
                "id": new_id("rs"),
                "summary": [{"type": "summary_text", "text": message["reasoning"]}],
            }
        )
    if message.get("content") or not message.get("tool_calls"):
        items.append(
            {
                "type": "message",
                "id": new_id("msg"),
                "role": "assistant",
                "status": "completed",
                "content": [
                    {"type": "output_text", "text": message.get("content") or "", "annotations": []}
                ],
            }
        )
    for call in message.get("tool_calls") or []:
        items.append(
            {
                "type": "function_call",
                "id": new_id("fc"),
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    if evidence:
        items[-1].update({k: evidence[k] for k in TOKEN_FIELDS})
    return items
