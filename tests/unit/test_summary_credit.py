"""Summary-training switches (issue 54 item 2): `grpo.summary_credit` and `summarize.require_stop`.

- `summary_advantages` against a float64 reference written from its definition (a group's k-th
  summaries compared with one another by the leave-one-out baseline and std);
- `segment_rewards` against a hand-built transcript, and `verify` unchanged by its refactor;
- the whole lane without Ray or vLLM: scripted models through the real agent loop (`run_episode`,
  the real summarizing policy), `parse_rollout` and the controller's `assemble`: under
  `next_segment` a summary trace trains with its own advantage, every other trace with its
  rollout's; under `rollout` (the default) every trace shares it;
- `require_stop`: a summary cut by the cap (`finish_reason=length`) with a closed block is
  rejected as `not_stop` and resampled; accepted by default.
Pure CPU, well under a second each.
"""

from __future__ import annotations

import asyncio
import json
import random
import re

import numpy as np
import pytest

from minirl.agents.agent import ModelReply, run_episode
from minirl.agents.compaction.summarize import SUMMARY_KIND, segment_rewards
from minirl.agents.env import make_rooms, verify
from minirl.algo.grpo import group_advantages, summary_advantages
from minirl.config import load_config
from minirl.controller import assemble
from minirl.data import prompt_row
from minirl.rollout.evidence import parse_rollout
from minirl.types import GroupOutcome
from minirl.wire import Coords, with_extra_body

PICTURE = re.compile(r"<image>(.*?)</image>", re.S)


def reference(rewards, valid, leave_one_out=True, normalize=True, eps=1e-6):
    """summary_advantages from its definition, in float64 with plain loops."""
    out = [[0.0] * len(r) for r in rewards]
    for k in range(max(map(len, rewards), default=0)):
        members = [i for i, r in enumerate(rewards) if valid[i] and k < len(r) and r[k] is not None]
        if len(members) <= 1:
            continue
        for i in members:
            others = [float(rewards[j][k]) for j in members if j != i or not leave_one_out]
            mean = sum(others) / len(others)
            a = float(rewards[i][k]) - mean
            if normalize and len(others) > 1 and max(others) != min(others):
                a /= (sum((x - mean) ** 2 for x in others) / (len(others) - 1)) ** 0.5 + eps
            out[i][k] = a
    return out


@pytest.mark.parametrize("leave_one_out,normalize", [(True, True), (False, True), (True, False)])
def test_summary_advantages_match_a_float64_reference(leave_one_out, normalize):
    rng = random.Random(5)
    for _ in range(300):
        g = rng.randint(2, 6)
        rewards = [[rng.choice([None, 0.0, 0.5, 1.0, rng.random()]) for _ in range(rng.randint(0, 3))]
                   for _ in range(g)]
        valid = [rng.random() < 0.8 for _ in range(g)]
        got = summary_advantages(rewards, valid, leave_one_out, normalize)
        want = reference(rewards, valid, leave_one_out, normalize)
        assert [len(r) for r in got] == [len(r) for r in rewards]
        np.testing.assert_allclose(np.concatenate([*got, [0.0]]), np.concatenate([*want, [0.0]]),
                                   rtol=1e-12, atol=1e-12)
    # a worked case: the second summaries of rollouts 0 and 2 only (1 has none, 3 is masked)
    adv = summary_advantages([[1.0, 1.0], [0.0], [0.5, 0.0], [1.0, 1.0]], [1, 1, 1, 0])
    assert adv[0][1] == pytest.approx(1.0) and adv[2][1] == pytest.approx(-1.0) and adv[3] == [0.0, 0.0]
    assert adv[0][0] == pytest.approx((1.0 - 0.25) / (0.125 ** 0.5 + 1e-6))  # others 0.0, 0.5: mean 0.25, std 0.354


def calls(codes: list[int]) -> list[dict]:
    return [{"type": "function_call", "name": "open_door", "arguments": json.dumps({"code": c})} for c in codes]


def test_segment_rewards_score_the_rooms_each_summary_hands_off_to():
    task = {"env": "doors", "seed": 11, "num_rooms": 5}
    code = [r.code for r in make_rooms(11, 5)]
    wrong = [(c + 1) % 10 for c in code]
    mark = {"type": "message", "role": "assistant", "content": "<summary>x</summary>", "trace_kind": SUMMARY_KIND}
    # rooms 0, 1 before the first summary; room 2 (second try) and room 3 (missed... then opened on the 2nd try
    # after the second summary: it counts in room 3's segment, where its first try fell); room 4 never tried
    output = (calls([code[0], wrong[1], code[1]]) + [mark] + calls([wrong[2], code[2], wrong[3]]) + [mark]
              + calls([code[3]]) + [mark])
    assert segment_rewards(task, output) == [pytest.approx((0.5 + 0.5) / 2), None, None]
    assert verify(task, output) == pytest.approx((1 + 0.5 + 0.5 + 0.5) / 5)
    assert verify(task, calls(code)) == 1.0 and verify(task, calls(wrong)) == 0.0


def render(messages: list[dict]) -> str:
    def said(m):
        return (m.get("content") or "") + "".join(json.dumps(tc["function"]) for tc in m.get("tool_calls") or [])

    return "".join(said(m) if m["role"] == "assistant" else f"<{m['role']}>{m.get('content') or ''}" for m in messages)


