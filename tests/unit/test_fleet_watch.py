"""FleetWatch writes every transition the router hands over exactly once, even when the step ends while a
poll is on its way back: the router clears what it hands over (`GenerationRouter.poll_health`), so a poll
cut off would lose a quarantine (the suite once saw a run whose request failed with "was quarantined" and
whose events.jsonl had no `worker_quarantined`)."""

from __future__ import annotations

import asyncio

from minirl.generation.fleet import FleetWatch


class _HandOverOnce:
    """The router's `poll_health` as the watcher calls it (`.remote()`, awaited): its transitions are taken
    as the call starts, as the router's own loop takes them, and the answer comes back `delay_s` later."""

    def __init__(self, delay_s: float):
        self.delay_s, self.polls = delay_s, 0
        self.transitions = [{"type": "worker_quarantined", "worker": "http://w0", "rank": 0, "reason": "probes"}]
        self.poll_health = self

    def remote(self):
        self.polls += 1
        events, self.transitions = self.transitions, []

        async def answer():
            await asyncio.sleep(self.delay_s)
            return {"events": events, "healthy": 1, "quarantined": {}, "error": None}

        return answer()


def test_a_step_that_ends_mid_poll_keeps_the_transitions_that_poll_took():
    router, written = _HandOverOnce(delay_s=0.2), []
    watch = FleetWatch(router, probe_interval_s=1.0, write=written.append)

    async def step_body():
        await asyncio.sleep(0.05)  # ends while the watcher's first poll is on its way back
        return "collected"

    assert asyncio.run(watch.watched(3, step_body())) == "collected"
    assert [(e["type"], e["step"]) for e in written] == [("worker_quarantined", 3)]
    assert watch.stats["workers_quarantined"] == 1 and router.polls == 2  # the watcher's poll and the closing one
