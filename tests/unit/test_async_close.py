"""The async source's end of run (`BufferSource.close`): the call records a place was moving off the
servers when the run ended reach the end-of-run ledger, not the void. Found by the switch matrix's
`served` book (cell pw19: a windowed run's place cancelled at the end had taken its records off one
generation worker and was waiting on the other, and worker 0's records of s24.g1 were in no ledger line). A
late record of a group evicted while a take still waits is an orphan at once. And a `finish` that does
not end says where it waits."""

from __future__ import annotations

import asyncio

import pytest

from minirl.async_rl.source import BufferSource
from minirl.config import load_config
from minirl.generation.server import CallLog


def test_a_place_cancelled_mid_move_keeps_the_records_a_server_handed_over():
    cfg = load_config(None, ["async_rl.enabled=true", "async_rl.sampler.name=windowed",
                             "loss_fn.use_importance_sampling_correction=true",
                             "async_rl.rollout_failure.max_consecutive_dropped_prompts=0",
                             "async_rl.rollout_failure.max_skipped_prompts=0"])
    log = CallLog()  # the generation server's own call log
    keys = [f"s24.g1.r{r}.a0.c0" for r in range(4)]
    for r, key in enumerate(keys):
        log.add(24, {"key": key, "step": 24, "group": 1, "rollout": r, "attempt": 0, "call": 0})
    answered = asyncio.Event()

    async def drain(step: int) -> list[dict]:
        records = log.take(step)  # the server hands them over at once...
        await answered.wait()  # ...and its answer is still on the way when the run ends
        return records

    async def go():
        source = BufferSource(cfg, None, drain)
        place = asyncio.ensure_future(source.resolved(24, 1))
        await asyncio.sleep(0.01)
        place.cancel()  # the pump's stop at the run's end
        closing = asyncio.ensure_future(source.close())
        await asyncio.sleep(0.01)
        answered.set()
        return await closing

    unfinished, held = asyncio.run(go())
    assert sorted(rec["key"] for rec in held) == keys and log.finish()["left"] == []
    assert unfinished == {"buffered": [], "in_flight": []}


def test_a_finish_that_does_not_end_names_its_await():
    """`Controller.stacks`, which the driver prints when `finish` times out: every pending task of the
    controller's loop, each with the frame it waits in (the call that answers it, not itself)."""
    from minirl.controller import Controller

    async def take_calls_that_never_answers():
        await asyncio.Event().wait()

    async def go():
        stuck = asyncio.ensure_future(take_calls_that_never_answers())
        await asyncio.sleep(0)
        out = await Controller.stacks(None)
        stuck.cancel()
        return out

    out = asyncio.run(go())
    assert "take_calls_that_never_answers" in out and "await asyncio.Event().wait()" in out
    assert ", in go\n" not in out  # the task that asks is left out


def test_a_late_record_of_a_group_evicted_while_the_take_waits_is_an_orphan():
    """A take evicts a stale group and keeps waiting for its own: a record of the evicted group that
    arrives meanwhile (a retired attempt's, moved as its place resolves) is an orphan at once, handed
    to the next step's ledger; before, it was filed under the group's key until the take ended, so a
    checkpoint taken then left it out. The pump is a stand-in for its `check` and `inflight` only."""
    from collections import Counter
    from types import SimpleNamespace

    from minirl.async_rl.buffer import GroupBuffer, GroupRecord
    from minirl.async_rl.samplers import make_sampler
    from minirl.types import GroupOutcome

    cfg = load_config(None, ["async_rl.enabled=true", "async_rl.sampler.name=windowed",
                             "async_rl.sampler.max_staleness_versions=1", "grpo.num_prompts_per_step=1",
                             "loss_fn.use_importance_sampling_correction=true",
                             "async_rl.rollout_failure.max_consecutive_dropped_prompts=0",
                             "async_rl.rollout_failure.max_skipped_prompts=0"])
    late = {"key": "s0.g0.r0.a1.c0", "step": 0, "group": 0, "rollout": 0, "attempt": 1, "call": 0}
    events = []

    async def drain(step: int) -> list[dict]:
        return [late]

    async def go():
        source = BufferSource(cfg, SimpleNamespace(emit=events.append), drain)
        source.buffer, source.sampler = GroupBuffer(8), make_sampler("windowed", 1, 1)
        source.pump = SimpleNamespace(check=lambda: None, inflight=Counter(), train_waiting=None, selected=None)
        source.buffer.ready.append(GroupRecord(0, 0, 0, GroupOutcome(0, "committed", step=0), 0))
        taking = asyncio.ensure_future(source.take(3, 3))  # version 3, S = 1: the group of weight 0 is stale
        await asyncio.sleep(0.01)
        assert [e["type"] for e in events] == ["evict"] and not taking.done()
        await source.resolved(0, 0)  # the late record arrives while the take still waits
        orphans, filed = list(source.orphans), dict(source.calls)
        taking.cancel()
        return orphans, filed

    orphans, filed = asyncio.run(go())
    assert orphans == [late] and filed == {}


