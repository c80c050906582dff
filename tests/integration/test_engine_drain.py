"""A draining weight update (`update_weights(drain=True)`) and what arrives while it is held, through the
session's real vLLM engine: a request whose caller leaves while it is deferred behind the update is
aborted there and never generated, a second drain waits its turn instead of replacing the first, an
update whose caller gave up is not run (the engine serves on), a request id in flight is refused, and a
request no step has run takes the version of an update applied before its first step.

The engine's next step is held (`hang`) while the jobs are sent, so it takes them all together with the
first request in flight, as a busy engine does."""

from __future__ import annotations

from concurrent.futures import CancelledError

import pytest
from helpers import wait_held_in_step


@pytest.fixture(scope="module")
def weights(base_cfg):
    """The served checkpoint's own weights: an update that changes nothing but the version."""
    from safetensors.numpy import load_file

    return list(load_file(f"{base_cfg.policy.model_name}/model.safetensors").items())


def params(max_tokens: int, seed: int):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=seed)


def test_an_abort_while_deferred_behind_a_drain_is_counted_and_never_generated(engine, weights):
    """The front end's path: the engine-side future of a request is never cancelled by its caller, only
    `abort(rid)` reaches the engine. Before, an abort that came while the request waited behind the
    drain found nothing in flight and was lost: the request was generated in full after the update."""
    v0, aborted = engine.version, engine.aborted
    try:
        engine.hang()
        running = engine.generate([1, 388, 201, 300], params(32, 1))
        update = engine.update_weights(weights, v0 + 1, drain=True)
        left = engine.generate([1, 388, 201, 301], params(32, 2), "left-while-deferred")
        engine.abort("left-while-deferred")
        engine.unhang()
        assert running.result(timeout=120).version_end == v0
        update.result(timeout=120)
        with pytest.raises(CancelledError, match="left-while-deferred aborted: its caller left"):
            left.result(timeout=10)
        assert engine.aborted == aborted + 1, "the abort of a deferred request was not counted"
        assert engine.in_flight == 0 and engine.version == v0 + 1
    finally:
        engine.unhang()
        engine.update_weights(weights, v0).result(timeout=120)


def test_a_second_drain_waits_its_turn_and_both_land_in_order(engine, weights):
    """Before, a second drain that came while one was held replaced it: the first update's future never
    resolved, and a request sent between the two waited for the second."""
    v0 = engine.version
    try:
        engine.hang()
        first = engine.generate([1, 388, 201, 300], params(16, 1))
        u1 = engine.update_weights(weights, v0 + 1, drain=True)
        between = engine.generate([1, 388, 201, 301], params(16, 2))
        u2 = engine.update_weights(weights, v0 + 2, drain=True)
        after = engine.generate([1, 388, 201, 302], params(4, 3))
        engine.unhang()
        versions = [(r.version_start, r.version_end) for r in (f.result(timeout=120) for f in (first, between, after))]
        assert versions == [(v0, v0), (v0 + 1, v0 + 1), (v0 + 2, v0 + 2)]
        assert u1.result(timeout=10) is None and u2.result(timeout=10) is None, "an update's future never resolved"
        assert engine.version == v0 + 2
    finally:
        engine.unhang()
        engine.update_weights(weights, v0).result(timeout=120)


def test_a_request_no_step_has_run_takes_the_version_of_an_update_before_its_first_step(engine, weights):
    """An update in flight (no drain) that the engine applies after accepting a request but before any step
    ran it: the request's first token comes from the new weights, so its version_start is the new version.
    Before, it was stamped at accept, one version too old (a ledger at the staleness window's edge could
    call it stale). A request already stepped keeps its version."""
    v0 = engine.version
    try:
        engine.hang()
        stepped = engine.generate([1, 388, 201, 300], params(8, 1))
        wait_held_in_step(engine)
        unstepped = engine.generate([1, 388, 201, 301], params(8, 2))
        update = engine.update_weights(weights, v0 + 1)
        engine.unhang()
        versions = [(r.version_start, r.version_end) for r in (f.result(timeout=120) for f in (stepped, unstepped))]
        assert update.result(timeout=10) is None
        assert versions == [(v0, v0 + 1), (v0 + 1, v0 + 1)]
    finally:
        engine.unhang()
        engine.update_weights(weights, v0).result(timeout=120)


