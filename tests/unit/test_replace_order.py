"""The pump's books of places and records: `replace`'s promotion picks its lender by coordinates, never
by the order in which groups committed (which is the machine's scheduling): a choice that hung on commit
order failed CI once; and a resume's restored groups count as begun."""

from __future__ import annotations

import itertools

from minirl.async_rl.buffer import GroupBuffer, GroupRecord
from minirl.async_rl.samplers import make_sampler
from minirl.rollout.manager import GroupOutcome


def test_the_lender_is_the_same_whatever_order_the_later_groups_committed_in():
    """Step 1 holds its own group 0; step 2 holds two spares re-aimed at it (its own groups were
    promoted earlier) that share group index 2 (spare batches 0 and 1, two prompts a step): every
    commit order promotes spare (0, 2), the furthest step's lowest group and, of the two, the older
    prompt step."""
    from minirl.async_rl.pump import RolloutPump
    from minirl.config import load_config
    from minirl.rollout.manager import RolloutManager

    cfg = load_config(None, ["async_rl.enabled=true", "loss_fn.use_importance_sampling_correction=true",
                             "grpo.num_prompts_per_step=2", "async_rl.rollout_failure.on_dropped_prompt=replace"])
    lenders = set()
    for order in itertools.permutations([(1, 0), (0, 2), (1, 2)]):
        pump = RolloutPump(cfg, RolloutManager(cfg, ["http://127.0.0.1:9"], lambda e: None, 100), GroupBuffer(8),
                           make_sampler("in_order", 2, 2), 0, 0, None)
        pump.stamped, pump.pool = True, [(2, 2)]
        records = {(s, g): GroupRecord(s, g, 0, GroupOutcome(g, "committed", step=s), target_step=1 if g < 2 else 2)
                   for s, g in order}
        pump.buffer.ready = [records[k] for k in order]
        assert pump._substitute([0, 1, 0, False, 0], GroupOutcome(1, "dropped", step=0))
        lenders.add(next(k for k, r in records.items() if r.promoted))
    assert lenders == {(0, 2)}


def test_a_resumed_pumps_restored_groups_count_in_a_run_failed_until_a_step_takes_them():
    """An async resume puts the checkpoint's finished groups back in the buffer and relaunches the places in
    flight with the prompts they gave up on: their sends count in the manager's `spent` (a run_failed's
    rollout_attempts / rollouts_generated: "the groups in no metrics line") until a step settles them.
    Before, only groups begun in this process counted, and a resumed run that failed first reported 0."""
    from minirl.async_rl.pump import RolloutPump
    from minirl.config import load_config
    from minirl.rollout.manager import RolloutManager

    cfg = load_config(None, ["async_rl.enabled=true", "loss_fn.use_importance_sampling_correction=true"])
    manager = RolloutManager(cfg, ["http://127.0.0.1:9"], lambda e: None, 100)
    pump = RolloutPump(cfg, manager, GroupBuffer(8), make_sampler("in_order", 4, 1), 3, 3, None)
    done = GroupOutcome(0, "committed", step=3, row_sends=6, rows_returned=4)
    lost = GroupOutcome(1, "dropped", step=3, row_sends=5, rows_returned=0)
    spare = GroupOutcome(2, "committed", step=8, row_sends=2, rows_returned=2)  # stood in for a prompt its place lost
    given_up = GroupOutcome(0, "dropped", step=2, row_sends=4, rows_returned=0)
    pump._restore({"next": (3, 2), "in_flight": [(9, 1, 3, True, 1, [lost])], "pool": [], "spare_batches": 0,
                   "ready": [GroupRecord(3, 0, 3, done, target_step=3),
                             GroupRecord(8, 2, 3, spare, replacement=True, lost=[given_up], target_step=3)],
                   "pacer": None}, 3)
    assert manager.spent() == (17, 6)
    manager.settle([done, lost, spare, given_up])
    assert manager.spent() == (0, 0)
