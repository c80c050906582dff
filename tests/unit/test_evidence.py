"""Per-call evidence -> traces, and the DATA checks on /run results."""

import json
import math
import re

import numpy as np
import pytest

# imported here, at collection: pytest rewrites hypothesis (a plugin) on first import, and that
# compile() mid-session can hit CPython 3.11's AST recursion-depth check (gh-106905, shared state
# across threads) while an earlier test's server threads are alive
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minirl.config import MinirlConfig, step_floor
from minirl.controller import assemble, check_step
from minirl.rollout.evidence import Ledger, parse_rollout, split_traces
from minirl.types import Call, GroupOutcome, Rollout
from minirl.wire import Coords, RolloutDataFailure

C = Coords(0, 0, 0, 0)


def item(prompt, gen, lps=None):
    return {"type": "function_call", "name": "open_door", "arguments": "{}", "call_id": "c",
            "prompt_token_ids": prompt, "generation_token_ids": gen,
            "generation_log_probs": lps if lps is not None else [-0.5] * len(gen)}


def result(items, reward=1.0, **evidence):
    return {"response": {"output": items}, "reward": reward, "evidence": evidence}


def parse(res, max_len=100, overlong=False, cc=True):
    return parse_rollout(res, C, vocab_size=50, max_len=max_len, overlong_filtering=overlong, allow_rewrites=cc)


def test_prefix_compatible_calls_extend_one_trace():
    calls = [Call([1, 2], [3, 4], [-1.0, -2.0]), Call([1, 2, 3, 4, 9, 9], [5], [-3.0])]
    (t,) = split_traces(calls)
    assert t.tokens == [1, 2, 3, 4, 9, 9, 5]
    assert t.loss_mask == [0, 0, 1, 1, 0, 0, 1]
    assert t.logprobs == [0, 0, -1.0, -2.0, 0, 0, -3.0]
    assert t.calls == 2


def test_rewritten_history_starts_a_new_trace():
    calls = [Call([1, 2], [3, 4], [-1.0, -1.0]), Call([1, 7, 3, 4], [5], [-1.0]), Call([1, 7, 3, 4, 5, 8], [6], [-1.0])]
    traces = split_traces(calls)
    assert [t.tokens for t in traces] == [[1, 2, 3, 4], [1, 7, 3, 4, 5, 8, 6]]
    assert [t.loss_mask for t in traces] == [[0, 0, 1, 1], [0, 0, 0, 0, 1, 0, 1]]
    # every generated token is trained exactly once
    assert sum(sum(t.loss_mask) for t in traces) == sum(len(c.gen) for c in calls)


def test_all_traces_of_a_rollout_share_its_advantage():
    cfg = MinirlConfig()
    cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt = 1, 3
    rollouts = {}
    for r, reward in enumerate([1.0, 0.0, 0.5]):
        items = [item([1, 2], [3, 4]), item([1, 9, 3, 4], [5])] if r == 0 else [item([1, 2], [3])]
        rollouts[r] = parse_rollout(result(items, reward), Coords(0, 0, r, 0), vocab_size=50, max_len=100,
                                    overlong_filtering=False)
    assert len(rollouts[0].traces) == 2
    batch, stats = assemble(cfg, [GroupOutcome(0, "committed", rollouts)], pad_id=0)
    # rollout 0: others {0, 0.5}: mean 0.25, unbiased std sqrt(0.03125*... ) -> computed by hand
    others = [0.0, 0.5]
    mean = sum(others) / 2
    std = math.sqrt(sum((x - mean) ** 2 for x in others) / 1)
    want = (1.0 - mean) / (std + 1e-6)
    rows0 = batch.rollout == 0
    assert rows0.sum() == 2
    np.testing.assert_allclose(batch.advantages[rows0], [want, want], rtol=1e-6)
    assert stats["traces_trained"] == 4 and stats["rollouts_trained"] == 3


def test_lane_a_empty_reply_without_tokens_masks_the_rollout():
    empty = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": ""}]}
    r = parse(result([item([1, 2], [3]), empty]))
    assert r.capture_failed and r.sample_mask == 0 and r.mask_reason == "capture_failed"
    assert len(r.traces) == 1  # its tokens are present, with mask 0


