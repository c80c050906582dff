"""Segments (the physical traces of one rollout) under the two switches upstream's branches disagree
on, checked against float64 references written here from the upstream definitions, independently
of minirl.algo.grpo and minirl.controller:

- `grpo.segment_validity`: NeMo-RL #4124 (`all`) takes the amin of a rollout's segment masks, so one
  masked segment invalidates the rollout (out of training and, with masked rollouts excluded, out of
  the baseline); the segment-rows branch (`any`) takes the amax: the rollout votes while any segment
  is valid, and only its masked segments go untrained. A rollout-level mask masks every segment.
- `loss_fn.segment_weighting`: `token_mean` (every valid token once, upstream), `rollout_equal`
  (verl #7580's session-equal 1/N over a rollout's trained segments) and `length_ratio` (#7580's
  partition-preserving T_j / mean T over the rollout's segments), scaled to mean 1 over the step's
  trained segments (#7580's normalize_loss_weight_global) and applied to every per-token term; the
  normaliser stays the unweighted count.
- GRPO's baseline (NeMo-RL's calculate_baseline_and_std_per_prompt): leave-one-out mean, unbiased
  std of the same set, divided by std + 1e-6 where std > 0, 0 for a group of at most one member.
"""

import dataclasses
import math
import random

import numpy as np
import pytest
import torch

from minirl.algo.grpo import clipped_pg_loss
from minirl.config import ConfigError, load_config
from minirl.controller import assemble
from minirl.rollout.evidence import split_traces
from minirl.types import Call, GroupOutcome, Rollout, TrainBatch
from minirl.wire import Coords

VALIDITY = ["all", "any"]
WEIGHTING = ["token_mean", "rollout_equal", "length_ratio"]


# ------------------------------------------------------------------------------ float64 references
def ref_rollout_valid(rollout_masked: bool, segment_valid: list[bool], validity: str) -> bool:
    """#4124: amin over the segments' masks; segment-rows: amax. The rollout's own mask wins."""
    if rollout_masked:
        return False
    if not segment_valid:
        return True
    return min(segment_valid) if validity == "all" else max(segment_valid)


def ref_advantages(rewards: list[float], members: list[bool]) -> list[float]:
    """Leave-one-out baseline over the members, unbiased std, / (std + 1e-6) where std > 0."""
    out = []
    for i, r in enumerate(rewards):
        others = [float(rewards[j]) for j in range(len(rewards)) if members[j] and j != i]
        if not members[i] or sum(members) <= 1:
            out.append(0.0)
            continue
        mean = math.fsum(others) / len(others)
        a = r - mean
        if len(others) > 1:
            std = math.sqrt(math.fsum((x - mean) ** 2 for x in others) / (len(others) - 1))
            if std > 0:
                a /= std + 1e-6
        out.append(a)
    return out


def ref_weights(rollout_of_row: list, tokens: list[int], weighting: str) -> list[float]:
    """#7580: 1 per row (token_mean), 1/N (rollout_equal) or T / mean T of the rollout's rows
    (length_ratio), then divided by their mean over all rows."""
    w = []
    for key, t in zip(rollout_of_row, tokens):
        mine = [tokens[k] for k, other in enumerate(rollout_of_row) if other == key]
        w.append(1.0 if weighting == "token_mean" else 1.0 / len(mine) if weighting == "rollout_equal"
                 else t / (math.fsum(mine) / len(mine)))
    mean = math.fsum(w) / len(w)
    return [x / mean for x in w]


def ref_loss(curr, prev, adv, mask, weights, clip=0.2, kl_penalty=0.0, ref=None, token_level=True) -> float:
    """Upstream's ClippedPGLossFn per token, max(-A r, -A clip(r)), plus the k3 KL, times the row's
    weight; summed over valid tokens / their count, or each row's token mean summed / valid rows."""
    total, rows = 0.0, 0
    for s in range(len(curr)):
        row = 0.0
        for t in range(len(curr[s])):
            if not mask[s][t]:
                continue
            r = math.exp(curr[s][t] - prev[s][t])
            term = max(-adv[s] * r, -adv[s] * min(max(r, 1 - clip), 1 + clip))
            if kl_penalty:
                log_r = ref[s][t] - curr[s][t]
                term += kl_penalty * (math.exp(log_r) - log_r - 1)
            row += weights[s] * term
        n = sum(mask[s])
        if n:
            total += row if token_level else row / n
            rows += 1
    return total / (sum(map(sum, mask)) if token_level else rows)


