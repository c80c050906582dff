"""The failure policy, driven through real servers with faults from the seeded fault config.

Like NeMo-RL's redispatch tests, these assert invariants rather than call counts: nothing is
committed unless it succeeded, every reservation is released, each attempt gets a fresh id,
cancellation is never retried, and the backoff schedule (recorded by an injected sleep)."""

from __future__ import annotations

import asyncio
import copy
import json
import re

import pytest

from helpers import serve_run
from minirl.config import FaultSpec
from minirl.data import prompt_row
from minirl.rollout.evidence import Ledger
from minirl.wire import (
    GymTransportError,
    RolloutDataFailure,
    RolloutRedispatchExhausted,
    RolloutStall,
    RolloutTimeout,
)
from minirl.rollout.manager import RolloutManager

VOCAB = 512


def policy_cfg(base_cfg, faults=(), groups=2, gens=2, **rf):
    cfg = copy.deepcopy(base_cfg)
    cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt = groups, gens
    cfg.policy.train_global_batch_size = groups * gens
    cfg.faults.inject = [FaultSpec(**f) for f in faults]
    r = cfg.async_rl.rollout_failure
    r.backoff_base_s, r.max_backoff_s, r.max_infra_attempts_per_prompt = 1.0, 3.0, 4
    r.max_consecutive_dropped_prompts = r.max_skipped_prompts = 0
    r.nemo_gym.max_row_attempts = 2
    for key, value in rf.items():
        if key == "redispatch":
            cfg.context_compaction.redispatch_dropped_groups = value
        elif key == "rollout_timeout_s":
            r.nemo_gym.rollout_timeout_s = value
        elif key == "stall_timeout_s":
            cfg.async_rl.stall_watchdog.stall_timeout_s = value
        else:
            setattr(r, key, value)
    return cfg


class Run:
    def __init__(self):
        self.events, self.sleeps, self.manager, self.outcomes, self.calls, self.error = [], [], None, None, [], None

    def failures(self, decision=None):
        return [e for e in self.events if e["type"] == "failure" and (decision is None or e["decision"] == decision)]


def run_step(stack, cfg, step=0, cancel_after=None) -> Run:
    run = Run()

    async def sleep(s):
        run.sleeps.append(s)

    async def go():
        async with stack(cfg) as s:
            m = run.manager = RolloutManager(cfg, [s.agent_url], run.events.append, VOCAB, sleep=sleep)
            rows = [prompt_row(cfg, step, g) for g in range(cfg.grpo.num_prompts_per_step)]
            task = asyncio.create_task(m.run_step(step, rows))
            try:
                if cancel_after is not None:
                    while not m.in_flight:
                        await asyncio.sleep(0.05)
                    await asyncio.sleep(cancel_after)
                    task.cancel()
                run.outcomes = await task
            except BaseException as exc:
                run.error = exc
            finally:
                await m.session.close()
                run.calls = s.model.take_calls(step)

    asyncio.run(go())
    return run


def committed_attempts(run):
    return {r.coords for o in run.outcomes or [] for r in o.rollouts.values()}


def assert_invariants(run):
    m = run.manager
    assert m.reservations == {} and m.in_flight == {}, "every reservation is released"
    failed = {(e["step"], e["group"], e["rollout"], e["attempt"]) for e in run.failures()}
    ok = {(c.step, c.group, c.rollout, c.attempt) for c in committed_attempts(run)}
    assert not failed & ok, "nothing is committed unless it succeeded"
    # a row fails at most once per group attempt, so a row's group-level failures never share an id
    gids = [(e["step"], e["group"], e["rollout"], e["group_attempt"])
            for e in run.failures() if e.get("scope") != "row"]
    assert len(gids) == len(set(gids)), "each group attempt gets a fresh id"


def test_infra_backoff_schedule_then_drop_budget(stack, base_cfg):
    always = {"kind": "agent_exception", "step": 0, "group": 0, "rollout": 0}
    run = run_step(stack, policy_cfg(base_cfg, [always]))
    assert run.sleeps == [1.0, 2.0, 3.0], "min(base * 2**(k-1), max) between the 4 attempts"
    assert isinstance(run.error, RolloutRedispatchExhausted)
    msg = str(run.error)
    assert msg.startswith("prompt idx=0 exhausted its infrastructure retry budget after 4 attempt(s) "
                          "(max_infra_attempts_per_prompt=4)")
    assert "this was drop 1 with no rollout committed in between, exceeding max_consecutive_dropped_prompts=0" in msg
    assert "Last failure was GymTransportError: NeMo-Gym /run failed with HTTP 500" in msg
    # each group attempt re-sent only the failing row, twice (max_row_attempts=2): attempts 0..7
    assert sorted(e["attempt"] for e in run.failures() if e["group"] == 0) == list(range(8))
    assert_invariants(run)

    run = run_step(stack, policy_cfg(base_cfg, [always], max_consecutive_dropped_prompts=1))
    assert run.error is None
    assert [o.status for o in run.outcomes] == ["dropped", "committed"]
    assert [e["decision"] for e in run.events if e["type"] == "drop"] == ["dropped"]
    assert_invariants(run)


