"""The staleness samplers and the group buffer, on constructed records (pure logic, no servers)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from minirl.async_rl.buffer import GroupBuffer, GroupRecord
from minirl.async_rl.samplers import make_sampler
from minirl.rollout.manager import GroupOutcome


def rec(step, group, start, status="committed"):
    return GroupRecord(step, group, start, start, GroupOutcome(group, status, step=step), target_step=step)


def test_in_order_admits_within_the_lookahead_and_takes_its_own_step_once_resolved():
    s = make_sampler("in_order", 2, 1)
    assert s.admit(3, 2) and not s.admit(4, 2)
    assert make_sampler("in_order", 2, 0).admit(2, 2) and not make_sampler("in_order", 2, 0).admit(3, 2)
    ready = [rec(3, 0, 2), rec(2, 1, 2, "dropped"), rec(2, 0, 1)]
    assert [(r.step, r.group) for r in s.select(2, 2, ready, Counter())] == [(2, 0), (2, 1)]  # a drop resolves too
    assert s.select(3, 3, ready, Counter()) is None  # (3, 1) still in flight


def test_windowed_takes_the_oldest_in_window_and_evicts_what_fell_out():
    s = make_sampler("windowed", 2, 1)
    ready = [rec(0, 0, 0), rec(0, 1, 1), rec(1, 0, 2), rec(1, 1, 2), rec(2, 0, 2, "dropped")]
    assert s.stale(2, ready) == [ready[0]]
    chosen = s.select(0, 2, ready, Counter())
    assert [(r.step, r.group) for r in chosen] == [(0, 1), (1, 0), (2, 0)]  # 2 trainable + the drop, reported
    assert all(s.in_window(r, 2) for r in chosen if r.outcome.status == "committed")
    assert s.select(0, 2, ready[:2], Counter()) is None  # one in window: wait


def test_weight_fifo_waits_for_the_oldest_weights_batch():
    s = make_sampler("weight_fifo", 2, 1)
    ready = [rec(0, 0, 1), rec(1, 0, 2), rec(1, 1, 2)]
    assert s.select(0, 2, ready, Counter({1: 1})) is None  # weight 1 still has a group in flight
    assert [(r.step, r.group) for r in s.select(0, 2, ready, Counter())] == [(0, 0), (1, 0)]


def test_buffer_holds_capacity_places_and_evicts_while_waiting():
    async def go():
        buf = GroupBuffer(2)
        await buf.reserve()
        await buf.reserve()
        blocked = asyncio.create_task(buf.reserve())
        await asyncio.sleep(0.01)
        assert not blocked.done()  # full: a third dispatch waits
        old, new = rec(0, 0, 0), rec(0, 1, 1)
        await buf.commit(old)
        await buf.commit(new)
        s = make_sampler("windowed", 1, 0)
        stale, chosen = await buf.take_when(lambda ready: (s.stale(1, ready), s.select(0, 1, ready, Counter())))
        assert stale == [old] and chosen == [new] and buf.evicted == 1
        await asyncio.wait_for(blocked, 1)  # places freed
        assert buf.free == 1

    asyncio.run(go())


def test_unknown_sampler_and_a_buffer_too_small_for_the_window_are_config_errors():
    from minirl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="async_rl.sampler.name"):
        load_config(None, ["async_rl.enabled=true", "async_rl.sampler.name=lifo"])
    with pytest.raises(ConfigError, match="async_rl.max_buffered_rollouts: must hold the sampler's window of 16"):
        load_config(None, ["async_rl.enabled=true", "async_rl.max_buffered_rollouts=8",
                           "loss_fn.use_importance_sampling_correction=true"])
    with pytest.raises(ConfigError, match="loss_fn.use_importance_sampling_correction"):
        load_config(None, ["async_rl.enabled=true"])


def test_evicting_while_waiting_frees_places_for_the_pump():
    """The train pump evicts stale groups and keeps waiting; the rollout pump, blocked on a full
    buffer, must be woken by that eviction (a deadlock before)."""

    async def go():
        buf = GroupBuffer(2)
        s = make_sampler("windowed", 1, 0)
        for g in range(2):
            await buf.reserve()
            await buf.commit(rec(0, g, 0))

        async def pump():
            await buf.reserve()  # waits for a free place
            await buf.commit(rec(1, 0, 1))

        dispatch = asyncio.create_task(pump())
        await asyncio.sleep(0.01)  # the pump is blocked on the full buffer
        train = asyncio.create_task(buf.take_when(lambda ready: (s.stale(1, ready), s.select(1, 1, ready, Counter()))))
        await asyncio.wait_for(dispatch, 2)
        stale, chosen = await asyncio.wait_for(train, 2)
        assert len(stale) == 2 and [r.step for r in chosen] == [1]

    asyncio.run(go())


def test_a_restored_pump_drops_past_targets_keeps_the_rest_and_redispatches_only_what_was_in_flight():
    """The checkpoint's buffer on resume at step 3 (in_order): a group stamped for step 2 is past its
    target; the finished groups of step 3 stay (not generated again); the one in flight is re-sent."""
    import pickle

    from minirl.async_rl.pump import RolloutPump
    from minirl.config import load_config
    from minirl.rollout.manager import RolloutManager

    cfg = load_config(None, ["async_rl.enabled=true", "loss_fn.use_importance_sampling_correction=true",
                             "grpo.num_prompts_per_step=2"])
    events = []
    manager = RolloutManager(cfg, ["http://127.0.0.1:9"], events.append, 100)
    snap = {"next": (4, 1), "in_flight": [(3, 1, False), (4, 0, False)], "fresh": {}, "replacements": {},
            "ready": [rec(2, 1, 1), rec(3, 0, 2)]}
    snap = pickle.loads(pickle.dumps(snap))  # as the checkpoint file holds it
    pump = RolloutPump(cfg, manager, GroupBuffer(8), make_sampler("in_order", 2, 1), 3, 3, None, snap)
    assert [(r.step, r.group) for r in pump.buffer.ready] == [(3, 0)]
    assert pump.relaunch == [(3, 1, False), (4, 0, False)] and pump.next == (4, 1)
    (event,) = events
    assert event["type"] == "buffer_restored" and event["dropped_past_target"] == [[2, 1]]
    assert event["kept"] == [[3, 0]] and event["redispatched"] == [[3, 1], [4, 0]]


def test_a_snapshot_never_lists_a_finished_group_as_in_flight_too():
    """A group's task commits its record and ends in one loop step, but the done callback that drops
    it from the pump's task table runs a loop iteration later. A checkpoint taken in between listed
    the group both as finished and as in flight, and the resumed run generated it twice (seen in the
    async SIGKILL test). Here the callback has not run: the task is done, its record is in the buffer."""
    from minirl.async_rl.pump import RolloutPump
    from minirl.config import load_config
    from minirl.rollout.manager import RolloutManager

    cfg = load_config(None, ["async_rl.enabled=true", "loss_fn.use_importance_sampling_correction=true",
                             "grpo.num_prompts_per_step=2"])

    async def go():
        manager = RolloutManager(cfg, ["http://127.0.0.1:9"], lambda e: None, 100)
        pump = RolloutPump(cfg, manager, GroupBuffer(8), make_sampler("in_order", 2, 1), 0, 0, None)

        async def finishes():
            await pump.buffer.reserve()
            await pump.buffer.commit(rec(0, 1, 0))

        done, running = asyncio.create_task(finishes()), asyncio.create_task(asyncio.Event().wait())
        pump.tasks.update({done: (0, 1, False), running: (0, 0, False)})  # as _launch registers them
        await asyncio.sleep(0)
        assert done.done() and (0, 1, False) in pump.tasks.values()
        snap = pump.snapshot()
        running.cancel()
        return snap

    snap = asyncio.run(go())
    assert [(r.step, r.group) for r in snap["ready"]] == [(0, 1)]
    assert snap["in_flight"] == [(0, 0, False)]