def test_overlong_filtering_masks_only_rollouts_that_reach_the_sequence_limit():
    capped = result([item([1, 2], [3])])  # a reply cut by the per-call cap: not truncated (upstream)
    capped["response"]["incomplete_details"] = {"reason": "length"}
    assert parse(capped, overlong=True).mask_reason is None and parse(capped, overlong=True).sample_mask == 1
    full = result([item(list(range(1, 41)), [3] * 60)])  # 100 tokens = max_len
    assert parse(full).mask_reason is None and parse(full).sample_mask == 1  # truncated, but not filtered
    assert parse(full, overlong=True).mask_reason == "overlong"
    assert parse(result([item(list(range(1, 41)), [3] * 59)]), overlong=True).mask_reason is None


def test_without_compaction_a_rewritten_history_is_upstreams_non_contiguous_failure():
    rewritten = result([item([1, 2], [3, 4]), item([1, 7, 3, 4], [5])])
    assert len(parse(rewritten, cc=True).traces) == 2
    with pytest.raises(RolloutDataFailure, match="^Non-contiguous messages found!"):
        parse(rewritten, cc=False)
    assert len(parse(result([item([1, 2], [3]), item([1, 2, 3, 9], [5])]), cc=False).traces) == 1


@pytest.mark.parametrize(
    "res,message",
    [
        ("nope", "not a JSON object"),
        ({"reward": 1.0}, "missing response.output"),
        (result([item([1], [2])], reward=float("nan")), "reward must be a finite number"),
        (result([item([1], [2])], reward=1e39), "reward must be a finite number with |reward| <= 9.223e+08"),
        (result([item([1], [2])], reward=-3.5e38), "reward must be a finite number with |reward| <= 9.223e+08"),
        (result([item([1], [2, 3], [-0.5, float("inf")])]), "generation_log_probs must be finite and <= 0, got inf"),
        (result([item([1], [2, 3], [float("-inf"), -0.5])]), "generation_log_probs must be finite and <= 0, got -inf"),
        (result([item([1], [2, 3], [-0.5, 0.25])]), "generation_log_probs must be finite and <= 0, got 0.25"),
        (result([item([1], [2, 99])]), "token id 99 in generation_token_ids is out of vocabulary (size 50)"),
        (result([item([1], [2], [float("nan")])]), "Generation logprobs contain NaN"),
        (result([item([1], [2, 3], [-1.0])]), "one number per generated token"),
        (result([]), "empty episode"),
        (result([item(list(range(1, 40)), [1] * 70)]),
         "trace of 109 tokens exceeds policy.max_total_sequence_length=100"),
    ],
)
def test_bad_results_are_data_failures_naming_the_problem(res, message):
    with pytest.raises(RolloutDataFailure, match=re.escape(message)):
        parse(res)


def outcome(g, status, n=2):
    rollouts = {r: parse_rollout(result([item([1], [2])]), Coords(0, g, r, 0), vocab_size=50, max_len=100,
                                 overlong_filtering=False) for r in range(n)} if status == "committed" else {}
    return GroupOutcome(g, status, rollouts)


def step_cfg(shrink, fraction, cc=True):
    cfg = MinirlConfig()
    cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt = 4, 2
    cfg.policy.train_global_batch_size = 8
    cfg.context_compaction.enabled = cc
    cfg.context_compaction.allow_step_shrink = shrink
    cfg.async_rl.rollout_failure.min_step_batch_fraction = fraction
    return cfg


@pytest.mark.parametrize("n,fraction,floor", [(100, 0.55, 56), (10, 0.9, 9), (8, 0.75, 6), (4, 1.0, 4), (3, 0.5, 2)])
def test_floor_is_ceil_of_the_float_product_as_upstream(n, fraction, floor):
    cfg = step_cfg(True, fraction)
    cfg.grpo.num_prompts_per_step = n
    assert step_floor(cfg) == floor == math.ceil(n * fraction)


def test_a_shrunk_step_reports_its_target_not_its_size():
    outs = [outcome(0, "committed"), outcome(1, "dropped"), outcome(2, "committed"), outcome(3, "committed")]
    _, stats = assemble(step_cfg(True, 0.75), outs, pad_id=0)
    assert (stats["groups_target"], stats["groups_trained"], stats["dropped_prompt_groups"]) == (4, 3, 1)


def test_floor_message_is_upstreams():
    outs = [outcome(0, "committed"), outcome(1, "dropped"), outcome(2, "committed"), outcome(3, "committed")]
    with pytest.raises(RuntimeError, match=r"training step 7 lost 1 of 4 prompt group\(s\), leaving 3, below the floor "
                                           r"of 4 set by async_rl.rollout_failure.min_step_batch_fraction=1.0") as err:
        check_step(step_cfg(False, 1.0), 7, outs)
    text = str(err.value)  # the cause comes before upstream's guess that the generation fleet is failing
    assert text.index("Dominant failure") < text.index("Either the generation fleet") and ".." not in text
    check_step(step_cfg(True, 0.75), 7, outs)  # fix 1: trains 3 of 4


