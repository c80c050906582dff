"""minirl's `doors` resources server on nemo-gym 0.7.0's base classes, whose verifier reports Gym 0.7's
failure facts; it runs in the Gym 0.7 venv (it imports `nemo_gym`). 0.7's `SimpleResourcesServer`
wraps `/verify` in `judge_failsafe` and adds `/close_session` and `/reverify_mode`, and
`BaseVerifyResponse` gains `mask_sample`, `failure_kind` and `failure_reason`; the episode itself is
the 0.4 server's (`DoorsResourcesServer`).

Invariant: a session that was seeded verifies as the 0.4 server does (mask_sample false); only a
session the seeded fault plan lost (`session_lost`), or one no longer held (`session_expired`: never
seeded, or dropped past `max_live_episodes`), reports mask_sample, and verify never raises for it.
"""

from __future__ import annotations

from fastapi import Request

from minirl.config import faults_section
from minirl.faults import FaultPlan, fault_site
from minirl.gym_servers.doors_resources_server import (
    DoorsResourcesServer,
    DoorsSeedSessionRequest,
    DoorsVerifyRequest,
    DoorsVerifyResponse,
)
from minirl.gym.failures import EXPIRED_SESSION, LOST_SESSION
from minirl.wire import BadCoordinates, Coords
from nemo_gym.base_resources_server import BaseSeedSessionResponse
from nemo_gym.server_utils import SESSION_ID_KEY


def fault_plan(faults: dict) -> FaultPlan:
    """minirl's FaultPlan over `faults` (minirl's `faults.*` as plain JSON: {seed, inject: [{kind, step,
    ...}], rate: {kind: p}, rate_per_room: {kind: q}}), checked as a run's is: a ConfigError names a
    misspelt key, an unknown kind or a rate outside [0, 1]."""
    return FaultPlan(faults_section(faults))


def _lost(plan: FaultPlan, body) -> bool:
    try:
        coords = Coords.from_row((body.model_extra or {}))
    except BadCoordinates:
        coords = None
    rooms = body.task.get("num_rooms")  # a per-room rate's n, as minirl's own verifier reads it
    return fault_site(plan, coords, rooms if type(rooms) is int else None)("session_lost")


class DoorsResourcesServer07(DoorsResourcesServer):
    faults: dict = {}

    def model_post_init(self, context, /) -> None:
        super().model_post_init(context)
        self._plan = fault_plan(self.faults)

    async def seed_session(self, request: Request, body: DoorsSeedSessionRequest) -> BaseSeedSessionResponse:
        """As the 0.4 server, except for a row whose `_minirl` coordinates draw `session_lost` from the
        seeded fault plan (`faults` in the server's config, minirl's `faults.*` as JSON): no episode is
        kept, so the tool answers that there is none."""
        if _lost(self._plan, body):  # the seeded fault plan loses this session: no episode is kept
            self.keep(request.session[SESSION_ID_KEY], None)  # held as lost, not as never seeded
            return BaseSeedSessionResponse()
        return await super().seed_session(request, body)

    async def verify(self, request: Request, body: DoorsVerifyRequest) -> DoorsVerifyResponse:
        """A lost session answers `mask_sample: true`, `failure_kind: session_lost` (Gym's name) with
        reward 0.0, and one the server does not hold `session_expired`: the reward is not a
        measurement, so minirl masks that rollout instead of training a 0."""
        sid = request.session.get(SESSION_ID_KEY)
        if self.episodes.get(sid) is None:  # lost (held as None) or not held: not a measurement
            gone = LOST_SESSION if sid in self.episodes else EXPIRED_SESSION
            self.episodes.pop(sid, None)
            return DoorsVerifyResponse(**body.model_dump(), reward=0.0, mask_sample=True, **gone)
        return await super().verify(request, body)