def test_a_resumed_source_files_late_records_as_the_run_it_resumes_would():
    """The checkpoint carries the groups already taken or evicted and the orphans no step has ledgered
    yet. Before, a resumed run knew neither: a late record (a retired attempt's) of a group taken before
    the checkpoint was filed under its key until the run's end (`run_end`, not the next step's ledger),
    and the orphans the checkpointed run held were in no ledger at all. The pump is a stand-in for its
    `snapshot` only."""
    from types import SimpleNamespace

    cfg = load_config(None, ["async_rl.enabled=true", "async_rl.sampler.name=windowed",
                             "loss_fn.use_importance_sampling_correction=true",
                             "async_rl.rollout_failure.max_consecutive_dropped_prompts=0",
                             "async_rl.rollout_failure.max_skipped_prompts=0"])
    held = {"key": "s1.g2.r0.a0.c1", "step": 1, "group": 2, "rollout": 0, "attempt": 0, "call": 1}
    late = {"key": "s0.g0.r3.a1.c0", "step": 0, "group": 0, "rollout": 3, "attempt": 1, "call": 0}

    async def drain(step: int) -> list[dict]:
        return [late]

    before = BufferSource(cfg, None, drain)
    before.pump = SimpleNamespace(snapshot=lambda: {"ready": [], "in_flight": []})
    before.consumed, before.orphans = {(0, 0), (0, 1)}, [held]
    resumed = BufferSource(cfg, None, drain)
    resumed.restore(before.snapshot())
    asyncio.run(resumed.resolved(0, 0))
    assert resumed.orphans == [held, late] and resumed.calls == {}


@pytest.mark.parametrize("ticks", [0, 1, 2])
def test_a_paced_pumps_stop_ends_when_a_wake_meets_the_cancel(ticks):
    """Found by review: under `admission=paced` the dispatch loop waited on its wake with `asyncio.wait_for(...,
    0.2)`, which on Python 3.11 swallows a cancel that arrives just after the wake was set (CPython gh-86296):
    `stop` then waited for ever, and the run's `finish` hit the driver's 30 s timeout with no run_end. The wake
    set 0 or 1 loop ticks before the stop hung every time."""
    from minirl.async_rl.buffer import GroupBuffer
    from minirl.async_rl.pump import RolloutPump
    from minirl.async_rl.samplers import make_sampler
    from minirl.rollout.manager import RolloutManager

    cfg = load_config(None, ["async_rl.enabled=true", "loss_fn.use_importance_sampling_correction=true",
                             "grpo.num_prompts_per_step=2", "async_rl.sampler.admission=paced",
                             "async_rl.stall_watchdog.stall_timeout_s=null"])

    async def go():
        manager = RolloutManager(cfg, ["http://127.0.0.1:9"], lambda e: None, 100)
        manager.open()
        pump = RolloutPump(cfg, manager, GroupBuffer(8), make_sampler("in_order", 2, 1), 0, 0, None)
        pump.pause()  # a weight sync is under way: the dispatch loop waits on its wake
        pump.start()
        await asyncio.sleep(0.01)
        pump.wake.set()  # a place's done callback, or a new version
        for _ in range(ticks):
            await asyncio.sleep(0)
        try:
            await asyncio.wait_for(pump.stop(), 5)
        finally:
            pump.error = RuntimeError("end")  # a hung loop still exits, so the test ends either way
            pump.permitted.set()
            pump.wake.set()
            await manager.session.close()
        assert pump.main.done()

    asyncio.run(go())


def test_a_resumed_source_that_ends_before_its_first_take_reports_the_checkpoints_groups_unfinished():
    """Found by review: a resumed async run that failed before its first take (the resume's weight sync, a
    validation at start) reported no unfinished group in run_end, and the checkpoint's call records of them
    were retired nowhere: the pump, which restores them, had not started."""
    import pickle

    from minirl.async_rl.buffer import GroupRecord
    from minirl.rollout.manager import GroupOutcome

    cfg = load_config(None, ["async_rl.enabled=true", "loss_fn.use_importance_sampling_correction=true",
                             "grpo.num_prompts_per_step=2"])
    record = GroupRecord(3, 0, 3, GroupOutcome(0, "committed", step=3), target_step=3)
    call = {"key": "s3.g0.r0.a0.c0", "step": 3, "group": 0}
    source = BufferSource(cfg, None, None)
    source.restore(pickle.dumps({"pump": {"next": (4, 0), "in_flight": [(3, 1, 3, False, 0, [])], "ready": [record],
                                          "pool": [], "spare_batches": 0, "pacer": None},
                                 "calls": {(3, 0): [call]}, "orphans": [], "consumed": set()}))
    unfinished, held = asyncio.run(source.close())
    assert unfinished == {"buffered": [[3, 0]], "in_flight": [[3, 1]]} and held == [call]