def enc(text: str) -> list[int]:
    return [ord(ch) % 250 + 1 for ch in text]


class Summarizer:
    """A scripted model: reads the newest picture's door (the note for `door?`, else guesses 0); a
    summary request gets `<summary>` + the note when `keep`, else `<summary>none</summary>`, with
    the finish reasons of `finishes` in turn (then `stop`)."""

    def __init__(self, keep: bool, finishes: tuple[str, ...] = ()):
        self.keep, self.finishes = keep, list(finishes)

    async def chat(self, messages, tools, params, key, required_prefix):
        text = render(messages)
        finish = "stop"
        if not tools:
            notes = re.findall(r"note\d", text)
            message = {"role": "assistant",
                       "content": f"<summary>{notes[-1] if self.keep and notes else 'none'}</summary>"}
            finish = self.finishes.pop(0) if self.finishes else "stop"
        else:
            door = next(label[4:] for label in PICTURE.findall(text)[-1].split("\n")[1:] if label.startswith("door"))
            code = int(door) if door != "?" else int((re.findall(r"note(\d)", text) or ["0"])[-1])
            fn = {"name": "open_door", "arguments": json.dumps({"code": code})}
            message = {"role": "assistant", "content": "",
                       "tool_calls": [{"id": "c", "type": "function", "function": fn}]}
            finish = "tool_calls"
        gen = enc(render([message]))
        return ModelReply(message, finish, {"prompt_token_ids": enc(text), "generation_token_ids": gen,
                                            "generation_log_probs": [-0.5] * len(gen)})

    async def count_tokens(self, messages, tools, key, required_prefix):
        return len(enc(render(messages)))


def memory_cfg(*overrides: str):
    return load_config(overrides=["env.task=doors_memory", "env.num_rooms=5", "agent.max_steps=5",
                                  "agent.context_history.policy.type=summarize", "grpo.num_prompts_per_step=1",
                                  "agent.context_history.policy.summarize.threshold_tokens=[600,600]", *overrides])


def play(cfg, model, rollout: int = 0, group: int = 0) -> dict:
    row = {**prompt_row(cfg, 0, group), "_minirl": {"step": 0, "group": group, "rollout": rollout, "attempt": 0}}
    row["responses_create_params"] = with_extra_body(row["responses_create_params"], seed=7)
    return asyncio.run(run_episode(row, cfg.agent, model))


@pytest.mark.parametrize("credit", ["rollout", "next_segment"])
def test_next_segment_credit_trains_the_summary_on_the_segment_after_it(credit):
    cfg = memory_cfg(f"grpo.summary_credit={credit}")
    keeps = [True, False, True, False]
    results = [play(cfg, Summarizer(keep), i) for i, keep in enumerate(keeps)]
    rollouts = [parse_rollout(res, Coords(0, 0, i, 0), vocab_size=256, max_len=10**6, overlong_filtering=False)
                for i, res in enumerate(results)]
    segs = [r.evidence["segment_rewards"] for r in rollouts]
    # one summary each; the note decides the segment after it
    assert all(len(s) == 1 for s in segs) and segs[0] != segs[1]
    del rollouts[3].evidence["segment_rewards"]  # as an external agent's: it keeps its rollout's advantage
    unsummarized = memory_cfg("agent.context_history.policy.type=recency")
    rollouts.append(parse_rollout(play(unsummarized, Summarizer(False), 4), Coords(0, 0, 4, 0), vocab_size=256,
                                  max_len=10**6, overlong_filtering=False))
    assert "segment_rewards" not in rollouts[4].evidence  # no summary: nothing to score, nor a fallback
    batch, stats = assemble(cfg, [GroupOutcome(0, "committed", dict(enumerate(rollouts)))], 0)
    rollout_adv = group_advantages([r.reward for r in rollouts])
    kinds = [t.kind for r in rollouts for t in r.traces]
    own = summary_advantages([segs[0], segs[1], segs[2], [], []], [1] * 5)
    want = []
    for i, r in enumerate(rollouts):
        for t in r.traces:
            summary = credit == "next_segment" and t.kind == SUMMARY_KIND and i < 3
            want.append(own[i][0] if summary else rollout_adv[i])
    assert kinds.count(SUMMARY_KIND) == 4 and kinds.count("turns") > 5
    np.testing.assert_allclose(batch.advantages[: len(want)], want, rtol=1e-6)
    assert stats["summary_credit_fallbacks"] == (1 if credit == "next_segment" else 0)
    if credit == "next_segment":  # the keepers' summaries are credited, the dropper's blamed
        assert own[0][0] > 0 > own[1][0]


@pytest.mark.parametrize("require_stop", [False, True])
def test_require_stop_rejects_a_summary_cut_by_the_cap(require_stop):
    cfg = memory_cfg(f"agent.context_history.policy.summarize.require_stop={str(require_stop).lower()}")
    result = play(cfg, Summarizer(True, finishes=("length",)))
    reasons = [(s["decision"], s["reason"]) for s in result["evidence"]["summary"]]
    if require_stop:
        assert reasons == [("rejected", "not_stop"), ("accepted", None)]
        assert result["evidence"]["summary_attempts_rejected"] == 1
    else:
        assert reasons == [("accepted", None)]
    assert result["evidence"]["summaries"] == 1
