"""`learned_gap`, the gap a `learned` gather (vllm_cfg.gather_rule) waits inside a clump: the cap until
enough gaps are known, then a margin over their high quantile, floored and capped."""

from __future__ import annotations

import pytest

from minirl.generation.engine import GAP_FLOOR_S, GAP_MARGIN, GAP_MIN_SAMPLES, learned_gap


def test_the_learned_gap_follows_the_arrivals_between_its_floor_and_the_cap():
    cap = 0.02
    assert learned_gap([0.001] * (GAP_MIN_SAMPLES - 1), cap) == cap  # too few known: the fixed rule's gap
    assert learned_gap([0.0002] * GAP_MIN_SAMPLES, cap) == GAP_FLOOR_S  # a quiet machine: the floor
    loaded = [0.001] * 50 + [0.004] * 50  # 90th percentile 4 ms
    assert learned_gap(loaded, cap) == pytest.approx(GAP_MARGIN * 0.004)
    assert learned_gap([0.009] * GAP_MIN_SAMPLES, cap) == cap  # a loaded machine: the whole gap, as before