def test_row_redispatch_resends_only_the_failed_row(stack, base_cfg):
    once = {"kind": "agent_exception", "step": 0, "group": 1, "rollout": 0, "attempt": 0}
    run = run_step(stack, policy_cfg(base_cfg, [once]))
    assert run.error is None and run.sleeps == []
    g1 = run.outcomes[1]
    assert g1.status == "committed" and g1.row_retries == 1 and g1.redispatched
    assert g1.rollouts[0].coords.attempt == 1 and g1.rollouts[1].coords.attempt == 0
    sibling_calls = {c["attempt"] for c in run.calls if (c["group"], c["rollout"]) == (1, 1)}
    assert sibling_calls == {0}, "the successful sibling was not re-run"
    assert_invariants(run)


def test_failed_attempt_calls_are_retired_never_trained(stack, base_cfg):
    once = {"kind": "agent_exception", "step": 0, "group": 0, "rollout": 1, "attempt": 0}
    run = run_step(stack, policy_cfg(base_cfg, [once]))
    rollouts = [r for o in run.outcomes for r in o.rollouts.values()]
    counts = Ledger(None).close_step(0, run.calls, rollouts, version=0)
    retired = [c for c in run.calls if (c["group"], c["rollout"], c["attempt"]) == (0, 1, 0)]
    assert retired and counts["calls_retired"] == len(retired)
    trained = {tuple(c.gen) for r in rollouts for c in r.calls}
    ledger_keys = {tuple(c["generation_token_ids"]): (c["group"], c["rollout"], c["attempt"])
                   for c in run.calls if c["status"] == 200}
    assert all(ledger_keys[g] != (0, 1, 0) for g in trained), "no trained call comes from the failed attempt"
    assert all(ledger_keys[g][2] == (1 if ledger_keys[g][:2] == (0, 1) else 0) for g in trained)


def test_upstream_cc_never_redispatches(stack, base_cfg):
    once = {"kind": "agent_exception", "step": 0, "group": 1, "rollout": 0, "attempt": 0}
    run = run_step(stack, policy_cfg(base_cfg, [once], redispatch=False))
    assert isinstance(run.error, RolloutRedispatchExhausted) and run.sleeps == []
    assert "after 1 attempt(s)" in str(run.error) and "exceeding max_consecutive_dropped_prompts=0" in str(run.error)
    # the drop past the budget ends the run: its row's event says so, as its `drop` event (before: `dropped`)
    assert [e["decision"] for e in run.failures()] == ["raised"]
    assert [e["decision"] for e in run.events if e["type"] == "drop"] == ["raised"]
    assert_invariants(run)


@pytest.mark.parametrize("kind,cls,text", [("transport", GymTransportError, "failed in transport"),
                                            ("timeout", RolloutTimeout, "exceeded 6.0s")])
def test_transport_and_timeout_end_like_lane_b(stack, base_cfg, kind, cls, text):
    """The review table's last row under the upstream preset: budget 0 raises at the first drop;
    budget 5 keeps going and the step falls below the floor of 4 (min_step_batch_fraction=1)."""
    from minirl.controller import check_step

    fault = {"kind": kind, "step": 0, "group": 1, "rollout": 0, "attempt": 0}
    run = run_step(stack, policy_cfg(base_cfg, [fault], groups=4, redispatch=False, rollout_timeout_s=6.0))
    assert (isinstance(run.error, RolloutRedispatchExhausted)
            and "exceeding max_consecutive_dropped_prompts=0" in str(run.error))
    (failure,) = run.failures()
    assert failure["class"] == "infra" and failure["reason"] == cls.__name__ and text in failure["error"]
    assert failure["decision"] == "raised"

    cfg = policy_cfg(base_cfg, [fault], groups=4, redispatch=False, rollout_timeout_s=6.0,
                     max_consecutive_dropped_prompts=5)
    cfg.context_compaction.allow_step_shrink, cfg.async_rl.rollout_failure.min_step_batch_fraction = False, 1.0
    run = run_step(stack, cfg)
    assert run.error is None and [o.status for o in run.outcomes] == ["committed", "dropped", "committed", "committed"]
    with pytest.raises(RuntimeError,
                       match=r"training step 0 lost 1 of 4 prompt group\(s\), leaving 3, below the floor of 4"):
        check_step(cfg, 0, run.outcomes)