def test_a_replaced_prompt_is_no_lost_group_in_the_floor_message():
    """Under `replace` a prompt whose spare committed is `replaced`: the step did not lose it, so the floor
    message's dominant failure is the shortfall's alone (it read "all 2 lost group(s)" of a step that lost 1)."""
    outs = [outcome(0, "committed"), outcome(1, "dropped"), outcome(0, "replaced")]
    outs[1].reason, outs[2].reason = "GymTransportError: HTTP 503", "RolloutTimeout: exceeded 6.0s"
    cfg = step_cfg(False, 1.0)
    cfg.grpo.num_prompts_per_step = 2
    with pytest.raises(RuntimeError, match=r"lost 1 of 2 .*Dominant failure \(all 1 lost group\(s\)\): GymTransport"):
        check_step(cfg, 0, outs)


def test_cc_step_checks():
    partial = [outcome(g, "committed") for g in range(4)]
    del partial[2].rollouts[1]
    with pytest.raises(ValueError, match="CC optimizer step requires every rollout of every kept group"):
        check_step(step_cfg(True, 0.75), 0, partial)
    with pytest.raises(ValueError, match="CC optimizer step requires the full logical sample count"):
        check_step(step_cfg(False, 1.0), 0, partial)
    check_step(step_cfg(True, 0.75, cc=False), 0, partial)  # the ordinary path does not demand it


def record(c: Coords, call, prompt, gen, version=0, status=200):
    return {**c.as_dict(), "key": f"{c.key}.c{call}", "call": call, "status": status, "prompt_token_ids": prompt,
            "generation_token_ids": gen, "version_start": version, "version_end": version}


def test_ledger_masks_a_rollout_whose_calls_the_server_did_not_record():
    a, b = Coords(0, 0, 0, 0), Coords(0, 0, 1, 0)
    ra = parse(result([item([1, 2], [3]), item([1, 2, 3, 4], [5])]))
    ra.coords = a
    rb = parse(result([item([1, 2], [6])]))
    rb.coords = b
    calls = [record(a, 1, [1, 2, 3, 4], [5]), record(b, 0, [1, 2], [6])]  # a's first call was lost (restarted server)
    counts = Ledger(None).close_step(0, calls, [ra, rb], version=0)
    assert counts["calls_unrecorded"] == 1 and ra.mask_reason == "unrecorded_calls" and rb.sample_mask == 1
    with pytest.raises(RuntimeError, match="ledger mismatch: a trained call of attempt s0.g0.r1.a0"):
        Ledger(None).close_step(0, [record(b, 0, [1, 2], [7])], [rb], version=0)  # complete record, other tokens
    with pytest.raises(RuntimeError, match="policy-version discipline"):
        Ledger(None).close_step(0, [record(b, 0, [1, 2], [6], version=1)], [rb], version=0)


@pytest.mark.parametrize("validity", ["all", "any"])
def test_a_short_record_masks_the_segment_under_any_and_the_rollout_under_all(validity):
    """grpo.segment_validity at the ledger: a lost call masks the segment that holds it; under `all`
    (#4124's amin) its rollout goes too, under `any` (amax) the rollout still votes and trains its
    whole segments."""
    a, b = Coords(0, 0, 0, 0), Coords(0, 0, 1, 0)
    ra = parse(result([item([1, 2], [3]), item([7, 8], [9])]))  # a compaction rewrote the history: 2 segments
    ra.coords = a
    rb = parse(result([item([1, 2], [6])]))
    rb.coords = b
    calls = [record(a, 1, [7, 8], [9]), record(b, 0, [1, 2], [6])]  # a's first call was lost
    counts = Ledger(None, validity).close_step(0, calls, [ra, rb], version=0)
    assert counts["calls_unrecorded"] == 1 and [t.mask_reason for t in ra.traces] == ["unrecorded_calls", None]
    assert ra.mask_reason == ("unrecorded_calls" if validity == "all" else None)
    cfg = MinirlConfig()
    cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt = 1, 2
    cfg.grpo.segment_validity = validity
    batch, _ = assemble(cfg, [GroupOutcome(0, "committed", {0: ra, 1: rb})], pad_id=0)
    assert list(batch.sample_mask) == ([0, 0, 1] if validity == "all" else [0, 1, 1])


