"""Admission pacing (issue 35 item 2): the rule that holds a prompt group whose expected duration
would end after its staleness window closes (minirl/async_rl/pacing.py), its config, and one real
async run in which pacing removes the evictions that eager admission causes."""

from __future__ import annotations

import json

import pytest

from minirl.async_rl.pacing import Pacer, prompt_class, protects, quantile
from minirl.config import ConfigError, load_config


def test_quantile_is_the_upper_nearest_rank():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert quantile(xs, 0.5) == 3.0 and quantile(xs, 0.9) == 5.0 and quantile(xs, 0.2) == 1.0
    assert quantile(xs, 1.0) == 5.0 and quantile([7.0], 0.1) == 7.0


def test_prompt_class_reads_a_neutral_difficulty_else_the_doors_room_count_else_one_class():
    assert prompt_class({"difficulty": "hard", "task": {"num_rooms": 3}}) == "hard"
    assert prompt_class({"task": {"num_rooms": 3}}) == 3
    assert prompt_class({"responses_create_params": {"input": []}}) is None


def test_a_group_that_ends_after_the_window_is_held_and_one_that_fits_is_admitted():
    """S = 1, publishes every 10 s (the last at t = 20): the window of a group started at t closes at
    20 + 1 * 10. A 4 s class fits at t = 21 (9 s left); a 12 s class never fits in a window of one
    period, and waits until the train pump starves."""
    p = Pacer(1, quantile_q=0.9, started_at=0.0)
    p.published(10.0)
    p.published(20.0)
    for d in (3.0, 4.0, 3.5):
        p.observed(1, d)
    for d in (11.0, 12.0):
        p.observed(4, d)
    assert p.period() == 10.0 and p.window_left(21.0) == pytest.approx(9.0)
    assert (p.decide([1], 21.0, False).admit, p.decide([1], 21.0, False).reason) == (True, "fits")
    assert p.decide([1], 21.0, False).expected_s == 4.0  # the 0.9 quantile of 3, 3.5, 4
    assert p.decide([1], 26.5, False).admit is False  # 3.5 s left, 4 s expected
    held = p.decide([4], 21.0, False)
    assert (held.admit, held.reason, held.expected_s) == (False, "hold", 12.0)
    assert p.decide([4], 21.0, True).admit and p.decide([4], 21.0, True).reason == "starving"


def test_a_wider_window_admits_what_one_period_holds():
    p = Pacer(2, started_at=0.0)
    p.published(10.0)
    p.observed(4, 12.0)
    assert p.decide([4], 10.0, False).admit  # 2 periods = 20 s left
    assert not p.decide([4], 19.0, False).admit  # 11 s left


def test_an_unseen_class_is_admitted_to_learn_unless_a_bound_says_it_will_not_fit():
    p = Pacer(1, started_at=0.0)
    p.published(10.0)
    assert p.decide(["new"], 10.0, False).reason == "unknown"
    bounded = Pacer(1, bound_s=30.0, started_at=0.0)
    bounded.published(10.0)
    assert not bounded.decide(["new"], 10.0, False).admit
    bounded.observed("new", 2.0)  # an observation replaces the bound
    assert bounded.decide(["new"], 10.0, False).admit


def test_an_unseen_class_is_expected_as_slow_as_the_slowest_seen_and_a_batch_as_its_slowest_class():
    p = Pacer(1, started_at=0.0)
    p.published(10.0)
    p.observed(1, 2.0)
    p.observed(8, 9.0)
    assert p.expected(4) == 9.0
    assert not p.decide([1, 1, 8], 12.0, False).admit and p.decide([1, 1], 12.0, False).admit  # 8 s left


def test_protects_keeps_a_place_for_the_oldest_live_group_in_flight():
    """S = 1, N = 4, version 5. A group started under 5 while step 5 has not selected yet can be
    taken by steps 5 and 6: 8 places, so with the new group at most 7 others besides it."""
    assert protects({5: 1}, 5, 5, 1, 4, pending=True) and protects({5: 4}, 3, 5, 1, 4, pending=True)
    assert not protects({5: 4}, 4, 5, 1, 4, pending=True)
    # step 5 took its groups: only step 6 is left for it, 4 places: 3 others at most with the new one
    assert protects({5: 1}, 2, 5, 1, 4, pending=False) and not protects({5: 2}, 2, 5, 1, 4, pending=False)
    # a group under 4 after step 5 selected is no longer selectable (it will be evicted): the next oldest counts
    assert protects({4: 3, 5: 1}, 2, 5, 1, 4, pending=False) and not protects({4: 1, 5: 2}, 2, 5, 1, 4, pending=False)
    assert protects({}, 9, 5, 1, 4, pending=True)  # nothing in flight: nothing to protect


def test_before_the_first_publish_only_a_starving_step_is_fed():
    """No step period is known: admit only what the first step needs."""
    p = Pacer(1, started_at=0.0)
    assert p.window_left(1.0) is None
    assert not p.decide([1], 1.0, False).admit and p.decide([1], 1.0, True).admit


def test_the_period_is_the_median_of_recent_publish_intervals():
    p = Pacer(1, started_at=0.0, history=4)
    for t in (1.0, 2.0, 3.0, 30.0, 31.0, 32.0, 33.0):  # one slow step among fast ones
        p.published(t)
    assert p.period() == 1.0