# ------------------------------------------------------------------------------- hand-built steps
def rollout(g: int, r: int, reward: float, lengths: list[int], masked_segments=(), rollout_mask=None,
            kinds=None) -> Rollout:
    """A rollout of len(lengths) segments; segment k generates lengths[k] tokens after a 3-token
    prompt that no earlier segment's tokens prefix (each a rewritten history)."""
    traces, calls = [], []
    for k, n in enumerate(lengths):
        call = Call([100 + k, 7, 8], [10 + (k + j) % 50 for j in range(n)], [-0.5] * n)
        calls.append(call)
        (t,) = split_traces([call])
        t.mask_reason = "unrecorded_calls" if k in masked_segments else None
        t.kind = (kinds or {}).get(k, "turns")
        traces.append(t)
    return Rollout(Coords(0, g, r, 0), reward, calls, traces, False, {}, rollout_mask)


def config(validity="all", weighting="token_mean", exclude=True, groups=1, g=4):
    return load_config(None, [f"grpo.segment_validity={validity}", f"loss_fn.segment_weighting={weighting}",
                              f"grpo.baseline_excludes_masked={str(exclude).lower()}",
                              f"grpo.num_prompts_per_step={groups}",
                              f"grpo.num_generations_per_prompt={g}", f"policy.train_global_batch_size={groups * g}"])


def edge_groups(seed: int) -> list[GroupOutcome]:
    """Groups of 1, 2 and 4 rollouts: one segment, very different lengths (1 vs 200 tokens), one
    masked segment among valid ones, every segment masked, rollout-level masks, an all-masked group."""
    rng = random.Random(seed)
    sizes = [1, 2, 4, 4, 3]
    outcomes = []
    for g, size in enumerate(sizes):
        rollouts = {}
        for r in range(size):
            lengths = [rng.choice([1, 2, 5, 40, 200]) for _ in range(rng.choice([1, 1, 2, 3, 4]))]
            masked = {k for k in range(len(lengths)) if rng.random() < 0.25}
            rmask = "capture_failed" if rng.random() < 0.1 else None
            if g == 4:  # the all-masked group
                masked, rmask = set(range(len(lengths))), None
            rollouts[r] = rollout(g, r, rng.choice([0.0, 0.25, 1.0, rng.random()]), lengths, masked, rmask)
        outcomes.append(GroupOutcome(g, "committed", rollouts))
    return outcomes


def of_steps(*steps: int, seed: int) -> list[GroupOutcome]:
    """An async step's groups: edge_groups of each prompt step in `steps`, taken together (as the windowed,
    ready_first and weight_fifo samplers and in_order's promoted lenders take them), so group indices repeat."""
    return [GroupOutcome(o.group, "committed", {k: dataclasses.replace(r, coords=dataclasses.replace(r.coords, step=s))
                                                for k, r in o.rollouts.items()}, step=s)
            for s in steps for o in edge_groups(seed + s)]


def expected_rows(outcomes, validity, exclude, weighting):
    """Per batch row (rollouts in order, traces in order): sample mask, advantage, loss weight."""
    masks, advs, keys, tokens = [], [], [], []
    for o in outcomes:
        rs = [o.rollouts[k] for k in sorted(o.rollouts)]
        valid = [ref_rollout_valid(r.mask_reason is not None, [t.mask_reason is None for t in r.traces], validity)
                 for r in rs]
        adv = ref_advantages([r.reward for r in rs], valid if exclude else [True] * len(rs))
        for r, v, a in zip(rs, valid, adv):
            for t in r.traces:
                m = float(v and t.mask_reason is None)
                masks.append(m)
                advs.append(a)
                keys.append((r.coords.step, o.group, r.coords.rollout))
                tokens.append(sum(t.loss_mask) if m else 0)
    trained = [i for i, n in enumerate(tokens) if n]
    w = [1.0] * len(masks)
    for i, x in zip(trained, ref_weights([keys[i] for i in trained], [tokens[i] for i in trained], weighting)):
        w[i] = x
    return np.array(masks), np.array(advs), np.array(w)