def test_data_failure_retried_without_backoff_then_raised_or_skipped(stack, base_cfg):
    bad = {"kind": "bad_output", "step": 0, "group": 0, "rollout": 0}
    run = run_step(stack, policy_cfg(base_cfg, [bad], max_data_attempts_per_prompt=2))
    assert isinstance(run.error, RolloutDataFailure) and "invalid JSON" in str(run.error)
    assert run.sleeps == []
    assert [e["decision"] for e in run.failures()] == ["retried", "raised"]
    assert_invariants(run)

    run = run_step(stack, policy_cfg(base_cfg, [bad], max_data_attempts_per_prompt=2, max_skipped_prompts=1))
    assert run.error is None and run.outcomes[0].status == "skipped" and run.manager.skipped == 1
    (skip,) = [e for e in run.events if e["type"] == "skip"]  # the group's own line, as a drop has
    assert (skip["step"], skip["group"], skip["skipped"], skip["decision"]) == (0, 0, 1, "skipped")

    both = {"kind": "bad_output", "step": 0, "rollout": 0}  # groups 0 and 1: the second exceeds the budget
    run = run_step(stack, policy_cfg(base_cfg, [both], max_data_attempts_per_prompt=1, max_skipped_prompts=1))
    assert isinstance(run.error, RolloutDataFailure)
    assert str(run.error).startswith("skipped 1 prompts and this one also exhausted its data budget, exceeding "
                                     "max_skipped_prompts=1; the dataset or sequence-length configuration is likely "
                                     "wrong. ")
    assert "invalid JSON" in str(run.error.__cause__)
    # the cause, named (the two cut bodies may fail to parse at different tokens: one or both count as one failure)
    assert re.search(r"Dominant failure \((all 2 lost group\(s\)|1 of 2 lost groups)\): AgentBadAnswer: "
                     r"malformed /run result: NeMo-Gym /run for s0\.g[01]\.r0\.a0 returned invalid JSON",
                     str(run.error)), run.error


def test_a_group_with_every_rollout_masked_has_no_owner_and_drops_under_cc(stack, base_cfg):
    overflow = {"kind": "context_overflow", "step": 0, "group": 0}
    run = run_step(stack, policy_cfg(base_cfg, [overflow], max_consecutive_dropped_prompts=1))
    assert run.error is None
    assert run.outcomes[0].status == "dropped" and "no valid owner" in run.outcomes[0].reason
    assert "capture_failed" in run.outcomes[0].reason and "retry budget" not in run.outcomes[0].reason
    assert run.outcomes[1].status == "committed"
    run = run_step(stack, policy_cfg(base_cfg, [overflow]))  # budget 0: its own reason, not the infra one
    assert isinstance(run.error, RolloutRedispatchExhausted)
    assert str(run.error).startswith("prompt idx=0 has no valid owner (every rollout masked: capture_failed)")


def test_without_cc_an_all_masked_group_trains_with_zero_loss(stack, base_cfg):
    from minirl.controller import assemble

    overflow = {"kind": "context_overflow", "step": 0, "group": 0}
    cfg = policy_cfg(base_cfg, [overflow])
    cfg.context_compaction.enabled, cfg.agent.name, cfg.agent.context_history.enabled = False, "simple_agent", False
    run = run_step(stack, cfg)
    assert run.error is None and [o.status for o in run.outcomes] == ["committed", "committed"]
    batch, stats = assemble(cfg, run.outcomes, pad_id=0)
    g0 = batch.group == 0
    assert (batch.sample_mask[g0] == 0).all() and (batch.advantages[g0] == 0).all()
    assert stats["groups_trained"] == 2 and stats["rollouts_masked"] == 2