@pytest.mark.parametrize("key", ["s0a1", None])
def test_token_identical_summary_requests_train_only_the_kept_one(key):
    """A compaction's three requests share their prompt, and a peaked model answers them alike. The
    summary the agent kept is its request's record, found by the call key of its compaction record
    (here request 1, not the newest, so the key is what decides): the ledger retires the other two and
    `all_captured` leaves them out. A summary call without that key (another agent's) takes one record
    alike in content, the newest. Hand-built: tests/integration/test_summary_request_keys.py drives the
    real agent into identical rejected replies, but it keeps the newest of them."""
    from minirl.rollout.selection import select_calls

    turn = Call([1, 2], [3, 4], [-0.1, -0.1])
    record_of = {"outcome": "failed", "model_calls": 3, **({"call": key} if key else {})}
    summary = Call([1, 2, 3, 4, 5, 6], [9], [-0.1], kind="compaction_summary", compaction=record_of)
    calls = [{**record(C, 0, turn.prompt, turn.gen), "generation_log_probs": turn.logprobs, "t_start": 0.0}]
    calls += [{**record(C, f"s0a{n}", summary.prompt, summary.gen), "key": f"{C.key}.s0a{n}",
               "generation_log_probs": summary.logprobs, "t_start": 1.0 + n} for n in range(3)]
    r = Rollout(C, 0.0, [turn, summary], split_traces([turn, summary]), False, {})
    counts = Ledger(None).close_step(0, calls, [r], version=0)
    assert counts["calls_trained"] == 2 and counts["calls_retired"] == 2 and counts["calls_unrecorded"] == 0
    kept = key or "s0a2"
    rejected = Ledger._rejected_summaries(calls, r.calls)
    assert [c["call"] for c in calls if id(c) not in rejected] == [0, kept]
    assert select_calls("all_captured", [r], calls, max_len=100) == 0  # it trains what the agent returned
    assert [t.kind for t in r.traces] == ["turns", "compaction_summary"]


@pytest.mark.parametrize("key", ["s0a1", None])
def test_returned_history_takes_one_record_per_returned_call_in_order(key):
    """`returned_history`, the built-in a custom policy builds on (`resolve_selection_policy`): a peaked
    model answers two calls alike, so two records share their tokens. Each returned call takes one
    record, the first not taken yet (as the ledger matches them); before, every alike record went to
    the first such call and the list was cut to the returned count, which dropped the last call and
    named the wrong terminal response. A compaction's token-identical requests select the kept one
    (its call key, else the newest), never a rejected one, which `select_calls` refuses."""
    from minirl.rollout.selection import returned_history, select_calls

    a, b = Call([1, 2], [3], [-0.1]), Call([1, 2, 3, 4], [5], [-0.1])
    calls = [{**record(C, n, call.prompt, call.gen), "generation_log_probs": call.logprobs, "t_start": float(n)}
             for n, call in enumerate([a, a, b])]
    selected, terminal = returned_history(calls, {"returned": [a, a, b]})
    assert [r["call"] for r in selected] == [0, 1, 2] and terminal == f"{C.key}.c2"
    selected, terminal = returned_history(calls, {"returned": [a, b]})
    assert [r["call"] for r in selected] == [0, 2] and terminal == f"{C.key}.c2"
    r = Rollout(C, 0.0, [a, b], split_traces([a, b]), False, {})
    assert select_calls("returned_history", [r], calls, max_len=100) == 0 and r.calls == [a, b]

    record_of = {"outcome": "failed", "model_calls": 3, **({"call": key} if key else {})}
    summary = Call([1, 2, 3, 6], [9], [-0.1], kind="compaction_summary", compaction=record_of)
    requests = [{**record(C, f"s0a{n}", summary.prompt, summary.gen), "key": f"{C.key}.s0a{n}",
                 "generation_log_probs": summary.logprobs, "t_start": 3.0 + n} for n in range(3)]
    r = Rollout(C, 0.0, [a, summary], split_traces([a, summary], allow_rewrites=True), False, {})
    selected, terminal = returned_history(calls[:1] + requests, {"returned": r.calls})
    assert [x["call"] for x in selected] == [0, key or "s0a2"] and terminal == f"{C.key}.{key or 's0a2'}"
    assert select_calls("returned_history", [r], calls[:1] + requests, max_len=100) == 0


