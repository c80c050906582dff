"""The episode loop behind `POST /run`: Gym's `simple_agent`, and the compaction agent
(`simple_agent_with_compaction`) that compacts its history and guards its context before model calls.

Invariant: the response's output holds every item the episode produced, in order, with each model
call's token evidence on exactly one item; `evidence.capture_failed` is true iff some model call
produced no tokens, so the trainer masks that rollout; an error that keeps the agent from
returning (guard `raise`, a model error, a lost model server, an injected agent fault) propagates
as an exception.
"""

from __future__ import annotations

import asyncio

from minirl.agents import compaction
from minirl.agents.compaction import CompactionPolicy
from minirl.agents.compaction.summarize import segment_rewards
from minirl.agents.env import DoorsEnv, verify
from minirl.agents.episode import Episode, Evidence, ModelClient, ModelReply, prompt_identity
from minirl.agents.items import items_to_messages, new_id, reply_to_items
from minirl.config import AgentConfig, ContextHistoryConfig
from minirl.faults import FaultPlan, fault_site
from minirl.wire import SUMMARY_FAILED_SCORED, ContextGuardRejected, Coords, extra_body

__all__ = ["Episode", "Evidence", "InjectedAgentFault", "ModelClient", "ModelReply", "chat_tools", "run_episode"]


class InjectedAgentFault(RuntimeError):
    """An `agent_exception` fault: the agent crashes mid-episode."""


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
    """Run one `/run` row to completion; returns the row plus `response`, `reward` and `evidence`.

    Loop: [compact on schedule] -> [guard] -> model call -> tool calls -> ... -> verify. It ends when a
    reply is cut off (`finish_reason == "length"`), has no tool call, the environment is done, `max_steps`
    calls were made, the model server refused an over-long prompt (its reply carries no tokens), the
    guard rejected a call under `on_reject=end_episode`, or a compaction ended it (summarize:
    `max_compactions` reached, or a failed summary under `end_episode`). Any other model error is not
    absorbed, as in Gym's `simple_agent`: it fails the episode (HTTP 500, INFRA). The episode's state
    is an `Episode` (agents/episode.py); compaction runs through agents/compaction/'s policies.
    """
    ep = start_episode(row)
    ch = cfg.context_history
    policy = compaction.policy_for(ch) if cfg.name == "compaction_agent" and ch.enabled else None
    fault = fault_site(plan, ep.coords, row["task"]["num_rooms"])
    ep.fault = fault

    for call in range(cfg.max_steps):
        if not await _admit(ep, ch, policy, model, fault("guard_reject", call), call):
            break
        reply, items = await _call_model(ep, model, call)
        if fault("agent_exception", call):
            raise InjectedAgentFault(f"injected agent_exception after call {call} of {ep.coords.key}")
        if await _ended(ep, reply, items, tool_latency_s):
            break
        # no yield here: the next call goes out at once. When one engine step answers many episodes, an
        # extra yield held each episode's next call until every other answered episode had parsed its
        # reply, while the engine sat idle.
    return finish_episode(row, ep)


def start_episode(row: dict) -> Episode:
    """The episode of a `/run` row: its input as history, its tools and sampling, a fresh environment."""
    params = row["responses_create_params"]
    task = row["task"]
    coords = Coords.from_row(row)
    env = DoorsEnv(task["seed"], task["num_rooms"], task.get("env", "doors"))
    tools = chat_tools(params.get("tools", []))
    sampling = {k: params[k] for k in ("temperature", "top_p", "max_output_tokens") if k in params}
    sampling.update({k: v for k, v in extra_body(params).items() if k == "seed"})
    history = list(params["input"])
    return Episode(history=history, tools=tools, initial_len=len(history), prompt=prompt_identity(history, task, env),
                   sampling=sampling, coords=coords, env=env,
                   ev=Evidence(counters=dict.fromkeys(compaction.counter_names(), 0)))


def finish_episode(row: dict, ep: Episode) -> dict:
    """Verify the output and return the row with Gym's response, the reward and the evidence (with
    each accepted summary's next-segment score, when there is one)."""
    reward = verify(row["task"], ep.output)
    if ep.ev.count("summaries") or ep.ev.count("summaries_failed"):
        ep.ev.segment_rewards = segment_rewards(row["task"], ep.output)
    ended = ("length", "context_length", "guard_reject", "max_compactions", "summary_failed", SUMMARY_FAILED_SCORED)
    status = "incomplete" if ep.ev.end_reason in ended else "completed"
    # a cut reply and lane A are Gym's vllm_model's `max_output_tokens`; minirl's own ends keep their names
    reason = "max_output_tokens" if ep.ev.end_reason in ("length", "context_length") else ep.ev.end_reason
    response = {
        "id": new_id("resp"),
        "object": "response",
        "status": status,
        "output": ep.output,
        "incomplete_details": {"reason": reason} if status == "incomplete" else None,
    }
    return {**row, "response": response, "reward": reward, "evidence": ep.ev.as_dict()}


