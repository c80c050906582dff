"""The generation router: one stable URL in front of the generation workers, for servers that need
their model `base_url` before a run starts (Gym's `vllm_model`). It forwards each request unchanged
to the eligible worker with the fewest requests outstanding, and with fleet health on
(`async_rl.generation_fleet_health`) quarantines workers that fail their health probes.

Invariant: a request is forwarded to at most one worker that accepted its connection, and gets
exactly one answer; the outstanding count of each worker returns to zero when its requests end; no
request is forwarded to a quarantined worker, and none stays in flight on one.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import yarl
from aiohttp import web

from minirl.config import ROUTER_MAX_BODY_BYTES, GenerationFleetHealthConfig, GenerationRouterConfig
from minirl.runtime.http_thread import HttpThread
from minirl.wire import NO_HEALTHY_BACKEND, ROLLOUT_HEADER, SEED_HEADER

FORWARDED_HEADERS = ("Content-Type", ROLLOUT_HEADER, SEED_HEADER)


def _error(status: int, message: str, kind: str | None = None) -> web.Response:
    kind = kind or {408: "RequestTimeoutError", 409: "ConflictError", 413: "RequestEntityTooLargeError",
                    502: "BadGatewayError", 503: "ServiceUnavailableError",
                    504: "GatewayTimeoutError"}.get(status, "RouterError")
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status)


def _health_error(body: bytes) -> str:
    """The `error` a worker's unhealthy /health names (server.health), as ': why', else ''."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return ""
    return f": {str(error)[:300]}" if error else ""


