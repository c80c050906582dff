"""GRPO math as pure functions: per-group advantages (NeMo-RL's leave-one-out baseline and std,
`group_advantages`) and the clipped policy-gradient loss (NeMo-RL's `ClippedPGLossFn`,
`clipped_pg_loss`), with switches for a rollout split into several traces (segments, e.g. under
compaction) where upstream's branches disagree (`rollout_votes`, `segment_weights`).

Invariant: nothing here depends on how many groups or rollouts a step holds: the advantage is per
group and the token-level loss is divided by the tokens actually trained, so a step shrunk by
dropped groups is exactly the same objective over fewer samples. The advantages are numpy and the
loss is torch, imported where used: the controller never loads torch (2 s of CPU at start-up here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


def group_advantages(rewards, valid=None, leave_one_out: bool = True, normalize: bool = True,
                     exclude_masked: bool = True, eps: float = 1e-6, in_baseline=None) -> np.ndarray:
    """Advantages of one prompt group's rollouts; `valid` is each rollout's sample mask (default all 1).

    `exclude_masked` (minirl) runs the baseline over the valid rollouts, plus the masked ones that
    `in_baseline` names (NeMo's `masked_sample_rewards_in_baseline`: a rollout flagged incomplete
    keeps its reward in its siblings' baseline and std, and gets no gradient); without it (upstream)
    the baseline runs over every rollout, masked ones included, as upstream's GRPO hands its baseline
    function `valid_mask = ones_like(rewards)`. That membership decides everything below: a group
    whose membership holds at most one rollout gets 0 everywhere (minirl: at most one valid
    rollout; upstream: a group of one, so a G = 2 group with one rollout masked trains its
    survivor with r1 - r0). Rollout i is compared with the members other than itself (all of them
    with `leave_one_out=False`); its advantage is r_i minus their mean, divided by (std + eps)
    where their unbiased std is > 0. A constant set has std exactly 0: the std is computed
    two-pass and only for a set whose values differ, since even two-pass leaves ~1e-17 for
    [0.1, 0.1, 0.1] (an inexact mean), and dividing by it turns an advantage of 0.1 into 1e5. The
    difference is taken as the mean of r_i minus each other member, the same value, so a constant set's
    advantages are exactly 0 rather than r_i minus an inexact mean (-1.4e-17 for [0.1] * 4), which a
    reader counting zero advantages (`zero_advantage_sample_frac`) would miss.
    Rollouts outside the membership get 0 (members that are masked get theirs computed, as
    upstream's; the loss masks them).
    """
    r = np.asarray(rewards, dtype=np.float64)
    g = len(r)
    v = np.ones(g, dtype=bool) if valid is None else np.asarray(valid, dtype=bool)
    extra = np.zeros(g, dtype=bool) if in_baseline is None else np.asarray(in_baseline, dtype=bool)
    members = (v | extra) if exclude_masked else np.ones(g, dtype=bool)
    adv = np.zeros(g)
    if members.sum() <= 1:
        return adv
    for i in range(g):
        if not members[i]:
            continue
        member = members.copy()
        if leave_one_out:
            member[i] = False
        others = r[member]
        adv[i] = (r[i] - others).mean()  # exactly 0 where every other equals r_i, however their mean rounds
        if normalize and len(others) > 1 and others.max() != others.min():
            std = np.sqrt(((others - others.mean()) ** 2).sum() / (len(others) - 1))
            adv[i] /= std + eps
    return adv


def rollout_votes(segment_valid, validity: str = "all") -> bool:
    """Whether a rollout with a valid reward counts as valid (trained, and a member of its group's
    baseline where masked ones are excluded), from its segments' validity: `all` is NeMo-RL #4124's
    amin (one masked segment invalidates the rollout), `any` the segment-rows branch's amax (it
    votes while any segment is valid; its masked segments are still not trained). A rollout with
    no segments is left to its own mask."""
    v = np.asarray(segment_valid, dtype=bool)
    if v.size == 0:
        return True
    return bool(v.all() if validity == "all" else v.any())


def summary_advantages(segment_rewards, valid, leave_one_out: bool = True, normalize: bool = True,
                       eps: float = 1e-6) -> list[list[float]]:
    """`grpo.summary_credit=next_segment`: the advantage of each summary of one prompt group's
    rollouts. `segment_rewards[i][k]` scores the segment rollout i's k-th summary hands off to (None:
    no room in it); `valid[i]` whether rollout i is trained. For each k, the k-th summaries of the
    valid rollouts with a scored segment are a group of their own, and `group_advantages` (the same
    leave-one-out baseline, std and eps) gives each its advantage; every other k-th summary gets 0.
    A rollout's summaries are compared only with the other rollouts' summaries at the same place
    (the group shares its prompt and its trigger threshold, so the k-th summary of each falls at
    about the same room)."""
    out = [[0.0] * len(r) for r in segment_rewards]
    for k in range(max((len(r) for r in segment_rewards), default=0)):
        member = [bool(valid[i]) and k < len(r) and r[k] is not None for i, r in enumerate(segment_rewards)]
        rewards = [r[k] if m else 0.0 for r, m in zip(segment_rewards, member)]
        adv = group_advantages(rewards, member, leave_one_out, normalize, exclude_masked=True, eps=eps)
        for i, m in enumerate(member):
            if m:
                out[i][k] = float(adv[i])
    return out


def segment_weights(rollout_ids, tokens, weighting: str = "token_mean") -> np.ndarray:
    """Loss weight of each trained row (segment): `rollout_ids[i]` names row i's rollout and
    `tokens[i]` its trained-token count (> 0). `token_mean` gives 1 (every token counts once);
    `rollout_equal` 1/N_r, N_r the rollout's trained segments (verl #7580's session-equal weight);
    `length_ratio` T_i over the mean T of its rollout's segments (#7580's partition-preserving
    weight). Then scaled to mean 1 over the rows, once for the global batch, as #7580's
    normalize_loss_weight_global, so only the ratios move the objective. #7580's names hold for a
    per-segment token mean; under the token-level loss a row's mass is w_i x T_i, so a rollout's
    mass under `rollout_equal` is its mean segment length (not one share per rollout), and under
    `length_ratio` sum T_i^2 / mean T, which changes when the rollout splits (not partition-preserving)."""
    t = np.asarray(tokens, dtype=np.float64)
    if len(t) == 0 or weighting == "token_mean":
        return np.ones(len(t))
    _, inv = np.unique(np.asarray(rollout_ids), return_inverse=True)
    n = np.bincount(inv).astype(np.float64)
    w = 1.0 / n[inv] if weighting == "rollout_equal" else t / (np.bincount(inv, weights=t) / n)[inv]
    return w / w.mean()


def k3_kl(curr_logprobs: torch.Tensor, reference_logprobs: torch.Tensor, input_clamp: float | None = 20.0,
          output_clamp: float | None = 10.0, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Upstream's `calculate_kl(kl_type="k3")`: log r = ref - curr clamped to +-input_clamp,
    exp(log r) - log r - 1, times `weights` (where the input clamp binds, the weight is detached),
    then clamped to +-output_clamp. The weight goes in before the output clamp, so a token whose
    k3 is clamped by either clamp has zero gradient, as upstream's."""
    import torch

    log_r = reference_logprobs - curr_logprobs
    if input_clamp is not None:
        clamped = log_r.clamp(-input_clamp, input_clamp)
        if weights is not None:
            weights = torch.where(log_r == clamped, weights, weights.detach())
        log_r = clamped
    kl = torch.exp(log_r) - log_r - 1.0
    if weights is not None:
        kl = weights * kl
    return kl if output_clamp is None else kl.clamp(-output_clamp, output_clamp)


