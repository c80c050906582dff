"""Summarizing compaction (issue 30 items 2, 3, 4, 7): `agent.context_history.policy.type=summarize`.

Two halves:
- a scripted model through the real agent loop (`run_episode`, the real policy, `parse_rollout`, the
  ledger), with a character-level "chat template" whose prompts extend each other exactly as a real
  one does, for the accepted path (the default tiny model never writes a summary block): the trigger,
  the handoff, the traces and their kinds, every accepted generated token trained exactly once, the
  recall metric, the resampling and trimming lanes and `max_compactions`;
- the real generation server and agent pool (`stack`, the shared vLLM engine and the default tiny
  model, whose replies never carry a block: every real attempt is `missing_block`) for the failure
  lanes, the seeded summary faults, the ledger retiring rejected attempts, the rollout manager's
  `summary_failed` branch and the metrics.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import re

import aiohttp
import pytest
from helpers import child_result

from minirl.agents.agent import ModelReply, run_episode
from minirl.agents.compaction.summarize import SUMMARY_KIND, threshold, trim_middle
from minirl.agents.compaction.summary_format import (HANDOFF_PREFIX, SUMMARY_REQUEST, continuation, is_handoff,
                                                    summary_text)
from minirl.config import ConfigError, FaultSpec, load_config
from minirl.controller import assemble
from minirl.data import prompt_row
from minirl.faults import FaultPlan
from minirl.rollout.evidence import Ledger, parse_rollout, split_traces, summary_stats
from minirl.types import Call, GroupOutcome
from minirl.wire import SUMMARY_FAILED_SCORED, Coords, is_summary_call, parse_call_key, with_extra_body

VOCAB = 256
PICTURE = re.compile(r"<image>(.*?)</image>", re.S)


def enc(text: str) -> list[int]:
    return [ord(ch) % 250 + 1 for ch in text]


def said(m: dict) -> str:
    """What an assistant message renders as: exactly the tokens its call generated."""
    return (m.get("content") or "") + "".join(json.dumps(tc["function"]) for tc in m.get("tool_calls") or [])


def render(messages: list[dict]) -> str:
    return "".join(said(m) if m["role"] == "assistant" else f"<{m['role']}>{m.get('content') or ''}" for m in messages)


class Scripted:
    """A scripted model: reads the newest picture's door (the note for `door?`), and answers a summary
    request with `summaries.pop(0)` when given, else `<summary>` + the notes its prompt shows. A
    prompt longer than `max_len` is refused as the server's lane A refuses it."""

    def __init__(self, summaries: list[str] | None = None, max_len: int = 10**9):
        self.summaries, self.max_len = list(summaries or []), max_len
        self.keys: list[str] = []
        self.summary_prompts: list[str] = []
        self.prompts: list[tuple[bool, str]] = []  # (a summary request?, its prompt)

    async def chat(self, messages, tools, params, key, required_prefix):
        text = render(messages)
        prompt = enc(text)
        self.keys.append(key)
        self.prompts.append((not tools, text))
        if len(prompt) > self.max_len:
            return ModelReply({"content": ""}, "length", None, "context_length: maximum context length")
        if not tools:
            assert messages[-1] == {"role": "user", "content": SUMMARY_REQUEST}
            self.summary_prompts.append(text)
            notes = " ".join(sorted(set(re.findall(r"note\d", text)))) or "none"
            message = {"role": "assistant",
                       "content": self.summaries.pop(0) if self.summaries else f"<summary>{notes}</summary>"}
        else:
            labels = PICTURE.findall(text)[-1].split("\n")[1:]
            door = next(label[4:] for label in labels if label.startswith("door"))
            code = int(door) if door != "?" else int((re.findall(r"note(\d)", text) or ["0"])[-1])
            fn = {"name": "open_door", "arguments": json.dumps({"code": code})}
            message = {"role": "assistant", "content": "",
                       "tool_calls": [{"id": f"call_{len(self.keys)}", "type": "function", "function": fn}]}
        gen = enc(said(message))
        evidence = {"prompt_token_ids": prompt, "generation_token_ids": gen, "generation_log_probs": [-0.5] * len(gen)}
        return ModelReply(message, "tool_calls" if message.get("tool_calls") else "stop", evidence)

    async def count_tokens(self, messages, tools, key, required_prefix):
        return len(enc(render(messages)))