def test_an_external_agents_calls_are_matched_by_their_tokens():
    """J item 5: Gym sends no rollout header; each committed call is found in the servers'
    headerless records by prompt + generated ids, or its rollout is masked."""
    a, b = Coords(0, 0, 0, 0), Coords(0, 0, 1, 0)
    ra = parse(result([item([1, 2], [3]), item([1, 2, 3, 4], [5])]))
    ra.coords = a
    rb = parse(result([item([1, 2], [6])]))
    rb.coords = b
    unkeyed = lambda p, g, v=0: {"prompt_token_ids": p, "generation_token_ids": g, "status": 200,  # noqa: E731
                                 "version_start": v, "version_end": v, "generation_log_probs": [-0.5] * len(g)}
    # b's call is missing; [9] is another's
    pool = [unkeyed([1, 2], [3]), unkeyed([1, 2, 3, 4], [5]), unkeyed([9], [9])]
    counts, left = Ledger(None).match_external(0, pool, [ra, rb], version=0)
    assert (counts["calls_matched"], counts["calls_unrecorded"], counts["tokens_matched"]) == (2, 1, 2)
    assert ra.sample_mask == 1 and rb.mask_reason == "unrecorded_calls"
    assert left == [pool[2]]
    # issue 29: a call the engine ran under weights outside the window masks its rollout, never ends the run
    rb.mask_reason = None
    counts, _ = Ledger(None).match_external(3, [unkeyed([1, 2], [6], v=1)], [rb], version=3, oldest=2)
    assert counts["calls_stale"] == 1 and counts["calls_matched"] == 0 and rb.mask_reason == "stale_calls"
    assert "call 0 ran under weights [1], but step 3 trains versions 2..3" in rb.evidence["errors"][-1]


def test_an_external_agents_ledger_does_not_depend_on_arrival_order(tmp_path):
    """A rerun of the same seeded run must write the same ledger (tests/integration/test_generation_r3.py
    reruns one): the rollouts come back in completion order and the servers' records in arrival order,
    and two rollouts of a group may generate alike tokens under different seeds."""
    def rec(p, g, seed):
        return {"prompt_token_ids": p, "generation_token_ids": g, "status": 200, "seed": seed,
                "version_start": 0, "version_end": 0, "generation_log_probs": [-0.5] * len(g)}

    written = []
    for order in (1, -1):
        rollouts = []
        for n in range(3):
            r = parse(result([item([1, 2], [3]), item([1, 2, 3, 4], [5 + n])]))
            r.coords = Coords(0, 0, n, 0)
            rollouts.append(r)
        pool = [rec([1, 2], [3], seed) for seed in (11, 12, 13)]  # the first calls are alike
        pool += [rec([1, 2, 3, 4], [5 + n], 20 + n) for n in range(3)]
        ledger = Ledger(tmp_path / str(order))
        counts, left = ledger.match_external(0, pool[::order], rollouts[::order], version=0)
        assert counts["calls_matched"] == 6 and left == []
        written.append((tmp_path / str(order) / "step_0.jsonl").read_text())
    assert written[0] == written[1]
    lines = [json.loads(x) for x in written[0].splitlines()]
    assert [(x["rollout"], x["call"]) for x in lines] == [(n, c) for n in range(3) for c in range(2)]


# ------------------------------------------------------------------- issue 29: one total parser
def test_forged_logprobs_mask_their_rollout_and_close_ones_pass():
    """An external agent's logprob is compared with the engine's record of the same token: beyond
    LOGPROB_TOLERANCE the rollout is masked (counted, with the gap in its mask event's errors);
    the chat API's -9999 clamp is no mismatch."""
    from minirl.rollout.evidence import LOGPROB_TOLERANCE

    rec = lambda p, g, lps: {"prompt_token_ids": p, "generation_token_ids": g, "status": 200,  # noqa: E731
                             "version_start": 0, "version_end": 0, "generation_log_probs": lps}
    forged = parse(result([item([1, 2], [3, 4], [-40.0, -40.0])]))
    close = parse(result([item([1, 2], [5, 6], [-0.5 + LOGPROB_TOLERANCE / 2, -9999.0])]))
    pool = [rec([1, 2], [3, 4], [-0.25, -1.5]), rec([1, 2], [5, 6], [-0.5, float("-inf")])]
    counts, left = Ledger(None).match_external(0, pool, [forged, close], version=0)
    assert counts["calls_logprob_mismatch"] == 1 and counts["calls_matched"] == 1 and left == []
    assert forged.mask_reason == "logprob_mismatch" and close.sample_mask == 1
    assert "a logprob differs from the engine's record by 39.75" in forged.evidence["errors"][-1]
    assert counts["tokens_matched"] == 2, "a mismatched call's tokens are not counted as matched"


