"""Which rows of a step train, which count in their group's baseline, and NeMo-RL's per-step
masking and rollout stats (`train/masking/*`, `train/rollouts/*`) over them. A row is one kept
rollout (a logical sample; its physical traces share it), of one kind (`row_kind`): trained, or
masked as `placeholder`, `env_flag`, `truncated` or `seq_logprob_error`.

Invariant: the kinds partition the rows, so `train/masking/rows` is the sum of the trained rows and
the four masked counts; a row trains iff its kind is `trained`; the stats read the rows and their
advantages and change nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from minirl.types import Rollout

ROW_KINDS = {
    "capture_failed": "placeholder",
    "mask_sample": "env_flag",
    "summary_failed": "env_flag",
    "overlong": "truncated",
    "unrecorded_calls": "seq_logprob_error",
    "stale_calls": "seq_logprob_error",
    "logprob_mismatch": "seq_logprob_error",
}
"""Mask reason -> row kind. A reason not listed here is a placeholder (out of every baseline)."""
MASKED_KINDS = ("placeholder", "env_flag", "truncated", "seq_logprob_error")
REINSTATED_KINDS = ("env_flag", "truncated")
"""The masked kinds whose reward stays in the baseline under `masked_sample_rewards_in_baseline`."""


def row_kind(r: Rollout) -> str:
    """`trained` (sample mask 1), or the masked row's kind by its mask reason:
    - `placeholder`: no result to measure (`capture_failed`: a model call failed, a guard rejection
      or context overflow ended the episode); minirl keeps no row for a dropped `/run` (its group is
      dropped instead), so a placeholder here is always one of these;
    - `env_flag`: the harness flagged the rollout incomplete (its verifier's `mask_sample`, a
      summarizing agent's `summary_failed`);
    - `truncated`: truncated at `policy.max_total_sequence_length` under `grpo.overlong_filtering`;
    - `seq_logprob_error`: the ledger refused its tokens or logprobs (`unrecorded_calls`,
      `stale_calls`, `logprob_mismatch`), minirl's counterpart of NeMo's sequence-logprob-error rows.
    """
    return "trained" if r.mask_reason is None else ROW_KINDS.get(r.mask_reason, "placeholder")


def stronger_mask(first: str | None, second: str | None) -> str | None:
    """The mask reason a rollout keeps when two find it: a reason whose kind keeps the row out of every
    baseline (`placeholder`, `seq_logprob_error`) over one a baseline policy may reinstate (`env_flag`,
    `truncated`), else `first`. Upstream: placeholders and sequence-logprob-error rows stay out of both,
    whatever else flagged them (a verifier's `mask_sample` on an episode a context overflow ended, the
    ledger's `logprob_mismatch` on an `overlong` row)."""
    if first is None or second is None:
        return first or second
    reinstated = [ROW_KINDS.get(r, "placeholder") in REINSTATED_KINDS for r in (first, second)]
    return second if reinstated == [True, False] else first


def baseline_members(rollouts: list[Rollout], excludes_masked: bool, rewards_in_baseline: bool) -> np.ndarray:
    """Which rollouts' rewards count in their group's baseline, std and "at most one member" count:
    the trained rows only (`grpo.baseline_excludes_masked=true`), those plus the `env_flag` and
    `truncated` rows (`grpo.masked_sample_rewards_in_baseline=true`, NeMo's third policy), or every
    row (`baseline_excludes_masked=false`, upstream's `valid_mask = ones`); docs/architecture.md,
    "Baseline policies"."""
    if not excludes_masked:
        return np.ones(len(rollouts), dtype=bool)
    keep = ("trained", *REINSTATED_KINDS) if rewards_in_baseline else ("trained",)
    return np.array([row_kind(r) in keep for r in rollouts], dtype=bool)


class ScoredGroup(NamedTuple):
    """One kept group's rollouts in index order, its baseline membership and its advantages."""

    rollouts: list[Rollout]
    members: np.ndarray
    advantages: np.ndarray


def _mean(values) -> float:
    return float(np.mean(values)) if len(values) else float("nan")


def masking_stats(groups: list[ScoredGroup]) -> dict:
    """NeMo's `train/masking/*` over the step's kept rows (nan where a mean has no row)."""
    rows = [(r, row_kind(r), bool(m)) for g in groups for r, m in zip(g.rollouts, g.members)]
    n = len(rows)
    by_kind = {k: [r.reward for r, kind, _ in rows if kind == k] for k in ("trained", *MASKED_KINDS)}
    masked = [r.reward for r, kind, _ in rows if kind != "trained"]

    def frac(kind: str) -> float:
        return len(by_kind[kind]) / n if n else 0.0

    lt2 = sum(sum(row_kind(r) == "trained" for r in g.rollouts) < 2 for g in groups)
    p = "train/masking/"
    return {
        p + "rows": n,
        p + "placeholder_rows": len(by_kind["placeholder"]),
        p + "env_flag_rows": len(by_kind["env_flag"]),
        p + "env_flag_frac": frac("env_flag"),
        p + "truncated_rows": len(by_kind["truncated"]),
        p + "truncated_frac": frac("truncated"),
        p + "seq_logprob_error_rows": len(by_kind["seq_logprob_error"]),
        p + "masked_frac": len(masked) / n if n else 0.0,
        p + "trained_frac": frac("trained"),
        p + "baseline_rows": sum(m for _, _, m in rows),
        p + "reinstated_rows": sum(m and kind != "trained" for _, kind, m in rows),
        p + "reward_mean_trained": _mean(by_kind["trained"]),
        p + "reward_mean_env_flag": _mean(by_kind["env_flag"]),
        p + "reward_mean_truncated": _mean(by_kind["truncated"]),
        p + "reward_mean_masked": _mean(masked),
        p + "groups": len(groups),
        p + "groups_lt2_trained_frac": lt2 / len(groups) if groups else 0.0,
    }


PASS_REWARD = 1.0
"""A rollout passes when its reward reaches this (as `val_success_rate` counts a success)."""
_QUANTILES = (("mean", None), ("p50", 50), ("p75", 75), ("p90", 90), ("max", 100))


def _spread(prefix: str, values) -> dict:
    """mean, p50, p75, p90 and max of `values` (nan for none), keyed under `prefix`. The percentiles
    come from one `np.percentile` call (the same values as one call each, at a quarter of the cost)."""
    v = np.asarray(values, dtype=np.float64)
    if not v.size:
        return {f"{prefix}/{name}": float("nan") for name, _ in _QUANTILES}
    stats = [v.mean(), *np.percentile(v, [q for _, q in _QUANTILES[1:]])]
    return {f"{prefix}/{name}": float(x) for (name, _), x in zip(_QUANTILES, stats)}


def rollout_stats(groups: list[ScoredGroup], trace_lengths, context: int) -> dict:
    """NeMo's rollout stats over the step's kept rows, under `train/rollouts/`: generated tokens per
    rollout (all, passing, failing), model calls per rollout (`turns`), the share of the batch's
    traces longer than 90% of `context`, the groups that mix passes and failures, pass or fail
    whole, their mean reward std (population), and the share of trained rows with advantage 0."""
    rollouts = [r for g in groups for r in g.rollouts]
    tokens = [sum(len(c.gen) for c in r.calls) for r in rollouts]
    passed = [r.reward >= PASS_REWARD for r in rollouts]
    lengths = np.asarray(trace_lengths, dtype=np.float64)
    shares = [np.mean([r.reward >= PASS_REWARD for r in g.rollouts]) for g in groups if g.rollouts]
    trained_adv = [a for g in groups for r, a in zip(g.rollouts, g.advantages) if row_kind(r) == "trained"]
    p = "train/rollouts/"
    return {
        **_spread(p + "gen_tokens", tokens),
        **_spread(p + "gen_tokens/pass", [t for t, ok in zip(tokens, passed) if ok]),
        **_spread(p + "gen_tokens/fail", [t for t, ok in zip(tokens, passed) if not ok]),
        **_spread(p + "turns", [len(r.calls) for r in rollouts]),
        p + "seq_len/frac_above_90pct_ctx": float((lengths > 0.9 * context).mean()) if lengths.size else 0.0,
        p + "groups/mixed_frac": _mean([0.0 < s < 1.0 for s in shares]) if shares else 0.0,
        p + "groups/all_pass_frac": _mean([s == 1.0 for s in shares]) if shares else 0.0,
        p + "groups/all_fail_frac": _mean([s == 0.0 for s in shares]) if shares else 0.0,
        p + "groups/reward_std_mean": _mean([np.std([r.reward for r in g.rollouts]) for g in groups if g.rollouts]),
        p + "groups/zero_advantage_sample_frac": _mean([a == 0.0 for a in trained_adv]) if trained_adv else 0.0,
    }
