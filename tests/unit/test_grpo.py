"""GRPO math against float64 (and exact rational) references written here from upstream's definitions,
independently of minirl.algo.grpo."""

import math
import random
from fractions import Fraction

import numpy as np
import pytest
import torch

from minirl.algo.grpo import clipped_pg_loss, group_advantages


def reference_advantages(rewards, valid=None, leave_one_out=True, normalize=True, exclude_masked=True):
    """Upstream's definition in exact rational arithmetic (fractions.Fraction of the float inputs):
    leave-one-out mean and unbiased variance of the comparison set, computed exactly, so a constant
    set has variance exactly 0 however its float mean rounds. The baseline's valid mask is the
    sample mask with `exclude_masked` (minirl) and all ones without it (upstream's GRPO calls its
    baseline function with `valid_mask = ones_like(rewards)`); a group whose valid mask holds at
    most one rollout gets 0, and a rollout outside the mask gets 0."""
    g = len(rewards)
    sample = [1] * g if valid is None else list(valid)
    valid = sample if exclude_masked else [1] * g
    exact = [Fraction(r) for r in rewards]
    if sum(1 for v in valid if v) <= 1:
        return [0.0] * g
    out = []
    for i in range(g):
        if not valid[i]:
            out.append(0.0)
            continue
        members = [exact[j] for j in range(g) if (j != i or not leave_one_out) and valid[j]]
        mean = sum(members) / len(members)
        a = exact[i] - mean
        if normalize and len(members) > 1:
            var = sum((x - mean) ** 2 for x in members) / (len(members) - 1)
            if var > 0:
                out.append(float(a) / (math.sqrt(var) + 1e-6))
                continue
        out.append(float(a))
    return out


