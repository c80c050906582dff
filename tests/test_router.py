"""The generation router against real aiohttp backends on 127.0.0.1: least-outstanding shard
selection, a refused worker skipped, and the no-shard status when none is eligible."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest
from aiohttp import web

from minirl.config import ConfigError, GenerationRouterConfig, load_config
from minirl.generation.router import GenerationRouter, write_endpoints
from minirl.wire import ROLLOUT_HEADER


class Backend:
    """A worker stand-in: answers `/tokenize` with its name and the header it got; `/hold` waits
    until released, so the test controls what is outstanding."""

    def __init__(self, name: str):
        self.name, self.release = name, asyncio.Event()

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/hold", self.hold)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def tokenize(self, request):
        return web.json_response({"backend": self.name, "header": request.headers.get(ROLLOUT_HEADER)}, status=200)

    async def hold(self, request):
        await self.release.wait()
        return web.json_response({"backend": self.name})


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens here once closed


def router_cfg(**changes) -> GenerationRouterConfig:
    cfg = GenerationRouterConfig(port_range_low=6000, port_range_high=6099, connect_timeout_s=2.0)
    for k, v in changes.items():
        setattr(cfg, k, v)
    return cfg


def test_least_outstanding_and_refused_worker_skipped(tmp_path):
    async def go():
        a, b = Backend("a"), Backend("b")
        urls = [await a.start(), await b.start()]
        router = await asyncio.get_running_loop().run_in_executor(None, GenerationRouter, router_cfg(), [dead_url(), *urls])
        try:
            assert 6000 <= int(router.url.rsplit(":", 1)[1]) <= 6099
            async with aiohttp.ClientSession() as http:
                async def post(path, **kw):
                    async with http.post(router.url + path, json={}, **kw) as r:
                        return r.status, await r.json()
                # the dead worker is skipped (connection refused), then a gets the first request
                held = asyncio.ensure_future(post("/hold"))
                while router.outstanding[urls[0]] + router.outstanding[urls[1]] == 0:
                    await asyncio.sleep(0.01)
                first = next(u for u in urls if router.outstanding[u] == 1)
                # with one request outstanding there, the next goes to the other worker
                status, body = await post("/tokenize", headers={ROLLOUT_HEADER: "s0.g0.r0.a0.c0"})
                assert status == 200 and body["header"] == "s0.g0.r0.a0.c0"
                other = urls[1 - urls.index(first)]
                assert body["backend"] == ("a" if other == urls[0] else "b")
                a.release.set()
                b.release.set()
                assert (await held)[0] == 200
            assert all(v == 0 for v in router.outstanding.values())
        finally:
            await asyncio.get_running_loop().run_in_executor(None, router.stop)
            await a.runner.cleanup()
            await b.runner.cleanup()

    asyncio.run(go())
    ends = write_endpoints(tmp_path, "http://127.0.0.1:6000", ["http://w"], ["http://a"])
    assert (tmp_path / "endpoints.json").read_text().count("generation_router") == 1 and ends["agents"] == ["http://a"]


def test_no_eligible_worker_gets_the_no_shard_status():
    async def go():
        router = await asyncio.get_running_loop().run_in_executor(
            None, GenerationRouter, router_cfg(no_healthy_backend_status=409), [dead_url(), dead_url()])
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(router.url + "/v1/chat/completions", json={}) as r:
                    return r.status, await r.json()
        finally:
            await asyncio.get_running_loop().run_in_executor(None, router.stop)

    status, body = asyncio.run(go())
    assert status == 409 and "no healthy generation worker" in body["error"]["message"]


def test_no_shard_status_must_not_be_one_gym_retries():
    for bad in (503, 500, 200):
        with pytest.raises(ConfigError, match="async_rl.generation_router.no_healthy_backend_status"):
            load_config(None, [f"async_rl.generation_router.no_healthy_backend_status={bad}"])
    with pytest.raises(ConfigError, match="async_rl.generation_router.port_range_high"):
        load_config(None, ["async_rl.generation_router.port_range_low=6100", "async_rl.generation_router.port_range_high=6000"])