# ---------------------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("validity", VALIDITY)
@pytest.mark.parametrize("exclude", [True, False])
@pytest.mark.parametrize("weighting", WEIGHTING)
def test_masks_baseline_and_weights_match_the_reference(validity, exclude, weighting):
    cfg = config(validity, weighting, exclude, groups=5)
    for seed in range(8):
        outcomes = edge_groups(seed)
        want_mask, want_adv, want_w = expected_rows(outcomes, validity, exclude, weighting)
        batch, stats = assemble(cfg, outcomes, pad_id=0)
        np.testing.assert_array_equal(batch.sample_mask, want_mask)
        np.testing.assert_allclose(batch.advantages, want_adv, rtol=1e-6, atol=1e-6)
        if weighting == "token_mean":
            assert batch.loss_weight is None  # the default arithmetic: no weight at all
        else:
            np.testing.assert_allclose(batch.loss_weight, want_w, rtol=1e-6)
        assert stats["segments_masked"] == sum(t.mask_reason is not None for o in outcomes
                                               for r in o.rollouts.values() for t in r.traces)
        assert stats["traces_trained"] == int(want_mask.sum())
        assert batch.global_valid_tokens == sum(batch.loss_mask[i].sum() for i in np.flatnonzero(want_mask))
        mass = [sum(want_w[i] * batch.loss_mask[i].sum() * want_mask[i] for i in np.flatnonzero(batch.group == g))
                for g in range(len(outcomes))]
        np.testing.assert_allclose(stats["loss_mass_by_group"], np.array(mass) / sum(mass), atol=2e-6)


@pytest.mark.parametrize("weighting", ["rollout_equal", "length_ratio"])
def test_an_async_step_of_two_prompt_steps_weighs_each_rollout_as_its_own(weighting):
    """Group g of prompt steps 3 and 4 in one optimizer step: each rollout's segments are weighed as its
    own, never pooled with the other step's rollout r of group g (found by review: both were keyed by
    (group, rollout)); `loss_mass_by_group` has one share per group, in the step's `prompt_seeds` order."""
    cfg = config("all", weighting, True, groups=5)
    for seed in range(8):
        outcomes = of_steps(3, 4, seed=seed)
        want_mask, _, want_w = expected_rows(outcomes, "all", True, weighting)
        batch, stats = assemble(cfg, outcomes, pad_id=0)
        np.testing.assert_allclose(batch.loss_weight, want_w, rtol=1e-6)
        rows = [k for o in outcomes for r in o.rollouts.values() for k in [o] * len(r.traces)]
        mass = [sum(want_w[i] * batch.loss_mask[i].sum() * want_mask[i] for i, o in enumerate(rows) if o is mine)
                for mine in outcomes]
        assert len(stats["loss_mass_by_group"]) == len(outcomes) == 10
        np.testing.assert_allclose(stats["loss_mass_by_group"], np.array(mass) / sum(mass), atol=2e-6)


def test_one_masked_segment_under_each_validity():
    """Group of 3: rollout 0 has 3 segments, the middle one masked. `all`: rollout 0 is masked and out
    of the baseline (the survivors compare with each other); `any`: it votes with reward 1 and trains
    segments 0 and 2 with its advantage."""
    def group():
        return [GroupOutcome(0, "committed", {0: rollout(0, 0, 1.0, [5, 5, 5], {1}), 1: rollout(0, 1, 0.0, [5]),
                                              2: rollout(0, 2, 0.5, [5])})]
    b_all, s_all = assemble(config("all", g=3), group(), pad_id=0)
    assert b_all.sample_mask.tolist() == [0, 0, 0, 1, 1] and s_all["rollouts_masked"] == 1
    assert b_all.advantages[3] == pytest.approx(-0.5) and b_all.advantages[4] == pytest.approx(0.5)
    b_any, s_any = assemble(config("any", g=3), group(), pad_id=0)
    assert b_any.sample_mask.tolist() == [1, 0, 1, 1, 1] and s_any["rollouts_masked"] == 0
    std = math.sqrt(0.125)
    assert b_any.advantages[:3] == pytest.approx([0.75 / (std + 1e-6)] * 3)
    assert s_any["traces_trained"] == 4 and s_any["segments_masked"] == 1