@pytest.mark.parametrize("g", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("loo", [True, False])
@pytest.mark.parametrize("norm", [True, False])
def test_advantages_match_reference(g, loo, norm):
    rng = random.Random(g * 10 + loo * 2 + norm)
    for _ in range(40):
        rewards = [rng.choice([0.0, 0.25, 0.5, 1.0, rng.random()]) for _ in range(g)]
        got = group_advantages(rewards, leave_one_out=loo, normalize=norm)
        np.testing.assert_allclose(got, reference_advantages(rewards, None, loo, norm), rtol=1e-9, atol=1e-9)


TENTHS = [round(0.1 * k, 1) for k in range(11)]


@pytest.mark.parametrize("exclude", [True, False])
def test_rewards_in_tenths_with_constant_comparison_sets(exclude):
    """Every group of 2-5 rollouts over {0.0, 0.1, ..., 1.0} with one rollout that differs from
    otherwise equal siblings (the sets whose float mean is inexact), plus random ones with masks."""
    rng = random.Random(7)
    groups = [[c] * (g - 1) + [d] for g in (2, 3, 4, 5) for c in TENTHS for d in TENTHS]
    groups += [[rng.choice(TENTHS) for _ in range(rng.randint(1, 8))] for _ in range(500)]
    worst = 0.0
    for rewards in groups:
        valid = [rng.random() > 0.2 for _ in rewards]
        for v in (None, valid):
            got = group_advantages(rewards, v, exclude_masked=exclude)
            want = reference_advantages(rewards, v, exclude_masked=exclude)
            worst = max(worst, float(np.max(np.abs(got - np.asarray(want)), initial=0.0)))
    assert worst <= 1e-6, worst


def test_the_review_example_is_minus_a_tenth_not_minus_1e5():
    adv = group_advantages([0.1, 0.1, 0.1, 0.0])
    assert adv[3] == pytest.approx(-0.1, abs=1e-12)  # others {0.1, 0.1, 0.1}: std 0, no normalisation
    assert np.abs(adv).max() < 1.0


def test_equal_rewards_give_zero_advantage():
    assert np.all(group_advantages([0.5, 0.5, 0.5, 0.5]) == 0)
    assert np.all(group_advantages([0.1, 0.1, 0.1]) == 0)


def test_constant_sets_give_exactly_zero_advantages():
    """A group whose rewards are all equal has advantage exactly 0 (the exact reference's), whatever its
    size, value, mask or switches, though the float mean of 3 x 0.1 is not 0.1: a `zero_advantage_sample_frac`
    that counts `a == 0.0` must see every such rollout (before, [0.1] * 4 gave -1.4e-17 each)."""
    rng = random.Random(3)
    values = TENTHS + [rng.random() for _ in range(20)] + [1 / 3, 2 / 3, 1e-3]
    for g in range(1, 9):
        for value in values:
            for valid in (None, [rng.random() > 0.3 for _ in range(g)]):
                for loo, norm, exclude in ((True, True, True), (True, True, False), (False, True, True),
                                           (True, False, True)):
                    got = group_advantages([value] * g, valid, leave_one_out=loo, normalize=norm,
                                           exclude_masked=exclude)
                    assert got.tolist() == [0.0] * g, (value, g, valid, loo, norm, exclude)
                    assert reference_advantages([value] * g, valid, loo, norm, exclude) == [0.0] * g


def test_groups_of_one_and_two():
    assert group_advantages([0.7]).tolist() == [0.0]
    assert group_advantages([0.7], [0], exclude_masked=False).tolist() == [0.0]
    assert group_advantages([0.3, 0.1]) == pytest.approx([0.2, -0.2])  # one comparison rollout: no std
    assert group_advantages([0.3, 0.1], [1, 0]).tolist() == [0.0, 0.0]  # minirl: one valid rollout
    # upstream: both rollouts count, so the survivor trains with r0 - r1 (the masked one's is masked in the loss)
    assert group_advantages([0.3, 0.1], [1, 0], exclude_masked=False) == pytest.approx([0.2, -0.2], abs=1e-15)
    assert group_advantages([0.3, 0.1], [0, 0], exclude_masked=False) == pytest.approx([0.2, -0.2], abs=1e-15)


def test_upstream_mode_edges_against_the_reference():
    """Groups of 1 and 2, all-masked groups and constant sets with an inexact mean, each mask."""
    cases = [([0.7], m) for m in ([1], [0])]
    cases += [(r, m) for r in ([0.3, 0.1], [0.1, 0.1], [1.0, 0.0]) for m in ([1, 1], [1, 0], [0, 1], [0, 0])]
    cases += [(r, m) for r in ([0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.0], [0.2, 0.1, 0.1, 0.1])
              for m in ([1] * len(r), [0] * len(r), [1] + [0] * (len(r) - 1), [0] + [1] * (len(r) - 1))]
    for rewards, mask in cases:
        for exclude in (True, False):
            want = reference_advantages(rewards, mask, exclude_masked=exclude)
            np.testing.assert_allclose(group_advantages(rewards, mask, exclude_masked=exclude), want, rtol=1e-9,
                                       atol=1e-12,
                                       err_msg=f"{rewards} {mask} exclude={exclude}")
    assert group_advantages([0.1, 0.1, 0.1], [0, 0, 0], exclude_masked=False).tolist() == [0.0] * 3
    assert group_advantages([0.1, 0.1, 0.1, 0.0], [0, 1, 1, 1],
                            exclude_masked=False)[3] == pytest.approx(-0.1, abs=1e-12)


def test_masked_rollouts_and_the_baseline():
    rewards, valid = [1.0, 0.0, 0.0, 0.5], [1, 1, 1, 0]
    minirl = group_advantages(rewards, valid, exclude_masked=True)
    upstream = group_advantages(rewards, valid, exclude_masked=False)
    assert minirl[3] == 0.0  # masked: no advantage of its own
    assert minirl[0] == pytest.approx(1.0)  # others {0, 0}: the masked 0.5 is not in the baseline
    assert upstream[0] == pytest.approx((1.0 - 1 / 6) / (math.sqrt(1 / 12) + 1e-6))  # others {0, 0, 0.5}
    assert group_advantages(rewards, [0, 0, 0, 0]).tolist() == [0.0] * 4  # all masked
    # upstream: an all-masked group still has its leave-one-out advantages (the loss masks every one of them)
    assert group_advantages(rewards, [0, 0, 0, 0], exclude_masked=False) == pytest.approx(group_advantages(rewards))
    assert upstream[3] == pytest.approx((0.5 - 1 / 3) / (math.sqrt(1 / 3) + 1e-6))  # computed, masked in the loss


def test_advantage_worked_example():
    # rewards 1, 0, 0, 0: baseline of rollout 0 is 0 (others), std of {0,0,0} is 0 -> adv 1
    # rollout 1: others {1,0,0}, mean 1/3, unbiased std sqrt(1/3) -> (0 - 1/3)/(sqrt(1/3)+1e-6)
    adv = group_advantages([1.0, 0.0, 0.0, 0.0])
    assert adv[0] == pytest.approx(1.0)
    assert adv[1] == pytest.approx(-(1 / 3) / (math.sqrt(1 / 3) + 1e-6), rel=1e-12)


def reference_loss(curr, prev, adv, mask, lo, hi, ref=None, kl=0.0):
    """Token-level clipped PG loss, float64, explicit loops."""
    total, count = 0.0, 0.0
    for b in range(len(curr)):
        for t in range(len(curr[b])):
            if not mask[b][t]:
                continue
            r = math.exp(curr[b][t] - prev[b][t])
            rc = min(max(r, 1 - lo), 1 + hi)
            term = max(-adv[b] * r, -adv[b] * rc)
            if ref is not None:
                d = min(max(ref[b][t] - curr[b][t], -20.0), 20.0)
                term += kl * min(max(math.exp(d) - d - 1, -10.0), 10.0)
            total += term
            count += mask[b][t]
    return total / count


@pytest.mark.parametrize("kl", [0.0, 0.01])
def test_clipped_loss_matches_reference(kl):
    g = torch.Generator().manual_seed(0)
    B, T = 5, 9
    curr = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3 - 1
    prev = curr + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4  # ratios well outside the clip
    ref = curr + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.3).double()
    mask[2] = 0  # a masked sample
    n = float(mask.sum())
    loss, m = clipped_pg_loss(curr, prev, adv, mask, n, 0.2, 0.2, ref, kl)
    want = reference_loss(curr.tolist(), prev.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.2, ref.tolist(), kl)
    assert float(loss) == pytest.approx(want, rel=1e-12)
    assert 0 < m["clip_fraction"] < 1


