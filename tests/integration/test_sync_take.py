"""The sync step source's take of the servers' call records (minirl/rollout/source.py), through real
servers: the records of every group but the last are taken while the last one runs alone, so the take
after the step carries one group's; every record is handed over exactly once, in the step's take or,
when the take fails, to `close` (the ledger's run_end)."""

from __future__ import annotations

import asyncio

from minirl.rollout.manager import RolloutManager
from minirl.rollout.source import SyncSource
from minirl.wire import RolloutRedispatchExhausted
from test_failure_policy import VOCAB, policy_cfg


def _take(stack, cfg):
    """SyncSource.take of step 0 over a real stack; each drain notes the groups with a send in flight
    as it is asked, and what it took. Returns (take or the error, the drains, what close returns, every
    record the server holds afterwards)."""
    drains, events = [], []

    async def go():
        async with stack(cfg) as s:
            manager = RolloutManager(cfg, [s.agent_url], events.append, VOCAB)

            async def drain(step):
                running = sorted({key.split(".")[1] for key in manager.in_flight})
                records = s.model.take_calls(step)
                drains.append((running, records))
                return records

            source = SyncSource(cfg, manager, drain)
            try:
                result = await source.take(0, 0)
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                result = exc
            finally:
                await manager.session.close()
            _, held = await source.close()
            return result, held, s.model.take_calls(0)

    result, held, left = asyncio.run(go())
    return result, drains, held, left


def test_the_records_of_all_but_the_last_group_are_taken_while_it_runs(stack, base_cfg):
    """Group 2's first attempt hangs to its deadline and its retry then commits: groups 0 and 1 are
    long resolved, so their records are taken while group 2 runs alone."""
    hang = {"kind": "timeout", "step": 0, "group": 2, "rollout": 0, "attempt": 0}
    take, drains, held, left = _take(stack, policy_cfg(base_cfg, [hang], groups=3, rollout_timeout_s=4.0))
    (early_running, early), (late_running, late) = drains
    assert early_running == ["g2"], "the early take runs while the last group is left"
    assert late_running == [], "the last take follows every group"
    assert early and late, "each take carries records"
    assert {r["group"] for r in early} >= {0, 1} and {r["group"] for r in late} == {2}
    assert take.calls == early + late, "handed over in the order taken"
    keys = [r["key"] for r in take.calls]
    calls = sum(len(r.calls) for o in take.outcomes for r in o.rollouts.values())
    assert len(keys) == len(set(keys)) == calls, "every committed call's record, once"
    assert held == [] and left == []


def test_a_failed_take_hands_its_early_records_to_close(stack, base_cfg):
    """The last group hangs past its deadline and its drop ends the run: the records of the other
    groups, taken while it hung, go to `close` (the ledger retires them at the run's end), none twice."""
    hang = {"kind": "timeout", "step": 0, "group": 2, "rollout": 0, "attempt": 0}
    cfg = policy_cfg(base_cfg, [hang], groups=3, redispatch=False, rollout_timeout_s=4.0,
                     max_infra_attempts_per_prompt=1)
    error, drains, held, left = _take(stack, cfg)
    assert isinstance(error, RolloutRedispatchExhausted)
    ((running, early),) = drains
    assert running == ["g2"] and early
    assert held == early, "what the early take held goes to close"
    assert not {r["key"] for r in held} & {r["key"] for r in left}
