"""The sync step source's take of the servers' call records (minirl/rollout/source.py), through real
servers: the records are taken as the groups resolve, so the take after the step carries only the
last group's; every record is handed over exactly once, in the step's take or, when the take fails,
to `close` (the ledger's run_end), as they do when the step fails after its take."""

from __future__ import annotations

import asyncio

from minirl.rollout.manager import RolloutManager
from minirl.rollout.source import SyncSource
from minirl.wire import RolloutRedispatchExhausted
from test_failure_policy import VOCAB, policy_cfg


def _take(stack, cfg, ledgered=True):
    """SyncSource.take of step 0 over a real stack; each drain notes the groups with a send in flight
    as it is asked, and what it took. A take that succeeds is then `ledgered` (the controller's ledger
    has its records) unless the step fails after it (`ledgered=False`). Returns (take or the error, the
    drains, what close returns, every record the server holds afterwards)."""
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
                if ledgered:
                    source.ledgered()
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                result = exc
            finally:
                await manager.session.close()
            _, held = await source.close()
            return result, held, s.model.take_calls(0)

    result, held, left = asyncio.run(go())
    return result, drains, held, left


def test_a_step_that_fails_after_its_take_leaves_the_takes_records_to_close(stack, base_cfg):
    """The take succeeds, then the step fails before its ledger takes the records (its checks, the
    fleet watch's last poll): `close` hands every record of the take to the ledger's run_end, once."""
    take, _, held, left = _take(stack, policy_cfg(base_cfg, groups=2), ledgered=False)
    assert take.calls and held == take.calls and left == []


def test_the_records_of_all_but_the_last_group_are_taken_while_it_runs(stack, base_cfg):
    """Group 2's first attempt hangs to its deadline and its retry then commits: groups 0 and 1 are
    long resolved, so their records (and those of group 2's calls that returned) are taken while
    group 2 runs, and the take after the step carries only group 2's."""
    hang = {"kind": "timeout", "step": 0, "group": 2, "rollout": 0, "attempt": 0}
    take, drains, held, left = _take(stack, policy_cfg(base_cfg, [hang], groups=3, rollout_timeout_s=4.0))
    *during, (late_running, late) = drains
    assert during and all(running for running, _ in during), "each take but the last runs while a group is in flight"
    assert during[-1][0] == ["g2"], "the last of them while group 2 runs alone"
    assert late_running == [], "the last take follows every group"
    early = [r for _, records in during for r in records]
    assert {r["group"] for r in early} >= {0, 1}, "groups 0 and 1 taken before the step ends"
    assert late and {r["group"] for r in late} == {2}, "the last take: group 2's retry alone"
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
    assert drains and all("g2" in running for running, _ in drains), "every take ran while group 2 hung"
    early = [r for _, records in drains for r in records]
    assert early and {r["group"] for r in early} >= {0, 1}
    assert held == early, "what the takes held goes to close"
    assert not {r["key"] for r in held} & {r["key"] for r in left}


def test_the_runs_end_mid_take_stops_it_names_its_groups_and_retires_what_it_took(stack, base_cfg):
    """A SIGTERM mid-step: the driver stops waiting, the controller's take goes on, and the run's end
    (`Controller.finish`) closes the source under it. Group 2 hangs; once the records of groups 0 and 1
    are taken, `close` stops the take (its groups' run is cancelled), names the step's three groups in
    flight and hands over every record the take's trickle took, none also left on the server. Before,
    `close` ignored the running take: no group in flight and the trickle's records in no ledger line."""
    hang = {"kind": "timeout", "step": 0, "group": 2, "rollout": 0, "attempt": 0}
    cfg = policy_cfg(base_cfg, [hang], groups=3, rollout_timeout_s=120.0)
    drains = []

    async def go():
        async with stack(cfg) as s:
            manager = RolloutManager(cfg, [s.agent_url], [].append, VOCAB)

            async def drain(step):
                drains.append(s.model.take_calls(step))
                return drains[-1]

            source = SyncSource(cfg, manager, drain)
            take = asyncio.ensure_future(source.take(0, 0))
            for _ in range(600):  # groups 0 and 1 resolve in seconds; group 2 hangs for the deadline
                if {r["group"] for records in drains for r in records} >= {0, 1} or take.done():
                    break
                await asyncio.sleep(0.1)
            try:
                unfinished, held = await asyncio.wait_for(source.close(), 30)
                stopped = take.done()
            finally:
                take.cancel()  # before the fix, close left it running (to group 2's deadline)
                result = (await asyncio.gather(take, return_exceptions=True))[0]
                await manager.session.close()
            return unfinished, held, stopped, result, s.model.take_calls(0)

    unfinished, held, stopped, result, left = asyncio.run(go())
    taken = [r for records in drains for r in records]
    assert {r["group"] for r in taken} >= {0, 1}, "groups 0 and 1 were taken while group 2 hung"
    assert unfinished == {"buffered": [], "in_flight": [[0, 0], [0, 1], [0, 2]]}, unfinished
    assert stopped and isinstance(result, asyncio.CancelledError), "close stops the take"
    assert held == taken, "what the trickle took goes to close, in the order taken"
    assert not {r["key"] for r in held} & {r["key"] for r in left}