def summarize_cfg(*overrides: str, rooms: int = 5, lo: int = 600, hi: int = 600):
    return load_config(overrides=["env.task=doors_memory", f"env.num_rooms={rooms}", f"agent.max_steps={rooms + 2}",
                                  "agent.context_history.policy.type=summarize",
                                  f"agent.context_history.policy.summarize.threshold_tokens=[{lo},{hi}]", *overrides])


def row_of(cfg, group=0, rollout=0, attempt=0, seed=7):
    row = {**prompt_row(cfg, 0, group), "_rowidx": rollout,
           "_minirl": {"step": 0, "group": group, "rollout": rollout, "attempt": attempt}}
    row["responses_create_params"] = with_extra_body(row["responses_create_params"], seed=seed)
    return row


def play(cfg, model, row=None, faults=None):
    plan = None
    if faults:
        cfg = copy.deepcopy(cfg)
        cfg.faults.inject = [FaultSpec(**f) for f in faults]
        plan = FaultPlan(cfg.faults)
    return asyncio.run(run_episode(row or row_of(cfg), cfg.agent, model, plan))


def rollout_of(cfg, result, coords=Coords(0, 0, 0, 0)):
    return parse_rollout(result, coords, vocab_size=VOCAB, max_len=10**6,
                         overlong_filtering=cfg.grpo.overlong_filtering)


def generated(result) -> int:
    return sum(len(it["generation_token_ids"]) for it in result["response"]["output"] if "generation_token_ids" in it)


# ----------------------------------------------------------------------------------- scripted model
def test_an_accepted_summary_is_its_own_trace_and_every_generated_token_trains_once():
    cfg = summarize_cfg()
    model = Scripted()
    result = play(cfg, model)
    ev = result["evidence"]
    assert result["reward"] == 1.0 and ev["end_reason"] == "env_done"  # the last room answered from the summary
    assert ev["summaries"] >= 1 and ev["compactions"] == ev["summaries"] and ev["summary_attempts_rejected"] == 0
    assert ev["summary_facts_needed"] >= 1 and ev["summary_facts_recalled"] == ev["summary_facts_needed"]
    assert [k for k in model.keys if ".s" in k][0] == "s0.g0.r0.a0.s0a0"
    assert parse_call_key("s0.g0.r0.a0.s0a0") == (Coords(0, 0, 0, 0), "s0a0") and is_summary_call("s0a0")

    marked = [it for it in result["response"]["output"] if it.get("trace_kind") == SUMMARY_KIND]
    assert len(marked) == ev["summaries"]
    record = marked[0]["compaction"]
    assert record["outcome"] == "completed" and record["model_calls"] == 1
    assert record["tokens_before"] > 600 > record["tokens_after"]
    assert summary_text(marked[0]["content"][0]["text"]) is not None

    r = rollout_of(cfg, result)
    kinds = [t.kind for t in r.traces]
    assert kinds[:3] == ["turns", SUMMARY_KIND, "turns"] and kinds.count(SUMMARY_KIND) == ev["summaries"]
    summary_trace = r.traces[1]
    assert summary_trace.calls == 1 and summary_trace.compaction == record
    # the summary's prompt extends the turns before it, and still it is a trace of its own
    assert summary_trace.tokens[: len(r.traces[0].tokens)] == r.traces[0].tokens
    assert sum(sum(t.loss_mask) for t in r.traces) == generated(result) == sum(len(c.gen) for c in r.calls)
    # the handoff: system prompt, task, summary, then the current observation
    first = next(i for i, (summary, _) in enumerate(model.prompts) if summary)
    after = model.prompts[first + 1][1]
    handoff = f"<user>{HANDOFF_PREFIX}<summary>{summary_text(marked[0]['content'][0]['text'])}</summary>"
    assert after.startswith(render_initial(result) + handoff + "<user>Opened. Room ")
    assert after.count("<image>") == 2  # the task's picture and the current one

    stats = summary_stats([r])
    assert stats["summaries"] == ev["summaries"] and stats["summary_recall"] == 1.0
    assert stats["compaction_ratio"] == ev["summary_tokens_before"] / ev["summary_tokens_after"] > 1
    assert stats["summary_tokens_mean"] == ev["summary_tokens"] / ev["summaries"]


def test_the_threshold_is_the_prompts_and_a_group_shares_it():
    s = summarize_cfg(lo=100, hi=900).agent.context_history.policy.summarize
    draws = [threshold(s, seed) for seed in range(200)]
    assert all(100 <= d <= 900 for d in draws) and len(set(draws)) > 50
    assert [threshold(s, seed) for seed in range(200)] == draws