def test_an_update_its_caller_gave_up_on_is_not_run_and_the_engine_serves_on(engine, weights):
    """`asyncio.wait_for(asyncio.wrap_future(update), T)` cancels the update's future when it times out (while
    a drain waits for long requests). The engine thread then set a result on a cancelled future: the
    InvalidStateError escaped its loop, the engine was marked dead (a generation worker ends itself), and
    the update had been applied all the same."""
    v0 = engine.version
    try:
        engine.hang()
        running = engine.generate([1, 388, 201, 300], params(2, 1))
        update = engine.update_weights(weights, v0 + 1, drain=True)
        assert update.cancel()
        engine.unhang()
        assert running.result(timeout=120).version_end == v0
        assert engine.generate([1, 2, 3], params(2, 2)).result(timeout=120).token_ids
        assert engine.dead is None and engine.version == v0, (engine.dead, engine.version)
    finally:
        engine.unhang()


def test_a_request_id_in_flight_already_is_refused(engine):
    """vLLM takes a second request under an id in flight (its internal ids differ), but the engine keys its
    requests by that id: the first to finish resolved the second caller with the first's tokens, and the
    first caller waited for good."""
    try:
        engine.hang()
        first = engine.generate([1, 388, 201, 300], params(2, 1), "same-id")
        second = engine.generate([1, 388, 201, 301], params(2, 2), "same-id")
        engine.unhang()
        with pytest.raises(ValueError, match="request id 'same-id' is in flight already"):
            second.result(timeout=60)
        assert first.result(timeout=120).prompt_token_ids == [1, 388, 201, 300]
        assert engine.dead is None and engine.in_flight == 0
    finally:
        engine.unhang()


def test_an_in_flight_update_leaves_no_kv_of_the_old_weights_to_a_later_request(engine, weights):
    """An update with a request in flight (`async_rl.in_flight_weight_updates`, the upstream preset): vLLM's
    `reset_prefix_cache()` refuses while a request holds KV, and minirl ignored its answer, so a later
    request with a cached prefix (a group's rollouts share their prompt) reused KV of the old weights while
    stamped with the new version: "a stamp may be too old, never too new" broke (found by review). Now the
    requests in flight are preempted and recompute under the new weights: a prompt cached under v0 samples
    after an in-flight update as it does after an update with nothing in flight."""
    import numpy as np
    from vllm import SamplingParams

    rng = np.random.default_rng(0)
    new = [(n, (a + rng.normal(0, 0.05, a.shape)).astype(a.dtype)) for n, a in weights]
    prompt = [1] + [300 + (i * 7) % 150 for i in range(400)]  # 25 full KV blocks to cache
    greedy = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0)
    v0 = engine.version
    try:
        engine.generate(prompt, greedy).result(timeout=120)  # its blocks cached under v0
        engine.hang()
        running = engine.generate([1] + [200 + i % 90 for i in range(50)], params(64, 1))
        wait_held_in_step(engine)
        update = engine.update_weights(new, v0 + 1)  # in flight: `running` holds KV
        engine.unhang()
        update.result(timeout=120)
        after = engine.generate(prompt, greedy).result(timeout=120)
        mixed = running.result(timeout=120)
        engine.update_weights(new, v0 + 1).result(timeout=120)  # nothing in flight: a clean cache
        clean = engine.generate(prompt, greedy).result(timeout=120)
        assert (mixed.version_start, mixed.version_end) == (v0, v0 + 1) and len(mixed.token_ids) == 64
        assert (after.version_start, clean.version_start) == (v0 + 1, v0 + 1)
        assert after.token_ids == clean.token_ids, (after.token_ids, clean.token_ids)
        np.testing.assert_allclose(after.logprobs, clean.logprobs, atol=1e-3)
    finally:
        engine.unhang()
        engine.update_weights(weights, v0).result(timeout=120)
