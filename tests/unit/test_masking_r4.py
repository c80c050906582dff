"""The three baseline policies and NeMo-RL's per-step masking and rollout stats.

The advantages are checked against a float64 reference written here from upstream's definition
(NeMo-RL's `calculate_baseline_and_std_per_prompt`: leave-one-out mean over the group's baseline
members; the unbiased std of the same leave-one-out set, from `statistics.stdev`, whose sum of
squares is exact, so a constant set's std is 0 however its float mean rounds; divide by std + 1e-6
where std > 0; a group with at most one member gets 0) and the policies' membership as NeMo's
`sample_masks.py` states it (`masked_sample_rewards_in_baseline`: rows flagged incomplete keep
their reward in the baseline and std; placeholders and sequence-logprob-error rows stay out of
both), independently of minirl.algo.grpo and minirl.rollout.masking.
"""

import functools
import math
import random
import statistics

import numpy as np
import pytest

from minirl.algo.grpo import group_advantages
from minirl.config import ConfigError, load_config
from minirl.controller import assemble
from minirl.rollout.evidence import split_traces
from minirl.types import Call, GroupOutcome, Rollout
from minirl.wire import Coords

POLICIES = {  # name -> (grpo.baseline_excludes_masked, grpo.masked_sample_rewards_in_baseline)
    "exclude": (True, False), "reinstate": (True, True), "upstream": (False, False)}
REASONS = {"trained": [None], "placeholder": ["capture_failed"], "env_flag": ["mask_sample", "summary_failed"],
           "truncated": ["overlong"], "seq_logprob_error": ["logprob_mismatch", "unrecorded_calls", "stale_calls"]}


def ref_members(kinds: list[str], policy: str) -> list[bool]:
    """Whose reward counts in the baseline: the trained rows; those and the incomplete ones
    (env flag, truncated); or every row (upstream's `valid_mask = ones`)."""
    if policy == "upstream":
        return [True] * len(kinds)
    keep = {"trained", "env_flag", "truncated"} if policy == "reinstate" else {"trained"}
    return [k in keep for k in kinds]


def ref_advantages(rewards: list[float], members: list[bool]) -> list[float]:
    out = []
    for i, r in enumerate(rewards):
        if not members[i] or sum(members) <= 1:
            out.append(0.0)
            continue
        others = [rewards[j] for j in range(len(rewards)) if members[j] and j != i]
        a = r - statistics.fmean(others)
        if len(others) > 1 and statistics.stdev(others) > 0:
            a /= statistics.stdev(others) + 1e-6
        out.append(a)
    return out


def rollout(g: int, r: int, reward: float, lengths=(3,), reason=None) -> Rollout:
    """A rollout of len(lengths) traces (each a rewritten history), generating lengths[k] tokens after a 3-token
    prompt."""
    calls = [Call([100 + k, 7, 8], [10 + j % 50 for j in range(n)], [-0.5] * n) for k, n in enumerate(lengths)]
    traces = [t for c in calls for t in split_traces([c])]
    return Rollout(Coords(0, g, r, 0), reward, calls, traces, reason == "capture_failed", {}, reason)


@functools.cache
def config(policy: str, groups: int, g: int, *extra: str):
    """A config of the policy (cached: assemble only reads it, and loading one costs ~0.5 s of CPU here)."""
    exclude, reinstate = POLICIES[policy]
    return load_config(None, [f"grpo.baseline_excludes_masked={str(exclude).lower()}",
                              f"grpo.masked_sample_rewards_in_baseline={str(reinstate).lower()}",
                              f"grpo.num_prompts_per_step={groups}", f"grpo.num_generations_per_prompt={g}",
                              f"policy.train_global_batch_size={groups * g}", *extra])


EDGES = [  # (rewards, kinds): constant sets with an inexact mean, groups of 1 and 2, all-masked groups
    ([0.7], ["trained"]), ([0.7], ["env_flag"]),
    ([0.3, 0.1], ["trained", "env_flag"]), ([0.3, 0.1], ["trained", "placeholder"]),
    ([0.3, 0.1], ["env_flag", "truncated"]),
    ([0.1, 0.1], ["trained", "trained"]), ([1.0, 0.0], ["trained", "seq_logprob_error"]),
    ([0.1, 0.1, 0.1], ["trained"] * 3), ([0.1, 0.1, 0.1], ["trained", "env_flag", "truncated"]),
    ([0.1, 0.1, 0.1, 0.0], ["trained", "trained", "env_flag", "trained"]),
    ([0.1, 0.1, 0.1, 0.0], ["trained", "trained", "trained", "placeholder"]),
    ([0.2, 0.1, 0.1, 0.1], ["trained", "env_flag", "env_flag", "env_flag"]),
    ([1.0, 1.0, 0.0, 0.0], ["trained", "trained", "env_flag", "placeholder"]),
    ([0.0, 0.5, 1.0], ["env_flag", "truncated", "env_flag"]),  # all masked, all reinstated
    ([0.0, 0.5, 1.0], ["placeholder", "seq_logprob_error", "placeholder"]),  # all masked, none reinstated
]


