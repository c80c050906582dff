"""minirl.timeline: each lane's parts add up to its whole, and the occupancy clock counts overlapping
rollouts once (pure functions and a clock; no Ray, no engine)."""

from __future__ import annotations

import time

import pytest

from minirl.timeline import TIMING_FIELDS, EngineClocks, Occupancy, generation_lane, trainer_lane


def test_occupancy_counts_overlapping_intervals_once():
    occ = Occupancy()
    assert occ.read() == 0.0
    occ.enter()
    occ.enter()  # two rollouts in flight at once
    time.sleep(0.02)
    occ.leave()
    open_read = occ.read()  # one still in flight: the open interval counts
    time.sleep(0.02)
    occ.leave()
    closed = occ.read()
    assert 0.02 <= open_read < closed < 0.2
    time.sleep(0.02)
    assert occ.read() == closed  # nothing in flight: the clock stands still


def test_trainer_lane_adds_up_to_the_step():
    lane = trainer_lane(10.0, 12.0, 13.5, 13.75, exposed=1.5)
    assert lane["timing/train/data_processing"] == pytest.approx(0.5)
    parts = ("exposed_generation", "data_processing", "policy_training", "weight_sync")
    assert sum(lane[f"timing/train/{p}"] for p in parts) == pytest.approx(lane["timing/train/total_step_time"]) == 3.75


def test_generation_lane_adds_up_to_the_cycle():
    # (now, engine busy, weight load, weight drain, gather, rollouts in flight): 4 s of cycle, 1.5 s
    # busy, 0.25 s loading, 0.25 s gathering a burst, 3 s with rollouts in flight
    lane = generation_lane((100.0, 7.0, 1.0, 0.0, 2.0, 50.0), (104.0, 8.5, 1.25, 0.5, 2.25, 53.0))
    assert lane["timing/generation/gather"] == pytest.approx(0.25)
    assert lane["timing/generation/rollout_wait"] == pytest.approx(1.0)
    assert lane["timing/generation/idle"] == pytest.approx(1.0)
    parts = ("engine_busy", "weight_load", "gather", "rollout_wait", "idle")
    assert sum(lane[f"timing/generation/{p}"] for p in parts) == pytest.approx(lane["timing/generation/cycle"])
    assert lane["timing/generation/weight_drain"] == 0.5
    assert set(lane) | set(trainer_lane(0, 1, 2, 3, 0.5)) | {"timing/train/policy_compute"} == set(TIMING_FIELDS)


def test_a_sync_runs_weight_load_is_outside_the_rollouts_in_flight():
    """Sync: collect awaits every group, then train, then the weight sync loads with no rollout in
    flight. A 10 s cycle, rollouts in flight 6 s of it (engines busy 4 s), a 1 s load after: 2 s of
    rollout_wait, 3 s idle (the load was taken out of rollout_wait and counted twice)."""
    before, after = (100.0, 0.0, 0.0, 0.0, 0.0, 0.0), (110.0, 4.0, 1.0, 0.0, 0.0, 6.0)
    lane = generation_lane(before, after, loads_in_flight=False)
    assert lane["timing/generation/rollout_wait"] == pytest.approx(2.0)
    assert lane["timing/generation/idle"] == pytest.approx(3.0)
    parts = ("engine_busy", "weight_load", "gather", "rollout_wait", "idle")
    assert sum(lane[f"timing/generation/{p}"] for p in parts) == pytest.approx(lane["timing/generation/cycle"])
    assert generation_lane(before, after)["timing/generation/rollout_wait"] == pytest.approx(1.0)  # async: inside


def test_engine_clocks_continue_across_a_worker_restart():
    """A restarted generation worker's engine counts from 0 in a new epoch: its earlier life's totals,
    as last read, are carried, so a step's difference never goes negative (it was -95 s for a shared
    worker killed mid-run); the other worker is untouched."""
    def reading(busy, epoch):
        return {"busy_s": busy, "weights_s": busy / 10, "drain_s": 0.0, "gather_s": busy / 5, "epoch": epoch}

    ec = EngineClocks()
    series = [[reading(100.0, "a"), reading(50.0, "x")], [reading(105.0, "a"), reading(52.0, "x")],
              [reading(2.0, "b"), reading(53.0, "x")], [reading(4.0, "b"), reading(55.0, "x")]]
    busy = [[r["busy_s"] for r in ec.read(step)] for step in series]
    assert busy == [[100.0, 50.0], [105.0, 52.0], [107.0, 53.0], [109.0, 55.0]]
    assert ec.read([reading(5.0, "b"), reading(56.0, "x")])[0]["gather_s"] == pytest.approx(105.0 / 5 + 1.0)