def test_rejected_attempts_are_resampled_and_never_trained():
    cfg = summarize_cfg("agent.context_history.policy.summarize.max_summary_tokens=40")
    bad = ["no block here", "<summary></summary>", "<summary>" + "x" * 60 + "</summary>"]
    model = Scripted(summaries=bad[:2])
    result = play(cfg, model)
    ev = result["evidence"]
    reasons = [(s["decision"], s["reason"]) for s in ev["summary"] if s["compaction"] == 0]
    assert reasons == [("rejected", "missing_block"), ("rejected", "empty"), ("accepted", None)]
    assert ev["summary_attempts_rejected"] == 2 and result["reward"] == 1.0
    r = rollout_of(cfg, result)
    assert sum(sum(t.loss_mask) for t in r.traces) == generated(result)  # the rejected two are in no trace
    assert [it["compaction"]["model_calls"] for it in result["response"]["output"] if it.get("trace_kind")][0] == 3

    # over max_summary_tokens, three times: attempts exhausted; end_episode masks the rollout
    cfg = summarize_cfg("agent.context_history.policy.summarize.max_summary_tokens=40",
                        "agent.context_history.policy.summarize.on_summary_failure=end_episode")
    result = play(cfg, Scripted(summaries=[bad[2]] * 3))
    ev = result["evidence"]
    assert [s["reason"] for s in ev["summary"]] == ["too_long"] * 3 + ["end_episode"]
    assert ev["end_reason"] == "summary_failed" and ev["summaries_failed"] == 1
    assert result["response"]["status"] == "incomplete"
    assert rollout_of(cfg, result).mask_reason == "summary_failed"


def test_end_episode_scored_trains_the_newest_rejected_reply_and_keeps_the_rollout():
    """on_summary_failure=end_episode_scored: a policy that writes no block is a bad rollout, not a lost
    one. The episode ends scored on the rooms it reached (valid, never masked); the newest rejected
    reply trains as the failed compaction's summary trace (the older two stay out, as the ledger
    retires them); its segment scores 0, so under next_segment it takes a negative advantage against
    a sibling whose summary handed off. A tool-call reply (here a fault) trains nothing."""
    cfg = summarize_cfg(f"{SUMMARY}.on_summary_failure=end_episode_scored", "grpo.summary_credit=next_segment")
    bad = ["no block", "still none", "none at all"]
    result = play(cfg, Scripted(summaries=list(bad)))
    ev, output = result["evidence"], result["response"]["output"]
    assert [s["reason"] for s in ev["summary"]] == ["missing_block"] * 3 + ["end_episode_scored"]
    assert ev["end_reason"] == SUMMARY_FAILED_SCORED and ev["summaries_failed"] == 1 and ev["summaries"] == 0
    assert result["response"]["status"] == "incomplete" and 0 < result["reward"] < 1  # the rooms before it count
    (marked,) = [it for it in output if it.get("trace_kind") == SUMMARY_KIND]
    assert marked["generation_token_ids"] == enc(bad[-1]) and marked["compaction"]["outcome"] == "failed"
    assert marked["compaction"]["model_calls"] == 3 and ev["segment_rewards"] == [0.0]
    failed = rollout_of(cfg, result)
    assert failed.mask_reason is None and failed.sample_mask == 1
    assert [t.kind for t in failed.traces] == ["turns", SUMMARY_KIND]
    assert sum(sum(t.loss_mask) for t in failed.traces) == generated(result)  # every token in the output trains

    handed_off = rollout_of(cfg, play(cfg, Scripted()), Coords(0, 0, 1, 0))
    assert handed_off.evidence["segment_rewards"] == [1.0]
    batch, _ = assemble(cfg, [GroupOutcome(0, "committed", {0: failed, 1: handed_off})], 0)
    kinds = [t.kind for r in (failed, handed_off) for t in r.traces]
    summary_adv = [float(a) for a, k in zip(batch.advantages, kinds) if k == SUMMARY_KIND]
    assert summary_adv[0] < 0 < summary_adv[1]

    faulted = play(cfg, Scripted(), faults=[{"kind": "summary_tool_call", "step": 0, "group": 0, "rollout": 0,
                                             "call": 0}])
    assert faulted["evidence"]["end_reason"] == SUMMARY_FAILED_SCORED
    assert not [it for it in faulted["response"]["output"] if it.get("trace_kind")]
    assert rollout_of(cfg, faulted).mask_reason is None