def check(policy: str, groups: list[tuple[list[float], list[str]]], seed: int = 0) -> None:
    """assemble's advantages and sample masks against the reference, one row per rollout."""
    rng = random.Random(seed)
    outcomes = [GroupOutcome(gi, "committed", {i: rollout(gi, i, rw, reason=rng.choice(REASONS[k]))
                                               for i, (rw, k) in enumerate(zip(rewards, kinds))})
                for gi, (rewards, kinds) in enumerate(groups)]
    cfg = config(policy, 3, 4)  # assemble reads neither shape: a group holds the rollouts it was given
    batch, _ = assemble(cfg, outcomes, pad_id=0)
    want_adv = [a for rewards, kinds in groups for a in ref_advantages(rewards, ref_members(kinds, policy))]
    want_mask = [float(k == "trained") for _, kinds in groups for k in kinds]
    assert batch.sample_mask.tolist() == want_mask  # only the trained rows get a gradient, in every policy
    np.testing.assert_allclose(batch.advantages, want_adv, rtol=1e-6, atol=1e-7, err_msg=f"{policy} {groups}")


@pytest.mark.parametrize("policy", POLICIES)
def test_edges_match_the_float64_reference(policy):
    for i, case in enumerate(EDGES):
        check(policy, [case], seed=i)


@pytest.mark.parametrize("policy", POLICIES)
def test_random_groups_match_the_float64_reference(policy):
    rng = random.Random(11)
    tenths = [round(0.1 * k, 1) for k in range(11)]
    for seed in range(60):
        g = rng.choice([1, 2, 3, 4, 6])
        groups = [([rng.choice(tenths + [rng.random()]) for _ in range(g)],
                   [rng.choice(list(REASONS) + ["trained"] * 3) for _ in range(g)]) for _ in range(3)]
        check(policy, groups, seed)


def test_a_timeout_still_reads_as_a_failure_for_the_group():
    """Two passes, a verifier timeout (reward 0, mask_sample) and a capture failure (reward 0.5).
    minirl's default compares the passes only (advantage 0: the group looks solved); the third
    policy keeps the timeout's 0 in the baseline and std, not the placeholder's 0.5; upstream's
    legacy loop counts the placeholder too."""
    rewards = [1.0, 1.0, 0.0, 0.5]
    valid, reinstated = [1, 1, 0, 0], [0, 0, 1, 0]
    assert group_advantages(rewards, valid).tolist()[:2] == [0.0, 0.0]
    third = group_advantages(rewards, valid, in_baseline=reinstated)
    want = 0.5 / (math.sqrt(0.5) + 1e-6)  # others {1, 0}: mean 0.5, unbiased std sqrt(1/2)
    assert third[:2] == pytest.approx([want, want], rel=1e-12) and third[3] == 0.0
    legacy = group_advantages(rewards, valid, exclude_masked=False)
    assert legacy[0] == pytest.approx((1.0 - 0.5) / (statistics.stdev([1.0, 0.0, 0.5]) + 1e-6), rel=1e-12)


def test_a_contradictory_combination_is_a_config_error():
    with pytest.raises(ConfigError,
                       match=r"^grpo\.masked_sample_rewards_in_baseline: true needs "
                             r"grpo\.baseline_excludes_masked=true"):
        load_config(None, ["grpo.baseline_excludes_masked=false", "grpo.masked_sample_rewards_in_baseline=true"])
    for exclude, reinstate in POLICIES.values():
        load_config(None,
                    [f"grpo.baseline_excludes_masked={exclude}", f"grpo.masked_sample_rewards_in_baseline={reinstate}"])


def test_the_upstream_preset_sets_upstreams_baseline():
    cfg = load_config("configs/upstream_pr4124.yaml")
    assert (cfg.grpo.baseline_excludes_masked, cfg.grpo.masked_sample_rewards_in_baseline) == (False, False)
    rf = cfg.async_rl.rollout_failure  # X item 7: upstream has no rollout deadline, and backs off 1 s doubling to 30 s
    assert (rf.nemo_gym.rollout_timeout_s, rf.backoff_base_s, rf.max_backoff_s) == (None, 1.0, 30.0)


