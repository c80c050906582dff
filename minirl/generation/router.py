"""The generation router: one stable URL in front of the generation workers, for servers that need
their model `base_url` before a run starts (Gym's `vllm_model`). A Ray actor (`num_cpus=0`) bound to
the first free port of `async_rl.generation_router.port_range_low..high`.

Every request (`/v1/chat/completions`, `/tokenize`, `/v1/models`, `/health`) is forwarded unchanged,
with minirl's rollout header, to the eligible worker with the fewest requests outstanding; the
worker's answer comes back unchanged (status, body, content type), so vLLM's 400 for an over-long
prompt still reaches Gym as Gym's lane A. A worker that refuses the connection or does not connect
within `connect_timeout_s` is ineligible for `connect_timeout_s` and the request goes to the next
one. A request that outlives `backend_timeout_s` gets 504, a worker lost mid-answer 502 (both ones
Gym retries). With no eligible worker the answer is `no_healthy_backend_status` (409 by default),
a status Gym does not retry, so the caller sees the outage at once.

Invariant: a request is forwarded to at most one worker that accepted its connection, and gets
exactly one answer; the outstanding count of each worker returns to zero when its requests end.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from minirl.config import GenerationRouterConfig
from minirl.http_thread import HttpThread
from minirl.wire import ROLLOUT_HEADER

FORWARDED_HEADERS = ("Content-Type", ROLLOUT_HEADER)


def _error(status: int, message: str) -> web.Response:
    kind = {409: "ConflictError", 502: "BadGatewayError", 504: "GatewayTimeoutError"}.get(status, "RouterError")
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": status}}, status=status)


class GenerationRouter:
    """Ray actor (or plain object in tests): serves from its constructor, like the other servers."""

    def __init__(self, cfg: GenerationRouterConfig, backends: list[str], host: str = "127.0.0.1"):
        self.cfg = cfg
        self.backends = [u.rstrip("/") for u in backends]
        self.outstanding = {u: 0 for u in self.backends}
        self.down_until = {u: 0.0 for u in self.backends}
        self.served = {u: 0 for u in self.backends}
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

    @property
    def url(self) -> str:
        return self.http.url

    def start(self) -> str:
        return self.http.url

    def stats(self) -> dict:
        return {"outstanding": dict(self.outstanding), "served": dict(self.served)}

    def stop(self) -> None:
        self.http.stop(self.session.close)

    async def _setup(self) -> web.Application:
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.cfg.backend_timeout_s, sock_connect=self.cfg.connect_timeout_s),
            connector=aiohttp.TCPConnector(limit=0),
        )
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{path:.*}", self.forward)
        return app

    def pick(self, exclude: set[str]) -> str | None:
        """The eligible worker with the fewest outstanding requests (the first such in list order)."""
        now = time.monotonic()
        eligible = [u for u in self.backends if u not in exclude and self.down_until[u] <= now]
        return min(eligible, key=lambda u: self.outstanding[u]) if eligible else None

    async def forward(self, request: web.Request) -> web.Response:
        body = await request.read()
        headers = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
        tried: set[str] = set()
        while (backend := self.pick(tried)) is not None:
            tried.add(backend)
            self.outstanding[backend] += 1
            try:
                async with self.session.request(request.method, backend + request.rel_url.path_qs, data=body, headers=headers) as resp:
                    payload = await resp.read()
                    self.served[backend] += 1
                    return web.Response(body=payload, status=resp.status, content_type=resp.content_type)
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError):
                self.down_until[backend] = time.monotonic() + self.cfg.connect_timeout_s  # not delivered: try another
            except asyncio.TimeoutError:
                return _error(504, f"generation worker {backend} did not answer within backend_timeout_s={self.cfg.backend_timeout_s}")
            except (aiohttp.ClientError, ConnectionError) as exc:
                return _error(502, f"generation worker {backend} failed mid-request: {exc!r}")
            finally:
                self.outstanding[backend] -= 1
        return _error(
            self.cfg.no_healthy_backend_status,
            f"no healthy generation worker: all {len(self.backends)} are unreachable or cooling down",
        )


def start_router(cfg, backends: list[str], host: str, name: str | None = None) -> tuple[object, str]:
    """The router as a Ray actor (`num_cpus=0`); with `name`, detached as `<name>-router` so runs that
    attach to the workers `<name>-<rank>` find it. Returns (actor, url)."""
    import ray

    options = {"num_cpus": 0, "max_restarts": -1}
    if name is not None:
        options.update(name=f"{name}-router", namespace="minirl", lifetime="detached")
    actor = ray.remote(GenerationRouter).options(**options).remote(cfg.async_rl.generation_router, backends, host)
    return actor, ray.get(actor.start.remote())


def router_url(cfg, model_urls: list[str], host: str) -> str | None:
    """The run's router URL: the attached workers' router when there is one, else a new router
    (None when `async_rl.generation_router.enabled` is false). Keeps the actor alive via the module."""
    import ray

    if not cfg.async_rl.generation_router.enabled:
        return None
    attach = cfg.cluster.attach_generation_workers
    if attach:
        try:
            return ray.get(ray.get_actor(f"{attach}-router", namespace="minirl").start.remote())
        except ValueError:  # the attached workers have no router: start this run's own
            pass
    actor, url = start_router(cfg, model_urls, host)
    _ROUTERS.append(actor)
    return url


_ROUTERS: list = []  # this driver's routers: a Ray actor lives while a handle to it does


def write_endpoints(run_dir: Path, router: str | None, workers: list[str], agents: list[str]) -> dict:
    """`run_dir/endpoints.json`: where the run's servers answer, written before step 0."""
    endpoints = {"generation_router": router, "generation_workers": workers, "agents": agents}
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / "endpoints.json").write_text(json.dumps(endpoints, indent=1) + "\n")
    return endpoints