def test_an_overflowing_summary_request_trims_the_middle_and_retries():
    cfg = summarize_cfg()
    probe = Scripted()
    play(cfg, probe)
    limit = len(enc(probe.summary_prompts[0])) - 1  # the first summary request is one token too long
    model = Scripted(max_len=limit)
    result = play(cfg, model)
    ev = result["evidence"]
    first = [s for s in ev["summary"] if s["compaction"] == 0]
    assert [(s["decision"], s["reason"]) for s in first] == [("overflow", "trimmed"), ("accepted", None)]
    assert ev["summaries"] >= 1 and ev["summary_attempts_rejected"] == 0
    kept = model.summary_prompts[0]
    assert kept.startswith(render_initial(result)) and len(enc(kept)) <= limit  # system and task kept
    assert probe.summary_prompts[0].endswith(kept[-200:])  # the newest turns kept


def render_initial(result) -> str:
    from minirl.agents.items import items_to_messages

    return render(items_to_messages(result["responses_create_params"]["input"]))


def test_trim_middle_keeps_the_initial_context_and_the_newest_turns():
    initial = [{"type": "message", "role": "system", "content": "s"},
               {"type": "message", "role": "user", "content": "t"}]
    turns = [[{"type": "function_call", "call_id": f"c{i}", "name": "open_door", "arguments": "{}"},
              {"type": "function_call_output", "call_id": f"c{i}", "output": [{"type": "input_text", "text": str(i)}]}]
             for i in range(5)]
    history = initial + [it for t in turns for it in t]
    trimmed = trim_middle(history, 2)
    assert trimmed == initial + [it for t in turns[3:] for it in t]
    assert trim_middle(trim_middle(trimmed, 2), 2) is None  # one turn left: nothing to trim
    # after an earlier summary its handoff and the observation after it stay: the earlier rooms' only record
    # (found by review: they were the oldest "turn" and the first to go, so the next summary lost them)
    carried = continuation(history[:4], 2, "note7 seen in room 1")
    (h,) = [i for i, item in enumerate(carried) if is_handoff(item)]
    longer = carried + [it for t in turns[1:] for it in t]
    assert trim_middle(longer, 2) == carried + [it for t in turns[3:] for it in t]
    assert trim_middle(carried + turns[4], 2) is None and carried[:h] == initial


def test_max_compactions_ends_the_rollout_as_truncated():
    cfg = summarize_cfg("agent.context_history.policy.summarize.max_compactions=1", "grpo.overlong_filtering=false",
                        rooms=8, lo=450, hi=450)
    result = play(cfg, Scripted())
    ev = result["evidence"]
    assert ev["summaries"] == 1 and ev["end_reason"] == "max_compactions"
    assert ev["summary"][-1]["decision"] == "max_compactions"
    assert result["response"]["status"] == "incomplete"
    assert rollout_of(cfg, result).mask_reason is None  # truncated, but not filtered
    cfg.grpo.overlong_filtering = True
    assert rollout_of(cfg, result).mask_reason == "overlong"


def chunked_cfg(*overrides: str, rooms: int, limit: int = 420):
    """summarize on `turn_chunked_recency`, with the guard's limit at the trigger's threshold: a prompt
    the scheduled summary leaves over it is compacted again, early, by the guard (agent.py:_guard)."""
    return summarize_cfg("env.task=doors", "agent.context_history.schedule.type=turn_chunked_recency",
                         f"agent.context_history.guards.max_total_tokens={limit}", *overrides,
                         rooms=rooms, lo=limit, hi=limit)


def test_a_guards_early_summary_after_the_scheduled_one_keeps_the_current_observation():
    """The scheduled summary (every call) leaves a continuation still over the guard's limit, so the
    guard summarizes that continuation before the same call. Its history ends in the observation the
    first continuation re-rendered as a user message, which the second keeps too. Before, only a
    trailing tool reply was carried: the call went out without the room it is in."""
    cfg = chunked_cfg("agent.context_history.schedule.actions_per_chunk=1", f"{SUMMARY}.max_summary_tokens=400",
                      f"{SUMMARY}.on_summary_failure=end_episode", rooms=3)
    model = Scripted(summaries=["<summary>" + "I opened the first door; " * 8 + "</summary>", "<summary>ok</summary>"])
    result = play(cfg, model, row=row_of(cfg, group=1))
    ev = result["evidence"]
    second = [i for i, (summary, _) in enumerate(model.prompts) if summary][1]
    after = model.prompts[second + 1][1]
    handoff = f"<user>{HANDOFF_PREFIX}<summary>ok</summary>"
    assert after.startswith(render_initial(result) + handoff + "<user>Opened. Room 3.")
    assert after.count("<image>") == 2  # the task's picture and the current one
    assert [g["decision"] for g in ev["guard"]] == ["admit", "admit", "admit_after_compaction"]
    assert ev["summaries"] == 2 and result["reward"] == 1.0 and ev["end_reason"] == "env_done"


