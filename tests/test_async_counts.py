"""Async steps count only their own groups, and a group is stamped by its true age (issues 50, 52).

Through the real rollout pump, buffer, samplers, train-pump source (`BufferSource`) and ledger, over
a real agent and model server on the session's vLLM engine, whose weights are re-published between
steps so that its call records carry the versions they ran under."""

from __future__ import annotations

import asyncio
import copy

import pytest

from minirl.config import FaultSpec

VOCAB = 512


def async_cfg(base_cfg, sampler: str, faults: list[dict], staleness: int = 1, prompts: int = 1):
    cfg = copy.deepcopy(base_cfg)
    cfg.async_rl.enabled, cfg.grpo.max_num_steps = True, 8
    cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt = prompts, 2
    cfg.policy.train_global_batch_size = prompts * 2
    ar, rf = cfg.async_rl, cfg.async_rl.rollout_failure
    ar.sampler.name, ar.sampler.max_staleness_versions = sampler, staleness
    ar.max_inflight_prompts, ar.max_buffered_rollouts = 2, 4
    rf.max_consecutive_dropped_prompts = rf.max_skipped_prompts = 0
    rf.nemo_gym.max_row_attempts = 1  # a row's failure fails its group attempt: the retry keeps the other row
    cfg.faults.inject = [FaultSpec(**f) for f in faults]
    return cfg


async def train_steps(s, engine, weights, cfg, steps: int, until=None):
    """Play the train pump: each step takes its groups from a `BufferSource`, checks them against the
    ledger (the controller's window, `StepTake.oldest`) and publishes `weights` to the engine as the
    next version. Every INFRA backoff waits until step 1's publish. Stops after `steps`, or once
    `until(events)`. Returns (takes with their ledger counts, events, the first version, the manager)."""
    from minirl.async_rl.source import BufferSource
    from minirl.rollout.evidence import Ledger
    from minirl.rollout.manager import RolloutManager

    events, release, takes = [], asyncio.Event(), []

    async def backoff(seconds):
        await release.wait()

    async def drain(step):
        return s.model.take_calls(step)

    manager = RolloutManager(cfg, [s.agent_url], events.append, VOCAB, sleep=backoff)
    source, ledger = BufferSource(cfg, manager, drain), Ledger(None)
    base = engine.version
    try:
        for step in range(steps):
            version = base + step
            take = await asyncio.wait_for(source.take(step, version), 180)
            kept = [r for o in take.outcomes if o.status == "committed" for r in o.rollouts.values()]
            counts = ledger.close_step(step, take.calls, kept, version, oldest=take.oldest(version, source.window))
            takes.append((take, counts))
            manager.settle(take.outcomes + take.evicted)
            source.syncing()
            await asyncio.wrap_future(engine.update_weights(weights, version=version + 1))
            source.published(version + 1)
            if step == 1:
                release.set()
            if until is not None and until(events):
                break
    finally:
        pump = source.pump
        tasks = [t for t in [pump.main, pump.watchdog, pump.starved, *pump.tasks] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await manager.session.close()
        await asyncio.wrap_future(engine.update_weights(weights, version=base))
    return takes, events, base, manager


@pytest.fixture(scope="module")
def weights(base_cfg):
    """The policy's initial weights, re-published to the engine as each new version."""
    from minirl.trainer.policy_worker import PolicyWorker

    return PolicyWorker(base_cfg).get_weights()


@pytest.mark.parametrize("sampler", ["windowed", "ready_first"])
def test_a_retry_that_keeps_an_old_row_is_stamped_with_that_rows_version(stack, base_cfg, engine, weights, sampler):
    """Issue 50, item 1. Group (0, 0)'s row 0 comes back under weights v0; row 1 fails (a dropped
    connection, INFRA), and the group's retry waits until the train pump has published twice, so
    it re-runs row 1 alone under v2 and keeps row 0 (`keep_returned_rows`, the default). The group
    is stamped v0, the oldest version its kept rows ran under: `windowed` (S = 1) evicts it as stale
    at v2 or later, and `ready_first` trains it with the ledger's window reaching back to v0. Before,
    the group was stamped v2, the newest attempt's, and the ledger ended the run: "policy-version
    discipline: call s0.g0.r0.a0 ran under weights [0], but step 3 trains versions 2..3"."""
    cfg = async_cfg(base_cfg, sampler, [{"kind": "transport", "step": 0, "group": 0, "rollout": 1, "attempt": 0}])

    def consumed(events):
        return any(e["type"] == "evict" and (e["step"], e["group"]) == (0, 0) for e in events)

    async def go():
        async with stack(cfg) as s:
            return await train_steps(s, engine, weights, cfg, 6, until=consumed)

    takes, events, base, _ = asyncio.run(go())
    retried = [e for e in events if e["type"] == "failure" and (e["step"], e["group"]) == (0, 0)]
    assert [(e["rollout"], e["decision"]) for e in retried] == [(1, "retried")]
    trained = [(take, w) for take, _ in takes for o, w in zip(take.outcomes, take.start_weights) if (o.step, o.group) == (0, 0)]
    if sampler == "windowed":
        (evict,) = [e for e in events if e["type"] == "evict" and (e["step"], e["group"]) == (0, 0)]
        assert evict["start_weight"] == base and evict["reason"] == "stale" and evict["train_version"] >= base + 2
        assert not trained
        evicted = [o for take, _ in takes for o in take.evicted if (o.step, o.group) == (0, 0)]
        assert [o.group_attempts for o in evicted] == [2], "the step that evicted it has its outcome"
    else:
        (take, w), = trained
        assert w == base, "stamped with its kept row's version, not the retry's"
        (o,) = [o for o in take.outcomes if (o.step, o.group) == (0, 0)]
        assert o.group_attempts == 2 and sorted(o.rollouts) == [0, 1]
        assert o.rollouts[0].coords.attempt == 0 and o.rollouts[1].coords.attempt == 1
    assert all(counts.get("calls_trained", 0) > 0 for _, counts in takes)