def test_micro_batches_add_up_to_the_global_token_normalised_loss():
    g = torch.Generator().manual_seed(1)
    curr = torch.randn(6, 7, generator=g, dtype=torch.float64)
    prev = curr.detach() + 0.1
    adv = torch.randn(6, generator=g, dtype=torch.float64)
    mask = (torch.rand(6, 7, generator=g) > 0.5).double()
    n = float(mask.sum())
    whole, _ = clipped_pg_loss(curr, prev, adv, mask, n)
    parts = sum(clipped_pg_loss(curr[i:i + 2], prev[i:i + 2], adv[i:i + 2], mask[i:i + 2], n)[0] for i in (0, 2, 4))
    assert float(whole) == pytest.approx(float(parts), rel=1e-12)


def test_gradient_is_minus_advantage_times_score_at_ratio_one():
    curr = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0]], dtype=torch.float64)
    loss, _ = clipped_pg_loss(curr, curr.detach(), torch.tensor([2.0], dtype=torch.float64), mask, 2.0)
    loss.backward()
    assert curr.grad.tolist() == [[0.0, -1.0, -1.0]]


def test_kl_gradient_is_upstreams_not_plain_k3():
    """Upstream weights k3 by w = exp(curr - curr.detach()) (value 1) before its output clamp. Its
    gradient per valid token, by hand: (-A + beta * (k3 + 1 - exp(ref - curr))) / N where no clamp
    binds; where one does, the clamped product has no gradient at all, and only -A / N remains."""
    beta, adv = 0.05, 0.7
    curr0 = [-1.0, -2.0, -0.5, -0.3, -25.0, -1.2]
    ref = [-1.3, -1.5, -0.5, 2.7, -1.0, -30.0]  # token 3: k3 output-clamped; 4 and 5: log r input-clamped
    mask = [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    n = sum(mask)
    curr = torch.tensor([curr0], dtype=torch.float64, requires_grad=True)
    loss, _ = clipped_pg_loss(curr, curr.detach(), torch.tensor([adv], dtype=torch.float64),
                              torch.tensor([mask], dtype=torch.float64), n, 0.2, 0.2,
                              torch.tensor([ref], dtype=torch.float64), beta)
    loss.backward()
    want, free = [], []
    for c, r, m in zip(curr0, ref, mask):
        d = r - c
        k3 = math.exp(min(max(d, -20.0), 20.0)) - min(max(d, -20.0), 20.0) - 1
        free.append(abs(d) < 20.0 and abs(k3) < 10.0)
        want.append(m * (-adv + (beta * (k3 + 1 - math.exp(d)) if free[-1] else 0.0)) / n)
    assert free == [True, True, True, False, False, False]
    np.testing.assert_allclose(curr.grad[0].tolist(), want, rtol=1e-12, atol=1e-15)
    # plain k3 (no w) would miss exactly beta * k3 / N on each unclamped token
    plain = torch.tensor([curr0], dtype=torch.float64, requires_grad=True)
    d = (torch.tensor([ref], dtype=torch.float64) - plain).clamp(-20, 20)
    k3 = (torch.exp(d) - d - 1).clamp(-10, 10)
    (
        (
            -adv * torch.exp(plain - plain.detach()) + beta * k3) * torch.tensor(
                [mask], dtype=torch.float64)).sum().div(n).backward()
    gap = (curr.grad - plain.grad)[0].tolist()
    np.testing.assert_allclose(gap, [m * beta * float(k) / n if f else 0.0
                                     for m, k, f in zip(mask, k3[0].detach(), free)],
                               rtol=1e-12, atol=1e-15)


def reference_calculate_kl(curr, ref, input_clamp=20.0, output_clamp=10.0):
    """Upstream's `calculate_kl(kl_type="k3")` with its importance-sampling weight, as its loss
    calls it, in plain float64 torch: w = exp(curr - curr.detach()), non-finite -> 0; log r =
    ref - curr; where clamping log r to +-input_clamp changes it, w is detached; k3 of the clamped
    log r, times w, then clamped to +-output_clamp."""
    w = torch.exp(curr - curr.detach())
    w = torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0)
    logr = ref - curr
    if input_clamp is not None:
        logr_c = logr.clamp(min=-input_clamp, max=input_clamp)
        w = torch.where(logr == logr_c, w, w.detach())
        logr = logr_c
    kl = w * (torch.exp(logr) - 1 - logr)
    if output_clamp is not None:
        kl = kl.clamp(min=-output_clamp, max=output_clamp)
    return kl