@pytest.mark.parametrize("on_reject", ["end_episode", "raise"])
def test_a_guards_early_summary_that_ends_the_episode_is_recorded_as_that_end(on_reject):
    """max_compactions reached at the guard's early compaction: the episode ends there, truncated, and
    the guard's record says so (`compaction_ended`), under either `on_reject`: no rejection is counted
    (the controller counts `reject` records) for a rollout that trains. Before, the record said
    `reject` while the rollout ended `max_compactions`, trained, and `raise` never raised."""
    cfg = chunked_cfg("agent.context_history.schedule.actions_per_chunk=100", f"{SUMMARY}.max_compactions=1",
                      f"agent.context_history.guards.on_reject={on_reject}", "grpo.overlong_filtering=false",
                      rooms=5)
    result = play(cfg, Scripted())
    ev = result["evidence"]
    assert ev["summaries"] == 1 and ev["end_reason"] == "max_compactions" and not ev["capture_failed"]
    decisions = [g["decision"] for g in ev["guard"]]
    assert decisions[-1] == "compaction_ended" and "reject" not in decisions and "admit_after_compaction" in decisions
    assert rollout_of(cfg, result).mask_reason is None  # truncated, and it trains: no rejection to count


def test_no_summary_of_the_initial_context_alone():
    """Over the threshold at turn 0 the history is the initial context, which a continuation keeps
    whole: a summary would only add its handoff. So none is requested or counted, and the first call
    is the turn's. Before, the policy spent a model call and installed a longer prompt as a completed
    compaction."""
    cfg = summarize_cfg("env.task=doors", rooms=3, lo=150, hi=150)
    model = Scripted()
    result = play(cfg, model)
    ev = result["evidence"]
    assert not model.prompts[0][0], "the first request is the turn call"
    assert ev["summary"][0]["compaction"] == 0 and ev["summaries"] == ev["compactions"] == len(model.summary_prompts)
    assert ev["end_reason"] == "env_done" and result["reward"] == 1.0
    first = next(it for it in result["response"]["output"] if it.get("trace_kind") == SUMMARY_KIND)
    assert first["compaction"]["tokens_before"] > len(enc(model.prompts[0][1]))  # after the first turn


def test_summary_traces_split_by_kind():
    a = Call([1, 2], [3], [-0.1])
    s = Call([1, 2, 3, 4], [5, 6], [-0.2, -0.3], kind=SUMMARY_KIND, compaction={"outcome": "completed"})
    b = Call([1, 2, 3, 4, 5, 6, 7], [8], [-0.4])  # extends the summary's tokens, yet starts its own trace
    traces = split_traces([a, s, b])
    assert [t.kind for t in traces] == ["turns", SUMMARY_KIND, "turns"]
    assert [sum(t.loss_mask) for t in traces] == [1, 2, 1] and traces[1].compaction == {"outcome": "completed"}


def test_summarize_config_is_checked():
    for override, key in (("threshold_tokens=[9,3]", "threshold_tokens"),
                          ("threshold_tokens=[1,2,3]", "threshold_tokens"),
                          ("max_summary_attempts=0", "max_summary_attempts"),
                          ("on_summary_failure=retry", "on_summary_failure")):
        with pytest.raises(ConfigError, match=f"agent.context_history.policy.summarize.{key}"):
            load_config(overrides=["agent.context_history.policy.type=summarize",
                                   f"agent.context_history.policy.summarize.{override}"])
    with pytest.raises(ConfigError,
                       match="agent.context_history.policy.type: summarize needs agent.name=compaction_agent"):
        load_config(overrides=["agent.context_history.policy.type=summarize", "agent.name=simple_agent"])


# ---------------------------------------------------------------------- the real generation server
def stack_cfg(base_cfg, *changes: tuple[str, object], faults=()):
    cfg = copy.deepcopy(base_cfg)
    cfg.env.num_rooms, cfg.agent.max_steps = 3, 3  # one trigger, before the last call
    cfg.agent.context_history.policy.type = "summarize"
    cfg.agent.context_history.policy.summarize.threshold_tokens = [150, 150]  # before the third call (~190 tokens)
    for key, value in changes:
        obj = cfg
        *path, last = key.split(".")
        for p in path:
            obj = getattr(obj, p)
        setattr(obj, last, value)
    cfg.faults.inject = [FaultSpec(**f) for f in faults]
    return cfg


