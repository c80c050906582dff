"""minirl's `doors` task as a NeMo Gym (0.4.0) resources server, built on Gym's own base classes; it
runs in the Gym venv (it imports `nemo_gym`). `/seed_session` starts an episode from the row's
`task`, `/open_door` is the tool `simple_agent` calls, `/verify` scores the transcript.

Invariant: the reward of a `/run` is `env.verify(task, output)`, a pure function of the row's task
and the agent's calls, whatever state the live episodes hold; at most `max_live_episodes` are held.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import PlainTextResponse
from pydantic import ConfigDict

from minirl.agents.env import TOOL_NAME, DoorsEnv, verify
from minirl.agents.items import parts_text
from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseSeedSessionRequest,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from nemo_gym.server_utils import SESSION_ID_KEY


class DoorsSeedSessionRequest(BaseSeedSessionRequest):
    model_config = ConfigDict(extra="allow")
    task: dict


class DoorsVerifyRequest(BaseVerifyRequest):
    model_config = ConfigDict(extra="allow")
    task: dict


class DoorsVerifyResponse(BaseVerifyResponse):
    model_config = ConfigDict(extra="allow")


class DoorsResourcesServer(SimpleResourcesServer):
    config: BaseResourcesServerConfig
    episodes: dict = {}
    """Live episodes by Gym's session id, oldest first."""
    max_live_episodes: int = 4096
    """Episodes held at once. Only `/verify` ends one, and a `/run` whose model call fails between
    `/seed_session` and `/verify` never verifies (Gym's `simple_agent` closes nothing), so past this
    the oldest is dropped (its `/verify` finds no episode): far above any run's rollouts in flight."""

    def setup_webserver(self):
        app = super().setup_webserver()
        app.post(f"/{TOOL_NAME}")(self.open_door)
        return app

    async def seed_session(self, request: Request, body: DoorsSeedSessionRequest) -> BaseSeedSessionResponse:
        """An episode from the row's `task` (`{"env": "doors", "seed", "num_rooms"}`), kept under Gym's
        per-rollout session id."""
        env = DoorsEnv(body.task["seed"], body.task["num_rooms"], body.task.get("env", "doors"))
        self.keep(request.session[SESSION_ID_KEY], env)
        return BaseSeedSessionResponse()

    def keep(self, session_id: str, env: DoorsEnv | None) -> None:
        """`env` as the session's episode, the newest; the oldest past `max_live_episodes` dropped."""
        self.episodes.pop(session_id, None)
        self.episodes[session_id] = env
        while len(self.episodes) > self.max_live_episodes:
            self.episodes.pop(next(iter(self.episodes)))

    async def open_door(self, request: Request) -> PlainTextResponse:
        """The tool `simple_agent` calls by name with the parsed arguments: the observation as plain
        text in the model's own format (the text minirl's agent would show: `items.parts_text` of
        `DoorsEnv.step`), a call after the last door included (the environment's own `All doors are
        open.`, never an exception's text)."""
        env = self.episodes.get(request.session[SESSION_ID_KEY])
        if env is None:
            return PlainTextResponse("Error: no episode; call /seed_session first.", status_code=400)
        raw = (await request.body()).decode()
        return PlainTextResponse(parts_text(env.step(TOOL_NAME, raw)))

    async def verify(self, request: Request, body: DoorsVerifyRequest) -> DoorsVerifyResponse:
        """Replays the transcript with `env.verify`, as minirl's agent does."""
        self.episodes.pop(request.session.get(SESSION_ID_KEY), None)
        output = [item.model_dump() if hasattr(item, "model_dump") else dict(item) for item in body.response.output]
        return DoorsVerifyResponse(**body.model_dump(), reward=verify(body.task, output))
