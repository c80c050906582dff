"""The agent pool's HTTP server: Gym's `POST /run` (one rollout row per request), as a Ray actor.

Request: a row (`responses_create_params`, `agent_ref`, `_rowidx`, `task`, and minirl's
`_minirl` coordinates). Response: the row plus `response` (Responses output items carrying each
model call's token ids and logprobs), `reward` and the agent's `evidence`.

As in Gym's error middleware, an exception inside an agent becomes HTTP 500 with `repr(e)`, in a
typed body `{"error", "type"}` (minirl.wire); a failure known to be the data's (a model server's
4xx) answers 400 instead, so it stays DATA. An
unknown `agent_ref.name` is a 404 and a body over `agent.max_request_bytes` a 413, never a 500.
The HTTP-layer fault sites fire here: `timeout` (the answer never comes in time), `transport`
(the connection drops mid-response), `bad_output` (a malformed 200) and `agent_kill` (the server's
process dies, taking every row in flight with it; Ray restarts it at the same port).

Invariant: every request gets exactly one of: a well-formed 200, a 4xx naming the problem, a 500
carrying the agent's exception, or (only under an injected fault) a hang, a cut or a bad body.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal

import aiohttp
from aiohttp import web

from minirl.agents.agent import run_episode
from minirl.agents.model_client import HttpModelClient
from minirl.config import AgentConfig, MinirlConfig
from minirl.faults import FaultPlan
from minirl.wire import Coords, run_error_body, run_error_status
from minirl.http_thread import HttpThread

AGENT_NAMES = ("simple_agent", "compaction_agent")


class AgentServer:
    """Ray actor (or plain object in tests): serves `/run` on its own thread from construction."""

    def __init__(self, cfg: MinirlConfig, model_urls: list[str], host: str = "127.0.0.1", port: int = 0):
        self.cfg, self.model_urls = cfg, model_urls
        self.plan = FaultPlan(cfg.faults)
        self.agents = {name: self._agent_config(name) for name in AGENT_NAMES}
        self.in_flight = 0
        self.http = HttpThread(self._setup, host, port, name="agent-server")

    @property
    def url(self) -> str:
        return self.http.url

    def start(self) -> str:
        """The base URL (the server is already up: it starts in the constructor)."""
        return self.http.url

    def stop(self) -> None:
        self.http.stop(self.session.close)

    def pid(self) -> int:
        return os.getpid()

    def _agent_config(self, name: str) -> AgentConfig:
        agent = copy.deepcopy(self.cfg.agent)
        agent.name = name
        if name == "simple_agent":
            agent.context_history.enabled = False
        return agent

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.agent.max_request_bytes)
        app.router.add_post("/run", self.run)
        app.router.add_get("/health", self.health)
        return app

    async def _setup(self) -> web.Application:
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            connector=aiohttp.TCPConnector(limit=0),
        )
        self.client = HttpModelClient(self.model_urls, self.cfg.policy.model_name, self.session)
        return self.app()

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "in_flight": self.in_flight})

    async def run(self, request: web.Request) -> web.StreamResponse:
        try:
            row = await request.json()
        except web.HTTPRequestEntityTooLarge:
            raise
        except ValueError as exc:
            return web.json_response({"error": f"request body is not JSON: {exc}"}, status=400)
        if not isinstance(row, dict) or "responses_create_params" not in row or "task" not in row:
            return web.json_response({"error": "a /run row needs responses_create_params and task"}, status=400)
        name = (row.get("agent_ref") or {}).get("name")
        if name not in self.agents:
            return web.json_response({"error": f"unknown agent_ref name {name!r}; known: {list(self.agents)}"}, status=404)

        coords = Coords.from_row(row)
        rooms = row["task"].get("num_rooms")
        fires = (lambda kind: coords is not None and self.plan.call_of(kind, coords, rooms) is not None)
        self.in_flight += 1
        try:
            if fires("agent_kill"):
                os.kill(os.getpid(), signal.SIGKILL)  # the whole server dies with every row in flight
            if fires("timeout"):
                await asyncio.sleep(self.cfg.faults.hang_s)
            try:
                result = await run_episode(row, self.agents[name], self.client, self.plan)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Gym's error middleware: an agent exception is a 500 (data's: 400)
                return web.json_response(run_error_body(exc), status=run_error_status(exc))
            body = json.dumps(result).encode()
            if fires("bad_output"):
                return web.Response(body=body[: len(body) // 2], status=200, content_type="application/json")
            if fires("transport"):
                resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json", "Content-Length": str(len(body))})
                await resp.prepare(request)
                await resp.write(body[: len(body) // 2])
                request.transport.close()  # the connection drops mid-response
                return resp
            return web.Response(body=body, status=200, content_type="application/json")
        finally:
            self.in_flight -= 1