@pytest.mark.parametrize("output_clamp", [10.0, None])
def test_kl_where_the_clamps_bind_matches_upstreams_calculate_kl(output_clamp):
    """Loss and d loss / d curr, token by token, in the three regimes: no clamp binds, the +-10
    output clamp binds (log r > ~2.61 or < ~-11), the +-20 input clamp binds (|log r| > 20; with
    the output clamp off, the detached weight is what keeps its gradient at 0)."""
    from minirl.algo.grpo import k3_kl

    d = torch.tensor([[0.0, 0.3, -0.7, 1.9, 2.0, -9.0],      # neither clamp binds
                      [2.7, 3.0, 5.0, 12.0, -11.5, -15.0],   # output clamp binds (input does not)
                      [20.5, 25.0, 40.0, -20.5, -33.0, 20.0]],  # input clamp binds (20.0: exactly at it)
                     dtype=torch.float64)
    c0 = torch.linspace(-3.0, -0.1, d.numel(), dtype=torch.float64).reshape(d.shape)
    ref = c0 + d
    ours = c0.clone().requires_grad_(True)
    theirs = c0.clone().requires_grad_(True)
    w = torch.exp(ours - ours.detach())
    got = k3_kl(ours, ref, output_clamp=output_clamp, weights=torch.where(torch.isfinite(w), w, torch.zeros_like(w)))
    want = reference_calculate_kl(theirs, ref, output_clamp=output_clamp)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-12, atol=0)
    if output_clamp is not None:
        assert (ours.grad[1:] == 0).all() and (ours.grad[0, 1:] != 0).all()  # every clamped token: no gradient
    assert (ours.grad[2, :5] == 0).all()
    # and through the loss: beta * mean over the valid tokens
    beta, mask = 0.01, torch.ones_like(d)
    mask[0, 0] = 0
    if output_clamp is not None:
        a = c0.clone().requires_grad_(True)
        b = c0.clone().requires_grad_(True)
        zero = torch.zeros(d.shape[0], dtype=torch.float64)
        loss, m = clipped_pg_loss(a, a.detach(), zero, mask, float(mask.sum()), reference_logprobs=ref, kl_penalty=beta)
        want_loss = (beta * reference_calculate_kl(b, ref) * mask).sum() / mask.sum()
        torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=0)
        loss.backward()
        want_loss.backward()
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=0)
        assert m["kl"] == pytest.approx(float((reference_calculate_kl(c0, ref) * mask).sum() / mask.sum()), rel=1e-12)


