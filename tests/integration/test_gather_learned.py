"""The idle engine's `learned` gather rule (`vllm_cfg.gather_rule`) through the real in-process
engine: a clump of requests is held for the gap learned from the engine's own recent gathers, far
less than `gather_gap_s`, while a burst of first turns is still gathered whole with the gap, and the
`fixed` rule holds the clump the whole gap, as before.

What the engine learns is the spacing it saw, and a loaded machine's stalls widen it (the learned gap
then rightly grows toward the cap): so the learning bursts go on, a bounded number of times, until
the gaps learned are a quiet machine's, and the clump and the burst are submitted together, so no
stall of the test's thread between two submissions splits them."""

from __future__ import annotations

from helpers import first_step_size
from minirl.generation.engine import learned_gap

LEARN_BURSTS, MAX_LEARN_BURSTS = 5, 25
"""Bursts that teach the engine its spacing (7 gaps each: 35 >= GAP_MIN_SAMPLES after five), and at
most this many when a stall of the loaded machine widened the gaps learned so far."""


def _held(engine, spacings_s) -> tuple[int, float]:
    """The engine's first step's size and the time its gather held, for requests `spacings_s` apart."""
    before = engine.gather_s
    return first_step_size(engine, spacings_s), engine.gather_s - before


def test_a_learned_gather_holds_a_clump_briefly_and_a_burst_whole(engine):
    """Issue 55: with a gap of 0.4 s, after bursts of 9 requests ~1 ms apart (the engine learns their
    spacing), a clump of 4 requests is held for well under the gap (the fixed rule held it 0.4 s past
    its last request), while 10 requests with two 0.12 s pauses after the first 8 still all join the
    first step, and the gather is counted as a burst. The `fixed` rule holds the clump the gap."""
    gap = 0.4
    assert engine.gather_gap_s == 0.0
    try:
        engine.set_gather(gap, 5.0, 0.05)
        engine.gather_rule = "learned"
        # the first two together: a stall past the first window (50 ms) would split the burst
        burst = [0.0] + [0.001] * 7
        for _ in range(LEARN_BURSTS):  # 7 gaps learned from each (those after its second request): 28 at the fifth
            assert first_step_size(engine, burst) == 9
        assert getattr(engine, "gather_learned_s", gap) == gap, "too few gaps known (GAP_MIN_SAMPLES): the cap"
        learned = LEARN_BURSTS
        while learned_gap(engine._gaps, gap) >= gap / 8 and learned < MAX_LEARN_BURSTS:
            first_step_size(engine, burst)  # a stall widened the gaps learned: more quiet ones push it out
            learned += 1
        assert learned_gap(engine._gaps, gap) < gap / 8, \
            f"{learned} bursts 1 ms apart taught the engine a gap of {learned_gap(engine._gaps, gap):.3f} s"
        bursts = engine.gathers_burst
        size, held = _held(engine, [0.0] * 3)
        assert size == 4, "a clump was not gathered into the first step"
        assert held < gap / 4, f"a clump was held {held:.3f} s at an idle engine (the gap is {gap} s)"
        assert engine.gathers_burst == bursts + 1 and 0 < engine.gather_learned_s < gap / 4
        burst_n = engine.gather_burst_n
        spacings = [0.0] * (burst_n - 1) + [0.12, 0.12]  # a burst pausing longer than the learned gap
        assert first_step_size(engine, spacings) == burst_n + 2, "a burst was not gathered whole"
        engine.gather_rule = "fixed"
        size, held = _held(engine, [0.0] * 3)
        assert size == 4 and held >= gap, "the fixed rule no longer holds a clump the whole gap"
    finally:
        engine.set_gather(0.0, 0.0, 0.0)
