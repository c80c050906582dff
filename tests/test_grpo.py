"""GRPO math against float64 references written here, independently of minirl.algo.grpo."""

import math
import random

import numpy as np
import pytest
import torch

from minirl.algo.grpo import clipped_pg_loss, group_advantages


def reference_advantages(rewards, leave_one_out=True, normalize=True):
    """Loop-by-loop float64 reference: leave-one-out mean, unbiased std of the same set."""
    out = []
    g = len(rewards)
    for i, r in enumerate(rewards):
        others = [x for j, x in enumerate(rewards) if j != i] if leave_one_out else list(rewards)
        if g <= 1:
            out.append(0.0)
            continue
        mean = math.fsum(others) / len(others)
        a = r - mean
        if normalize and len(others) > 1:
            var = math.fsum((x - mean) ** 2 for x in others) / (len(others) - 1)
            std = math.sqrt(var)
            if std > 0:
                a = a / (std + 1e-6)
        out.append(a)
    return out


@pytest.mark.parametrize("g", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("loo", [True, False])
@pytest.mark.parametrize("norm", [True, False])
def test_advantages_match_reference(g, loo, norm):
    rng = random.Random(g * 10 + loo * 2 + norm)
    for _ in range(20):
        rewards = [rng.choice([0.0, 0.25, 0.5, 1.0, rng.random()]) for _ in range(g)]
        got = group_advantages(rewards, leave_one_out=loo, normalize=norm)
        want = reference_advantages(rewards, loo, norm)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_equal_rewards_give_zero_advantage():
    assert np.all(group_advantages([0.5, 0.5, 0.5, 0.5]) == 0)


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
                d = ref[b][t] - curr[b][t]
                term += kl * (math.exp(d) - d - 1)
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
