"""Summarizing compaction (`agent.context_history.policy.type=summarize`): when the prompt plus the
reserved output would pass a threshold, the model writes a summary of its history, and the episode
continues from the system prompt, the task, the summary and the current observation
(`summary_format.continuation`). `SummarizePolicy` spells out the trigger, rejection and failure rules.

Invariant: only an accepted summary reaches the output (under `on_summary_failure=end_episode_scored`,
also a failed compaction's newest rejected reply, its record's outcome `failed`): its reply items, the
token evidence on the last one marked `trace_kind: compaction_summary` with the compaction record
(outcome, tokens_before, tokens_after, model_calls, and `call`: its request's `s<k>a<n>`, by which the
ledger knows it from a token-identical rejected request), so it becomes one trace of its own and is trained
once; any other rejected or refused request is in no output item (the ledger retires the server's
record of it); every request leaves one flat record in `evidence.summary`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from minirl.agents.compaction.base import CompactionResult
from minirl.agents.compaction.rewrite import RewritePolicy
from minirl.agents.compaction.summary_format import SUMMARY_REQUEST, continuation, is_handoff, summary_text
from minirl.agents.env import DoorsEnv, room_scores
from minirl.agents.episode import Episode, ModelClient, ModelReply
from minirl.agents.items import items_to_messages, new_id, reply_to_items
from minirl.config import ContextHistoryConfig, SummarizeConfig
from minirl.wire import SUMMARY_FAILED_SCORED, SummaryFailed

SUMMARY_KIND = "compaction_summary"
"""The trace kind of a summary call (upstream's segment branch's name)."""
SEED_STRIDE = 1_000_003
"""Summary requests sample with the row's seed + SEED_STRIDE * (k + 1) + n: apart from the turn calls'."""
SUMMARY_COUNTERS = ("summaries", "summary_attempts_rejected", "summaries_failed", "summary_tokens",
                    "summary_tokens_before", "summary_tokens_after", "summary_facts_needed",
                    "summary_facts_recalled")
"""This policy's own counters: summaries accepted; rejected attempts; compactions whose attempts ran
out and that went on (`end_episode`, `recency_fallback`; under `raise` the episode fails instead);
generated tokens of the accepted summaries; prompt tokens before and after them (their ratio:
compaction_ratio); the `DoorsEnv.memory_facts()` shown before and needed at or after each accepted
summary, and those of them it carries (their ratio: summary_recall)."""


def threshold(cfg: SummarizeConfig, seed: int) -> int:
    """The prompt's trigger threshold: uniform in [lo, hi], a function of the prompt's identity alone."""
    lo, hi = cfg.threshold_tokens
    return random.Random(f"summarize|{seed}").randint(lo, hi)


def trim_middle(history: list[dict], initial_len: int) -> list[dict] | None:
    """The history with the oldest half of its turns dropped (a turn: the model's items and the tool
    replies after them); the initial context, the newest turn and an earlier summary's handoff (with the
    observation after it: the only place facts of the rooms before it survive) always stay, since the
    reference trims "the middle of the history". None: nothing to drop."""
    start = initial_len
    handoffs = [i for i in range(initial_len, len(history)) if is_handoff(history[i])]
    if handoffs:
        start = handoffs[-1] + 1
        while start < len(history) and not _by_model(history[start]):
            start += 1
    turns: list[list[dict]] = []
    for item in history[start:]:
        if not turns or (_by_model(item) and not _by_model(turns[-1][-1])):
            turns.append([])
        turns[-1].append(item)
    if len(turns) < 2:
        return None
    keep = turns[(len(turns) + 1) // 2:]
    return history[:start] + [item for turn in keep for item in turn]


def _by_model(item: dict) -> bool:
    return item.get("type") in ("reasoning", "function_call") or item.get("role") == "assistant"


def rejection(reply: ModelReply, max_tokens: int, empty: bool = False, tool_call: bool = False,
              require_stop: bool = False) -> str | None:
    """Why a summary reply is rejected (`empty` / `tool_call`: an injected fault), or None."""
    if tool_call or reply.message.get("tool_calls"):
        return "tool_call"
    if empty:
        return "empty"
    if require_stop and reply.finish_reason != "stop":
        return "not_stop"
    text = summary_text(reply.message.get("content") or "")
    if text is None:
        return "missing_block"
    if not text:
        return "empty"
    if len(reply.evidence["generation_token_ids"]) > max_tokens:
        return "too_long"
    return None


def recall(env: DoorsEnv | None, summary: str) -> tuple[int, int]:
    """(facts needed, facts carried): the task's memory facts shown before the current room and
    needed at or after it, and how many of them the summary holds verbatim."""
    if env is None:
        return 0, 0
    facts = [f for f in env.memory_facts() if f["shown_in_room"] < env.room <= f["needed_in_room"]]
    return len(facts), sum(f["text"] in summary for f in facts)


def segment_rewards(task: dict, output: list[dict]) -> list[float | None]:
    """Per summary in `output` (an item marked SUMMARY_KIND), in order: the mean `room_scores`
    score of the rooms first tried after it and before the next summary (the segment it hands off
    to; a room's later tries count in that room's score); None when that segment tries no room; 0.0
    for a failed one (`end_episode_scored`: it handed off nothing, and the episode ended)."""
    marks = [i for i, item in enumerate(output) if item.get("trace_kind") == SUMMARY_KIND] + [len(output)]
    scores = room_scores(task, output)
    out: list[float | None] = []
    for start, end in zip(marks, marks[1:]):
        if (output[start].get("compaction") or {}).get("outcome") == "failed":
            out.append(0.0)
            continue
        mine = [s for first, s in scores if start < first < end]
        out.append(sum(mine) / len(mine) if mine else None)
    return out


@dataclass
class Requests:
    """One compaction's summary requests so far."""

    k: int
    history: list[dict]
    sent: int = 0
    trims: int = 0
    rejected: list[str] = field(default_factory=list)
    last: ModelReply | None = None
    """The newest rejected reply the policy wrote as it came (no tool call, no injected fault): the
    one `end_episode_scored` trains."""
    last_call: str | None = None
    """`last`'s request, as its call key ends (`s<k>a<n>`)."""

    def call(self, n: int) -> str:
        """Request n's call (`s<k>a<n>`): the kept summary's compaction record names it, so the ledger and
        the call selection find that request's record, not a token-identical rejected one."""
        return f"s{self.k}a{n}"