@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("weighting", WEIGHTING)
def test_loss_matches_the_reference_for_each_weighting(weighting, token_level):
    """clipped_pg_loss on an assembled batch (segments of 1 to 200 tokens, masked ones) in float64,
    split into micro-batches that add up, against `ref_loss` with the reference weights."""
    outcomes = edge_groups(3)
    batch, _ = assemble(config("any", weighting, groups=len(outcomes)), outcomes, pad_id=0)
    _, _, want_w = expected_rows(outcomes, "any", True, weighting)
    gen = torch.Generator().manual_seed(0)
    shape = batch.loss_mask.shape
    curr = -torch.rand(shape, generator=gen, dtype=torch.float64) * 2
    prev = curr + (torch.rand(shape, generator=gen, dtype=torch.float64) - 0.5) * 0.8  # ratios beyond both clips
    ref = curr + (torch.rand(shape, generator=gen, dtype=torch.float64) - 0.5) * 0.2
    mask = torch.as_tensor(batch.valid_mask(), dtype=torch.float64)
    adv = torch.as_tensor(batch.advantages, dtype=torch.float64)
    w = None if batch.loss_weight is None else torch.as_tensor(batch.loss_weight, dtype=torch.float64)
    normalizer = batch.global_valid_tokens if token_level else batch.global_valid_samples
    got = 0.0
    for rows in np.array_split(np.arange(shape[0]), 3):
        loss, _ = clipped_pg_loss(curr[rows], prev[rows], adv[rows], mask[rows], normalizer,
                                  reference_logprobs=ref[rows],
                                  kl_penalty=0.05, token_level=token_level, weights=None if w is None else w[rows])
        got += float(loss)
    want = ref_loss(curr.tolist(), prev.tolist(), batch.advantages.astype(np.float64).tolist(),
                    batch.valid_mask().tolist(),
                    want_w.tolist(), kl_penalty=0.05, ref=ref.tolist(), token_level=token_level)
    assert got == pytest.approx(want, rel=1e-6, abs=1e-9)  # float32 weights and advantages, float64 arithmetic
    if weighting != "token_mean":  # the switch moves the objective on this step
        unweighted = ref_loss(curr.tolist(), prev.tolist(), batch.advantages.astype(np.float64).tolist(),
                              batch.valid_mask().tolist(), [1.0] * shape[0], kl_penalty=0.05, ref=ref.tolist(),
                              token_level=token_level)
        assert abs(want - unweighted) > 1e-3


@pytest.mark.parametrize("weighting", WEIGHTING)
@pytest.mark.parametrize("validity", VALIDITY)
def test_a_summary_trace_trains_with_its_rollouts_advantage_every_token_once(validity, weighting):
    """Rollout 0 of a group of 3: two turn calls (one trace), the summary call (its own trace, kind
    compaction_summary), then two calls after the handoff (a new trace). Every generated token of
    every call is on the loss mask of exactly one row, once, in order, and the summary row carries the
    rollout's advantage."""
    calls = [Call([1, 2, 3], [20, 21], [-0.1, -0.2]), Call([1, 2, 3, 20, 21, 4], [22, 23, 24], [-0.3] * 3),
             Call([1, 2, 3, 20, 21, 4, 22, 23, 24, 5], [30, 31, 32, 33], [-0.4] * 4),  # the summary request's reply
             Call([1, 2, 6, 30, 31, 7], [40], [-0.5]), Call([1, 2, 6, 30, 31, 7, 40, 8], [41, 42], [-0.6] * 2)]
    traces = [*split_traces(calls[:2]), *split_traces(calls[2:3]), *split_traces(calls[3:])]
    traces[1].kind = "compaction_summary"
    r0 = Rollout(Coords(0, 0, 0, 0), 1.0, calls, traces, False, {"compactions": 1})
    outcome = GroupOutcome(0, "committed", {0: r0, 1: rollout(0, 1, 0.0, [3]), 2: rollout(0, 2, 0.5, [3, 9])})
    batch, stats = assemble(config(validity, weighting, g=3), [outcome], pad_id=0)
    rows = np.flatnonzero(batch.rollout == 0)
    assert len(rows) == 3 and [traces[k].kind for k in range(3)] == ["turns", "compaction_summary", "turns"]
    trained = [int(batch.input_ids[i, j]) for i in rows for j in range(batch.lengths[i]) if batch.valid_mask()[i, j]]
    assert trained == [tok for c in calls for tok in c.gen]  # each generated token once, in call order
    want = ref_advantages([1.0, 0.0, 0.5], [True] * 3)[0]
    assert batch.advantages[rows] == pytest.approx([want] * 3)
    assert stats["tokens_trained"] == sum(len(c.gen) for c in calls) + 3 + 12