def test_a_model_error_fails_the_row_and_is_redispatched_not_masked(stack, base_cfg):
    """Issue I: only lane A's 400 is absorbed by the agent; a model server's 500 fails /run (INFRA)."""
    once = {"kind": "model_error", "step": 0, "group": 1, "rollout": 0, "attempt": 0}
    run = run_step(stack, policy_cfg(base_cfg, [once]))
    assert run.error is None
    g1 = run.outcomes[1]
    assert g1.status == "committed" and g1.row_retries == 1
    assert g1.rollouts[0].coords.attempt == 1 and g1.rollouts[0].sample_mask == 1
    (failure,) = run.failures()
    assert (failure["class"], failure["reason"],
            failure["error_type"]) == ("infra", "GymTransportError", "ModelCallFailed")
    assert "injected model_error at s0.g1.r0.a0.c0" in failure["error"]
    assert_invariants(run)

    run = run_step(stack, policy_cfg(base_cfg, [once], redispatch=False))  # upstream: lane B
    assert isinstance(run.error, RolloutRedispatchExhausted)
    assert isinstance(run.error.__cause__, GymTransportError), "chained to the last failure"


def test_guard_rejections_are_counted_from_the_typed_error_body(stack, base_cfg):
    reject = {"kind": "guard_reject", "step": 0, "group": 1, "rollout": 0, "attempt": 0}
    cfg = policy_cfg(base_cfg, [reject])
    cfg.agent.context_history.guards.on_reject = "raise"
    run = run_step(stack, cfg)
    assert run.error is None and [o.guard_rejections for o in run.outcomes] == [0, 1]
    (failure,) = run.failures()
    assert failure["error_type"] == "ContextGuardRejected"


def test_a_lost_groups_ended_episode_still_counts_its_guard_rejection(stack, base_cfg):
    """Under the default on_reject=end_episode a rejection ends the episode and the row returns; group 1's
    sibling then fails (every /run cut) and the group is dropped. Its outcome still counts the rejection,
    as it counts the row returned (docs/contracts.md: the counts sum over every group outcome the step
    took). Before, only the kept rollouts' rejections were counted (by the controller): a lost group's
    were in no metric. Group 0's kept rollout counts its own once."""
    faults = [{"kind": "guard_reject", "step": 0, "group": 1, "rollout": 0, "call": 1},
              {"kind": "guard_reject", "step": 0, "group": 0, "rollout": 1, "call": 1},
              {"kind": "transport", "step": 0, "group": 1, "rollout": 1}]
    cfg = policy_cfg(base_cfg, faults, max_infra_attempts_per_prompt=1, max_consecutive_dropped_prompts=1)
    assert cfg.agent.context_history.guards.on_reject == "end_episode"
    run = run_step(stack, cfg)
    assert run.error is None, run.error
    assert [o.status for o in run.outcomes] == ["committed", "dropped"]
    assert [(o.rows_returned, o.guard_rejections) for o in run.outcomes] == [(2, 1), (1, 1)]
    assert not any(e.get("error_type") == "ContextGuardRejected" for e in run.failures()), "no send failed on it"
    assert_invariants(run)


def test_the_group_deadline_covers_a_whole_group_attempt_and_keeps_what_came_back(stack, base_cfg):
    """Upstream's rollout_timeout_s: one deadline per group attempt, row re-sends included."""
    hang = {"kind": "timeout", "step": 0, "group": 0, "rollout": 0, "attempt": 0}
    cfg = policy_cfg(base_cfg, [hang], groups=1, rollout_timeout_s=4.0)
    run = run_step(stack, cfg)
    assert run.error is None and run.sleeps == [1.0]
    g0 = run.outcomes[0]
    assert g0.status == "committed" and g0.group_attempts == 2
    assert g0.rollouts[1].coords.attempt == 0, "the sibling that came back before the deadline is kept"
    assert g0.rollouts[0].coords.attempt == 1
    (failure,) = run.failures()
    assert failure["error"] == "NeMo-Gym prompt group exceeded 4.0s" and failure["decision"] == "retried"
    assert_invariants(run)


def test_the_group_deadline_keeps_a_failed_rows_own_failure(stack, base_cfg):
    """Row 0 fails both its sends (HTTP 500) while row 1 hangs past the deadline: row 0's failure
    event names its own failure, not the deadline's RolloutTimeout (before, the deadline rewrote every
    failure that was not terminal, so a DATA failure there was retried with backoff as INFRA)."""
    faults = [{"kind": "agent_exception", "step": 0, "group": 0, "rollout": 0, "attempt": a} for a in (0, 1)]
    faults.append({"kind": "timeout", "step": 0, "group": 0, "rollout": 1, "attempt": 0})
    run = run_step(stack, policy_cfg(base_cfg, faults, groups=1, rollout_timeout_s=4.0))
    assert run.error is None and run.outcomes[0].status == "committed" and run.sleeps == [1.0]
    by_row = {e["rollout"]: e for e in run.failures("retried") if e.get("scope") != "row"}
    assert by_row[0]["reason"] == "GymTransportError" and by_row[0]["attempt"] == 1
    assert by_row[1]["reason"] == "RolloutTimeout" and by_row[1]["error"] == "NeMo-Gym prompt group exceeded 4.0s"
    assert_invariants(run)


