"""The sync source's `Trickle` (minirl/rollout/source.py): a take of the servers' call records that fails
while the step's groups still run is not replaced by the next group's take and forgotten; the step's
`finish` raises it, and `taken` hands what the takes before it held to `close`. (The takes through real
servers are in tests/integration/test_sync_take.py; no fault site makes a take fail there.)"""

from __future__ import annotations

import asyncio

import pytest

from minirl.rollout.source import Trickle


class _Takes:
    """A server's `take_calls` as the source's drain awaits it: hands over its next batch of records, or
    raises at the take numbered `fail_at`."""

    def __init__(self, fail_at: int | None = None):
        self.fail_at, self.n = fail_at, 0

    async def __call__(self) -> list[dict]:
        self.n += 1
        await asyncio.sleep(0.01)
        if self.n == self.fail_at:
            raise ConnectionError(f"take {self.n} failed")
        return [{"take": self.n}]


def _step(takes: _Takes, pokes: int):
    async def run():
        trickle = Trickle(takes)
        for _ in range(pokes):  # a group resolves, then the next after the take in flight has ended
            trickle.poke()
            await asyncio.sleep(0.05)
        try:
            return await trickle.finish(), None
        except ConnectionError as exc:
            return await trickle.taken(), exc

    return asyncio.run(run())


def test_every_take_is_kept_in_order():
    records, error = _step(_Takes(), pokes=3)
    assert error is None and records == [{"take": 1}, {"take": 2}, {"take": 3}, {"take": 4}]


@pytest.mark.parametrize("fail_at", [1, 2])
def test_a_take_that_fails_mid_step_fails_the_step_and_no_later_take_hides_it(fail_at):
    takes = _Takes(fail_at)
    records, error = _step(takes, pokes=3)
    assert isinstance(error, ConnectionError) and str(error) == f"take {fail_at} failed"
    assert takes.n == fail_at, "no take starts after the failed one"
    assert records == [{"take": k} for k in range(1, fail_at)], "what the takes before it held goes to close"