def importance_weights(prev_logprobs: torch.Tensor, generation_logprobs: torch.Tensor, kind: str | None,
                       ratio: float | None, ratio_min: float | None,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's off-policy correction: w = exp(prev - generation), detached, non-finite -> 0, then
    truncated: `tis` clamps w to [ratio_min or 0, ratio], `icepop` zeroes the tokens outside
    [ratio_min, ratio], `seq-mask-tis` zeroes every token of a sequence whose geometric-mean
    weight exp(mean over its `mask`ed tokens of prev - generation, non-finite terms -> 0) falls
    outside [ratio_min, ratio], and leaves the other sequences' weights untruncated. Returns
    (w, out_of_bounds): the tokens ([B, T]) or, for `seq-mask-tis`, the sequences ([B]) outside
    the bounds (all False without a truncation)."""
    import torch

    w = torch.exp(prev_logprobs - generation_logprobs).detach()
    w = torch.where(torch.isfinite(w), w, torch.zeros_like(w))
    lo = 0.0 if ratio_min is None else ratio_min
    if kind == "seq-mask-tis":
        log_w = (prev_logprobs - generation_logprobs).detach()
        log_w = torch.where(torch.isfinite(log_w), log_w, torch.zeros_like(log_w))
        m = torch.ones_like(log_w) if mask is None else mask.to(log_w.dtype)
        geo = torch.exp((log_w * m).sum(-1) / (m.sum(-1) + 1e-8))  # upstream's masked_mean: count + 1e-8
        oob = (geo < lo) | (geo > ratio)
        return torch.where(oob[:, None], torch.zeros_like(w), w), oob
    oob = torch.zeros_like(w, dtype=torch.bool) if kind is None else (w < lo) | (w > ratio)
    if kind == "tis":
        w = w.clamp(min=lo, max=ratio)
    elif kind == "icepop":
        w = torch.where(oob, torch.zeros_like(w), w)
    return w, oob


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
    generation_logprobs: torch.Tensor | None = None,
    is_type: str | None = None,
    is_ratio: float | None = None,
    is_ratio_min: float | None = None,
    curr_logprobs_unfiltered: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """Loss of a (micro)batch: [B, T] logprobs, [B] or [B, T] advantages, [B, T] mask
    (token_mask * sample_mask). `normalizer` is the global count of valid tokens (token-level)
    or of valid samples (sequence-level), so micro-batch losses add up to the step's loss.

    As NeMo-RL's `ClippedPGLossFn`: the ratio clipped to [1 - ratio_clip_min, 1 + ratio_clip_max],
    per token max(-A r, -A clip(r)). The KL term is upstream's: kl_penalty * clamp(w * k3) with
    w = exp(curr - curr.detach()) (value 1, non-finite -> 0), which keeps the score-function gradient of the
    sampled tokens where no clamp binds (see `k3_kl`). With top-p filtering (policy.generation.top_p < 1) the
    KL takes `curr_logprobs_unfiltered`, as upstream's does: the reference's logprobs are unfiltered. With
    `generation_logprobs` (use_importance_sampling_correction), the clipped term of each token is weighted by
    `importance_weights`; `is_oob_ratio` counts tokens, or sequences for `seq-mask-tis`. `weights` ([B],
    `segment_weights`) scale each row's per-token loss, the policy-gradient and the KL term alike, as verl
    #7580 weights every loss term; the normaliser stays the unweighted count."""
    import torch

    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(curr_logprobs)
    ratio = torch.exp(curr_logprobs - prev_logprobs)
    clipped = ratio.clamp(1.0 - ratio_clip_min, 1.0 + ratio_clip_max)
    per_token = torch.maximum(-advantages * ratio, -advantages * clipped)
    oob = torch.zeros_like(per_token, dtype=torch.bool)
    if generation_logprobs is not None:
        w, oob = importance_weights(prev_logprobs, generation_logprobs, is_type, is_ratio, is_ratio_min, mask)
        per_token = per_token * w
    kl = torch.zeros_like(per_token)
    if reference_logprobs is not None and kl_penalty > 0:
        kl_logprobs = curr_logprobs if curr_logprobs_unfiltered is None else curr_logprobs_unfiltered
        kl = _weighted_kl(kl_logprobs, reference_logprobs)
        per_token = per_token + kl_penalty * kl
    if weights is not None:
        per_token = per_token * weights[:, None]
    return _reduce(per_token, mask, normalizer, token_level), _loss_metrics(ratio, clipped, kl, oob, mask)


def _weighted_kl(curr: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Upstream's per-token KL: k3 weighted by w = exp(curr - curr.detach()) (value 1, non-finite -> 0)."""
    import torch

    w = torch.exp(curr - curr.detach())
    return k3_kl(curr, reference, weights=torch.where(torch.isfinite(w), w, torch.zeros_like(w)))


def _reduce(per_token: torch.Tensor, mask: torch.Tensor, normalizer: float, token_level: bool) -> torch.Tensor:
    """Masked per-token losses -> this micro-batch's share of the step's loss: summed over tokens, or
    each sequence's token mean summed over sequences; divided by the step's global `normalizer`."""
    if token_level:
        return (per_token * mask).sum() / normalizer
    per_sample = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return (per_sample * (mask.sum(-1) > 0)).sum() / normalizer


def _loss_metrics(ratio, clipped, kl, oob, mask) -> dict:
    """Clip fraction and KL per valid token; importance-sampling bounds hit, with the units they
    count (tokens, or sequences for `seq-mask-tis`), so micro-batches and ranks add up."""
    import torch

    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        if oob.dim() == 1:  # seq-mask-tis: counted in sequences, as upstream (over global_valid_seqs)
            valid_seqs = mask.sum(-1) > 0
            is_oob, is_units = float((oob & valid_seqs).sum()), float(valid_seqs.sum())
        else:
            is_oob, is_units = float((oob.float() * mask).sum()), float(mask.sum())
        return {
            "clip_fraction": float(((ratio != clipped).float() * mask).sum() / n),
            "kl": float((kl * mask).sum() / n),
            "is_oob_ratio": is_oob / max(is_units, 1.0),
            "is_oob": is_oob,  # tokens (or sequences) outside the bounds, and the valid ones they are out of,
            "is_units": is_units,  # so micro-batches and ranks add up to the global ratio
        }