class GenerationRouter:
    """Ray actor (or plain object in tests): serves from its constructor, like the other servers,
    at the first free port of `async_rl.generation_router.port_range_low..high`.

    Every request (`/v1/chat/completions`, `/tokenize`, `/v1/models`, `/health`) is forwarded
    unchanged, with minirl's rollout header, and the worker's answer comes back unchanged (status,
    body, content type), so vLLM's 400 for an over-long prompt still reaches Gym, which ends that
    episode with the rollout masked. A worker that refuses the connection or does not connect within
    `connect_timeout_s` is ineligible for `connect_timeout_s` and the request goes to the next one. A
    request that outlives `backend_timeout_s` gets 504, a worker lost mid-answer 502 (both ones Gym
    retries); with no eligible worker the answer is `no_healthy_backend_status` (409 by default), a
    status Gym does not retry, so the caller sees the outage at once, typed `NO_HEALTHY_BACKEND` so
    that minirl's own agents read it as the outage it is (INFRA), not a 4xx of the data. A body over
    `ROUTER_MAX_BODY_BYTES` gets 413, in the same JSON error body as every other answer of the router's own.
    A quarantined worker's requests in flight are answered 503 at once (INFRA: minirl redispatches
    their rollouts), those that were in flight across a `set_health` too.
    A client that stops sending mid-body for `connect_timeout_s` gets 408 and its connection is
    closed, as is a connection that has not sent a whole request head within `connect_timeout_s`.
    The client session to the workers lives exactly as long as the router's app: `stop` closes it,
    and so does a start that fails on a taken port."""

    def __init__(self, cfg: GenerationRouterConfig, backends: list[str], host: str = "127.0.0.1",
                 health: GenerationFleetHealthConfig | None = None):
        self.cfg = cfg
        self.outstanding, self.down_until, self.served = {}, {}, {}
        self._route_to(backends)
        self.health = health or GenerationFleetHealthConfig()
        self.probers: list[asyncio.Task] = []
        last: OSError | None = None
        for port in range(cfg.port_range_low, cfg.port_range_high + 1):
            try:
                self.http = HttpThread(self._setup, host, port, name="generation-router")
                break
            except OSError as exc:
                last = exc
        else:
            raise RuntimeError(
                f"async_rl.generation_router: no free port in {cfg.port_range_low}-{cfg.port_range_high} ({last})"
            )
        self.set_health(self.health)

    @property
    def url(self) -> str:
        return self.http.url

    def start(self) -> str:
        return self.http.url

    def stats(self) -> dict:
        return {"outstanding": dict(self.outstanding), "served": dict(self.served)}

    def stop(self) -> None:
        self.http.stop(self._close)

    async def _close(self) -> None:
        for task in self.probers:
            task.cancel()
        await asyncio.gather(*self.probers, return_exceptions=True)

    async def _setup(self) -> web.Application:
        self.evicted = {}  # on this app's loop: a start that failed on a taken port left its own
        self._admit_all()
        app = web.Application(client_max_size=ROUTER_MAX_BODY_BYTES)
        app.router.add_route("*", "/{path:.*}", self.forward)
        app.cleanup_ctx.append(self._session_ctx)
        return app

    async def _session_ctx(self, app: web.Application):
        """The client session to the workers, open while the app runs: closed by `stop`, and also when
        a start fails (a port taken), so no "Unclosed client session" is left behind."""
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.cfg.backend_timeout_s, sock_connect=self.cfg.connect_timeout_s),
            connector=aiohttp.TCPConnector(limit=0),
        )
        sweeper = asyncio.ensure_future(self._close_silent_connections())
        yield
        sweeper.cancel()
        await asyncio.gather(sweeper, return_exceptions=True)
        await self.session.close()

    async def _close_silent_connections(self) -> None:
        """Close every connection that has not delivered a whole request head within
        `connect_timeout_s` of opening (half-sent headers: aiohttp would hold it for its keep-alive
        timeout, an hour). A client opens a connection to send a request at once, so none is lost;
        a connection that has served a request is left to aiohttp's keep-alive handling."""
        timeout, opened = self.cfg.connect_timeout_s, {}
        while True:
            await asyncio.sleep(timeout / 4)
            runner = getattr(getattr(self, "http", None), "runner", None)
            server = runner.server if runner is not None else None
            if server is None:
                continue
            now, live = time.monotonic(), {}
            for conn in server.connections:
                live[conn] = since = opened.get(conn, now)
                if getattr(conn, "_request_count", 1) == 0 and now - since >= timeout:
                    conn.force_close()
            opened = live

    # -- fleet health ----------------------------------------------------------------------------
    def set_health(self, health: GenerationFleetHealthConfig, backends: list[str] | None = None) -> None:
        """(Re)start fleet health under `health` (a run attaching to a running router brings its own), over
        `backends` when given (the workers that run attached, until the next run's): every worker admitted,
        no probe counted yet; probers only when `health.enabled`. A request in flight on a worker left out
        finishes there, as it would have."""

        async def apply():
            for task in self.probers:
                task.cancel()
            if backends is not None:
                self._route_to(backends)
            self.health = health
            self._admit_all()
            self.probers = [asyncio.ensure_future(self._prober(u)) for u in self.backends] if health.enabled else []

        self.http.run(apply())

    def _route_to(self, backends: list[str]) -> None:
        """Forward to `backends` from now on; the counts of a worker left out stay, for its requests in flight."""
        self.backends = [u.rstrip("/") for u in backends]
        for u in self.backends:
            self.outstanding.setdefault(u, 0)
            self.down_until.setdefault(u, 0.0)
            self.served.setdefault(u, 0)

    def _admit_all(self) -> None:
        """Every worker out of quarantine, no probe counted (on the router's loop). A worker's `evicted`
        future that has not fired is kept: the requests in flight on it wait on that one, and must still
        be failed if it is quarantined later. The transitions not yet polled are dropped: a run attaching
        here (`set_health`) polls from now, the quarantines they told of undone."""
        self.quarantined: dict[str, str] = {}  # worker -> why (its failed probes)
        self.streak = {u: 0 for u in self.backends}  # >0: passes in a row, <0: failures in a row
        self.evicted = {u: f if (f := self.evicted.get(u)) is not None and not f.done()  # resolved on quarantine
                        else asyncio.get_running_loop().create_future() for u in self.backends}
        self.transitions: list[dict] = []

    async def _prober(self, url: str) -> None:
        h = self.health
        while True:
            started = time.monotonic()
            try:
                timeout = aiohttp.ClientTimeout(total=h.probe_timeout_s)
                async with self.session.get(url + "/health", timeout=timeout) as resp:
                    body = await resp.read()
                    failure = (None if resp.status == 200
                               else f"/health answered HTTP {resp.status}{_health_error(body)}")
            except asyncio.TimeoutError:
                failure = f"/health did not answer within probe_timeout_s={h.probe_timeout_s}"
            except (aiohttp.ClientError, ConnectionError) as exc:
                failure = f"/health failed: {exc!r}"
            except Exception as exc:  # anything else (an error body json cannot read): a failed probe, never a
                failure = f"/health probe failed: {exc!r}"  # prober that ends unseen and stops counting
            self.record_probe(url, failure)
            await asyncio.sleep(max(0.0, h.probe_interval_s - (time.monotonic() - started)))

    def record_probe(self, url: str, failure: str | None) -> None:
        """One probe's result (None: passed), on the router's loop: `unhealthy_threshold` failures in
        a row quarantine `url` and fail its requests in flight; `healthy_threshold` passes re-admit it."""
        h, s = self.health, self.streak[url]
        s = self.streak[url] = max(s, 0) + 1 if failure is None else min(s, 0) - 1
        if url not in self.quarantined and -s >= h.unhealthy_threshold:
            self.quarantined[url] = f"{-s} consecutive failed probes (last: {failure})"
            self.evicted[url].set_result(self.quarantined[url])
            self._transition("worker_quarantined", url, self.quarantined[url])
        elif url in self.quarantined and s >= h.healthy_threshold:
            del self.quarantined[url]
            self.evicted[url] = asyncio.get_running_loop().create_future()
            self.down_until[url] = 0.0
            self._transition("worker_readmitted", url, f"{s} consecutive passed probes")

    def _transition(self, kind: str, url: str, reason: str) -> None:
        self.transitions.append({"type": kind, "worker": url, "rank": self.backends.index(url), "reason": reason,
                                 "healthy_workers": len(self.backends) - len(self.quarantined),
                                 "at": round(time.time(), 3)})

    def poll_health(self) -> dict:
        """The transitions since the last poll (`events`), the workers out of quarantine (`healthy`),
        those in it with why (`quarantined`), and `error`: the run-ending message when fewer than
        `min_healthy_shards` are healthy (fleet health enabled only), else None."""

        async def take():
            events, self.transitions = self.transitions, []
            healthy = len(self.backends) - len(self.quarantined)
            error = None
            if self.health.enabled and healthy < self.health.min_healthy_shards:
                sick = "; ".join(f"worker {self.backends.index(u)} at {u}: {why}"
                                 for u, why in self.quarantined.items())
                error = (f"{healthy} of {len(self.backends)} generation workers healthy, below "
                         f"async_rl.generation_fleet_health.min_healthy_shards={self.health.min_healthy_shards}; "
                         f"quarantined by their /health probes: {sick}")
            return {"events": events, "healthy": healthy, "quarantined": dict(self.quarantined), "error": error}

        return self.http.run(take())

    # -- forwarding ------------------------------------------------------------------------------
    def pick(self, exclude: set[str]) -> str | None:
        """The eligible worker with the fewest outstanding requests (the first such in list order)."""
        now = time.monotonic()
        eligible = [u for u in self.backends
                    if u not in exclude and u not in self.quarantined and self.down_until[u] <= now]
        return min(eligible, key=lambda u: self.outstanding[u]) if eligible else None

    async def _exchange(self, backend: str, request: web.Request, body: bytes, headers: dict) -> tuple[int, bytes, str]:
        url = yarl.URL(backend + request.rel_url.raw_path_qs, encoded=True)  # the path as sent: not decoded first
        async with self.session.request(request.method, url, data=body, headers=headers) as resp:
            return resp.status, await resp.read(), resp.content_type

    async def _read_body(self, request: web.Request) -> bytes | None:
        """The request's body, or None when the client sends nothing for `connect_timeout_s` before
        the body is complete (a half-sent request is not held)."""
        if request.content.is_eof():  # all of it has arrived (the usual case): no timer needed
            return await request.read()
        body = bytearray()
        while True:
            try:
                chunk = await asyncio.wait_for(request.content.readany(), self.cfg.connect_timeout_s)
            except asyncio.TimeoutError:
                return None
            if not chunk:
                return bytes(body)
            body += chunk
            if len(body) > ROUTER_MAX_BODY_BYTES:
                raise web.HTTPRequestEntityTooLarge(max_size=ROUTER_MAX_BODY_BYTES, actual_size=len(body))

    async def forward(self, request: web.Request) -> web.Response:
        try:
            body = await self._read_body(request)
        except web.HTTPRequestEntityTooLarge as exc:  # raised, aiohttp would answer it in plain text
            return _error(413, f"the request body is over the router's limit of {ROUTER_MAX_BODY_BYTES} bytes: "
                               f"{exc.text}")
        if body is None:
            stalled = _error(408, "the request body stalled: nothing arrived for "
                                  f"connect_timeout_s={self.cfg.connect_timeout_s} before it was complete")
            stalled.force_close()  # "Connection: close"
            await stalled.prepare(request)
            await stalled.write_eof()
            request.protocol.force_close()  # at once: aiohttp would otherwise linger, reading the rest, for 10 s
            return stalled
        headers = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
        tried: set[str] = set()
        while (backend := self.pick(tried)) is not None:
            tried.add(backend)
            self.outstanding[backend] += 1
            evicted = self.evicted[backend]
            call = asyncio.ensure_future(self._exchange(backend, request, body, headers))
            try:
                await asyncio.wait((call, evicted), return_when=asyncio.FIRST_COMPLETED)
                if not call.done():
                    return _error(503, f"generation worker {backend} was quarantined with this request in flight: "
                                       f"{evicted.result()}")
                status, payload, content_type = call.result()
                self.served[backend] += 1
                return web.Response(body=payload, status=status, content_type=content_type)
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError):
                self.down_until[backend] = time.monotonic() + self.cfg.connect_timeout_s  # not delivered: try another
            except asyncio.TimeoutError:
                return _error(504, f"generation worker {backend} did not answer within "
                                   f"backend_timeout_s={self.cfg.backend_timeout_s}")
            except (aiohttp.ClientError, ConnectionError) as exc:
                return _error(502, f"generation worker {backend} failed mid-request: {exc!r}")
            finally:
                call.cancel()
                self.outstanding[backend] -= 1
        return _error(
            self.cfg.no_healthy_backend_status,
            f"no healthy generation worker: all {len(self.backends)} are unreachable, cooling down or quarantined",
            NO_HEALTHY_BACKEND,
        )


