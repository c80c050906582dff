"""The async bias report's paired differences (minirl/experiments/async_report.py) read by the project's one
rule, minirl.experiments.estimates.Estimate: resolved only where the t-interval excludes 0, and seeds that all
differ by the same amount give no t-interval, so they are never resolved."""

from __future__ import annotations

from minirl.experiments.async_report import _diff


def rows(values: list[float]) -> list[dict]:
    return [{"seed": s, "v": v} for s, v in enumerate(values)]


def test_a_difference_the_same_in_every_seed_is_not_resolved():
    # docs/experiments/async/results.jsonl's held-out rewards of weight_fifo+paced and sync: one prompt of 64
    # apart in both seeds, which the report called "-0.016 ± 0.000 (resolved)"
    paced, sync = rows([0.515625, 0.578125]), rows([0.53125, 0.59375])
    assert _diff(paced, sync, "v", 3) == "-0.016 ± 0.000 (the same in all 2 seeds: no t-interval, not resolved)"
    assert _diff(sync, sync, "v", 3) == "+0.000 ± 0.000 (not resolved)"  # exactly 0 in every seed
    assert _diff(rows([0.6, 0.7, 0.65]), rows([0.1, 0.1, 0.1]), "v", 2) == "+0.55 ± 0.12 (resolved)"  # a spread
    assert _diff(rows([0.6, 0.7]), rows([0.1, 0.1]), "v", 2) == "+0.55 ± 0.64 (not resolved)"
    assert _diff(rows([0.6]), rows([0.1]), "v", 2) == "+0.50 (1 seed)"
