"""The idle engine's `learned` gather rule (`vllm_cfg.gather_rule`) through the real in-process
engine: a clump whose requests come ~1 ms apart is held for the gap learned from the engine's own
recent gathers, far less than `gather_gap_s`, while a burst of first turns is still gathered whole
with the gap, and the `fixed` rule holds the clump the whole gap, as before."""

from __future__ import annotations

from helpers import first_step_size


def _held(engine, spacings_s) -> tuple[int, float]:
    """The engine's first step's size and the time its gather held, for requests `spacings_s` apart."""
    before = engine.gather_s
    return first_step_size(engine, spacings_s), engine.gather_s - before


def test_a_learned_gather_holds_a_clump_briefly_and_a_burst_whole(engine):
    """Issue 55: with a gap of 0.4 s, after five bursts of 9 requests ~1 ms apart (the engine learns their
    spacing), a clump of 4 requests 1 ms apart is held for well under the gap (the fixed rule held it
    0.4 s past its last request), while 10 requests with two 0.12 s pauses after the first 8 still all
    join the first step, and the gather is counted as a burst. The `fixed` rule holds the clump the gap."""
    gap = 0.4
    assert engine.gather_gap_s == 0.0
    try:
        engine.set_gather(gap, 5.0, 0.05)
        engine.gather_rule = "learned"
        for _ in range(5):  # 7 gaps learned from each (those after its second request): 28 known at the fifth
            assert first_step_size(engine, [0.001] * 8) == 9
        assert getattr(engine, "gather_learned_s", gap) == gap, "too few gaps known (GAP_MIN_SAMPLES): the cap"
        bursts = engine.gathers_burst
        size, held = _held(engine, [0.001] * 3)
        assert size == 4, "a clump was not gathered into the first step"
        assert held < gap / 4, f"a clump 1 ms apart was held {held:.3f} s at an idle engine (the gap is {gap} s)"
        assert engine.gathers_burst == bursts + 1 and 0 < engine.gather_learned_s < gap / 4
        burst_n = engine.gather_burst_n
        spacings = [0.001] * (burst_n - 1) + [0.12, 0.12]  # a burst pausing longer than the learned gap
        assert first_step_size(engine, spacings) == burst_n + 2, "a burst was not gathered whole"
        engine.gather_rule = "fixed"
        size, held = _held(engine, [0.001] * 3)
        assert size == 4 and held >= gap, "the fixed rule no longer holds a clump the whole gap"
    finally:
        engine.set_gather(0.0, 0.0, 0.0)
