"""bench/async_speedup.py counterbalances each seed's runs: sync first on an even seed, last on an odd one
(the async arms reversed with it), and every ratio is to the same seed's sync run, wherever it ran."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("seed, expected", [
    (0, ["sync", "async s=1", "async s=2"]),
    (1, ["async s=2", "async s=1", "sync"]),
    (2, ["sync", "async s=1", "async s=2"]),
])
def test_each_seed_is_counterbalanced_and_ratios_are_to_its_sync(monkeypatch, seed, expected):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    au = importlib.import_module("async_speedup")
    ran, speed = [], {"sync": 2.0, "async s=1": 3.0, "async s=2": 3.5}

    def run_arm(mode, staleness, seed_, variant):  # the run's result row, without the run
        label = mode + (f" s={staleness}" if mode == "async" else "")
        ran.append(label)
        return {"mode": label, "samples_per_s": speed[label], "step_time_median_s": 1.0, "reward_last5": 0.5,
                "staleness_mean": 0.5}

    results = au.seed_arms(seed, [("async", 1, None), ("async", 2, None)], run_arm)
    assert ran == expected
    assert [r["mode"] for r in results] == ["sync", "async s=1", "async s=2"]
    assert [r["ratio"] for r in results] == [1.0, 1.5, 1.75]