def reference_is_loss(curr, prev, gen, adv, mask, kind, hi, lo):
    """Upstream's off-policy correction, float64 loops: w = exp(prev - gen) (non-finite -> 0),
    truncated (tis: clamp to [lo or 0, hi]; icepop: 0 outside [lo, hi]), times the clipped term."""
    total = count = oob = 0.0
    for b in range(len(curr)):
        for t in range(len(curr[b])):
            if not mask[b][t]:
                continue
            try:
                w = math.exp(prev[b][t] - gen[b][t])
            except OverflowError:
                w = math.inf
            w = w if math.isfinite(w) else 0.0
            low = lo or 0.0
            out = w < low or w > hi
            if kind == "tis":
                w = min(max(w, low), hi)
            elif kind == "icepop" and out:
                w = 0.0
            r = math.exp(curr[b][t] - prev[b][t])
            rc = min(max(r, 0.8), 1.2)
            total += w * max(-adv[b] * r, -adv[b] * rc)
            count += 1
            oob += out
    return total / count, oob / count


@pytest.mark.parametrize("kind,hi,lo",
                         [(None, None, None), ("tis", 2.0, None), ("tis", 2.0, 0.5), ("icepop", 5.0, 0.5)])
def test_importance_sampling_correction_matches_reference(kind, hi, lo):
    g = torch.Generator().manual_seed(3)
    B, T = 4, 12
    curr = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3 - 1
    prev = curr + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.1
    gen = prev + torch.randn(B, T, generator=g, dtype=torch.float64) * 1.5  # weights far outside the bounds
    gen[0, 0] = -math.inf  # exp(prev - gen) = inf -> weight 0
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.2).double()
    mask[0, 0] = 1
    n = float(mask.sum())
    loss, m = clipped_pg_loss(curr, prev, adv, mask, n, generation_logprobs=gen, is_type=kind, is_ratio=hi,
                              is_ratio_min=lo)
    want, oob = reference_is_loss(curr.tolist(), prev.tolist(), gen.tolist(), adv.tolist(), mask.tolist(), kind,
                                  hi if hi is not None else math.inf, lo)
    assert float(loss) == pytest.approx(want, rel=1e-12)
    assert m["is_oob_ratio"] == pytest.approx(oob if kind else 0.0)
    if kind:
        assert 0 < m["is_oob_ratio"] < 1


