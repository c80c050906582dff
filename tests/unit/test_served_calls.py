"""The generation server's own account of the calls it served in a run (`CallLog.finish`): every keyed
record it logged, by key and in all, and the records no step took, handed over once at the run's end;
the switch matrix checks the ledger against it (minirl/experiments/invariants.py, `served`)."""

from __future__ import annotations

from minirl.generation.server import CALL_LOG_STEPS, UNKEYED_CALLS, CallLog


def test_the_call_log_accounts_for_every_call_it_served():
    log = CallLog()
    for step, key in [(0, "s0.g0.r0.a0.c0"), (0, "s0.g0.r0.a0.c1"), (1, "s1.g2.r0.a0.c0"), (0, "s0.g0.r0.a0.c1")]:
        log.add(step, {"key": key, "step": step})
    assert [r["key"] for r in log.take(0)] == ["s0.g0.r0.a0.c0", "s0.g0.r0.a0.c1", "s0.g0.r0.a0.c1"]
    end = log.finish()  # what step 0's ledger took stays served; step 1's record is left over
    assert end["served"] == ["s0.g0.r0.a0.c0", "s0.g0.r0.a0.c1", "s1.g2.r0.a0.c0", "s0.g0.r0.a0.c1"]
    assert end["served_count"] == 4 and end["dropped"] == 0
    assert [r["key"] for r in end["left"]] == ["s1.g2.r0.a0.c0"]
    assert log.finish()["left"] == []  # handed over once
    log.clear()  # a new run (the worker's reset): nothing served yet
    assert log.finish() == {"left": [], "served": [], "served_count": 0, "dropped": 0, "unkeyed_dropped": 0}


def test_records_the_bound_evicts_stay_served_and_are_counted():
    log = CallLog()
    for step in range(CALL_LOG_STEPS + 1):
        log.add(step, {"key": f"s{step}.g0.r0.a0.c0", "step": step})
    end = log.finish()
    assert end["served_count"] == CALL_LOG_STEPS + 1 and end["dropped"] == 1
    assert "s0.g0.r0.a0.c0" in end["served"] and "s0.g0.r0.a0.c0" not in [r["key"] for r in end["left"]]


def test_headerless_records_the_bound_evicts_are_counted_apart_from_dropped():
    """The oldest go first, each counted in `unkeyed_dropped` (before: evicted silently); `dropped`, the
    keyed records no ledger took, stays 0."""
    log = CallLog()
    for i in range(UNKEYED_CALLS + 5):
        log.add_unkeyed({"key": None, "status": 200, "i": i})
    assert log.unkeyed_dropped == 5 and log.dropped == 0
    assert [rec["i"] for rec in log.take_unkeyed()] == list(range(5, UNKEYED_CALLS + 5))
    assert log.finish()["unkeyed_dropped"] == 5
