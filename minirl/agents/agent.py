"""The episode loop behind `POST /run`: Gym's `simple_agent`, and the compaction agent
(`simple_agent_with_compaction`) that rewrites its history and guards its context before calls.

Loop: [compact on schedule] -> [guard] -> model call -> tool calls -> ... -> verify.
It ends when a reply is cut off (`finish_reason == "length"`), has no tool call, the environment is
done, `max_steps` calls were made, the model refused an over-long prompt (lane A: the overflow reply
carries no tokens), or the guard rejected a call under `on_reject=end_episode` (fix 2). Any other
model error is not absorbed, as in Gym's `simple_agent`: it fails the episode (HTTP 500, INFRA).

Invariant: the response's output holds every item the episode produced, in order, with each model
call's token evidence on exactly one item; `evidence.capture_failed` is true iff some model call
produced no tokens, so the trainer masks that rollout; an error that keeps the agent from
returning (guard `raise`, a model error, a lost model server, an injected agent fault) propagates
as an exception.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from minirl.agents import compaction
from minirl.agents.env import DoorsEnv, verify
from minirl.agents.items import items_to_messages, new_id, reply_to_items
from minirl.config import AgentConfig
from minirl.faults import FaultPlan, fault_site
from minirl.wire import ContextGuardRejected, Coords, extra_body


class InjectedAgentFault(RuntimeError):
    """An `agent_exception` fault: the agent crashes mid-episode."""


@dataclass
class ModelReply:
    """One model call's outcome. `evidence` is None when the call produced no tokens (lane A)."""

    message: dict
    finish_reason: str
    evidence: dict | None
    error: str | None = None


class ModelClient(Protocol):
    async def chat(
        self, messages: list[dict], tools: list[dict], params: dict, key: str, required_prefix: list[int] | None
    ) -> ModelReply: ...

    async def count_tokens(self, messages: list[dict], tools: list[dict]) -> int: ...


@dataclass
class Evidence:
    """What the agent saw and decided, returned beside the output for the controller's ledger."""

    calls: int = 0
    compactions: int = 0
    images_dropped: int = 0
    reasoning_dropped: int = 0
    guard: list[dict] = field(default_factory=list)
    capture_failed: bool = False
    end_reason: str = "max_steps"
    errors: list[str] = field(default_factory=list)


def chat_tools(tools: list[dict]) -> list[dict]:
    """Responses-style function tools -> chat-completions tools (`strict` dropped, as Gym's converter does)."""
    out = []
    for tool in tools:
        fn = tool.get("function") or {k: v for k, v in tool.items() if k not in ("type", "strict")}
        out.append({"type": "function", "function": fn})
    return out


