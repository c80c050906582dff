"""The buffer of finished prompt groups that the rollout pump fills and the train pump drains.

Invariant: a group enters the buffer once, and leaves it once: consumed by exactly one optimizer
step, or evicted as stale (counted, never trained). At most `capacity` unconsumed groups are held;
the pump reserves a place before it dispatches, so a finished group always finds one.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the samplers (and so the config's check) import this module without aiohttp
    from minirl.rollout.manager import GroupOutcome


@dataclass
class GroupRecord:
    """One prompt group's resolution (committed, dropped or skipped). `start_weight` is the oldest policy
    version any of its kept rows' group attempts started under (re-stamped on every attempt, as upstream
    reserves each attempt under the current version, but never younger than a row kept from an earlier
    attempt), so the group sorts, counts and is evicted by its true age."""

    step: int  # the prompt's step in the prompt stream (its coordinates)
    group: int
    start_weight: int
    outcome: GroupOutcome
    target_step: int  # the optimizer step it is stamped for (a sampler that stamps_target_steps); else the prompt step
    replacement: bool = False  # a spare prompt that stood in for a lost one (on_dropped_prompt=replace)
    promoted: bool = False  # re-stamped from a later step into a short one
    lost: list = field(default_factory=list)  # outcomes of the prompts its place gave up on before this one (replace)


class GroupBuffer:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.ready: list[GroupRecord] = []
        self.reserved = 0  # places held by groups in flight
        self.changed = asyncio.Condition()

    @property
    def free(self) -> int:
        return self.capacity - len(self.ready) - self.reserved

    async def reserve(self) -> None:
        """Wait for a free place and hold it for a place about to be dispatched; the place keeps it
        through its substitutions (on_dropped_prompt=replace) until its record is committed."""
        async with self.changed:
            await self.changed.wait_for(lambda: self.free > 0)
            self.reserved += 1

    async def commit(self, record: GroupRecord) -> None:
        async with self.changed:
            self.reserved -= 1
            self.ready.append(record)
            self.changed.notify_all()

    async def touched(self) -> None:
        """A ready record changed in place (a promotion re-stamped it): let the train pump look again."""
        async with self.changed:
            self.changed.notify_all()

    async def release(self) -> None:
        """Give back a reservation whose group will never arrive (its dispatch was cancelled)."""
        async with self.changed:
            self.reserved -= 1
            self.changed.notify_all()

    async def take_when(self, pick) -> tuple[list[GroupRecord], list[GroupRecord]]:
        """Wait until `pick(ready)` -> (stale, chosen) chooses; remove both; returns (stale, chosen).

        `pick` runs under the buffer's lock after every change; the stale records it names are
        evicted at once (returned, for the step source to count), even while it keeps waiting (chosen
        None); an exception it raises (the pump's failure) propagates."""
        evicted: list[GroupRecord] = []
        async with self.changed:
            while True:
                stale, chosen = pick(self.ready)
                for r in stale:
                    self.ready.remove(r)
                evicted += stale
                if chosen is not None:
                    break
                if stale:
                    self.changed.notify_all()  # places freed: the pump may dispatch again
                await self.changed.wait()
            for r in chosen:
                self.ready.remove(r)
            self.changed.notify_all()
        return evicted, chosen