def test_lane_a_masks_one_rollout_and_its_sibling_trains(stack, base_cfg):
    overflow = {"kind": "context_overflow", "step": 0, "group": 1, "rollout": 0}
    run = run_step(stack, policy_cfg(base_cfg, [overflow]))
    g1 = run.outcomes[1]
    assert g1.status == "committed"
    assert g1.rollouts[0].mask_reason == "capture_failed" and g1.rollouts[1].sample_mask == 1
    assert run.failures() == []


def test_cancellation_is_never_retried(stack, base_cfg):
    hang = {"kind": "timeout", "step": 0, "group": 0, "rollout": 0}
    run = run_step(stack, policy_cfg(base_cfg, [hang], rollout_timeout_s=60.0), cancel_after=0.5)
    assert isinstance(run.error, asyncio.CancelledError)
    assert run.failures("retried") == [] and run.sleeps == []
    assert_invariants(run)


def test_stall_watchdog_raises_with_what_is_in_flight(stack, base_cfg):
    hang = {"kind": "timeout", "step": 0, "group": 1, "rollout": 1}
    cfg = policy_cfg(base_cfg, [hang], rollout_timeout_s=120.0, stall_timeout_s=2.0)
    import time

    t0 = time.monotonic()
    run = run_step(stack, cfg)
    elapsed = time.monotonic() - t0
    assert isinstance(run.error, RolloutStall)
    assert "s0.g1.r1.a0" in str(run.error) and "stall_timeout_s=2.0" in str(run.error)
    assert elapsed < 20
    assert_invariants(run)


BAD_RESULTS = {
    0: ("malformed", "returned invalid JSON"),
    1: ("nan", "Generation logprobs contain NaN"),
    2: ("oov", "token id 9999 in generation_token_ids is out of vocabulary (size 512)"),
    3: ("long", "trace of 1030 tokens exceeds policy.max_total_sequence_length=1024"),
    4: ("empty", "empty episode: the /run result has no trainable model call"),
}


def test_bad_input_from_an_external_agent_is_data_named_and_never_trained(base_cfg):
    """An external Gym-style agent server (`agent.external_url`) answering each group with one kind
    of broken result: each is a DATA failure whose error names the problem; nothing is trained."""
    from aiohttp import web

    async def run_handler(request):
        row = await request.json()
        kind = BAD_RESULTS[row["_minirl"]["group"]][0]
        item = {"type": "function_call", "name": "open_door", "arguments": "{}", "call_id": "c",
                "prompt_token_ids": [1, 2, 3], "generation_token_ids": [5, 6], "generation_log_probs": [-0.1, -0.2]}
        if kind == "malformed":
            return web.Response(text='{"response": {"output": [', content_type="application/json")
        if kind == "nan":
            item["generation_log_probs"] = [-0.1, float("nan")]
        if kind == "oov":
            item["generation_token_ids"] = [5, 9999]
        if kind == "long":
            item["prompt_token_ids"] = [1] * 1028
        output = [] if kind == "empty" else [item]
        return web.json_response({**row, "response": {"output": output}, "reward": 1.0})

    cfg = policy_cfg(base_cfg, groups=5, gens=1, max_data_attempts_per_prompt=1, max_skipped_prompts=5)
    events = []

    async def go():
        runner, url = await serve_run(run_handler)
        m = RolloutManager(cfg, [url], events.append, VOCAB)
        try:
            return await m.run_step(0, [prompt_row(cfg, 0, g) for g in range(5)])
        finally:
            await m.session.close()
            await runner.cleanup()

    outcomes = asyncio.run(go())
    assert [o.status for o in outcomes] == ["skipped"] * 5
    assert all(o.rollouts == {} for o in outcomes), "nothing reaches the trainer"
    failures = [e for e in events if e["type"] == "failure"]
    assert sorted(e["group"] for e in failures) == list(range(5))
    for e in failures:
        assert e["class"] == "data" and e["decision"] == "skipped"
        assert BAD_RESULTS[e["group"]][1] in e["error"], e


