"""The session fixtures (tests/conftest.py) hand every test the same starting point, whichever test
a pytest worker runs first: a test's timings must not depend on its place in the suite's order."""

from __future__ import annotations


def test_the_session_engine_is_handed_out_with_its_sampler_compiled(engine):
    """The engine thread compiles vLLM's sampler before its first step (3-15 s here): a test with a
    group deadline that ran first used to pay it inside that deadline (all 8 rollouts of a 6 s
    deadline timed out). Run alone, this test is the engine's first user."""
    assert engine.sampler_compiled.is_set()
