"""The agent pool's HTTP server: Gym's `POST /run` (one rollout row per request), served in a
process of its own behind a Ray actor (minirl.agents.process).

Request: a row (`responses_create_params`, `agent_ref`, `_rowidx`, `task`, and minirl's `_minirl`
coordinates), checked by `parse_row` before its episode starts. Response: the row plus `response`
(Responses output items carrying each model call's token ids and logprobs), `reward` and `evidence`.

Invariant: every request gets exactly one of: a well-formed 200, a 4xx naming the problem, a 500
carrying the agent's exception, or (only under an injected fault) a hang, a cut or a bad body; a
row that fails `parse_row` never starts an episode.
"""
from __future__ import annotations

import asyncio
import copy
import os
import signal

import aiohttp
from aiohttp import web

from minirl.runtime import jsonio
from minirl.agents.agent import run_episode
from minirl.agents.env import MIN_ROOMS, TASKS
from minirl.agents.items import TOKEN_FIELDS, items_to_messages
from minirl.agents.model_client import HttpModelClient
from minirl.config import AgentConfig, MinirlConfig
from minirl.faults import FaultPlan, fault_site
from minirl.gym.failures import LOST_SESSION, verified
from minirl.wire import EXTRA_BODY, BadCoordinates, Coords, extra_body, run_error_body, run_error_status
from minirl.runtime.http_thread import INLINE_BYTES, HttpThread, off_loop

AGENT_NAMES = ("simple_agent", "compaction_agent")


class BadRow(ValueError):
    """A `/run` row the agents cannot run; the message names the field. Answered with 400 (DATA)."""


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_row(raw: bytes, cfg: MinirlConfig) -> tuple[dict, str, Coords | None]:
    """A `/run` body -> (row, agent name, coordinates), checking everything the episode reads before
    it starts (`check_row`). Raises BadRow (or BadCoordinates) naming the field. Linear in the body's size."""
    try:
        row = jsonio.loads(raw)
    except RecursionError:
        raise BadRow("request body nests deeper than the server parses") from None
    except ValueError as exc:
        raise BadRow(f"request body is not JSON: {exc}") from None
    return (row, *check_row(row, cfg))


def check_row(row, cfg: MinirlConfig) -> tuple[str, Coords | None]:
    """A parsed `/run` row -> (agent name, coordinates), or BadRow (BadCoordinates) naming the field:
    the agent server's own check, which `minirl.data` also runs on a dataset's rows before a run starts."""
    if not isinstance(row, dict):
        raise BadRow(f"a /run row must be a JSON object, got {type(row).__name__}")
    ref = row.get("agent_ref")
    if not isinstance(ref, dict) or not isinstance(ref.get("name"), str):
        raise BadRow(f"agent_ref must be an object with a string name, got {_short(ref)}")
    coords = Coords.from_row(row)
    task = row.get("task")
    if not isinstance(task, dict):
        raise BadRow(f"task must be an object, got {_short(task)}")
    for key in ("seed", "num_rooms"):
        if not _int(task.get(key)):
            raise BadRow(f"task.{key} must be an integer, got {_short(task.get(key))}")
    if not 1 <= task["num_rooms"] <= cfg.env.max_num_rooms:
        raise BadRow(f"task.num_rooms must be in [1, {cfg.env.max_num_rooms}] (env.max_num_rooms), "
                     f"got {task['num_rooms']}")
    if task.get("env", "doors") not in TASKS or task["num_rooms"] < MIN_ROOMS[task.get("env", "doors")]:
        raise BadRow(f"task.env must be one of {list(TASKS)} (doors_memory with num_rooms >= 3, doors_notes with "
                     f"num_rooms >= 7), got {_short(task.get('env'))}")
    params = row.get("responses_create_params")
    if not isinstance(params, dict):
        raise BadRow(f"responses_create_params must be an object, got {_short(params)}")
    items = params.get("input")
    if not isinstance(items, list):
        raise BadRow(f"responses_create_params.input must be a list of items, got {type(items).__name__}")
    if not items:
        raise BadRow("responses_create_params.input must hold at least one item, got []")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadRow(f"responses_create_params.input[{i}] must be an object, got {_short(item)}")
        try:  # the agent's own conversion, so what passes here is what the episode can read
            items_to_messages([item])
        except KeyError as exc:
            raise BadRow(f"responses_create_params.input[{i}] lacks key {exc}") from None
        except (ValueError, TypeError, AttributeError) as exc:
            raise BadRow(f"responses_create_params.input[{i}]: {exc}") from None
    tools = params.get("tools", [])
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRow(f"responses_create_params.tools must be a list of objects, got {_short(tools)}")
    if "seed" in params and not _int(params["seed"]):
        raise BadRow(f"responses_create_params.seed must be an integer, got {_short(params['seed'])}")
    cap = params.get("max_output_tokens")
    if cap is not None and not (_int(cap) and cap >= 1):
        raise BadRow(f"responses_create_params.max_output_tokens must be an integer >= 1 or null, got {_short(cap)}")
    try:  # Gym's per-request extras: a JSON object written as a string; the agent reads its seed
        extras = extra_body(params)
    except ValueError as exc:
        raise BadRow(str(exc)[:300]) from None
    if "seed" in extras and not _int(extras["seed"]):
        raise BadRow(f"{EXTRA_BODY}.seed must be an integer, got {_short(extras['seed'])}")
    return ref["name"], coords