def test_the_reward_bound_keeps_a_worst_case_step_finite_in_float32():
    """The bound (docs/reliability.md, "Bounds on a /run result"): a group whose advantage is amplified the most
    (normalised by std + eps with a spread of ~0) at |reward| = bound trains to a finite loss and
    gradient norm in the real policy worker; one past float32's sum, as the issue's 1e38 with
    equal siblings, is refused at parse as DATA naming the field and the bound."""
    import inspect

    from minirl.algo.grpo import group_advantages
    from minirl.config import load_config
    from minirl.rollout.evidence import ADVANTAGE_EPS, reward_bound
    from minirl.trainer.policy_worker import PolicyWorker

    assert inspect.signature(group_advantages).parameters["eps"].default == ADVANTAGE_EPS
    bound = reward_bound(True)
    assert reward_bound(False) == pytest.approx(bound * 1e6)
    for bad in (3.4028234663852886e38, 1e38, 7e36, bound * 1.0001, -bound * 1.0001, 10**400, -(10**400)):
        with pytest.raises(RolloutDataFailure,
                           match=re.escape(f"reward must be a finite number with |reward| <= {bound:.4g}")):
            parse(result([item([1], [2])], reward=bad))
    cfg = load_config(None, ["policy.train_micro_batch_size=4"])
    cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt = 1, 4
    gen = list(range(10, 60))  # 50 generated tokens per trace, as the issue's case
    rewards = [bound, 0.0, 1e-300, 0.0]  # rollout 0's others {0, 1e-300, 0}: a spread of ~0, so |A| = bound / eps
    rollouts = {r: parse_rollout(result([item([3, 4, 5], gen, [-1.0] * 50)], reward=x), Coords(0, 0, r, 0),
                                 vocab_size=400,
                                 max_len=1024, overlong_filtering=False) for r, x in enumerate(rewards)}
    batch, _ = assemble(cfg, [GroupOutcome(0, "committed", rollouts)], pad_id=0)
    assert cfg.grpo.normalize_rewards and cfg.grpo.use_leave_one_out_baseline
    assert np.isfinite(batch.advantages).all() and np.abs(batch.advantages).max() > 0.9 * bound / ADVANTAGE_EPS
    out = PolicyWorker(cfg).train(batch)
    assert math.isfinite(out["loss"]) and math.isfinite(out["grad_norm"]), out


def deep_list(depth):
    node = []
    for _ in range(depth):
        node = [node]
    return node


ISSUE_29_CASES = {  # name: (result, field the message names)
    "reward_huge_int": (result([item([1], [2])], reward=10**400), "reward must be a finite number"),
    "logprob_huge_negative_int": (result([item([1], [2], [-(10**400)])]),
                                  "generation_log_probs must be finite and <= 0"),
    "logprob_float64_not_float32": (result([item([1], [2], [-1e308])]), "got -1e+308 (finite in float32"),
    "logprob_positive_int": (result([item([1], [2], [1])]), "generation_log_probs must be finite and <= 0, got 1"),
    "logprob_bool": (result([item([1], [2], [True])]), "one number per generated token"),
    "token_id_huge_int": (result([item([1], [10**400])]), "in generation_token_ids is out of vocabulary"),
    "compactions_a_string": (result([item([1], [2])], compactions="many"),
                             "evidence.compactions must be a non-negative integer"),
    "compactions_negative": (result([item([1], [2])], compactions=-1),
                             "evidence.compactions must be a non-negative integer"),
    "guard_an_int": (result([item([1], [2])], guard=5), "evidence.guard must be a list of flat objects"),
    "guard_a_list_of_ints": (result([item([1], [2])], guard=[1]), "evidence.guard must be a list of flat objects"),
    "guard_nested": (result([item([1], [2])], guard=[{"decision": deep_list(50_000)}]),
                     "evidence.guard must be a list of flat"),
    "errors_not_strings": (result([item([1], [2])], errors=[1]), "evidence.errors must be a list of strings"),
    "capture_failed_a_string": (result([item([1], [2])], capture_failed="yes"),
                                "evidence.capture_failed must be a boolean"),
    "evidence_a_list": ({"response": {"output": [item([1], [2])]}, "reward": 1.0, "evidence": [1]},
                        "evidence must be an object"),
    "content_an_int": (result([item([1], [2]), {"type": "message", "role": "assistant", "content": 5}]),
                       "response.output[1].content must be a string or a list of parts"),
    "content_text_an_int": (result([item([1], [2]),
                                    {"type": "message", "role": "assistant", "content": [{"text": 5}]}]),
                            "response.output[1].content must be"),
    "content_text_null": (result([item([1], [2]),
                                  {"type": "message", "role": "assistant", "content": [{"text": None}]}]),
                          "response.output[1].content must be"),
    "output_deep": ({"response": {"output": deep_list(200_000)}, "reward": 1.0}, "response.output[0]"),
}