class SummarizePolicy:
    """The model summarizes its history when the context fills.

    - Trigger: prompt tokens + `guards.reserved_generation_tokens` > a threshold drawn from
      `summarize.threshold_tokens` by the prompt's identity (`threshold`, `episode.prompt_identity`: a
      doors task's seed, a dataset row's input and task), so a group's rollouts share it and prompts differ.
    - The summary request is an ordinary sampled call through the generation server: the history plus
      `SUMMARY_REQUEST`, no tools, its own call key `<rollout>.s<k>a<n>` (compaction k, request n).
    - A reply is rejected (`rejection`) when it carries a tool call, did not end by itself under
      `require_stop` (`not_stop`), has no closed block, an empty one,
      or more than `max_summary_tokens` generated tokens; it is resampled, up to
      `max_summary_attempts` rejections. A request the server refuses as too long (a reply with no
      tokens) is sent again with the middle of the history trimmed (`trim_middle`); that costs no
      attempt, and a history that cannot shrink fails.
    - Attempts exhausted: `on_summary_failure` (`raise`: SummaryFailed, an INFRA failure of the
      attempt; `end_episode`: the rollout ends masked; `end_episode_scored`: it ends valid, scored on
      the rooms it reached, and its newest rejected reply trains as the summary, with the compaction
      record's outcome `failed` (`Requests.last`; none when every reply was a tool call or faulted);
      `recency_fallback`: the recency rewrite).
    - `max_compactions` summaries done: the next trigger ends the rollout as truncated.
    - A history holding only the initial context (turn 0) is never summarized: there is nothing to
      compact, so the prompt goes out as it is (the guard, if on, judges it).
    - Faults (faults.py): `summary_empty` / `summary_tool_call` at compaction k read every reply of it
      as empty / as carrying a tool call; `summary_overflow` reads its first request as refused.
    - Credit (`grpo.summary_credit=next_segment`): `segment_rewards` scores the segment each accepted
      summary hands off to; the agent returns it as evidence `segment_rewards`.
    """

    COUNTERS: tuple[str, ...] = (*RewritePolicy.COUNTERS, *SUMMARY_COUNTERS)
    """Its own, and the recency rewrite's (`recency_fallback`)."""

    def __init__(self, cfg: ContextHistoryConfig) -> None:
        self.cfg, self.s = cfg, cfg.policy.summarize
        self.fallback = RewritePolicy(cfg)

    async def compact(self, ep: Episode, client: ModelClient) -> CompactionResult:
        if len(ep.history) <= ep.initial_len:
            # nothing to compact: the continuation keeps the initial context whole and adds a handoff,
            # a longer prompt bought with a model call
            return CompactionResult(ep.history)
        before = await ep.prompt_tokens(client)  # what the next turn call sends, its token prefix spliced in
        if before + self.cfg.guards.reserved_generation_tokens <= threshold(self.s, ep.prompt):
            return CompactionResult(ep.history)
        k = ep.ev.count("summaries") + ep.ev.count("summaries_failed")
        if k >= self.s.max_compactions:
            ep.ev.summary.append({"compaction": k, "request": None, "decision": "max_compactions", "reason": None,
                                  "tokens": 0, "injected": False})
            return CompactionResult(ep.history, outcome="aborted", tokens_before=before, end_reason="max_compactions")
        run = Requests(k, list(ep.history))
        accepted = await self._request(ep, client, run)
        if accepted is None:
            return await self._failed(ep, client, run, before)
        return await self._accepted(ep, client, run, before, *accepted)

    async def _request(self, ep: Episode, client: ModelClient, run: Requests) -> tuple[ModelReply, str] | None:
        """Sample summaries until one is accepted, trimming the history on overflow; None: failed."""
        fires = ep.fault or (lambda kind, at=None: False)
        empty, tool_call = fires("summary_empty", run.k), fires("summary_tool_call", run.k)
        while len(run.rejected) < self.s.max_summary_attempts:
            injected = run.trims == 0 and fires("summary_overflow", run.k)
            reply = None if injected else await self._send(ep, client, run)
            if reply is None or reply.evidence is None:
                trimmed = trim_middle(run.history, ep.initial_len)
                self._note(ep, run, "overflow", "trimmed" if trimmed else "untrimmable", 0, injected, sent=not injected)
                if trimmed is None:
                    run.rejected.append("overflow")
                    return None
                run.history, run.trims = trimmed, run.trims + 1
                continue
            reason = rejection(reply, self.s.max_summary_tokens, empty, tool_call, self.s.require_stop)
            tokens = len(reply.evidence["generation_token_ids"])
            self._note(ep, run, "rejected" if reason else "accepted", reason, tokens, empty or tool_call)
            if reason is None:
                return reply, summary_text(reply.message.get("content") or "")
            run.rejected.append(reason)
            if not (empty or tool_call or reply.message.get("tool_calls")):
                run.last, run.last_call = reply, run.call(run.sent - 1)
        return None

    async def _send(self, ep: Episode, client: ModelClient, run: Requests) -> ModelReply:
        # a row without coordinates (validation): a plain call id, as its turns get; a key starting with "s"
        # would be sent as the rollout header and refused by the server (HTTP 400)
        key = f"{ep.coords.key}.s{run.k}a{run.sent}" if ep.coords else new_id("call")
        sampling = dict(ep.sampling)
        if "seed" in sampling:
            sampling["seed"] += SEED_STRIDE * (run.k + 1) + run.sent
        request = {"type": "message", "role": "user", "content": SUMMARY_REQUEST}
        run.sent += 1
        return await client.chat(items_to_messages(run.history + [request]), [], sampling, key, None)

    @staticmethod
    def _note(ep: Episode, run: Requests, decision: str, reason: str | None, tokens: int, injected: bool,
              sent: bool = True) -> None:
        """The request's record in `evidence.summary` (`request` None: an injected overflow, never sent)."""
        ep.ev.summary.append({"compaction": run.k, "request": run.sent - 1 if sent else None, "decision": decision,
                              "reason": reason, "tokens": tokens, "injected": injected})

    async def _accepted(self, ep: Episode, client: ModelClient, run: Requests, before: int, reply: ModelReply,
                        text: str) -> CompactionResult:
        items = continuation(ep.history, ep.initial_len, text)
        after = await ep.prompt_tokens(client, items)  # the continuation, sent without a prefix
        record = {"outcome": "completed", "tokens_before": before, "tokens_after": after, "model_calls": run.sent}
        out = reply_to_items(reply.message, reply.evidence)
        out[-1].update(trace_kind=SUMMARY_KIND, compaction={**record, "call": run.call(run.sent - 1)})
        ep.output += out
        needed, recalled = recall(ep.env, text)
        counters = {"summaries": 1, "summary_attempts_rejected": len(run.rejected),
                    "summary_tokens": len(reply.evidence["generation_token_ids"]), "summary_tokens_before": before,
                    "summary_tokens_after": after, "summary_facts_needed": needed, "summary_facts_recalled": recalled}
        return CompactionResult(items, changed=True, tokens_before=before, tokens_after=after, model_calls=run.sent,
                                counters=counters)

    async def _failed(self, ep: Episode, client: ModelClient, run: Requests, before: int) -> CompactionResult:
        """The attempts ran out: `on_summary_failure` decides."""
        if self.s.on_summary_failure == "raise":
            where = ep.coords.key if ep.coords else "this episode"
            raise SummaryFailed(f"summary_failed: compaction {run.k} of {where} found no acceptable summary in "
                                f"{run.sent} request(s) (max_summary_attempts={self.s.max_summary_attempts}; "
                                f"rejected: {', '.join(run.rejected)})")
        counters = {"summaries_failed": 1, "summary_attempts_rejected": len(run.rejected)}
        ep.ev.summary.append({"compaction": run.k, "request": None, "decision": "failed",
                              "reason": self.s.on_summary_failure, "tokens": 0, "injected": False})
        if self.s.on_summary_failure in ("end_episode", "end_episode_scored"):
            scored = self.s.on_summary_failure == "end_episode_scored"
            if scored and run.last is not None:  # the failure trains, with its rollout's (or segment's) advantage
                out = reply_to_items(run.last.message, run.last.evidence)
                out[-1].update(trace_kind=SUMMARY_KIND, compaction={"outcome": "failed", "tokens_before": before,
                                                                    "model_calls": run.sent, "call": run.last_call})
                ep.output += out
            return CompactionResult(ep.history, outcome="failed", tokens_before=before, model_calls=run.sent,
                                    counters=counters, end_reason=SUMMARY_FAILED_SCORED if scored else "summary_failed")
        rewrite = await self.fallback.compact(ep, client)
        return CompactionResult(rewrite.items, changed=rewrite.changed, outcome="failed", tokens_before=before,
                                model_calls=run.sent, counters={**rewrite.counters, **counters})
