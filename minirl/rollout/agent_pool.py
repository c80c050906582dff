"""Several agent servers behind one run: which one a `/run` goes to (`agent.selection`: `least_busy` or
`round_robin`), which ones are down, and when a down one is probed again. docs/failure-policy.md
("Down and up again") gives the rules: what marks a server down, the probe, the doubling wait.

Invariant: `pick` returns one of the pool's URLs; every `acquire` is matched by one `release`, so
`in_flight` counts only requests still open; a server is in `downs` exactly while it is marked
down, and at most one probe of it is out at a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

FAILURE_REASONS = ("refused", "bad_answer", "timeout")
"""What a server's own failed send can be (see the module docstring); `refused` marks it down at once."""


@dataclass
class Down:
    """A server's down mark: since when, why, and when it is next due for a probe."""

    since: float
    reason: str
    retry_at: float
    probing: bool = False


class AgentPool:
    def __init__(self, urls: list[str], selection: str = "least_busy", retry_s: float = 2.0,
                 max_retry_s: float = 30.0, max_failures: int = 2, clock: Callable[[], float] = time.monotonic):
        if not urls:
            raise ValueError("an agent pool needs at least one URL")
        self.urls, self.selection = list(urls), selection
        self.retry_s, self.max_retry_s, self.max_failures, self.clock = retry_s, max_retry_s, max_failures, clock
        self.in_flight = dict.fromkeys(self.urls, 0)
        self.downs: dict[str, Down] = {}
        self.failures = dict.fromkeys(self.urls, 0)  # the server's own failed sends since its last /run answer
        self.wait = dict.fromkeys(self.urls, retry_s)  # its next down mark's wait before a probe
        self.answered_at = dict.fromkeys(self.urls, float("-inf"))  # its last /run answer
        self.turn = 0

    @classmethod
    def of(cls, urls: list[str], ag) -> AgentPool:
        """The pool `agent` (an AgentConfig) configures, as training and validation send through it."""
        return cls(urls, ag.selection, ag.down_retry_s, ag.down_retry_max_s, ag.max_server_failures)

    def pick(self, avoid: str | None = None) -> str:
        """The server for the next send (`avoid`: the one this row just failed on)."""
        up = [u for u in self.urls if u not in self.downs]
        longest = [min(self.downs, key=lambda u: self.downs[u].since)] if self.downs else []
        candidates = [u for u in up if u != avoid] or up or longest
        order = [candidates[(self.turn + i) % len(candidates)] for i in range(len(candidates))]
        self.turn += 1
        if self.selection == "round_robin":
            return order[0]
        return min(order, key=self.in_flight.__getitem__)  # min keeps the first of equals: ties go in turn

    def acquire(self, url: str) -> None:
        self.in_flight[url] += 1

    def release(self, url: str) -> None:
        self.in_flight[url] -= 1

    def answered(self, url: str) -> Down | None:
        """`url` answered a `/run` (any HTTP answer): up, its count and wait reset. Returns the
        down mark this clears, if it was down."""
        self.failures[url], self.wait[url], self.answered_at[url] = 0, self.retry_s, self.clock()
        return self.downs.pop(url, None)

    def failed(self, url: str, reason: str, sent_at: float) -> Down | None:
        """A send to `url` made at `sent_at` failed by the server's own doing (`reason`, one of
        FAILURE_REASONS). Returns the down mark when this one sets it."""
        if reason == "timeout" and self.answered_at[url] >= sent_at:
            return None  # it answered other sends meanwhile: slow work, not a silent server
        self.failures[url] += 1
        if url in self.downs or (reason != "refused" and self.failures[url] < self.max_failures):
            return None
        now = self.clock()
        self.downs[url] = Down(now, reason, now + self._next_wait(url))
        return self.downs[url]

    def due(self) -> list[str]:
        """Down servers whose wait is over and that no probe is looking at: each now taken for one probe."""
        now = self.clock()
        due = [u for u, d in self.downs.items() if not d.probing and d.retry_at <= now]
        for u in due:
            self.downs[u].probing = True
        return due

    def probed(self, url: str, ok: bool) -> Down | None:
        """A probe of `url` ended: `ok` brings it up (returns the cleared mark), else it waits again."""
        down = self.downs.get(url)
        if down is None:
            return None  # a /run answered meanwhile
        if ok:
            return self.downs.pop(url)
        down.probing, down.retry_at = False, self.clock() + self._next_wait(url)
        return None

    def _next_wait(self, url: str) -> float:
        wait, self.wait[url] = self.wait[url], min(self.wait[url] * 2, self.max_retry_s)
        return wait

    def up_besides(self, url: str) -> bool:
        """Whether a server other than `url` is up."""
        return any(u != url and u not in self.downs for u in self.urls)

    def down(self) -> list[str]:
        return [u for u in self.urls if u in self.downs]

    def up_count(self) -> int:
        return len(self.urls) - len(self.downs)