def unknown_agent(name: str) -> str | None:
    """Why the pool cannot run `agent_ref.name` (answered 404), or None: it runs the `AGENT_NAMES`."""
    return None if name in AGENT_NAMES else f"unknown agent_ref name {name[:80]!r}; known: {list(AGENT_NAMES)}"


_FIELD_BYTES = {f: 24 if f == "generation_log_probs" else 8 for f in TOKEN_FIELDS}
"""`_small`'s most JSON bytes per element of each token field: a logprob's repr, or an id's 7 digits, and a comma."""


def _small(raw: bytes, result: dict) -> bool:
    """Whether a `/run` answer is small enough to serialize on the event loop, as `off_loop` parses
    a small body there (the thread hop cost ~0.1 ms of CPU a request, more than encoding a few kB,
    and 1-3 ms of wall time on the step's last answer): the row's size plus at most 8 bytes for each
    token id (7 digits and a comma) and 24 for each logprob (a float's repr and a comma) its output
    carries. At 24 bytes for an id too, a default run's 8.4 kB answers read as over 16 kB."""
    output = result["response"]["output"]
    tokens = sum(n * len(item.get(f) or ()) for item in output for f, n in _FIELD_BYTES.items())
    return len(raw) + tokens <= INLINE_BYTES


class AgentServer:
    """Serves `/run` on its own thread from construction: in `AgentProcess`'s child, or in a test's process."""

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
        self.client = HttpModelClient(self.model_urls, self.cfg.policy.model_name, self.session,
                                      self.cfg.agent.uses_reasoning_parser)
        return self.app()

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "in_flight": self.in_flight})

    async def run(self, request: web.Request) -> web.StreamResponse:
        """One `/run` row: parse and check it, run its episode, answer.

        A row `parse_row` refuses is a 400 `{"error", "type"}` (minirl.wire's shape) naming the field,
        so the rollout manager reads it as DATA. Parsing runs in a worker thread for a row over
        `minirl.runtime.http_thread.INLINE_BYTES`, and an answer that may be larger (`_small`) is serialized off
        the loop too, so a large row does not hold up other requests or `/health`.

        As in Gym's error middleware, an exception inside an agent becomes HTTP 500 with `repr(e)` in a
        typed body; a failure known to be the data's (a model server's 4xx) answers 400, so it stays
        DATA. Every failure body also carries Gym 0.7's facts (`failure_kind`, `stage`, `terminal`: a
        4xx is terminal, a 500 is not) and every 200 its verify fields (`mask_sample`, `failure_kind`,
        `failure_reason`), as `verified` and `run_error_body` write them (the row is echoed without result facts
        it may carry, e.g. a row copied from a rollout dump). An unknown `agent_ref.name` is a 404 and a
        body over `agent.max_request_bytes` a 413, never a 500. Fault sites here: `session_lost` (the
        verifier reports its session lost), `timeout` (the answer never comes in time), `transport`
        (the connection drops mid-response), `bad_output` (a malformed 200) and `agent_kill` (the
        server's process dies with every row in flight; Ray restarts it at the same port).
        """
        raw = await request.read()
        try:
            row, name, coords = await off_loop(parse_row, raw, self.cfg)
        except (BadRow, BadCoordinates) as exc:
            return web.json_response(run_error_body(exc, 400, stage="admission"), status=400)
        if (error := unknown_agent(name)) is not None:
            return web.json_response({"error": error, "type": "UnknownAgent", "failure_kind": "minirl:unknown_agent",
                                      "stage": "admission", "terminal": True}, status=404)

        rooms = row["task"].get("num_rooms")
        fires = fault_site(self.plan, coords, rooms)
        self.in_flight += 1
        try:
            if fires("agent_kill"):
                os.kill(os.getpid(), signal.SIGKILL)  # the whole server dies with every row in flight
            if fires("timeout"):
                await asyncio.sleep(self.cfg.faults.hang_s)
            try:
                env = self.cfg.env
                latency = env.tool_latency_s + env.tool_latency_per_room_s * (rooms or 0)
                result = await run_episode(row, self.agents[name], self.client, self.plan, latency)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Gym's error middleware: an agent exception is a 500 (data's: 400)
                return web.json_response(run_error_body(exc), status=run_error_status(exc))
            result = verified(result, LOST_SESSION if fires("session_lost") else None)  # Gym 0.7's verify fields
            body = jsonio.dumps(result) if _small(raw, result) else await asyncio.to_thread(jsonio.dumps, result)
            if fires("bad_output"):
                return web.Response(body=body[: len(body) // 2], status=200, content_type="application/json")
            if fires("transport"):
                headers = {"Content-Type": "application/json", "Content-Length": str(len(body))}
                resp = web.StreamResponse(status=200, headers=headers)
                await resp.prepare(request)
                await resp.write(body[: len(body) // 2])
                request.transport.close()  # the connection drops mid-response
                return resp
            return web.Response(body=body, status=200, content_type="application/json", charset="utf-8")
        finally:
            self.in_flight -= 1