def start_router(cfg, backends: list[str], host: str, name: str | None = None) -> tuple[object, str]:
    """The router as a Ray actor (`num_cpus=0`); with `name`, detached as `<name>-router` so runs that
    attach to the workers `<name>-<rank>` find it. Returns (actor, url)."""
    import ray

    options = {"num_cpus": 0, "max_restarts": -1}
    if name is not None:
        options.update(name=f"{name}-router", namespace="minirl", lifetime="detached")
    actor = ray.remote(GenerationRouter).options(**options).remote(
        cfg.async_rl.generation_router, backends, host, cfg.async_rl.generation_fleet_health)
    return actor, ray.get(actor.start.remote())


def run_router(cfg, model_urls: list[str], host: str) -> tuple[object, str] | tuple[None, None]:
    """The run's router as (actor, url): the attached workers' router when there is one, taken over by
    this run (forwarding to the workers it attached, under its fleet health, as attaching resets each
    worker), else a new one; (None, None) when `async_rl.generation_router.enabled` is false. The caller
    holds the actor: a Ray actor lives while a handle to it does."""
    import ray

    if not cfg.async_rl.generation_router.enabled:
        return None, None
    attach = cfg.cluster.attach_generation_workers
    if attach:
        try:
            actor = ray.get_actor(f"{attach}-router", namespace="minirl")
            ray.get(actor.set_health.remote(cfg.async_rl.generation_fleet_health, model_urls))
            return actor, ray.get(actor.start.remote())
        except ValueError:  # the attached workers have no router: start this run's own
            pass
    return start_router(cfg, model_urls, host)


def write_endpoints(run_dir: Path, router: str | None, workers: list[str], agents: list[str]) -> dict:
    """`run_dir/endpoints.json`: where the run's servers answer, written before step 0."""
    endpoints = {"generation_router": router, "generation_workers": workers, "agents": agents}
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / "endpoints.json").write_text(json.dumps(endpoints, indent=1) + "\n")
    return endpoints