def test_a_programming_error_propagates_and_is_never_a_skipped_prompt(base_cfg):
    """Only the taxonomy's failures are retried or skipped: a bug (here a KeyError raised while
    handling a result) ends the run as itself, whatever the skip budget."""

    async def broken_post(session, url, row):
        return {}["missing"]

    cfg = policy_cfg(base_cfg, max_skipped_prompts=5)
    events = []

    async def go():
        m = RolloutManager(cfg, ["http://127.0.0.1:9"], events.append, VOCAB, post=broken_post)
        try:
            return await m.run_step(0, [prompt_row(cfg, 0, g) for g in range(2)])
        finally:
            await m.session.close()

    with pytest.raises(KeyError):
        asyncio.run(go())
    assert not [e for e in events if e["type"] == "failure"]


# ---------------------------------------------------------------------------- issue 29
def deep_json(depth: int) -> str:
    return "[" * depth + "]" * depth


GOOD_ITEM = {"type": "function_call", "name": "open_door", "arguments": "{}", "call_id": "c",
             "prompt_token_ids": [1, 2, 3], "generation_token_ids": [5, 6], "generation_log_probs": [-0.1, -0.2]}
EMPTY_REPLY = {"type": "message", "role": "assistant"}
ISSUE_29_RESULTS = {  # group: (what rollout 0 of the group answers, as JSON text; the message fragment)
    0: ('{"response": {"output": [ITEM]}, "reward": 1' + "0" * 400 + "}",
        "reward must be a finite number with |reward| <="),
    1: ('{"response": {"output": [ITEM_LPS]}, "reward": 1.0}', "generation_log_probs must be finite and <= 0"),
    2: ('{"response": {"output": [ITEM_F32]}, "reward": 1.0}', "got -1e+308 (finite in float32"),
    3: ('{"response": {"output": [ITEM]}, "reward": 1.0, "evidence": {"compactions": "many"}}', "evidence.compactions"),
    4: ('{"response": {"output": [ITEM]}, "reward": 1.0, "evidence": {"guard": 5}}', "evidence.guard"),
    5: ('{"response": {"output": [ITEM]}, "reward": 1.0, "evidence": {"guard": [1]}}', "evidence.guard"),
    6: ('{"response": {"output": [ITEM, CONTENT_5]}, "reward": 1.0}', "response.output[1].content must be"),
    7: ('{"response": {"output": [ITEM, CONTENT_NULL]}, "reward": 1.0}', "response.output[1].content must be"),
    8: ('{"response": {"output": ' + deep_json(200_000) + '}, "reward": 1.0}', "nested deeper than it parses"),
    9: ('{"response": {"output": [ITEM]}, "reward": 1e38}', "reward must be a finite number with |reward| <="),
}


def _issue_29_body(group: int) -> str:
    text = ISSUE_29_RESULTS[group][0]
    for name, item in {"ITEM_LPS": {**GOOD_ITEM, "generation_log_probs": [-0.1, -(10**400)]},
                       "ITEM_F32": {**GOOD_ITEM, "generation_log_probs": [-0.1, -1e308]},
                       "CONTENT_5": {**EMPTY_REPLY, "content": 5},
                       "CONTENT_NULL": {**EMPTY_REPLY, "content": [{"text": None}]},
                       "ITEM": GOOD_ITEM}.items():
        text = text.replace(name, json.dumps(item))
    return text


def test_each_malformed_result_of_issue_29_costs_its_group_one_data_failure(base_cfg):
    """An external agent server answers rollout 0 of each group with one of the issue's shapes
    (rollout 1 is good): each group's malformed row is one DATA failure naming the field, retried
    without backoff and then skipped within the skip budget (the normal DATA policy); no bare
    Python exception escapes, the good sibling is never trained alone, no backoff is slept."""
    from aiohttp import web

    async def run_handler(request):
        row = await request.json()
        c = row["_minirl"]
        if c["rollout"] == 0:
            return web.Response(text=_issue_29_body(c["group"]), content_type="application/json")
        return web.json_response({**row, "response": {"output": [GOOD_ITEM]}, "reward": 0.0})

    n = len(ISSUE_29_RESULTS)
    cfg = policy_cfg(base_cfg, groups=n, gens=2, max_data_attempts_per_prompt=2, max_skipped_prompts=n)
    run = Run()

    async def sleep(s):
        run.sleeps.append(s)

    async def go():
        runner, url = await serve_run(run_handler, client_max_size=64 * 2**20)
        m = run.manager = RolloutManager(cfg, [url], run.events.append, VOCAB, sleep=sleep)
        try:
            return await m.run_step(0, [prompt_row(cfg, 0, g) for g in range(n)])
        finally:
            await m.session.close()
            await runner.cleanup()

    run.outcomes = asyncio.run(go())
    assert [o.status for o in run.outcomes] == ["skipped"] * n and run.manager.skipped == n
    assert all(o.rollouts == {} for o in run.outcomes), "nothing reaches the trainer"
    assert run.sleeps == []
    for g, (_, fragment) in ISSUE_29_RESULTS.items():
        mine = [e for e in run.failures() if e["group"] == g]
        assert [e["decision"] for e in mine] == ["retried", "skipped"], mine
        assert {e["rollout"] for e in mine} == {0} and {e["class"] for e in mine} == {"data"}
        assert {e["reason"] for e in mine} == {"RolloutDataFailure"}
        assert all(fragment in e["error"] for e in mine), (g, mine[0]["error"])
    assert_invariants(run)


