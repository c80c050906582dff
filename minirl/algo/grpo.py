"""GRPO math as pure functions: per-group advantages and the clipped policy-gradient loss.

Matches NeMo-RL's `calculate_baseline_and_std_per_prompt` (leave-one-out baseline, unbiased std
over the same leave-one-out set, divide by std + 1e-6 only where std > 0, a group of one sample
gets advantage 0; the std is computed two-pass, see `group_advantages`) and `ClippedPGLossFn` (ratio clipped to [1 - lo, 1 + hi], per-token
max(-A r, -A clip(r)), optional k3 KL, token-level normalisation by the global valid-token count).

Invariant: nothing here depends on how many groups or rollouts a step holds: the advantage is per
group and the token-level loss is divided by the tokens actually trained, so a shrunk step (fix 1)
is exactly the same objective over fewer samples.
"""

from __future__ import annotations

import numpy as np
import torch


def group_advantages(rewards, leave_one_out: bool = True, normalize: bool = True, eps: float = 1e-6) -> np.ndarray:
    """Advantages of one prompt group's rollouts (masked rollouts count toward the baseline).

    The std is computed two-pass over each rollout's comparison set. Upstream's one-pass
    E[r^2] - E[r]^2 cancels badly when that set is constant: it leaves a std of ~1e-9 instead of 0
    and an advantage of ~1e5 instead of the unnormalised one.
    """
    r = np.asarray(rewards, dtype=np.float64)
    g = len(r)
    if g <= 1:
        return np.zeros_like(r)
    if leave_one_out:
        others = np.stack([np.delete(r, i) for i in range(g)])  # [g, g-1]
    else:
        others = np.broadcast_to(r, (g, g))
    baseline = others.mean(axis=1)
    adv = r - baseline
    if normalize and others.shape[1] > 1:
        std = np.sqrt(((others - baseline[:, None]) ** 2).sum(axis=1) / (others.shape[1] - 1))
        adv = np.where(std > 0, adv / (std + eps), adv)
    return adv


def clipped_pg_loss(
    curr_logprobs: torch.Tensor,
    prev_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    normalizer: float,
    ratio_clip_min: float = 0.2,
    ratio_clip_max: float = 0.2,
    reference_logprobs: torch.Tensor | None = None,
    kl_penalty: float = 0.0,
    token_level: bool = True,
) -> tuple[torch.Tensor, dict]:
    """Loss of a (micro)batch: [B, T] logprobs, [B] or [B, T] advantages, [B, T] mask
    (token_mask * sample_mask). `normalizer` is the global count of valid tokens (token-level)
    or of valid samples (sequence-level), so micro-batch losses add up to the step's loss."""
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(curr_logprobs)
    ratio = torch.exp(curr_logprobs - prev_logprobs)
    clipped = ratio.clamp(1.0 - ratio_clip_min, 1.0 + ratio_clip_max)
    per_token = torch.maximum(-advantages * ratio, -advantages * clipped)
    kl = torch.zeros_like(per_token)
    if reference_logprobs is not None and kl_penalty > 0:
        log_r = reference_logprobs - curr_logprobs
        kl = torch.exp(log_r) - log_r - 1.0  # k3
        per_token = per_token + kl_penalty * kl
    if token_level:
        loss = (per_token * mask).sum() / normalizer
    else:
        per_sample = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        loss = (per_sample * (mask.sum(-1) > 0)).sum() / normalizer
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        metrics = {
            "clip_fraction": float(((ratio != clipped).float() * mask).sum() / n),
            "kl": float((kl * mask).sum() / n),
        }
    return loss, metrics