def lane_a_step(cfg, rewards):
    """The review's lane-A example as `assemble` receives it: 4 groups x 2 rollouts from real /run
    results; group 1 rollout 0's second model call overflowed (an empty reply without tokens), so
    that rollout is masked (capture_failed) and the rest of its group trains."""
    from minirl.rollout.evidence import parse_rollout
    from minirl.types import GroupOutcome
    from minirl.wire import Coords

    def item(prompt, gen):
        return {"type": "function_call", "name": "open_door", "arguments": "{}", "call_id": "c",
                "prompt_token_ids": prompt, "generation_token_ids": gen, "generation_log_probs": [-0.5] * len(gen)}

    empty = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": ""}]}
    outcomes = []
    for g in range(4):
        rollouts = {}
        for r in range(2):
            output = [item([1, 2 + g], [3, 4 + r])] + ([empty] if (g, r) == (1, 0) else [])
            res = {"response": {"output": output}, "reward": rewards[g][r]}
            rollouts[r] = parse_rollout(res, Coords(0, g, r, 0), vocab_size=50, max_len=100, overlong_filtering=False)
        outcomes.append(GroupOutcome(g, "committed", rollouts))
    return outcomes


@pytest.mark.parametrize("upstream", [True, False])
def test_lane_a_survivor_trains_with_r1_minus_r0_in_upstream_mode(upstream):
    """Issue 28's acceptance: under configs/upstream_pr4124.yaml the survivor of group 1 (rollout 0
    masked) trains with r1 - r0, as upstream's baseline over all G rollouts gives; minirl's default
    (baseline over the valid rollouts only) gives it 0."""
    from minirl.config import REPO_ROOT, load_config
    from minirl.controller import assemble

    shape = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=2"]
    cfg = load_config(str(REPO_ROOT / "configs" / "upstream_pr4124.yaml"),
                      shape) if upstream else load_config(None, shape)
    assert cfg.grpo.baseline_excludes_masked is not upstream
    rewards = [[1.0, 0.0], [0.25, 1.0], [0.5, 0.5], [0.0, 0.75]]
    batch, stats = assemble(cfg, lane_a_step(cfg, rewards), pad_id=0)
    assert (stats["groups_trained"], stats["rollouts_masked"]) == (4, 1)
    adv = {(int(g), int(r)): float(a) for g, r, a in zip(batch.group, batch.rollout, batch.advantages)}
    mask = {(int(g), int(r)): float(m) for g, r, m in zip(batch.group, batch.rollout, batch.sample_mask)}
    assert mask[(1, 0)] == 0.0 and mask[(1, 1)] == 1.0
    r0, r1 = rewards[1]
    assert adv[(1, 1)] == pytest.approx(r1 - r0 if upstream else 0.0, abs=1e-7)
    # the other groups train as usual in both modes: G = 2, one comparison rollout, no std
    for g in (0, 2, 3):
        assert adv[(g, 0)] == pytest.approx(rewards[g][0] - rewards[g][1], abs=1e-7)


def test_sequence_level_normaliser_counts_trained_rows():
    """`global_valid_samples` (the sequence-level loss's normaliser) is upstream's global_valid_seqs,
    the sample-mask sum over the batch's rows. Without CC (which sequence-level loss needs: CC
    requires token_level_loss=true) each rollout is one row, so it counts the trained rollouts;
    a masked rollout's row is not counted."""
    from minirl.config import load_config
    from minirl.controller import assemble

    cfg = load_config(None, ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=2",
                             "context_compaction.enabled=false", "agent.name=simple_agent",
                             "loss_fn.token_level_loss=false"])
    batch, stats = assemble(cfg, lane_a_step(cfg, [[1.0, 0.0]] * 4), pad_id=0)
    assert len(batch.sample_mask) == 8 and stats["rollouts_trained"] == 7
    assert batch.global_valid_samples == float(batch.sample_mask.sum()) == 7.0