async def post(url, body):
    async with aiohttp.ClientSession() as http, http.post(url + "/run", json=body) as r:
        return r.status, await r.json(content_type=None)


def run_four(stack, cfg) -> tuple[list, list[dict]]:
    """Rollouts 0-3 of group 0 through the real agent and model server: each `/run`'s (status, body),
    all 200, and step 0's call records."""
    async def go():
        async with stack(cfg) as s:
            results = await asyncio.gather(*(post(s.agent_url, row_of(cfg, rollout=r, seed=3)) for r in range(4)))
            return results, s.model.take_calls(0)

    results, calls = asyncio.run(go())
    assert all(status == 200 for status, _ in results), results
    return results, calls


SUMMARY = "agent.context_history.policy.summarize"


def test_failure_lanes_through_the_real_stack(stack, base_cfg, tokenizer):
    """The default tiny model never writes a block, so each real attempt is `missing_block`; faults
    turn rollout 1's into tool calls, rollout 3's into empty blocks, and refuse rollout 2's first
    request (trimmed, then sent). Under recency_fallback all four come back 200 with their attempts
    recorded and their summaries failed; the ledger retires every rejected summary call (none
    trained, none unrecorded, nothing masked); the step's metrics count them."""
    faults = [{"kind": "summary_tool_call", "step": 0, "group": 0, "rollout": 1, "call": 0},
              {"kind": "summary_overflow", "step": 0, "group": 0, "rollout": 2, "call": 0},
              {"kind": "summary_empty", "step": 0, "group": 0, "rollout": 3, "call": 0}]
    cfg = stack_cfg(base_cfg, (f"{SUMMARY}.on_summary_failure", "recency_fallback"), faults=faults)

    results, calls = run_four(stack, cfg)
    reasons = {r: [(x["decision"], x["reason"]) for x in body["evidence"]["summary"]]
               for r, (_, body) in enumerate(results)}
    assert reasons[0] == [("rejected", "missing_block")] * 3 + [("failed", "recency_fallback")]
    assert reasons[1] == [("rejected", "tool_call")] * 3 + [("failed", "recency_fallback")]
    assert reasons[2] == [("overflow", "trimmed")] + [("rejected",
                                                       "missing_block")] * 3 + [("failed", "recency_fallback")]
    assert reasons[3] == [("rejected", "empty")] * 3 + [("failed", "recency_fallback")]
    assert (results[2][1]["evidence"]["summary"][0]["injected"]
            and results[2][1]["evidence"]["summary"][0]["request"] is None)

    rollouts = [parse_rollout(body, Coords(0, 0, r, 0), vocab_size=len(tokenizer),
                              max_len=cfg.policy.max_total_sequence_length,
                              overlong_filtering=True) for r, (_, body) in enumerate(results)]
    assert all(t.kind == "turns" for r in rollouts for t in r.traces)
    summary_calls = [c for c in calls if is_summary_call(c["call"])]
    # the injected overflow was never sent
    assert len(summary_calls) == 12 and all(c["status"] == 200 for c in summary_calls)
    counts = Ledger(None).close_step(0, calls, rollouts, version=0)
    assert (counts["calls_retired"] == 12 and counts["calls_unrecorded"] == 0
            and counts["calls_trained"] == len(calls) - 12)
    assert all(r.mask_reason is None for r in rollouts)

    batch, stats = assemble(cfg, [GroupOutcome(0, "committed", dict(enumerate(rollouts)))], tokenizer.pad_token_id or 0)
    assert stats["summary_attempts_rejected"] == 12 and stats["summaries_failed"] == 4 and stats["summaries"] == 0
    assert math.isnan(stats["summary_recall"]) and stats["rollouts_masked"] == 0
    assert batch.global_valid_tokens == sum(len(c.gen) for r in rollouts for c in r.calls)


