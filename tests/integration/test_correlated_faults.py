"""Failures correlated with the episode (issue M): a per-room hazard drawn from the seed, and a real
context limit that long (many-room) episodes cross; the per-attempt coins stay as they were."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import aiohttp
import pytest

from minirl.config import ConfigError, FaultsConfig, load_config
from minirl.data import prompt_row
from minirl.faults import FaultPlan
from minirl.validation import held_out_rows
from minirl.wire import Coords

COORDS = [Coords(s, g, r, a) for s in range(10) for g in range(8) for r in range(4) for a in range(5)]


def test_per_room_hazard_grows_with_rooms_and_is_a_pure_function_of_seed_and_coordinates():
    q = 0.05
    plan = FaultPlan(FaultsConfig(seed=3, rate_per_room={"agent_exception": q}))
    fired = {n: [plan.call_of("agent_exception", c, n) is not None for c in COORDS] for n in (1, 2, 4, 8)}
    for n, f in fired.items():  # 1600 draws: within 4 standard errors of 1 - (1 - q)**n
        p = 1 - (1 - q) ** n
        assert abs(sum(f) / len(f) - p) < 4 * (p * (1 - p) / len(f)) ** 0.5, n
    for lo, hi in ((1, 2), (2, 4), (4, 8)):  # one draw per attempt: a fault at n rooms fires at more rooms too
        assert all(b for a, b in zip(fired[lo], fired[hi]) if a)
    again = FaultPlan(FaultsConfig(seed=3, rate_per_room={"agent_exception": q}))
    assert [again.call_of("agent_exception", c, 4) is not None for c in COORDS] == fired[4]
    other = FaultPlan(FaultsConfig(seed=4, rate_per_room={"agent_exception": q}))
    assert [other.call_of("agent_exception", c, 4) is not None for c in COORDS] != fired[4]
    # the coin is untouched: a per-attempt rate ignores the room count
    coin = FaultPlan(FaultsConfig(seed=3, rate={"agent_exception": 0.2}))
    assert [coin.call_of("agent_exception", c, 1) for c in COORDS] == [
        coin.call_of("agent_exception", c, 8) for c in COORDS]
    with pytest.raises(ValueError, match="faults.rate_per_room.agent_exception needs the row's num_rooms"):
        plan.call_of("agent_exception", COORDS[0])


def test_per_room_rates_are_checked_by_key():
    with pytest.raises(ConfigError, match=r"^faults.rate_per_room.model_error: needs the row's room count"):
        load_config(None, ["faults.rate_per_room.model_error=0.1"])
    with pytest.raises(ConfigError, match=r"^faults.rate_per_room.guard_reject: must be a probability"):
        load_config(None, ["faults.rate_per_room.guard_reject=1.5"])
    with pytest.raises(ConfigError, match=r"^async_rl.rollout_failure.nemo_gym.rollout_timeout_s"):
        load_config(None, ["faults.rate_per_room.timeout=0.1",
                           "async_rl.rollout_failure.nemo_gym.rollout_timeout_s=null"])
    with pytest.raises(ConfigError, match=r"^env.num_rooms_choices\[1\]: must be in \[1, env.max_num_rooms=16\]"):
        load_config(None, ["env.num_rooms_choices=[2,17]"])


def _by_rooms(rows, results) -> dict[int, list[dict]]:
    out = defaultdict(list)
    for row, res in zip(rows, results):
        out[row["task"]["num_rooms"]].append(res)
    return out


async def _post(url: str, rows: list[dict]) -> list[dict]:
    async with aiohttp.ClientSession() as http:
        async def one(row):
            async with http.post(url + "/run", json=row) as r:
                return {"status": r.status, **(await r.json(content_type=None))}
        return await asyncio.gather(*map(one, rows))


def test_per_room_guard_rejections_fire_where_the_plan_says_on_a_mix(stack):
    cfg = load_config(None, ["env.num_rooms_choices=[1,4]", "faults.rate_per_room.guard_reject=0.25", "faults.seed=1"])
    plan = FaultPlan(cfg.faults)
    rows = []
    for group in range(12):
        row = prompt_row(cfg, 0, group)
        for r in range(2):
            rows.append({**row, "_rowidx": r, "_minirl": {"step": 0, "group": group, "rollout": r, "attempt": 0},
                         "responses_create_params": {**row["responses_create_params"], "seed": 11 * group + r}})

    async def go():
        async with stack(cfg) as s:
            return await _post(s.agent_url, rows)

    results = asyncio.run(go())
    for row, res in zip(rows, results):
        planned = plan.call_of("guard_reject", Coords.from_row(row), row["task"]["num_rooms"]) is not None
        injected = any(g.get("injected") for g in res["evidence"]["guard"])
        assert res["status"] == 200 and injected == planned  # on_reject=end_episode: a masked 200
    rate = {n: sum(any(g.get("injected") for g in r["evidence"]["guard"]) for r in rs) / len(rs)
            for n, rs in _by_rooms(rows, results).items()}
    assert rate[4] > rate[1], rate


def test_a_real_guard_limit_ends_many_room_episodes_more_often(stack):
    """No injected fault: the guard's own token count, on a mix where longer episodes cross it."""
    cfg = load_config(None, ["env.num_rooms_choices=[1,4]", "agent.max_steps=6", "grpo.val_num_prompts=24",
                             "agent.context_history.guards.max_total_tokens=140",
                             "agent.context_history.policy.config.images.keep_last_groups=3",
                             "agent.context_history.policy.config.reasoning.keep_last_blocks=3"])
    rows = held_out_rows(cfg)

    async def go():
        async with stack(cfg) as s:
            return await _post(s.agent_url, rows)

    by = _by_rooms(rows, asyncio.run(go()))
    rejected = {n: sum(r["evidence"]["end_reason"] == "guard_reject" for r in rs) / len(rs) for n, rs in by.items()}
    assert not any(g.get("injected") for rs in by.values() for r in rs for g in r["evidence"]["guard"])
    assert rejected[4] >= 0.75 and rejected[4] > rejected[1] + 0.3, rejected