def test_a_group_deadline_before_any_send_names_fresh_attempts_never_minus_one(base_cfg):
    """A deadline that ends the group attempt before its rows are sent (here 0 s) still writes
    each row's failure under an attempt id of its own: 0, then 1 (never -1, never reused)."""
    cfg = policy_cfg(base_cfg, groups=1, gens=2, max_infra_attempts_per_prompt=2, max_consecutive_dropped_prompts=1)
    cfg.async_rl.rollout_failure.nemo_gym.rollout_timeout_s = 0.0
    run = Run()

    async def sleep(s):
        run.sleeps.append(s)

    async def go():
        m = run.manager = RolloutManager(cfg, ["http://127.0.0.1:9"], run.events.append, VOCAB, sleep=sleep)
        try:
            return await m.run_step(0, [prompt_row(cfg, 0, 0)])
        finally:
            await m.session.close()

    run.outcomes = asyncio.run(go())
    assert run.outcomes[0].status == "dropped" and run.outcomes[0].row_sends == 0
    assert sorted((e["rollout"], e["attempt"]) for e in run.failures()) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [e["decision"] for e in run.failures()] == ["retried", "retried", "dropped", "dropped"]
    assert run.manager.reservations == {} and run.manager.in_flight == {}
    assert len({e["group_attempt"] for e in run.failures()}) == 2, \
        "one fresh group id per group attempt, shared by its rows"


def test_a_group_retry_keeps_returned_rows_unless_keep_returned_rows_is_false(stack, base_cfg):
    """Fix 3's design: a group retry re-sends only the rows that did not come back; with
    `nemo_gym.keep_returned_rows=false` (upstream) it re-runs every row of the group. With
    `max_row_attempts=1` rollout 0's INFRA failure fails the group attempt at once."""
    once = {"kind": "agent_exception", "step": 0, "group": 0, "rollout": 0, "attempt": 0}
    for keep, sibling_attempts in ((True, {0}), (False, {0, 1})):
        cfg = policy_cfg(base_cfg, [once], groups=1)
        cfg.async_rl.rollout_failure.nemo_gym.max_row_attempts = 1
        cfg.async_rl.rollout_failure.nemo_gym.keep_returned_rows = keep
        run = run_step(stack, cfg)
        assert run.error is None and run.sleeps == [1.0]
        g0 = run.outcomes[0]
        assert g0.status == "committed" and g0.group_attempts == 2
        assert g0.rollouts[0].coords.attempt == 1 and g0.rollouts[1].coords.attempt == max(sibling_attempts)
        assert {c["attempt"] for c in run.calls if c["rollout"] == 1} == sibling_attempts
        discards = [e for e in run.events if e["type"] == "discard"]  # the returned row thrown away says so
        assert [(e["rollout"], e["attempt"], e["group_attempt"]) for e in discards] == ([] if keep else [(1, 0, 2)])
        assert_invariants(run)


def test_the_exhausted_message_names_the_prompts_stream_index_as_upstreams_idx(stack, base_cfg):
    """Upstream's `prompt idx={idx}` is the sample's dataset index: here group 1 of step 1 with
    2 prompts a step is prompt 3 of the stream, not slot 1 of its step."""
    always = {"kind": "agent_exception", "step": 1, "group": 1, "rollout": 0}
    run = run_step(stack, policy_cfg(base_cfg, [always], redispatch=False), step=1)
    assert isinstance(run.error, RolloutRedispatchExhausted)
    assert str(run.error).startswith("prompt idx=3 exhausted its infrastructure retry budget after 1 attempt(s)")