def test_end_episode_scored_through_the_real_stack_trains_one_failed_summary_each(stack, base_cfg, tokenizer):
    """The default tiny model writes no block: under end_episode_scored each rollout ends valid, and
    the ledger finds the newest rejected request of rollouts 0 and 2 in their traces (trained) and
    retires the other ten; rollout 1's tool calls and rollout 3's emptied replies (faults) train none."""
    faults = [{"kind": "summary_tool_call", "step": 0, "group": 0, "rollout": 1, "call": 0},
              {"kind": "summary_empty", "step": 0, "group": 0, "rollout": 3, "call": 0}]
    cfg = stack_cfg(base_cfg, (f"{SUMMARY}.on_summary_failure", "end_episode_scored"), faults=faults)

    results, calls = run_four(stack, cfg)
    rollouts = [parse_rollout(body, Coords(0, 0, r, 0), vocab_size=len(tokenizer),
                              max_len=cfg.policy.max_total_sequence_length,
                              overlong_filtering=True) for r, (_, body) in enumerate(results)]
    assert all(r.evidence["end_reason"] == SUMMARY_FAILED_SCORED and r.mask_reason is None for r in rollouts)
    assert [sum(t.kind == SUMMARY_KIND for t in r.traces) for r in rollouts] == [1, 0, 1, 0]
    trained = [c for r in rollouts for c in r.calls if c.kind == SUMMARY_KIND]
    newest = {r: max((c for c in calls if c["rollout"] == r and is_summary_call(c["call"])), key=lambda c: c["call"])
              for r in (0, 2)}  # each rollout's third request, s0a2
    assert [c.gen for c in trained] == [newest[0]["generation_token_ids"], newest[2]["generation_token_ids"]]
    counts = Ledger(None).close_step(0, calls, rollouts, version=0)
    assert counts["calls_retired"] == 10 and counts["calls_unrecorded"] == 0
    assert counts["calls_trained"] == len(calls) - 10
    batch, stats = assemble(cfg, [GroupOutcome(0, "committed", dict(enumerate(rollouts)))], tokenizer.pad_token_id or 0)
    assert stats["summaries_failed"] == 4 and stats["rollouts_masked"] == 0
    assert batch.global_valid_tokens == sum(len(c.gen) for r in rollouts for c in r.calls)


async def run_group(s, cfg, events: list, tokenizer):
    """Group 0 of step 0 (row_of's seed 3) through a rollout manager to the stack `s`'s agent server."""
    from minirl.rollout.manager import RolloutManager

    manager = RolloutManager(cfg, [s.agent_url], events.append, len(tokenizer))
    manager.open()
    try:
        return await manager.run_group(0, 0, row_of(cfg, seed=3))
    finally:
        await manager.session.close()


def test_exhausted_attempts_are_a_retryable_harness_failure(stack, base_cfg, tokenizer):
    """on_summary_failure=raise: the attempt fails with SummaryFailed (HTTP 500), which the rollout
    manager retries as INFRA (row redispatch), then drops against the drop budget: never a reward
    of 0. The summary_failed events and counter follow."""
    cfg = stack_cfg(base_cfg, ("grpo.num_generations_per_prompt", 2),
                    ("async_rl.rollout_failure.nemo_gym.max_row_attempts", 2),
                    ("async_rl.rollout_failure.max_infra_attempts_per_prompt", 1),
                    (f"{SUMMARY}.max_summary_attempts", 1))
    events: list[dict] = []

    async def go():
        async with stack(cfg) as s:
            outcome = await run_group(s, cfg, events, tokenizer)
            direct = await post(s.agent_url, row_of(cfg, attempt=9, seed=3))
            return outcome, outcome.summaries_failed, direct

    outcome, failures, (status, body) = asyncio.run(go())
    assert status == 500 and body["type"] == "SummaryFailed"
    assert "summary_failed: compaction 0 of s0.g0.r0.a9 found no acceptable summary in 1 request(s)" in body["error"]
    assert outcome.status == "dropped" and outcome.rollouts == {} and outcome.row_retries == 2
    failed = [e for e in events if e["type"] == "summary_failed"]
    assert failures == len(failed) == 4 and {e["class"] for e in failed} == {"infra"}
    assert sorted(e["decision"] for e in failed) == ["dropped", "dropped", "retried", "retried"]
    assert [e["type"] for e in events].count("drop") == 1


