"""A compaction's summary requests share their prompt, so a peaked model's rejected replies can be
token-identical. Under `on_summary_failure=end_episode_scored` the newest one trains as the failed
compaction's summary; the ledger and `context_compaction.call_selection=all_captured` must find that one
request's record (by the call key its compaction record names, `s<k>a<n>`), not every record alike in
content. Through the real agent and model server (`stack`) with the default tiny model, which never
writes a summary block, sampled greedily (a tiny `top_p` keeps only the likeliest token) so that the
three requests of a compaction answer alike.
"""

from __future__ import annotations

import asyncio
import copy
import json

from test_summarize import SUMMARY, post, row_of, stack_cfg

from minirl.rollout.evidence import SUMMARY_KIND, Ledger, parse_rollout
from minirl.rollout.selection import select_calls
from minirl.wire import SUMMARY_FAILED_SCORED, Coords, is_summary_call


def test_token_identical_rejected_summaries_train_the_kept_request_once(stack, base_cfg, tokenizer, tmp_path):
    cfg = stack_cfg(base_cfg, (f"{SUMMARY}.on_summary_failure", "end_episode_scored"),
                    ("policy.generation.top_p", 1e-6))

    async def go():
        async with stack(cfg) as s:
            result = await post(s.agent_url, row_of(cfg, seed=3))
            return result, s.model.take_calls(0)

    (status, body), calls = asyncio.run(go())
    assert status == 200, body
    requests = [c for c in calls if is_summary_call(c["call"])]
    assert [c["call"] for c in requests] == ["s0a0", "s0a1", "s0a2"]
    assert len({(tuple(c["prompt_token_ids"]), tuple(c["generation_token_ids"])) for c in requests}) == 1, \
        "greedy sampling should answer the three requests alike"
    r = parse_rollout(body, Coords(0, 0, 0, 0), vocab_size=len(tokenizer),
                      max_len=cfg.policy.max_total_sequence_length, overlong_filtering=True)
    assert r.evidence["end_reason"] == SUMMARY_FAILED_SCORED and r.mask_reason is None
    (summary,) = [c for c in r.calls if c.kind == SUMMARY_KIND]
    assert summary.compaction["outcome"] == "failed" and summary.compaction["call"] == "s0a2"

    selected = copy.deepcopy(r)
    assert select_calls("all_captured", [selected], calls, cfg.policy.max_total_sequence_length) == 0
    assert [t.kind for t in selected.traces] == [t.kind for t in r.traces]  # the summary trains once
    assert sum(sum(t.loss_mask) for t in selected.traces) == sum(len(c.gen) for c in r.calls)

    counts = Ledger(tmp_path, cfg.grpo.segment_validity).close_step(0, calls, [r], version=0)
    status_of = {x["call"]: x["ledger_status"] for x in map(json.loads, open(tmp_path / "step_0.jsonl"))}
    assert [status_of[c] for c in ("s0a0", "s0a1", "s0a2")] == ["retired", "retired", "trained"]
    assert counts["calls_retired"] == 2 and counts["calls_trained"] == len(r.calls) == len(calls) - 2
