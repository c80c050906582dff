"""The staleness samplers and the group buffer, on constructed records (pure logic, no servers)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from minirl.async_rl.buffer import GroupBuffer, GroupRecord
from minirl.async_rl.samplers import make_sampler
from minirl.rollout.manager import GroupOutcome


def rec(step, group, start, status="committed"):
    return GroupRecord(step, group, start, GroupOutcome(group, status, step=step), target_step=step)


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


def test_weight_fifo_is_gated_and_takes_one_weight_per_step_oldest_first():
    """Upstream's weight_fifo: batch k is admitted only while k <= w + S (as in_order), and a step
    waits for the single oldest start weight over every in-window group, in flight or ready, and
    never mixes versions."""
    s = make_sampler("weight_fifo", 2, 1)
    assert s.admit(3, 2) and not s.admit(4, 2)  # ungated before: 68 groups under version 0 in 4 steps
    ready = [rec(0, 0, 1), rec(1, 0, 2), rec(1, 1, 2)]
    assert s.select(0, 2, ready, Counter({1: 1})) is None  # weight 1's batch is still filling
    assert s.stale(2, ready, Counter({1: 1})) == []
    # nothing of weight 1 in flight and one ready: it can never fill a step of its own, and is
    # evicted rather than mixed into weight 2's step (upstream's select would wait for it)
    assert s.stale(2, ready, Counter()) == [ready[0]]
    assert [(r.step, r.group) for r in s.select(0, 2, ready[1:], Counter())] == [(1, 0), (1, 1)]
    assert s.select(0, 2, ready[1:], Counter({1: 1})) is None  # an older weight is in flight: wait for it
    assert s.stale(2, ready[1:], Counter()) == []  # the current weight can still grow


def test_a_take_selects_the_next_weight_once_it_evicted_the_short_weight_before_it():
    """weight_fifo inside one take (`BufferSource._pick`): step 2 at version 2, S = 1, N = 2. Group (2, 1)
    ran under weights 1, its batch sibling (2, 0) was retried after the publish and re-stamped 2, and
    batch 3 went out under 2; nothing is in flight. Weight 1 is short and evicted; weight 2's three
    groups hold a step. Before, `select` was handed the buffer as it was before that eviction, still
    found weight 1 the oldest, and chose nothing: the take waited for a change that never came (a
    RolloutStall after stall_timeout_s). The pump is a stand-in for its `check` and `inflight` only,
    as in tests/unit/test_async_close.py."""
    from types import SimpleNamespace

    from minirl.async_rl.source import BufferSource
    from minirl.config import load_config

    cfg = load_config(None, ["async_rl.enabled=true", "async_rl.sampler.name=weight_fifo",
                             "async_rl.sampler.max_staleness_versions=1", "grpo.num_prompts_per_step=2",
                             "loss_fn.use_importance_sampling_correction=true",
                             "async_rl.rollout_failure.max_consecutive_dropped_prompts=0",
                             "async_rl.rollout_failure.max_skipped_prompts=0"])
    events = []

    async def drain(step: int) -> list[dict]:
        return []

    async def go():
        source = BufferSource(cfg, SimpleNamespace(emit=events.append), drain)
        source.buffer, source.sampler = GroupBuffer(4), make_sampler("weight_fifo", 2, 1)
        source.pump = SimpleNamespace(check=lambda: None, inflight=Counter(), train_waiting=None, selected=None)
        source.buffer.ready = [rec(2, 1, 1), rec(2, 0, 2), rec(3, 0, 2), rec(3, 1, 2)]
        take = await asyncio.wait_for(source.take(2, 2), 2)
        return take, source.buffer.ready

    take, left = asyncio.run(go())
    assert [(e["step"], e["group"], e["reason"]) for e in events if e["type"] == "evict"] == [(2, 1, "short_weight")]
    assert [(o.step, o.group) for o in take.outcomes] == [(2, 0), (3, 0)] and take.start_weights == [2, 2]
    assert [(r.step, r.group) for r in left] == [(3, 1)]


def test_ready_first_takes_the_first_ready_groups_of_any_age_in_dispatch_order_and_evicts_nothing():
    """Upstream's reservation order (issue 50, item 6): the slow group (0, 0), dispatched first and
    committed after (1, 0), trains first; before, commit order put (1, 0) first."""
    s = make_sampler("ready_first", 2, 0)
    assert s.admit(2, 2) and not s.admit(3, 2)  # gated as in_order
    ready = [rec(1, 0, 3), rec(0, 0, 0), rec(1, 1, 2)]  # commit order; weight 0 is 3 versions old
    assert s.stale(3, ready) == []
    assert [(r.step, r.group) for r in s.select(0, 3, ready, Counter())] == [(0, 0), (1, 0)]
    assert s.select(0, 2, ready, Counter()) == [ready[1], ready[2]]  # never a group from a newer weight
    assert s.select(0, 1, ready, Counter()) is None


def test_each_sampler_declares_what_the_config_asks_of_it():
    from minirl.async_rl.samplers import SAMPLERS

    assert {name for name, cls in SAMPLERS.items() if cls.stamps_target_steps} == {"in_order"}
    assert {name for name, cls in SAMPLERS.items() if cls.gated} == {"in_order", "weight_fifo", "ready_first"}
    assert SAMPLERS["weight_fifo"].capacity(4, 1) == 8 and SAMPLERS["windowed"].capacity(4, 1) == 4


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
        assert stale == [old] and chosen == [new] and buf.ready == []
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
    with pytest.raises(ConfigError, match="loss_fn.use_importance_sampling_correction: must be true with "
                                          "async_rl.sampler.name=ready_first"):
        load_config(None, ["async_rl.enabled=true", "async_rl.sampler.name=ready_first",
                           "async_rl.sampler.max_staleness_versions=0",
                           "async_rl.rollout_failure.max_skipped_prompts=0",
                           "async_rl.rollout_failure.max_consecutive_dropped_prompts=0"])
    with pytest.raises(ConfigError, match="async_rl.max_buffered_rollouts: must hold the sampler's window of 16"):
        load_config(None,
                    ["async_rl.enabled=true", "async_rl.sampler.name=weight_fifo", "async_rl.max_buffered_rollouts=8",
                           "loss_fn.use_importance_sampling_correction=true",
                           "async_rl.rollout_failure.max_skipped_prompts=0",
                           "async_rl.rollout_failure.max_consecutive_dropped_prompts=0"])


@pytest.mark.parametrize("name", ["windowed", "weight_fifo", "ready_first"])
def test_drop_budgets_under_a_sampler_that_stamps_no_target_step_are_rejected_at_setup(name):
    """Upstream rejects them at setup: a prompt given up on is never subtracted from the step
    waiting for it. The default config carries budgets (4, 4); both at 0 are accepted."""
    from minirl.config import ConfigError, load_config

    base = ["async_rl.enabled=true", f"async_rl.sampler.name={name}", "loss_fn.use_importance_sampling_correction=true"]
    with pytest.raises(ConfigError,
                       match=rf"^async_rl.sampler.name: '{name}' stamps no target step, so the drop budget "
                                          r"\(max_skipped_prompts=4, max_consecutive_dropped_prompts=4\) cannot be "
                                          r"honoured"):
        load_config(None, base)
    with pytest.raises(ConfigError,
                       match=r"^async_rl.sampler.name: .*max_skipped_prompts=0, max_consecutive_dropped_prompts=4\)"):
        load_config(None, [*base, "async_rl.rollout_failure.max_skipped_prompts=0"])
    zero = ["async_rl.rollout_failure.max_skipped_prompts=0",
            "async_rl.rollout_failure.max_consecutive_dropped_prompts=0"]
    assert load_config(None, [*base, *zero]).async_rl.sampler.name == name
    with pytest.raises(ConfigError,
                       match="^async_rl.rollout_failure.on_dropped_prompt: replace needs a sampler that stamps"):
        load_config(None, [*base, *zero, "async_rl.rollout_failure.on_dropped_prompt=replace"])


def test_max_lookahead_versions_is_upstreams_name_for_the_in_order_gate():
    from minirl.config import ConfigError, load_config

    on = ["async_rl.enabled=true", "loss_fn.use_importance_sampling_correction=true"]
    sampler = load_config(None, [*on, "async_rl.sampler.max_lookahead_versions=2"]).async_rl.sampler
    assert (sampler.max_lookahead_versions, sampler.max_staleness_versions) == (2, 2)  # one resolved value
    assert load_config(None, on).async_rl.sampler.max_staleness_versions == 1  # unset: minirl's name
    with pytest.raises(ConfigError, match="^async_rl.sampler.max_lookahead_versions: is in_order's gate"):
        load_config(None, ["async_rl.sampler.name=windowed", "async_rl.sampler.max_lookahead_versions=1"])
    with pytest.raises(ConfigError, match="^async_rl.sampler.max_lookahead_versions: must be >= 0"):
        load_config(None, ["async_rl.sampler.max_lookahead_versions=-1"])


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
    snap = {"next": (4, 1), "in_flight": [(3, 1, 3, False, 0), (4, 0, 4, False, 0), (0, 2, 2, True, 1)],
            "pool": [(0, 3)],
            "spare_batches": 1, "ready": [rec(2, 1, 1), rec(3, 0, 2)]}
    snap = pickle.loads(pickle.dumps(snap))  # as the checkpoint file holds it
    pump = RolloutPump(cfg, manager, GroupBuffer(8), make_sampler("in_order", 2, 1), 3, 3, None, snap)
    assert [(r.step, r.group) for r in pump.buffer.ready] == [(3, 0)]
    # the spare (0, 2) in flight for step 2 is past its target too: only the target step counts
    assert pump.relaunch == [[3, 1, 3, False, 0, []], [4, 0, 4, False, 0, []]] and pump.next == (4, 1)
    assert pump.pool == [(0, 3)] and pump.spare_batches == 1
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
        # as _launch registers them: [step, group, target_step, replacement, attempts used, lost]
        pump.tasks.update({done: [0, 1, 0, False, 0, []], running: [0, 0, 0, False, 0, []]})
        await asyncio.sleep(0)
        assert done.done() and [0, 1, 0, False, 0, []] in pump.tasks.values()
        snap = pump.snapshot()
        running.cancel()
        return snap

    snap = asyncio.run(go())
    assert [(r.step, r.group) for r in snap["ready"]] == [(0, 1)]
    assert snap["in_flight"] == [(0, 0, 0, False, 0, [])]


def test_a_lost_place_takes_a_spare_within_its_own_budget_and_borrows_from_the_furthest_step():
    """`replace` as upstream's pump decides it, on constructed records: the pool refills a whole
    batch at a time below its low-water mark; a lost place (drop or skip) takes a spare and, when a
    later step holds a finished group, promotes the lowest from the furthest such step and re-aims itself
    there; `max_replacement_attempts` counts per place, and an empty pool shrinks."""
    from minirl.async_rl.pump import RolloutPump
    from minirl.config import load_config
    from minirl.rollout.manager import RolloutManager

    cfg = load_config(None, ["async_rl.enabled=true", "loss_fn.use_importance_sampling_correction=true",
                             "grpo.num_prompts_per_step=2", "async_rl.rollout_failure.on_dropped_prompt=replace",
                             "async_rl.rollout_failure.replacement_reserve_prompts=3"])
    events = []
    pump = RolloutPump(cfg, RolloutManager(cfg, ["http://127.0.0.1:9"], events.append, 100), GroupBuffer(8),
                       make_sampler("in_order", 2, 2), 0, 0, None)
    pump.stamped = True
    pump._refill()
    assert pump.pool == [(0, 2), (0, 3), (1, 2), (1, 3)]  # two batches to get above the mark of 3
    assert [e["batch"] for e in events if e["type"] == "spare_pool"] == [0, 1]
    step1, step2a, step2b = rec(1, 0, 0), rec(2, 0, 0), rec(2, 1, 0)
    pump.buffer.ready = [step1, step2b, step2a, rec(2, 9, 0, "dropped")]  # group 1 committed first
    place = [0, 1, 0, False, 0]
    assert pump._substitute(place, GroupOutcome(1, "dropped", step=0))
    # the furthest step lends its lowest group, whatever order its groups committed in
    assert place == [0, 2, 2, True, 1] and (step2a.target_step, step2a.promoted) == (0, True)
    assert not pump._substitute(place, GroupOutcome(2, "dropped", step=0))  # its one attempt is used: shrink
    other = [1, 1, 1, False, 0]
    assert pump._substitute(other, GroupOutcome(1, "skipped", step=1))  # a skip is replaced as a drop is
    assert other == [0, 3, 2, True, 1] and step2b.target_step == 1 and step1.target_step == 1
    pump.pool = []
    assert not pump._substitute([1, 0, 1, False, 0], GroupOutcome(0, "dropped", step=1))
    decisions = [(e["decision"], e.get("reason"), e.get("lender_step")) for e in events if e["type"] == "replace"]
    assert decisions == [("promoted", None, 2), ("shrink", "max_replacement_attempts", None), ("promoted", None, 2),
                         ("shrink", "pool_empty", None)]


def test_replacement_prompt_source_stream_diverts_the_next_training_batch_as_upstream():
    """`replacement_prompt_source=stream`: a refill takes the batch the next step would have trained,
    and from then on step s trains prompt step s + (batches diverted). The real pump's dispatches
    are read off its events (the groups never get far: the test ends them at once)."""
    from minirl.async_rl.pump import RolloutPump
    from minirl.config import load_config
    from minirl.rollout.manager import RolloutManager

    cfg = load_config(None, ["async_rl.enabled=true", "loss_fn.use_importance_sampling_correction=true",
                             "grpo.num_prompts_per_step=2", "grpo.max_num_steps=2",
                             "async_rl.rollout_failure.on_dropped_prompt=replace",
                             "async_rl.rollout_failure.replacement_prompt_source=stream",
                             "async_rl.stall_watchdog.stall_timeout_s=null"])
    events = []

    async def go():
        async def parked(seconds):
            await asyncio.Event().wait()

        manager = RolloutManager(cfg, ["http://127.0.0.1:9"], events.append, 100, sleep=parked)
        manager.open()

        async def resolved(step, group):
            pass

        pump = RolloutPump(cfg, manager, GroupBuffer(8), make_sampler("in_order", 2, 1), 0, 0, resolved)
        pump.start()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if pump.main.done():
                break
        for t in [pump.main, pump.watchdog, pump.starved, *pump.tasks]:
            t.cancel()
        await asyncio.gather(pump.main, pump.watchdog, pump.starved, *pump.tasks, return_exceptions=True)
        await manager.session.close()
        return pump

    pump = asyncio.run(go())
    dispatched = [(e["step"], e["group"], e["target_step"]) for e in events if e["type"] == "dispatch"]
    assert dispatched == [(0, 0, 0), (0, 1, 0), (2, 0, 1), (2, 1, 1)]  # prompt step 1 went to the pool
    assert pump.pool == [(1, 0), (1, 1)] and pump.spare_batches == 1
    (refill,) = [e for e in events if e["type"] == "spare_pool"]
    assert refill["prompts"] == [[1, 0], [1, 1]]
    from minirl.config import ConfigError

    with pytest.raises(ConfigError,
                       match="^async_rl.rollout_failure.replacement_prompt_source: must be spare_groups or stream"):
        load_config(None, ["async_rl.rollout_failure.replacement_prompt_source=dataset"])


def test_spare_groups_is_refused_with_a_dataset_file_whose_rows_are_all_in_the_stream(tmp_path):
    """`spare_groups` promises spares no step trains. A `data.train_jsonl` file has none: its spare
    (b, N + g) would be row b * N + N + g of the epoch's order, the row step b + 1 trains as its group
    g, so a step that took spare (0, N) trained the next step's first prompt twice. Refused, naming
    the key and the way out; `stream`, and the doors task's spares (seeds no step uses), are not."""
    from minirl.config import ConfigError, load_config
    from minirl.data import prompt_key, task_row, task_seed

    base = load_config()
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(task_row(base, task_seed(base, 1000 + i, 0))) + "\n" for i in range(16)))
    on = ["async_rl.enabled=true", "loss_fn.use_importance_sampling_correction=true", "grpo.num_prompts_per_step=2",
          "async_rl.rollout_failure.on_dropped_prompt=replace"]
    with pytest.raises(ConfigError, match=r"^async_rl.rollout_failure.replacement_prompt_source: spare_groups .* "
                                          r"set async_rl.rollout_failure.replacement_prompt_source=stream$"):
        load_config(None, [*on, f"data.train_jsonl={path}"])
    stream = ["async_rl.rollout_failure.replacement_prompt_source=stream"]
    assert load_config(None, [*on, f"data.train_jsonl={path}", *stream]).data.train_jsonl == str(path)
    doors = load_config(None, on)
    assert doors.async_rl.rollout_failure.replacement_prompt_source == "spare_groups"
    spares = {prompt_key(doors, b, 2 + g) for b in range(8) for g in range(2)}
    assert not spares & {prompt_key(doors, s, g) for s in range(9) for g in range(2)}