def test_a_lost_groups_failed_summary_is_still_counted(stack, base_cfg, tokenizer):
    """on_summary_failure=end_episode: row 0's summary fails (the default tiny model writes no block), its
    episode ends and the row returns; row 1's every /run is cut, so the group is dropped. Its outcome still
    counts row 0's failed summary, as it counts the row returned and its guard rejections (docs/contracts.md:
    the counts sum over every group outcome the step took). Before, only kept rollouts' failed summaries
    reached `summaries_failed`: a lost or evicted group's were in no metric, though its `summary` event was."""
    cfg = stack_cfg(base_cfg, ("grpo.num_generations_per_prompt", 2), (f"{SUMMARY}.on_summary_failure", "end_episode"),
                    ("async_rl.rollout_failure.nemo_gym.max_row_attempts", 1),
                    ("async_rl.rollout_failure.max_infra_attempts_per_prompt", 1),
                    (f"{SUMMARY}.max_summary_attempts", 1),
                    faults=[{"kind": "transport", "step": 0, "group": 0, "rollout": 1}])
    cfg.async_rl.rollout_failure.max_consecutive_dropped_prompts = 1
    events: list[dict] = []

    async def go():
        async with stack(cfg) as s:
            return await run_group(s, cfg, events, tokenizer)

    outcome = asyncio.run(go())
    assert outcome.status == "dropped" and outcome.rows_returned == 1
    failed = [e for e in events if e["type"] == "summary" and e.get("decision") == "failed"]
    assert len(failed) == 1 and failed[0]["rollout"] == 0, [e for e in events if e["type"] == "summary"]
    assert outcome.summaries_failed == 1


ACCEPTED_CHILD = """
import asyncio, json, sys
sys.path[:0] = ["tests", "tests/integration"]  # conftest.py, and this file
import aiohttp
from conftest import Stack
from test_summarize import row_of
from transformers import AutoTokenizer
from minirl.config import load_config
from minirl.generation.engine import VllmEngine, configure_cpu_env

cfg = load_config("configs/summarize.yaml")
configure_cpu_env(1, 2)
engine = VllmEngine(cfg.policy.model_name, max_model_len=cfg.policy.generation.vllm_cfg.max_model_len, seed=0)
tokenizer = AutoTokenizer.from_pretrained(cfg.policy.model_name)

async def post(http, url, body):
    async with http.post(url + "/run", json=body) as r:
        return await r.json(content_type=None)

async def go():
    async with Stack(cfg, engine, tokenizer) as s, aiohttp.ClientSession() as http:
        results = await asyncio.gather(*(post(http, s.agent_url, row_of(cfg, group=g, rollout=r, seed=11 + r))
                                         for g in range(4) for r in range(2)))
        return results, s.model.take_calls(0)

results, calls = asyncio.run(go())
json.dump({"results": results, "calls": calls, "vocab": len(tokenizer)}, open(sys.argv[1], "w"))
"""


def test_the_warm_started_summarizer_through_the_real_stack(tmp_path):
    """configs/summarize.yaml's model (models/tiny-summarize) on its own engine (a child process, so the
    session's engine stays the default model's): its accepted summaries come back as their own traces,
    trained once, matched by the ledger, and their rejected siblings retired; recall is measured."""
    from minirl.config import REPO_ROOT

    if not (REPO_ROOT / "models" / "tiny-summarize" / "config.json").exists():
        pytest.skip("models/tiny-summarize is not built")
    data = child_result(ACCEPTED_CHILD, tmp_path, timeout=300)
    cfg = load_config("configs/summarize.yaml")
    rollouts = []
    for i, body in enumerate(data["results"]):
        assert "response" in body, body
        rollouts.append(parse_rollout(body, Coords(0, i // 2, i % 2, 0), vocab_size=data["vocab"],
                                      max_len=cfg.policy.max_total_sequence_length, overlong_filtering=True))
    summarized = [r for r in rollouts if r.evidence["summaries"]]
    assert summarized, [r.evidence["summary"] for r in rollouts]
    for r in summarized:
        marked = [t for t in r.traces if t.kind == SUMMARY_KIND]
        assert len(marked) == r.evidence["summaries"] and marked[0].compaction["outcome"] == "completed"
        assert sum(sum(t.loss_mask) for t in r.traces) == sum(len(c.gen) for c in r.calls)
    counts = Ledger(None).close_step(0, data["calls"], rollouts, version=0)
    rejected = sum(r.evidence["summary_attempts_rejected"] for r in rollouts)
    assert counts["calls_unrecorded"] == 0 and counts["calls_retired"] >= rejected
    assert counts["calls_trained"] + counts["calls_masked"] == sum(len(r.calls) for r in rollouts)
    stats = summary_stats(rollouts)
    assert stats["summaries"] > 0 and 0 <= stats["summary_recall"] <= 1 and stats["compaction_ratio"] > 1
    print(f"tiny-summarize: {sum(r.evidence['summaries'] for r in rollouts)} summaries over 8 rollouts, {rejected} "
          "rejected, "
          f"recall {stats['summary_recall']:.2f}, ratio {stats['compaction_ratio']:.2f}")