def test_an_external_agents_forged_logprobs_and_stale_call_mask_their_rollouts(stack, base_cfg, engine):
    """Through the real model server and engine: an external agent (no rollout header) whose
    rollout 1 reports every logprob as -40 is masked (`calls_logprob_mismatch`), its honest sibling
    trains; at step 1 (after a weight update) rollout 0 returns a call it made and discarded at
    step 0: that call is stale, and it masks its rollout (`calls_stale`) instead of ending the run."""
    from aiohttp import ClientSession, web

    from minirl.agents.agent import chat_tools
    from minirl.agents.items import items_to_messages, reply_to_items
    from minirl.agents.model_client import HttpModelClient
    from minirl.trainer.policy_worker import PolicyWorker

    cfg = policy_cfg(base_cfg, groups=1, gens=2)
    stash = {}

    async def go():
        async with stack(cfg) as s, ClientSession() as http:
            client = HttpModelClient([s.model_url], cfg.policy.model_name, http)

            async def call(row, seed):
                params = row["responses_create_params"]
                reply = await client.chat(items_to_messages(params["input"]), chat_tools(params["tools"]),
                                          {"temperature": 1.0, "max_output_tokens": 6, "seed": seed}, "", None)
                return reply_to_items(reply.message, reply.evidence)

            async def run_handler(request):
                row = await request.json()
                c = row["_minirl"]
                if c["step"] == 1 and c["rollout"] == 0:
                    items = stash["discarded"]  # made at step 0, under the old weights
                else:
                    items = await call(row, 100 * c["step"] + c["rollout"])
                if c["step"] == 0 and c["rollout"] == 0:
                    stash["discarded"] = await call(row, 7)  # a second call it does not return now
                if c["rollout"] == 1 and c["step"] == 0:
                    items[-1]["generation_log_probs"] = [-40.0] * len(items[-1]["generation_log_probs"])
                return web.json_response({**row, "response": {"output": items}, "reward": float(c["rollout"])})

            runner, url = await serve_run(run_handler)
            m = RolloutManager(cfg, [url], [].append, VOCAB)
            ledger = Ledger(None)
            v0 = engine.version
            weights = PolicyWorker(base_cfg).get_weights()
            try:
                out0 = await m.run_step(0, [prompt_row(cfg, 0, 0)])
                kept0 = [out0[0].rollouts[r] for r in sorted(out0[0].rollouts)]
                counts0, left = ledger.match_external(0, s.model.take_calls(None), kept0, version=v0)
                await asyncio.wrap_future(engine.update_weights(weights, version=v0 + 1))
                out1 = await m.run_step(1, [prompt_row(cfg, 1, 0)])
                kept1 = [out1[0].rollouts[r] for r in sorted(out1[0].rollouts)]
                counts1, _ = ledger.match_external(1, left + s.model.take_calls(None), kept1, version=v0 + 1)
                return kept0, counts0, left, kept1, counts1
            finally:
                await asyncio.wrap_future(engine.update_weights(weights, version=v0))
                await m.session.close()
                await runner.cleanup()

    kept0, counts0, left, kept1, counts1 = asyncio.run(go())
    assert counts0["calls_matched"] == 1 and counts0["calls_logprob_mismatch"] == 1 and len(left) == 1
    assert [r.mask_reason for r in kept0] == [None, "logprob_mismatch"]
    assert "differs from the engine's record by" in kept0[1].evidence["errors"][-1]
    assert counts1["calls_matched"] == 1 and counts1["calls_stale"] == 1
    assert [r.mask_reason for r in kept1] == ["stale_calls", None]


def test_a_zero_backoff_restart_window_ends(base_cfg):
    """`backoff_base_s=0` is a valid config, and the restart window is measured in the group's waits: a group
    whose agent servers all refused it (nothing listens at the port: a real refused connection) retried for
    ever. In the window a wait is at least RESTART_POLL_S, so the group is dropped once its waits pass
    `agent_restart_window_s`."""
    from minirl.cluster import free_port
    from minirl.rollout.manager import RESTART_POLL_S
    from minirl.wire import RolloutRedispatchExhausted

    cfg = policy_cfg(base_cfg, groups=1, backoff_base_s=0.0, max_backoff_s=0.0, max_infra_attempts_per_prompt=2,
                     agent_restart_window_s=5.0)
    sleeps: list[float] = []

    async def sleep(s):
        sleeps.append(s)
        if len(sleeps) > 50:
            raise RuntimeError("the restart window never ended")

    async def go():
        m = RolloutManager(cfg, [f"http://127.0.0.1:{free_port('127.0.0.1')}"], lambda e: None, VOCAB, sleep=sleep)
        m.open()
        try:
            return await m.run_group(0, 0, prompt_row(cfg, 0, 0))
        finally:
            await m.session.close()

    with pytest.raises(RolloutRedispatchExhausted):
        asyncio.run(go())
    assert sleeps == [0.0] + [RESTART_POLL_S] * 5  # one within the attempt budget, then the window's 5 s
