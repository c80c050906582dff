"""The `call_log_lost` fault (minirl.faults, docs/faults.md): the real generation server answers the call but
its record never reaches the call log, so the controller's ledger finds the attempt short by one call and
`grpo.segment_validity` decides the rollout's fate: `all` masks the whole rollout, `any` masks only the
segment that held the lost call and trains the rest. Through the real model server and agent pool (`stack`).
Either way the ledger labels a call `trained` only when its tokens train: a recorded call of the masked
segment is `masked` under `any` too, though its rollout still votes.
"""

from __future__ import annotations

import asyncio
import copy
import json

import aiohttp

from minirl.config import FaultSpec
from minirl.controller import assemble
from minirl.data import prompt_row
from minirl.rollout.evidence import Ledger, parse_rollout
from minirl.types import GroupOutcome
from minirl.wire import Coords, with_extra_body


def row(cfg, rollout: int) -> dict:
    out = {**prompt_row(cfg, 0, 0), "_rowidx": rollout,
           "_minirl": {"step": 0, "group": 0, "rollout": rollout, "attempt": 0}}
    out["responses_create_params"] = with_extra_body(out["responses_create_params"], seed=5 + rollout)
    return out


def test_a_lost_call_log_masks_the_rollout_under_all_and_one_segment_under_any(stack, base_cfg, tokenizer, tmp_path):
    cfg = copy.deepcopy(base_cfg)
    cfg.env.num_rooms = 3  # the shipped compaction splits a 3-room episode into several segments
    cfg.agent.max_steps = 3
    cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt = 1, 2
    cfg.faults.inject = [FaultSpec(kind="call_log_lost", step=0, group=0, rollout=0, call=1)]

    async def go():
        async with stack(cfg) as s, aiohttp.ClientSession() as http:
            bodies = []
            for r in range(2):
                async with http.post(s.agent_url + "/run", json=row(cfg, r)) as resp:
                    assert resp.status == 200
                    bodies.append(await resp.json(content_type=None))
            return bodies, s.model.take_calls(0), s.model.calls.lost

    bodies, calls, lost = asyncio.run(go())
    assert lost == 1 and {(c["rollout"], c["call"]) for c in calls if c["rollout"] == 0} == {(0, 0), (0, 2)}
    fresh = [parse_rollout(b, Coords(0, 0, r, 0), vocab_size=len(tokenizer),
                           max_len=cfg.policy.max_total_sequence_length, overlong_filtering=True)
             for r, b in enumerate(bodies)]
    assert len(fresh[0].calls) == 3 and len(fresh[0].traces) >= 2, [t.calls for t in fresh[0].traces]
    assert fresh[0].traces[0].calls == 2  # the lost call 1 shares its segment with the recorded call 0
    seen = {}
    for validity in ("all", "any"):
        rollouts = copy.deepcopy(fresh)
        counts = Ledger(tmp_path / validity, validity).close_step(0, calls, rollouts, version=0)
        assert counts["calls_unrecorded"] == 1
        cfg.grpo.segment_validity = validity
        batch, stats = assemble(cfg, [GroupOutcome(0, "committed", dict(enumerate(rollouts)))], 0)
        # the ledger's trained calls are the batch's trained tokens, call for call
        lines = [json.loads(x) for x in open(tmp_path / validity / "step_0.jsonl")]
        trained = [x for x in lines if x["ledger_status"] == "trained"]
        assert counts["calls_trained"] == len(trained) and counts["calls_masked"] == len(lines) - len(trained)
        assert sum(len(x["generation_token_ids"]) for x in trained) == int(batch.global_valid_tokens)
        first, segment_of = 0, {}
        for k, t in enumerate(rollouts[0].traces):
            segment_of.update({i: k for i in range(first, first + t.calls)})
            first += t.calls
        for x in lines:
            if x["rollout"] == 0:
                masked = rollouts[0].mask_reason or rollouts[0].traces[segment_of[x["call"]]].mask_reason
                assert x["ledger_status"] == ("masked" if masked else "trained"), (validity, x["call"])
        seen[validity] = (rollouts[0].mask_reason, stats["rollouts_masked"], stats["segments_masked"],
                          int(batch.global_valid_tokens))
    others = sum(len(c.gen) for c in fresh[1].calls)  # the sibling's tokens, trained under both
    assert seen["all"][:2] == ("unrecorded_calls", 1) and seen["all"][3] == others
    assert seen["any"][:3] == (None, 0, 1) and seen["any"][3] > others  # rollout 0's whole segments train