def reference_seq_mask_tis(curr, prev, gen, adv, mask, hi, lo):
    """Upstream's `seq-mask-tis`, float64 loops: per sequence, the geometric mean of its token
    weights, exp(sum over valid tokens of (prev - gen), a non-finite term counting 0, divided by
    (valid tokens + 1e-8)); a sequence whose mean is outside [lo, hi] gets weight 0 on every token,
    the others keep w = exp(prev - gen) untruncated (non-finite -> 0). is_oob_ratio: sequences
    outside the bounds over the valid sequences."""
    total = count = oob = seqs = 0.0
    for b in range(len(curr)):
        valid = [t for t in range(len(curr[b])) if mask[b][t]]
        terms = [prev[b][t] - gen[b][t] for t in valid]
        geo = math.exp(sum(x if math.isfinite(x) else 0.0 for x in terms) / (len(valid) + 1e-8))
        out = geo < lo or geo > hi
        if valid:
            seqs += 1
            oob += out
        for t in valid:
            try:
                w = math.exp(prev[b][t] - gen[b][t])
            except OverflowError:
                w = math.inf
            w = 0.0 if out or not math.isfinite(w) else w
            r = math.exp(curr[b][t] - prev[b][t])
            total += w * max(-adv[b] * r, -adv[b] * min(max(r, 0.8), 1.2))
            count += 1
    return total / count, oob / seqs


def test_seq_mask_tis_matches_reference():
    g = torch.Generator().manual_seed(5)
    B, T, hi, lo = 10, 9, 1.25, 0.8
    curr = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3 - 1
    prev = curr + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.1
    gen = prev + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.6
    gen[0, 1] = -math.inf  # its weight is 0, and its term counts 0 in its sequence's mean
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.2).double()
    mask[0, 1] = 1
    mask[9] = 0  # a masked sample: not a valid sequence
    curr.requires_grad_(True)
    n = float(mask.sum())
    loss, m = clipped_pg_loss(curr, prev, adv, mask, n, generation_logprobs=gen, is_type="seq-mask-tis", is_ratio=hi,
                              is_ratio_min=lo)
    want, oob = reference_seq_mask_tis(curr.tolist(), prev.tolist(), gen.tolist(), adv.tolist(), mask.tolist(), hi, lo)
    assert float(loss.detach()) == pytest.approx(want, rel=1e-12)
    assert m["is_oob_ratio"] == pytest.approx(oob, rel=1e-12) and (m["is_oob"], m["is_units"]) == (oob * 9, 9.0)
    assert 0 < oob < 1
    # a kept sequence keeps token weights above `hi` (untruncated); a masked-out one has no gradient
    from minirl.algo.grpo import importance_weights

    w, seq_oob = importance_weights(prev, gen, "seq-mask-tis", hi, lo, mask)
    assert seq_oob.shape == (B,) and (w[~seq_oob] > hi).any() and (w[seq_oob] == 0).all()
    loss.backward()
    assert (curr.grad[seq_oob] == 0).all() and (curr.grad[~seq_oob] != 0).any() and curr.grad[0, 1] == 0


def test_seq_mask_tis_config():
    from minirl.config import ConfigError, load_config

    seq_mask = ["loss_fn.use_importance_sampling_correction=true",
                "loss_fn.truncated_importance_sampling_type=seq-mask-tis",
                "loss_fn.truncated_importance_sampling_ratio=1.002",
                "loss_fn.truncated_importance_sampling_ratio_min=0.999"]
    cfg = load_config("configs/plain.yaml", seq_mask)
    assert cfg.loss_fn.truncated_importance_sampling_type == "seq-mask-tis"
    # upstream's multi-trace guide: under CC a compaction rewrite splits a rollout into traces, each its own sequence
    with pytest.raises(ConfigError, match=r"^loss_fn\.truncated_importance_sampling_type: seq-mask-tis with "
                                          r"context_compaction\.enabled=true: sequence-level correction masks"):
        load_config(None, seq_mask)
    with pytest.raises(ConfigError, match="truncated_importance_sampling_ratio_min.*seq-mask-tis"):
        load_config(None, ["loss_fn.use_importance_sampling_correction=true",
                           "loss_fn.truncated_importance_sampling_type=seq-mask-tis",
                           "loss_fn.truncated_importance_sampling_ratio=1.002"])
    with pytest.raises(ConfigError, match="must be null, tis, icepop or seq-mask-tis"):
        load_config(None, ["loss_fn.use_importance_sampling_correction=true",
                           "loss_fn.truncated_importance_sampling_type=seq_mask_tis",
                           "loss_fn.truncated_importance_sampling_ratio=1.002"])
