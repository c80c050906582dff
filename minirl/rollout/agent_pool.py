"""Several agent servers behind one run: which one a `/run` goes to, and which ones to pass over.

`agent.selection`: `least_busy` sends to the server with the fewest of this run's `/run` requests in
flight (ties: the next in turn), `round_robin` to the next in turn. A server that refused or reset a
connection (`AgentUnreachable`: down, or restarting at its port) is marked down and passed over
while another is up; a `/run` it answers clears the mark. A re-send avoids the server its row just
failed on where another is up. When every server is down, the one marked down longest ago is tried,
so a restarted server is found again.

Invariant: `pick` returns one of the pool's URLs; every `acquire` is matched by one `release`, so
`in_flight` counts only requests still open.
"""

from __future__ import annotations

import time


class AgentPool:
    def __init__(self, urls: list[str], selection: str = "least_busy"):
        if not urls:
            raise ValueError("an agent pool needs at least one URL")
        self.urls, self.selection = list(urls), selection
        self.in_flight = dict.fromkeys(self.urls, 0)
        self.down_since: dict[str, float] = {}  # url -> when it last refused or reset a connection
        self.turn = 0

    def pick(self, avoid: str | None = None) -> str:
        """The server for the next send (`avoid`: the one this row just failed on)."""
        up = [u for u in self.urls if u not in self.down_since]
        candidates = [u for u in up if u != avoid] or up or [min(self.down_since, key=self.down_since.__getitem__)]
        order = [candidates[(self.turn + i) % len(candidates)] for i in range(len(candidates))]
        self.turn += 1
        if self.selection == "round_robin":
            return order[0]
        return min(order, key=self.in_flight.__getitem__)  # min keeps the first of equals: ties go in turn

    def acquire(self, url: str) -> None:
        self.in_flight[url] += 1

    def release(self, url: str, reached: bool | None) -> None:
        """The send to `url` ended: `reached` True (it answered), False (refused or reset), None (unknown)."""
        self.in_flight[url] -= 1
        if reached is False:
            self.down_since.setdefault(url, time.monotonic())
        elif reached:
            self.down_since.pop(url, None)

    def down(self) -> list[str]:
        return [u for u in self.urls if u in self.down_since]