@pytest.mark.parametrize("case", list(ISSUE_29_CASES))
def test_each_malformed_shape_of_issue_29_is_a_data_failure_naming_the_field(case):
    res, fragment = ISSUE_29_CASES[case]
    with pytest.raises(RolloutDataFailure) as info:
        parse(res)
    assert fragment in str(info.value), str(info.value)


def _json_values():
    scalars = (st.none() | st.booleans() | st.integers(min_value=-(10**400), max_value=10**400)
               | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8))
    return st.recursive(scalars,
                        lambda inner: st.lists(inner,
                                               max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                        max_leaves=12)


FIELDS = [("reward",), ("evidence",), ("evidence", "compactions"), ("evidence", "guard"), ("evidence", "errors"),
          ("evidence", "capture_failed"), ("evidence", "images_dropped"), ("response",), ("response", "output"),
          ("response", "output", 0), ("response", "output", 1), ("response", "output", 0, "generation_token_ids"),
          ("response", "output", 0, "prompt_token_ids"), ("response", "output", 0, "generation_log_probs"),
          ("response", "output", 1, "content"), ("response", "output", 0, "generation_log_probs", 1),
          ("response", "output", 0, "generation_token_ids", 0), ("evidence", "guard", 0)]


def _good():
    return {"response": {"output": [item([1, 2], [3, 4], [-0.5, -1.0]),
                                    {"type": "message", "role": "assistant", "content": "hi"}]},
            "reward": 0.5, "evidence": {"compactions": 1, "guard": [{"call": 0, "decision": "admit"}], "errors": []}}


def _survives(res) -> None:
    """parse_rollout returns or raises RolloutDataFailure; what it returns goes through the
    manager's event code and assemble without any other exception."""
    import json

    from minirl.config import MinirlConfig
    from minirl.rollout.manager import RolloutManager

    try:
        r = parse(res)
    except RolloutDataFailure:
        return
    cfg = MinirlConfig()
    cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt = 1, 2
    events = []
    RolloutManager(cfg, ["http://127.0.0.1:9"], events.append, 50)  # never sent to._agent_events(r)
    json.dumps(events)
    sibling = parse(_good())
    batch, stats = assemble(cfg, [GroupOutcome(0, "committed", {0: r, 1: sibling})], pad_id=0)
    assert np.isfinite(batch.advantages).all() and np.isfinite(batch.gen_logprobs).all()
    assert all(e["type"] in ("compaction", "guard") and e["rollout"] == 0 for e in events)


def test_no_result_shape_escapes_the_parser_as_another_exception():
    """Property test: a good result with one field (at any depth) replaced by an arbitrary JSON
    value, and arbitrary JSON values as whole results."""
    @settings(max_examples=600, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(FIELDS), _json_values())
    def one_field(path, value):
        res = _good()
        node = res
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        _survives(res)

    @settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(_json_values())
    def whole(value):
        _survives(value)

    one_field()
    whole()


def test_validation_reads_a_held_out_result_with_the_same_checks():
    """minirl.validation scores held-out results through parse_scored: the shapes that ended a
    run as OverflowError / AttributeError there are DATA failures naming the field."""
    from minirl.rollout.evidence import parse_scored, reward_bound

    bound = reward_bound(True)
    good = parse_scored({"response": {"status": "completed", "output": []}, "reward": 1,
                         "evidence": {"end_reason": "env_done"}}, bound)
    assert good == {"reward": 1.0, "evidence": {"end_reason": "env_done", "guard": [], "errors": []},
                    "response": {"status": "completed"}, "mask": None}
    masked = parse_scored({"response": {}, "reward": 0, "mask_sample": True, "failure_kind": "judge_failed"}, bound)
    assert masked["mask"] == {"failure_kind": "judge_failed", "failure_reason": None}
    for bad, fragment in (({"response": {}, "reward": 10**400}, "reward must be a finite number"),
                          ({"response": {}, "reward": 1.0, "evidence": [1]}, "evidence must be an object"),
                          ({"response": [1], "reward": 1.0}, "response must be an object"),
                          ([1], "not a JSON object")):
        with pytest.raises(RolloutDataFailure, match=re.escape(fragment)):
            parse_scored(bad, bound)


def test_reward_mean_keeps_its_meaning_and_reward_mean_trained_leaves_masked_rollouts_out():
    cfg = MinirlConfig()
    cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt = 1, 3
    empty = {"type": "message", "role": "assistant", "content": ""}  # lane A: masked capture_failed
    rollouts = {r: parse_rollout(result([item([1], [2])] + ([empty] if r == 2 else []), reward), Coords(0, 0, r, 0),
                                 vocab_size=50, max_len=100, overlong_filtering=False)
                for r, reward in enumerate([1.0, 0.5, 0.0])}
    _, stats = assemble(cfg, [GroupOutcome(0, "committed", rollouts)], pad_id=0)
    assert stats["rollouts_masked"] == 1
    assert stats["reward_mean"] == pytest.approx(0.5) and stats["reward_mean_trained"] == pytest.approx(0.75)


@pytest.mark.parametrize("cc", [True, False])
def test_a_group_the_ledger_masks_whole_drops_under_cc_and_trains_with_zero_loss_without(cc, tmp_path):
    """The ledger masks after the group committed (here every rollout of groups 1 and 2 lost its second
    call's record). Under CC such a group has no valid owner, as one masked whole at commit: it is
    dropped, counted, charged to the consecutive-drop budget (a second one past it ends the run), and its
    recorded calls are `retired` in the ledger, not `masked` as a trained group's. Without CC it trains
    with zero loss (upstream). Before, a CC group trained with zero loss too, counted in
    `groups_trained`, and no budget was charged."""
    from minirl.rollout.manager import RolloutManager
    from minirl.wire import RolloutRedispatchExhausted

    cfg = MinirlConfig()
    cfg.context_compaction.enabled = cc
    cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt = 3, 2
    cfg.async_rl.rollout_failure.min_step_batch_fraction = 1 / 3
    cfg.async_rl.rollout_failure.max_consecutive_dropped_prompts = 1
    outcomes, records = [], []
    for g in range(3):
        rollouts = {}
        for r in range(2):
            rollouts[r] = parse(result([item([1, 2], [3 + r]), item([1, 2, 3 + r, 4], [5])], reward=float(r)))
            rollouts[r].coords = c = Coords(0, g, r, 0)
            records += [record(c, 0, [1, 2], [3 + r])] + ([record(c, 1, [1, 2, 3 + r, 4], [5])] if g == 0 else [])
        outcomes.append(GroupOutcome(g, "committed", rollouts, step=0))
    events = []
    manager = RolloutManager(cfg, ["http://127.0.0.1:9"], events.append, 50)

    def close(groups, directory):
        return Ledger(directory).close_step(0, [x for x in records if x["group"] in [o.group for o in groups]],
                                           [r for o in groups for r in o.rollouts.values()], version=0,
                                           drop=lambda: manager.drop_unowned(groups))

    step, last = outcomes[:2], outcomes[2:]
    counts = close(step, tmp_path)
    lines = [(x["group"], x["ledger_status"]) for x in map(json.loads, (tmp_path / "step_0.jsonl").open())]
    check_step(cfg, 0, step)
    _, stats = assemble(cfg, step, 0)
    if not cc:
        assert [o.status for o in step] == ["committed"] * 2 and events == []
        assert lines == [(0, "trained")] * 4 + [(1, "masked")] * 2
        assert (counts["calls_unrecorded"], counts["calls_masked"], counts["calls_retired"]) == (2, 2, 0)
        assert (stats["groups_trained"], stats["dropped_prompt_groups"], stats["rollouts_masked"]) == (2, 0, 2)
        return
    assert [o.status for o in step] == ["committed", "dropped"] and step[1].rollouts == {}
    assert lines == [(0, "trained")] * 4 + [(1, "retired")] * 2
    assert (counts["calls_unrecorded"], counts["calls_masked"], counts["calls_retired"]) == (2, 0, 2)
    assert (stats["groups_trained"], stats["dropped_prompt_groups"], stats["rollouts_masked"]) == (1, 1, 0)
    assert [(e["type"], e["group"], e["decision"], e["reason"]) for e in events] == [
        ("drop", 1, "dropped", "RolloutDataFailure: no valid owner: every rollout of the group is masked by the "
                               "step's ledger (unrecorded_calls)")]
    with pytest.raises(RolloutRedispatchExhausted, match=re.escape(
            "prompt idx=2 has no valid owner (every rollout masked by the step's ledger: unrecorded_calls), and this "
            "was drop 2 with no rollout committed in between, exceeding max_consecutive_dropped_prompts=1")):
        close(last, tmp_path / "again")
    assert not (tmp_path / "again" / "step_0.jsonl").exists()  # the step failed: its records go to the run's end
