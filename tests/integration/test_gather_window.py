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