async def run_episode(
    row: dict,
    cfg: AgentConfig,
    model: ModelClient,
    plan: FaultPlan | None = None,
    tool_latency_s: float = 0.0,
) -> dict:
    """Run one `/run` row to completion; returns the row plus `response`, `reward` and `evidence`."""
    params = row["responses_create_params"]
    task = row["task"]
    coords = Coords.from_row(row)
    env = DoorsEnv(task["seed"], task["num_rooms"])
    tools = chat_tools(params.get("tools", []))
    sampling = {k: params[k] for k in ("temperature", "top_p", "max_output_tokens") if k in params}
    sampling.update({k: v for k, v in extra_body(params).items() if k == "seed"})
    ch = cfg.context_history
    compacting = cfg.name == "compaction_agent" and ch.enabled

    history = list(params["input"])
    initial_len = len(history)
    output: list[dict] = []
    ev = Evidence()
    prefix: list[int] | None = None  # prompt + reply tokens of the last call, while history is unrewritten

    fault = fault_site(plan, coords, task["num_rooms"])

    for call in range(cfg.max_steps):
        if compacting and compaction.scheduled(ch, call):
            if _compact(history, ch, initial_len, ev):
                prefix = None
        decision = await _guard(history, tools, ch, compacting, model, fault("guard_reject", call), initial_len, ev)
        if decision == "admit_after_compaction":
            prefix = None
        if decision == "reject":
            names = "max_total_tokens"
            if ch.guards.on_reject == "raise":
                raise ContextGuardRejected(
                    f"Context guard rejected model call at complete action boundary: step={call} guards={names}"
                )
            ev.capture_failed, ev.end_reason = True, "guard_reject"
            break

        key = f"{coords.key}.c{call}" if coords else new_id("call")
        call_sampling = {**sampling, "seed": sampling["seed"] + call} if "seed" in sampling else sampling
        reply = await model.chat(items_to_messages(history), tools, call_sampling, key, prefix)
        ev.calls += 1
        items = reply_to_items(reply.message, reply.evidence)
        history += items
        output += items
        if fault("agent_exception", call):
            raise InjectedAgentFault(f"injected agent_exception after call {call} of {coords.key}")
        if reply.evidence is None:
            ev.capture_failed, ev.end_reason = True, "context_length"
            ev.errors.append(reply.error or "model call produced no tokens")
            break
        prefix = reply.evidence["prompt_token_ids"] + reply.evidence["generation_token_ids"]
        if reply.finish_reason == "length":
            ev.end_reason = "length"
            break
        tool_calls = [it for it in items if it["type"] == "function_call"]
        if not tool_calls:
            ev.end_reason = "no_tool_call"
            break
        for fc in tool_calls:
            if tool_latency_s > 0:
                await asyncio.sleep(tool_latency_s)  # env.tool_latency_s: a real tool's time outside the model
            obs = {"type": "function_call_output", "call_id": fc["call_id"], "output": env.step(fc["name"], fc["arguments"])}
            history.append(obs)
            output.append(obs)
        if env.done:
            ev.end_reason = "env_done"
            break
        await asyncio.sleep(0)

    reward = verify(task, output)
    status = "incomplete" if ev.end_reason in ("length", "context_length", "guard_reject") else "completed"
    response = {
        "id": new_id("resp"),
        "object": "response",
        "status": status,
        "output": output,
        "incomplete_details": {"reason": ev.end_reason} if status == "incomplete" else None,
    }
    return {**row, "response": response, "reward": reward, "evidence": ev.__dict__}


def _compact(history: list[dict], ch, initial_len: int, ev: Evidence) -> bool:
    result = compaction.compact(history, ch, initial_len)
    if result.changed:
        history[:] = result.items
        ev.compactions += 1
        ev.images_dropped += result.images_dropped
        ev.reasoning_dropped += result.reasoning_dropped
    return result.changed


async def _guard(history, tools, ch, compacting, model, forced_reject, initial_len, ev) -> str:
    """Gym's context guard. Returns admit, admit_after_compaction or reject (recorded in evidence)."""
    limit = ch.guards.max_total_tokens if compacting else None
    if limit is None and not forced_reject:
        return "admit"
    record = {"call": ev.calls, "limit": limit, "reserved": ch.guards.reserved_generation_tokens}
    if forced_reject:
        decision = "reject"
        record["injected"] = True
    else:
        need = await model.count_tokens(items_to_messages(history), tools) + ch.guards.reserved_generation_tokens
        record["prompt_tokens"] = need - ch.guards.reserved_generation_tokens
        decision = "admit"
        if need > limit:
            decision = "reject"
            if ch.schedule.type == "turn_chunked_recency":
                # close the chunk now: compact ahead of schedule, then count again
                _compact(history, ch, initial_len, ev)
                need = await model.count_tokens(items_to_messages(history), tools) + ch.guards.reserved_generation_tokens
                record["prompt_tokens_after_compaction"] = need - ch.guards.reserved_generation_tokens
                if need <= limit:
                    decision = "admit_after_compaction"
    record["decision"] = decision
    ev.guard.append(record)
    return decision
