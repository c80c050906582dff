"""A draining weight update (`update_weights(drain=True)`) and what arrives while it is held, through the
session's real vLLM engine: a request whose caller leaves while it is deferred behind the update is
aborted there and never generated, and a second drain waits its turn instead of replacing the first.

The engine's next step is held (`hang`) while the jobs are sent, so it takes them all together with the
first request in flight, as a busy engine does."""

from __future__ import annotations

from concurrent.futures import CancelledError

import pytest


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