def test_paced_admission_is_a_typed_sampler_option_refused_with_ready_first():
    cfg = load_config(None, ["async_rl.enabled=true", "loss_fn.use_importance_sampling_correction=true",
                             "async_rl.sampler.name=windowed", "async_rl.sampler.admission=paced",
                             "async_rl.rollout_failure.max_skipped_prompts=0",
                             "async_rl.rollout_failure.max_consecutive_dropped_prompts=0"])
    assert cfg.async_rl.sampler.admission == "paced" and cfg.async_rl.sampler.pacing_quantile == 0.9
    with pytest.raises(ConfigError, match=r"async_rl\.sampler\.admission"):
        load_config(None, ["async_rl.enabled=true", "loss_fn.use_importance_sampling_correction=true",
                           "async_rl.sampler.name=ready_first", "async_rl.sampler.admission=paced",
                           "async_rl.rollout_failure.max_skipped_prompts=0",
                           "async_rl.rollout_failure.max_consecutive_dropped_prompts=0"])
    with pytest.raises(ConfigError, match=r"async_rl\.sampler\.admission"):
        load_config(None, ["async_rl.sampler.admission=sometimes"])
    with pytest.raises(ConfigError, match=r"env\.tool_latency_per_room_s"):
        load_config(None, ["env.tool_latency_per_room_s=-1"])


def test_group_fates_counts_each_dispatched_group_once_by_room_count():
    """The async skew measure: an evicted group, a dropped one, a trained one with a masked rollout
    and one in flight at the end; the resolved mix excludes the last, the trained mix counts rollouts."""
    from minirl.experiments.stats import difficulty_skew, group_fates

    rooms = {(0, 0): 1, (0, 1): 8, (0, 2): 8, (1, 0): 1, (1, 1): 8}
    events = [{"type": "evict", "step": 0, "group": 1}, {"type": "drop", "decision": "dropped", "step": 0, "group": 2},
              {"type": "mask", "step": 0, "group": 0, "rollout": 1}, {"type": "dispatch", "step": 1, "group": 1}]
    out = group_fates(lambda s, g: rooms[(s, g)], list(rooms) + [(0, 0)], [(0, 0), (1, 0)], 2, events)
    assert out["dispatched"] == {1: 2, 8: 3} and out["evicted"] == {8: 1} and out["dropped"] == {8: 1}
    assert out["trained"] == {1: 2} and out["unresolved"] == {8: 1}
    assert out["resolved"] == {1: 4, 8: 4} and out["rollouts_trained"] == {1: 3}
    skew = difficulty_skew(out["resolved"], out["rollouts_trained"])
    assert skew["rooms_shift"] == pytest.approx(1 - 4.5) and skew["skew_tv"] == pytest.approx(0.5)


@pytest.mark.slow
def test_paced_windowed_run_evicts_nothing_where_eager_evicts_most(tmp_path, shared_engine):
    """windowed at staleness 0 with room for 16 groups in flight: eager admission dispatches 16
    under weights 0 and evicts 12 (tests/integration/test_async.py). Paced, the pump starts only what a step
    needs once no window is left, so no group is generated to be evicted, every step trains its
    4 groups, and each hold is a `pace` event whose admission ends it."""
    from helpers import run_cli

    proc = run_cli("grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=2", "checkpoint.enabled=false",
                   "logger.tensorboard=false", "grpo.max_num_steps=2", "async_rl.enabled=true",
                   "async_rl.sampler.name=windowed", "async_rl.sampler.max_staleness_versions=0",
                   "async_rl.sampler.admission=paced", "async_rl.max_inflight_prompts=16",
                   "async_rl.max_buffered_rollouts=16", "async_rl.rollout_failure.max_skipped_prompts=0",
                   "async_rl.rollout_failure.max_consecutive_dropped_prompts=0", f"run_dir={tmp_path}", *shared_engine)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line]
    evs = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines() if line]
    assert [r["groups_trained"] for r in rows] == [4, 4]
    assert sum(r["stale_groups_evicted"] for r in rows) == 0 and not [e for e in evs if e["type"] == "evict"]
    pace = [e for e in evs if e["type"] == "pace"]
    holds = [e for e in pace if e["decision"] == "hold"]
    assert holds and all(e["decision"] == "admit_starving" for e in pace if e["decision"] != "hold")
    assert all(e["prompt_classes"] == [2] for e in pace)  # the default task: 2 rooms
    dispatched = [e for e in evs if e["type"] == "dispatch"]
    assert len(dispatched) <= 4 * 2 + 4  # each step's 4, and at most one batch drawn past the last step


def test_the_pacer_resumes_with_what_it_observed():
    """A checkpoint keeps the durations by class and the step period (not the clock): the resumed
    pacer holds the same slow class at once, where a fresh one would admit it to learn."""
    p = Pacer(1, quantile_q=0.9, started_at=0.0)
    for t in (10.0, 20.0):
        p.published(t)
    p.observed(1, 4.0)
    p.observed(4, 12.0)
    resumed, fresh = Pacer(1, quantile_q=0.9, started_at=500.0), Pacer(1, quantile_q=0.9, started_at=490.0)
    fresh.published(500.0)
    resumed.load(p.state(), 500.0)
    assert resumed.period() == 10.0 and resumed.window_left(501.0) == pytest.approx(9.0)
    assert resumed.expected(4) == 12.0 and not resumed.decide([4], 501.0, False).admit
    assert resumed.decide([1], 501.0, False).admit
    assert fresh.decide([4], 501.0, False).admit  # nothing observed: a fresh pacer admits and learns
