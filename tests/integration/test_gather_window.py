"""The idle engine's gather (`vllm_cfg.gather_gap_s`) through the real in-process engine: a lone
request waits only the first window (`gather_first_s`) before the engine steps, and a burst whose
second request comes within that window is still gathered whole with the gap."""

from __future__ import annotations

from helpers import first_step_size


def test_a_lone_request_waits_the_first_window_and_a_burst_is_still_gathered(engine):
    """Issue 55: with a first window of 50 ms and a gap of 0.4 s, a lone request at an idle engine is
    held for about the window (the old rule held it the whole gap), and requests whose second follows
    the first at once and the others 0.15 s apart (longer than the window, within the gap) all join the
    first step. The engine counts each gather as lone or burst."""
    gap, first = 0.4, 0.05
    assert engine.gather_gap_s == 0.0
    try:
        engine.gather_gap_s, engine.gather_max_s, engine.gather_first_s = gap, 5.0, first
        held = engine.gather_s
        assert first_step_size(engine, []) == 1
        assert engine.gather_s - held < first + 0.15 < gap, "a lone request waited past the first window"
        lone, burst = engine.gathers_lone, engine.gathers_burst
        assert first_step_size(engine, []) == 1
        assert (engine.gathers_lone, engine.gathers_burst) == (lone + 1, burst)
        assert first_step_size(engine, [0.0, 0.15, 0.15]) == 4, "a burst was not gathered into the first step"
        assert (engine.gathers_lone, engine.gathers_burst) == (lone + 1, burst + 1)
    finally:
        engine.gather_gap_s, engine.gather_max_s, engine.gather_first_s = 0.0, 0.0, 0.0


def test_only_requests_count_as_gathered(engine, base_cfg):
    """Issue 55's counts hold when the gather takes something that is not a request: a stray abort (of a
    request that finished before) leaves a lone request lone, its window running from the request; a
    weight update run meanwhile is counted in `weights_s`, and not again in `gather_s`: the two together
    fit in the time the request waited for its first step. Before, each item taken counted as a request
    gathered (the lone request got the burst's gap and was counted a burst), and the reload's time was
    in both."""
    import time

    from safetensors.numpy import load_file
    from vllm import SamplingParams

    weights = list(load_file(f"{base_cfg.policy.model_name}/model.safetensors").items())
    gap, first = 1.0, 0.4
    v0 = engine.version

    def lone_with(interloper) -> tuple[float, float, float]:
        """A lone request, and `interloper()` 0.15 s into its gather: the gather_s and weights_s it added,
        and how long the request waited for the engine's first step."""
        held, loaded, t0 = engine.gather_s, engine.weights_s, time.monotonic()
        fut = engine.generate([1, 388, 201, 300], SamplingParams(max_tokens=4, ignore_eos=True, seed=0))
        time.sleep(0.15)
        interloper()
        fut.result(timeout=60)
        stepped = next(start for start, _, _ in list(engine.step_log) if start >= t0)
        return engine.gather_s - held, engine.weights_s - loaded, stepped - t0

    try:
        engine.gather_gap_s, engine.gather_max_s, engine.gather_first_s = gap, 5.0, first
        lone, burst = engine.gathers_lone, engine.gathers_burst
        held, _, _ = lone_with(lambda: engine.abort("finished-long-ago"))
        assert (engine.gathers_lone, engine.gathers_burst) == (lone + 1, burst), "a stray abort made a burst"
        assert held < first + 0.2 < gap, f"a lone request with a stray abort was held {held:.2f} s"
        held, loaded, waited = lone_with(lambda: engine.update_weights(weights, v0 + 1).result(timeout=60))
        assert loaded > 0 and engine.version == v0 + 1
        assert (engine.gathers_lone, engine.gathers_burst) == (lone + 2, burst), "a weight update made a burst"
        assert held + loaded <= waited + 1e-3, f"gather_s {held:.3f} + weights_s {loaded:.3f} > {waited:.3f} s waited"
    finally:
        engine.gather_gap_s, engine.gather_max_s, engine.gather_first_s = 0.0, 0.0, 0.0
        engine.update_weights(weights, v0).result(timeout=120)