async def _admit(ep: Episode, ch: ContextHistoryConfig, policy: CompactionPolicy | None, model: ModelClient,
                 forced_reject: bool, call: int) -> bool:
    """Compact on schedule, then ask the guard. False ends the episode (a compaction that ends it, or
    a rejection under `on_reject=end_episode`); under `raise` a rejection raises `ContextGuardRejected`."""
    if policy is not None and compaction.scheduled(ch, call):
        await compaction.compact_episode(policy, ep, model)
    if ep.stopped:
        return False
    decision = await _guard(ep, ch, policy, model, forced_reject)
    if ep.stopped:  # the guard's early compaction ended it (decision compaction_ended): no rejection
        return False
    if decision == "admit_after_compaction":
        ep.prefix = None
    if decision != "reject":
        return True
    rejected = f"Context guard rejected model call at complete action boundary: step={call + 1} guards=max_total_tokens"
    if ch.guards.on_reject == "raise":
        raise ContextGuardRejected(rejected)
    ep.ev.capture_failed, ep.ev.end_reason = True, "guard_reject"
    ep.ev.errors.append(rejected)  # its `mask` event says the guard ended it, not an overflow (lane A's mask too)
    return False


async def _call_model(ep: Episode, model: ModelClient, call: int) -> tuple[ModelReply, list[dict]]:
    """One model call on the history; its items join the history and the output."""
    key = ep.call_key(call)
    sampling = {**ep.sampling, "seed": ep.sampling["seed"] + call} if "seed" in ep.sampling else ep.sampling
    reply = await model.chat(items_to_messages(ep.history), ep.tools, sampling, key, ep.prefix)
    ep.ev.calls += 1
    items = reply_to_items(reply.message, reply.evidence)
    ep.history += items
    ep.output += items
    return reply, items


async def _ended(ep: Episode, reply: ModelReply, items: list[dict], tool_latency_s: float) -> bool:
    """Run the reply's tool calls; True (with `end_reason` set) when the episode ends here."""
    if reply.evidence is None:
        ep.ev.capture_failed, ep.ev.end_reason = True, "context_length"
        ep.ev.errors.append(reply.error or "model call produced no tokens")
        return True
    ep.prefix = reply.evidence["prompt_token_ids"] + reply.evidence["generation_token_ids"]
    if reply.finish_reason == "length":
        ep.ev.end_reason = "length"
        return True
    tool_calls = [it for it in items if it["type"] == "function_call"]
    if not tool_calls:
        ep.ev.end_reason = "no_tool_call"
        return True
    for fc in tool_calls:
        if tool_latency_s > 0:
            await asyncio.sleep(tool_latency_s)  # env.tool_latency_s: a real tool's time outside the model
        obs = {"type": "function_call_output", "call_id": fc["call_id"],
               "output": ep.env.step(fc["name"], fc["arguments"])}
        ep.history.append(obs)
        ep.output.append(obs)
    if ep.env.done:
        ep.ev.end_reason = "env_done"
        return True
    return False


async def _guard(ep: Episode, ch: ContextHistoryConfig, policy: CompactionPolicy | None, model: ModelClient,
                 forced_reject: bool) -> str:
    """Gym's context guard (on while a policy compacts). Returns admit, admit_after_compaction,
    reject or compaction_ended, recorded in the evidence: compaction_ended when the early compaction
    of a rejected call ended the episode (summarize: `max_compactions` reached, or a failed summary
    under `end_episode*`), so the record says what the outcome is: that compaction's end, not a
    rejection (the controller counts `reject` records as guard rejections; `on_reject` never applies).

    `prompt_tokens` is the length of the prompt the call will send (`Episode.prompt_tokens`: the history
    with the last call's prompt + reply tokens spliced in, as the model server builds the call's prompt),
    what the engine sees. Upstream Gym's guard counts `/tokenize` of the messages alone, which differs
    when a reply is not in the template's canonical form (a re-serialised tool call, whitespace): it
    would admit a prompt over `max_total_tokens`, or reject one that fits."""
    limit = ch.guards.max_total_tokens if policy is not None else None
    if limit is None and not forced_reject:
        return "admit"
    reserved = ch.guards.reserved_generation_tokens
    record = {"call": ep.ev.calls, "limit": limit, "reserved": reserved}
    if forced_reject:
        decision = "reject"
        record["injected"] = True
    else:
        record["prompt_tokens"] = await ep.prompt_tokens(model)
        decision = "admit" if record["prompt_tokens"] + reserved <= limit else "reject"
        if decision == "reject" and ch.schedule.type == "turn_chunked_recency":
            # close the chunk now: compact ahead of schedule, then count again
            await compaction.compact_episode(policy, ep, model)
            after = await ep.prompt_tokens(model)  # the prefix is gone if the compaction rewrote the history
            record["prompt_tokens_after_compaction"] = after
            if ep.stopped:
                decision = "compaction_ended"
            elif after + reserved <= limit:
                decision = "admit_after_compaction"
    record["decision"] = decision
    ep.ev.guard.append(record)
    return decision