ADV = np.array([-1.0, 0.25, 0.5, 1.0], np.float32)


def fixed_batch(loss_weight=None) -> TrainBatch:
    """4 rows x 30 tokens, 15 trained each (tests/unit/test_policy_worker.py's rows, uneven advantages)."""
    rng = np.random.default_rng(0)
    b = TrainBatch(input_ids=rng.integers(3, 400, size=(4, 30)), loss_mask=np.zeros((4, 30), np.float32),
                   gen_logprobs=np.zeros((4, 30), np.float32), lengths=np.full(4, 30),
                   sample_mask=np.ones(4, np.float32),
                   advantages=ADV.copy(), loss_weight=loss_weight)
    b.loss_mask[:, 15:] = 1
    return b.count_valid()


PRE_SWITCH = {"loss": -0.1875, "grad_norm": 36.76327896118164, "weight_change": 102.79127066246254}
"""PolicyWorker.train on `fixed_batch()` under the default config with the code of b2a4514, before
these switches existed: its loss, gradient norm and the summed |change| of every weight. On this
machine the weights after the step were bit-identical (same sha256) with and without the switches."""


def step(cfg, batch):
    from minirl.trainer.policy_worker import PolicyWorker

    worker = PolicyWorker(cfg)
    before = {k: v.copy() for k, v in worker.get_weights()}  # get_weights shares the tensors' memory
    out = worker.train(batch)
    after = dict(worker.get_weights())
    out["weight_change"] = sum(float(np.abs(after[k].astype(np.float64) - before[k]).sum()) for k in after)
    return out, after


def test_the_default_path_keeps_its_loss_and_weighted_steps_match_the_reference():
    """Default config: assemble adds no weight, and a real torch step on a fixed batch gives the loss,
    gradient and update it gave before the switches; unit weights give the very same weights (x1.0 is
    exact). Uneven weights give the reference's loss: at the step's start the ratio is 1, so a row's
    per-token loss is -A, and the loss is sum_s w_s (-A_s) T_s / sum T."""
    cfg = load_config(None, ["policy.train_micro_batch_size=2"])
    assert cfg.loss_fn.segment_weighting == "token_mean" and cfg.grpo.segment_validity == "all"
    batch, _ = assemble(cfg, edge_groups(0)[:1], pad_id=0)
    assert batch.loss_weight is None
    (a, wa), (b, wb) = step(cfg, fixed_batch()), step(cfg, fixed_batch(np.ones(4, np.float32)))
    assert a["loss"] == b["loss"] == PRE_SWITCH["loss"]
    for key in ("grad_norm", "weight_change"):
        assert a[key] == pytest.approx(PRE_SWITCH[key], rel=1e-5), key
    assert all(np.array_equal(wa[k], wb[k]) for k in wa)
    w = np.array([0.4, 1.6, 0.5, 1.5], np.float32)  # mean 1, as assemble scales them
    got, _ = step(cfg, fixed_batch(w))
    assert got["loss"] == pytest.approx(float(np.sum(w.astype(np.float64) * -ADV * 15) / 60), rel=1e-6)
    assert abs(got["loss"] - a["loss"]) > 0.05 and abs(got["grad_norm"] - a["grad_norm"]) > 1e-3


def test_bad_switch_values_name_their_key():
    for key in ("loss_fn.segment_weighting", "grpo.segment_validity"):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, [f"{key}=most"])