# ------------------------------------------------------------------------- masking and rollout stats
def hand_built() -> list[GroupOutcome]:
    """Three groups of 4: (reward, generated tokens per trace, mask reason) per rollout."""
    rows = [
        [(1.0, [5], None), (0.0, [3, 4], None), (0.0, [10], "mask_sample"), (0.5, [2], "capture_failed")],
        [(1.0, [6, 6], None), (0.25, [20], "overlong"), (0.0, [1], "logprob_mismatch"), (1.0, [8], "summary_failed")],
        [(0.0, [1], None)] * 4,
    ]
    return [GroupOutcome(g, "committed", {i: rollout(g, i, rw, ln, why) for i, (rw, ln, why) in enumerate(group)})
            for g, group in enumerate(rows)]


@pytest.mark.parametrize("policy", POLICIES)
def test_masking_stats_of_a_hand_built_step(policy):
    _, stats = assemble(config(policy, 3, 4), hand_built(), pad_id=0)
    m = {k.removeprefix("train/masking/"): v for k, v in stats.items() if k.startswith("train/masking/")}
    baseline, reinstated = {"exclude": (7, 0), "reinstate": (10, 3), "upstream": (12, 5)}[policy]
    assert m == pytest.approx({
        "rows": 12, "placeholder_rows": 1, "env_flag_rows": 2, "env_flag_frac": 2 / 12, "truncated_rows": 1,
        "truncated_frac": 1 / 12, "seq_logprob_error_rows": 1, "masked_frac": 5 / 12, "trained_frac": 7 / 12,
        "baseline_rows": baseline, "reinstated_rows": reinstated, "reward_mean_trained": 2 / 7,
        "reward_mean_env_flag": 0.5,
        "reward_mean_truncated": 0.25, "reward_mean_masked": 0.35, "groups": 3, "groups_lt2_trained_frac": 1 / 3},
                              rel=1e-12)
    assert stats["rollouts_masked"] == 5 and stats["rollouts_trained"] == 7


@pytest.mark.parametrize("policy", POLICIES)
def test_rollout_stats_of_a_hand_built_step(policy):
    _, stats = assemble(config(policy, 3, 4, "policy.max_total_sequence_length=25"), hand_built(), pad_id=0)
    s = {k.removeprefix("train/rollouts/"): v for k, v in stats.items() if k.startswith("train/rollouts/")}
    std = (math.sqrt(0.171875) + math.sqrt(0.19921875)) / 3  # population stds of groups 0 and 1; group 2 is constant
    zero = {"exclude": 5 / 7, "reinstate": 4 / 7, "upstream": 4 / 7}[policy]
    assert s == pytest.approx({
        # generated tokens per rollout: 5 7 10 2 | 12 20 1 8 | 1 1 1 1; passes (reward >= 1): 5, 12, 8
        "gen_tokens/mean": 69 / 12, "gen_tokens/p50": 3.5, "gen_tokens/p75": 8.5, "gen_tokens/p90": 11.8,
        "gen_tokens/max": 20,
        "gen_tokens/pass/mean": 25 / 3, "gen_tokens/pass/p50": 8, "gen_tokens/pass/p75": 10,
        "gen_tokens/pass/p90": 11.2,
        "gen_tokens/pass/max": 12,
        "gen_tokens/fail/mean": 44 / 9, "gen_tokens/fail/p50": 1, "gen_tokens/fail/p75": 7, "gen_tokens/fail/p90": 12,
        "gen_tokens/fail/max": 20,
        "turns/mean": 14 / 12, "turns/p50": 1, "turns/p75": 1, "turns/p90": 1.9, "turns/max": 2,
        "seq_len/frac_above_90pct_ctx": 1 / 14,  # 14 traces; one of 23 tokens > 22.5
        "groups/mixed_frac": 2 / 3, "groups/all_pass_frac": 0.0, "groups/all_fail_frac": 1 / 3,
        "groups/reward_std_mean": std, "groups/zero_advantage_sample_frac": zero}, rel=1e-12)


def test_stats_of_an_empty_step_are_zero_or_nan():
    from minirl.rollout.masking import masking_stats, rollout_stats

    m, r = masking_stats([]), rollout_stats([], [], 100)
    assert m["train/masking/rows"] == 0 and m["train/masking/masked_frac"] == 0.0
    assert math.isnan(m["train/masking/reward_mean_trained"]) and math.isnan(r["train/rollouts/gen_tokens/mean"])


# ------------------------------------------------------------ segment weights under the token-level loss
def test_segment_weights_are_not_rollout_equal_nor_partition_preserving_under_the_token_level_loss():
    """What README and LossConfig now say: a row's loss mass is weight x trained tokens. Two
    one-segment rollouts of 75 and 600 tokens keep 75 : 600 under `rollout_equal` (not one share
    each); under `length_ratio` a 40-token rollout split 10 + 30 weighs (10^2 + 30^2) / 20 = 50
    against 40 unsplit, beside a 40-token sibling (not partition-preserving)."""
    from minirl.algo.grpo import segment_weights

    w = segment_weights([0, 1], [75, 600], "rollout_equal")
    assert w[0] * 75 / (w[1] * 600) == pytest.approx(75 / 600)
    split = segment_weights([0, 0, 1], [10, 30, 40], "length_ratio")
    unsplit = segment_weights([0, 1], [40, 40], "length_ratio")
    assert (split[0] * 10 + split[1] * 30) / (split[2] * 40) == pytest.approx(50 / 40)
    assert unsplit[0] * 40 / (unsplit[1] * 40) == pytest.approx(1.0)


def _result(**extra) -> dict:
    ev = {"prompt_token_ids": [1, 2, 3], "generation_token_ids": [4, 5], "generation_log_probs": [-0.1, -0.2]}
    return {"response": {"output": [{"type": "message", "role": "assistant", "content": "x", **ev}]}, "reward": 1.0,
            **extra}


def test_a_verifiers_flag_does_not_reinstate_an_episode_with_no_result():
    """A context overflow ended the episode (`capture_failed`: a placeholder) and the verifier flagged it
    too (`mask_sample`): the row stays a placeholder, out of every baseline. Before, the flag replaced the
    reason, and under masked_sample_rewards_in_baseline its reward re-entered its siblings' baseline."""
    from minirl.rollout.evidence import parse_rollout
    from minirl.rollout.masking import baseline_members, row_kind

    for extra, kind in (({}, "placeholder"), ({"mask_sample": True}, "placeholder")):
        r = parse_rollout(_result(evidence={"capture_failed": True}, **extra), Coords(0, 0, 0, 0), vocab_size=256,
                          max_len=100, overlong_filtering=True)
        assert (r.mask_reason, row_kind(r)) == ("capture_failed", kind)
        assert not baseline_members([r], True, True)[0]
    r = parse_rollout(_result(mask_sample=True), Coords(0, 0, 0, 0), vocab_size=256, max_len=5, overlong_filtering=True)
    assert r.mask_reason == "mask_sample", "between two reinstated kinds the verifier's flag wins, as before"


@pytest.mark.parametrize("extra,max_len", [({}, 5), ({"mask_sample": True}, 100)])
def test_the_ledgers_logprob_mismatch_takes_a_row_out_of_the_baseline_whatever_flagged_it_first(extra, max_len):
    """A row masked `overlong` or `mask_sample` (kinds a baseline policy may reinstate) whose logprobs the
    ledger then finds forged becomes a seq_logprob_error row, out of both (upstream's sample_masks.py).
    Before, the first reason stayed and the untrusted reward kept its place in the baseline."""
    from minirl.rollout.evidence import Ledger, parse_rollout
    from minirl.rollout.masking import baseline_members, row_kind

    r = parse_rollout(_result(**extra), Coords(0, 0, 0, 0), vocab_size=256, max_len=max_len, overlong_filtering=True)
    assert row_kind(r) in ("truncated", "env_flag")
    pool = [{"prompt_token_ids": [1, 2, 3], "generation_token_ids": [4, 5], "generation_log_probs": [-3.0, -0.2],
             "version_start": 0, "version_end": 0, "status": 200}]
    counts, _ = Ledger(None).match_external(0, pool, [r], version=0)
    assert counts["calls_logprob_mismatch"] == 1
    assert (r.mask_reason, row_kind(r)) == ("logprob_mismatch", "seq_logprob_error")
    assert not baseline_members([r], True, True)[0]


def test_stronger_mask_keeps_the_first_of_equal_standing():
    from minirl.rollout.masking import stronger_mask

    assert stronger_mask(None, "overlong") == "overlong" and stronger_mask("overlong", None) == "overlong"
    assert stronger_mask("overlong", "logprob_mismatch") == "logprob_mismatch"
    assert stronger_mask("capture_failed", "mask_sample") == "capture_failed"
    assert stronger_mask("mask_sample", "capture_failed") == "capture_failed"
    assert stronger_mask("unrecorded_calls", "stale_calls") == "unrecorded_calls"
    assert stronger_mask("summary_failed", "overlong") == "summary_failed"
