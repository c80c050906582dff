"""The generation router against real aiohttp backends on 127.0.0.1: least-outstanding shard
selection, a refused worker skipped, the no-shard status when none is eligible, and fleet health
(a worker that stops answering is quarantined with its requests in flight failed, and re-admitted
when it answers again; a restarted one rejoins; too few healthy workers give the run-ending error)."""

from __future__ import annotations

import asyncio
import re
import socket

import aiohttp
import pytest
import yarl
from aiohttp import web

from minirl.config import ConfigError, GenerationFleetHealthConfig, GenerationRouterConfig, load_config
from minirl.generation.router import GenerationRouter, write_endpoints
from minirl.wire import ROLLOUT_HEADER


class Backend:
    """A worker stand-in: answers `/tokenize` with its name and the header it got; `/hold` waits
    until released, so the test controls what is outstanding; `/health` answers while `answering`
    is set and hangs while it is not (a wedged worker), and answers 503 with the generation
    server's body while `unhealthy` names why."""

    def __init__(self, name: str):
        self.name, self.release, self.answering = name, asyncio.Event(), asyncio.Event()
        self.answering.set()
        self.unhealthy: str | None = None

    async def start(self, port: int = 0) -> str:
        app = web.Application()
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/hold", self.hold)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port, reuse_address=True)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def health(self, request):
        await self.answering.wait()
        if self.unhealthy is not None:
            return web.json_response({"status": "unhealthy", "error": self.unhealthy}, status=503)
        return web.json_response({"status": "ok"})

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
        router = await asyncio.get_running_loop().run_in_executor(
            None, GenerationRouter, router_cfg(), [dead_url(), *urls])
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


def test_an_attached_run_takes_the_shared_router_over_for_the_workers_it_attached(shared_engine):
    """start_shared_generation starts `<name>-router` over its workers; run_router hands it to each attached
    run, forwarding to the workers that run attached (and reset) only, under the run's fleet health."""
    from helpers import SHARED_WORKERS, connect

    from minirl.generation.router import run_router

    ray = connect(shared_engine)
    try:
        shared = ray.get_actor("shared-gen-router")
        workers = [ray.get(ray.get_actor(f"shared-gen-{i}").start.remote()) for i in range(SHARED_WORKERS)]
        url = ray.get(shared.start.remote())
        fleet = "async_rl.generation_fleet_health"
        both = load_config(None, [*shared_engine, f"cluster.num_generation_workers={SHARED_WORKERS}",
                                  f"{fleet}.enabled=true", f"{fleet}.probe_interval_s=7"])
        def probing(router):
            return router.backends, router.health.probe_interval_s, len(router.probers)

        assert run_router(both, workers, "127.0.0.1")[1] == url
        assert ray.get(shared.__ray_call__.remote(probing)) == (workers, 7, SHARED_WORKERS)
        # a run attached to the first worker alone: never routed to the other, which it did not reset
        assert run_router(load_config(None, shared_engine), workers[:1], "127.0.0.1")[1] == url
        backends, _, probers = ray.get(shared.__ray_call__.remote(probing))
        assert backends == workers[:1] and probers == 0  # its fleet health: off
    finally:
        ray.shutdown()


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
        load_config(None,
                    ["async_rl.generation_router.port_range_low=6100",
                     "async_rl.generation_router.port_range_high=6000"])


FAST = dict(enabled=True, probe_interval_s=0.25, probe_timeout_s=0.2, unhealthy_threshold=2, healthy_threshold=2)


async def until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def test_fleet_health_quarantines_a_hung_worker_fails_its_requests_at_once_and_readmits_it():
    async def go():
        loop = asyncio.get_running_loop()
        a, b = Backend("a"), Backend("b")
        urls = [await a.start(), await b.start()]
        health = GenerationFleetHealthConfig(**FAST, min_healthy_shards=1)
        router = await loop.run_in_executor(None, lambda: GenerationRouter(router_cfg(), urls, health=health))
        poll = lambda: loop.run_in_executor(None, router.poll_health)  # noqa: E731
        try:
            async with aiohttp.ClientSession() as http:
                async def post(path):
                    async with http.post(router.url + path, json={}) as r:
                        return r.status, await r.json()
                await asyncio.sleep(0.3)  # a few probes pass: nothing happens
                assert (await poll())["events"] == [] and router.quarantined == {}
                held = asyncio.ensure_future(post("/hold"))  # goes to a (tie: first in list order), never released
                await until(lambda: router.outstanding[urls[0]] == 1, what="the held request on a")
                a.answering.clear()  # a wedges: its probes time out
                status, body = await asyncio.wait_for(held, 5)
                assert status == 503 and "quarantined" in body["error"]["message"], body
                assert "probe_timeout_s=0.2" in body["error"]["message"]
                report = await poll()
                assert [(e["type"], e["rank"], e["worker"])
                        for e in report["events"]] == [("worker_quarantined", 0, urls[0])]
                assert report["healthy"] == 1 and report["error"] is None
                for _ in range(3):  # quarantined: everything goes to b, though a has nothing outstanding
                    assert (await post("/tokenize"))[1]["backend"] == "b"
                a.answering.set()  # a answers again: two passed probes re-admit it
                await until(lambda: not router.quarantined, what="re-admission")
                report = await poll()
                assert [e["type"] for e in report["events"]] == ["worker_readmitted"] and report["healthy"] == 2
                assert (await post("/tokenize"))[1]["backend"] == "a"  # a tie again: a, first in list order
            assert all(v == 0 for v in router.outstanding.values())
        finally:
            a.release.set()
            await loop.run_in_executor(None, router.stop)
            await a.runner.cleanup()
            await b.runner.cleanup()

    asyncio.run(go())


def test_a_restarted_worker_rejoins_and_too_few_healthy_workers_name_the_quarantined():
    async def go():
        loop = asyncio.get_running_loop()
        a, b = Backend("a"), Backend("b")
        urls = [await a.start(), await b.start()]
        health = GenerationFleetHealthConfig(**FAST, min_healthy_shards=2)
        router = await loop.run_in_executor(None, lambda: GenerationRouter(router_cfg(), urls, health=health))
        try:
            await a.runner.cleanup()  # a dies: its probes are refused
            await until(lambda: urls[0] in router.quarantined, what="a's quarantine")
            report = await loop.run_in_executor(None, router.poll_health)
            assert report["healthy"] == 1
            assert report["error"].startswith("1 of 2 generation workers healthy, below "
                                              "async_rl.generation_fleet_health"
                                              ".min_healthy_shards=2; quarantined by their /health probes: worker 0 at "
                                              f"{urls[0]}: 2 consecutive failed probes (last: /health failed: "), \
        report["error"]
            restarted = Backend("a2")
            await restarted.start(port=int(urls[0].rsplit(":", 1)[1]))  # back at the same URL, as Ray restarts it
            await until(lambda: not router.quarantined, what="the restarted worker's re-admission")
            report = await loop.run_in_executor(None, router.poll_health)
            assert report["error"] is None and [e["type"] for e in report["events"]] == ["worker_readmitted"]
            await restarted.runner.cleanup()
        finally:
            await loop.run_in_executor(None, router.stop)
            await b.runner.cleanup()

    asyncio.run(go())


def test_a_quarantine_names_the_error_an_unhealthy_worker_answered():
    async def go():
        loop = asyncio.get_running_loop()
        a, b = Backend("a"), Backend("b")
        urls = [await a.start(), await b.start()]
        router = await loop.run_in_executor(
            None, lambda: GenerationRouter(router_cfg(), urls, health=GenerationFleetHealthConfig(**FAST)))
        try:
            a.unhealthy = "an engine step has been running for 7 s (wedged?)"  # what server.health answers
            await until(lambda: urls[0] in router.quarantined, what="a's quarantine")
            assert router.quarantined[urls[0]].endswith(
                "consecutive failed probes (last: /health answered HTTP 503: an engine step has been running for 7 s "
                "(wedged?))")
            (event,) = (await loop.run_in_executor(None, router.poll_health))["events"]
            assert event["type"] == "worker_quarantined" and "running for 7 s" in event["reason"]
        finally:
            await loop.run_in_executor(None, router.stop)
            await a.runner.cleanup()
            await b.runner.cleanup()

    asyncio.run(go())


def test_a_probe_that_fails_in_an_unforeseen_way_counts_and_its_prober_goes_on():
    """A 503 whose body json cannot read (nested past the recursion limit: RecursionError) ended that worker's
    prober unseen, so a worker failing every probe was never quarantined. Any exception in a probe is now a
    failed probe."""

    class Nested(Backend):
        async def health(self, request):
            return web.Response(body=b"[" * 200_000, status=503, content_type="application/json")

    async def go():
        loop = asyncio.get_running_loop()
        a, b = Nested("a"), Backend("b")
        urls = [await a.start(), await b.start()]
        router = await loop.run_in_executor(
            None, lambda: GenerationRouter(router_cfg(), urls, health=GenerationFleetHealthConfig(**FAST)))
        try:
            await until(lambda: urls[0] in router.quarantined, what="a's quarantine")
            assert "RecursionError" in router.quarantined[urls[0]]
            assert not any(t.done() for t in router.probers), "a prober ended"
        finally:
            await loop.run_in_executor(None, router.stop)
            await a.runner.cleanup()
            await b.runner.cleanup()

    asyncio.run(go())


def test_a_request_path_is_forwarded_as_sent():
    """The router forwarded the decoded path: `%23` cut the path as a fragment, `%3F` made it a query, `%2F` a
    slash, `%2525` was decoded twice. The worker now gets the path the client sent, byte for byte."""
    seen: list[str] = []

    async def echo(request):
        seen.append(request.raw_path)
        return web.json_response({})

    async def go():
        loop = asyncio.get_running_loop()
        app = web.Application()
        app.router.add_route("*", "/{p:.*}", echo)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        router = await loop.run_in_executor(None, lambda: GenerationRouter(router_cfg(), [url]))
        paths = ["/v1/models?q=a%26b%3Dc", "/v1/models%23frag/x", "/x%3Fy=1", "/a%2Fb", "/%2525"]
        try:
            async with aiohttp.ClientSession() as http:
                for path in paths:
                    async with http.post(yarl.URL(router.url + path, encoded=True), data=b"{}") as resp:
                        assert resp.status == 200, path
        finally:
            await loop.run_in_executor(None, router.stop)
            await runner.cleanup()
        return paths

    assert asyncio.run(go()) == seen


def test_fleet_health_config_is_validated():
    key = "async_rl.generation_fleet_health"
    for overrides, problem in (
        ([f"{key}.probe_timeout_s=5"], "must be less than probe_interval_s (5.0)"),
        ([f"{key}.min_healthy_shards=2"], "must be at most cluster.num_generation_workers (1)"),
        ([f"{key}.min_healthy_shards=0"], "must be >= 1"),
        ([f"{key}.unhealthy_threshold=0"], "must be >= 1"),
        ([f"{key}.healthy_threshold=0"], "must be >= 1"),
        ([f"{key}.probe_interval_s=0"], "must be > 0"),
        ([f"{key}.enabled=true", "async_rl.generation_router.enabled=false"],
         "needs async_rl.generation_router.enabled=true"),
    ):
        with pytest.raises(ConfigError, match=re.escape(overrides[0].split("=")[0]) + ": " + re.escape(problem)):
            load_config(None, overrides)
    cfg = load_config(None, [f"{key}.enabled=true", "cluster.num_generation_workers=2", f"{key}.min_healthy_shards=2"])
    assert (cfg.async_rl.generation_fleet_health.probe_interval_s == 5.0
            and cfg.async_rl.generation_fleet_health.probe_timeout_s == 2.0)
    assert load_config().async_rl.generation_fleet_health.enabled is False


# ------------------------------------------------------------------------------- issue 29: half-sent bodies, the
# session
def test_a_client_that_stalls_mid_body_gets_408_and_is_closed_while_others_are_served():
    """A raw socket on loopback sends headers and half its body, then nothing: within
    connect_timeout_s the router answers 408 and closes the connection; a whole request meanwhile
    is forwarded as usual."""
    import json as _json
    import time

    async def go():
        loop = asyncio.get_running_loop()
        a = Backend("a")
        urls = [await a.start()]
        router = await loop.run_in_executor(None, GenerationRouter, router_cfg(connect_timeout_s=0.5), urls)
        try:
            port = int(router.url.rsplit(":", 1)[1])

            def stall() -> tuple[float, bytes, bytes]:
                with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                    body = _json.dumps({"messages": [{"role": "user", "content": "x" * 100}]}).encode()
                    head = (f"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            f"Content-Length: {len(body)}\r\n\r\n").encode()
                    t0 = time.monotonic()
                    sock.sendall(head + body[: len(body) // 2])
                    answer = b""
                    while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                        chunk = sock.recv(65536)
                        if not chunk:
                            break
                        answer += chunk
                    took = time.monotonic() - t0
                    rest = sock.recv(65536)  # closed by the router: b""
                    return took, answer, rest

            stalled = loop.run_in_executor(None, stall)
            async with aiohttp.ClientSession() as http:
                # 3.5 MB: many chunks
                async with http.post(router.url + "/tokenize", json={"prompt": "door 7 " * 500_000}) as r:
                    whole = r.status, await r.json()
            took, answer, rest = await stalled
            return took, answer, rest, whole
        finally:
            await loop.run_in_executor(None, router.stop)
            await a.runner.cleanup()

    took, answer, rest, (status, body) = asyncio.run(go())
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"connect_timeout_s=0.5" in answer and b'"type": "RequestTimeoutError"' in answer
    assert 0.4 < took < 3.0, took
    assert rest == b"", "the stalled connection stays open"
    assert status == 200 and body["backend"] == "a"


def test_a_router_whose_first_port_is_taken_leaves_no_unclosed_session():
    """A start that fails on a taken port closes its client session (the last stderr line of a
    successful run was aiohttp's "Unclosed client session" warning from the router)."""
    import subprocess
    import sys

    child = """
import socket, sys
from minirl.config import GenerationRouterConfig
from minirl.generation.router import GenerationRouter
taken = socket.socket(); taken.bind(("127.0.0.1", 0)); taken.listen()
low = taken.getsockname()[1]
cfg = GenerationRouterConfig(port_range_low=low, port_range_high=low + 20, connect_timeout_s=2.0)
router = GenerationRouter(cfg, ["http://127.0.0.1:9"])
assert int(router.url.rsplit(":", 1)[1]) > low, router.url
router.stop()
taken.close()
import gc; gc.collect()
print("stopped", flush=True)
"""
    from minirl.config import REPO_ROOT

    done = subprocess.run([sys.executable, "-W", "default", "-c", child], capture_output=True, text=True, timeout=120,
                          cwd=REPO_ROOT)
    assert done.returncode == 0 and "stopped" in done.stdout, done.stderr[-2000:]
    assert "Unclosed" not in done.stderr, done.stderr[-2000:]


def test_a_client_that_stalls_mid_headers_is_closed():
    """Half a request head, then nothing: the connection is closed within about 1.25 connect_timeout_s
    (aiohttp alone would hold it for its keep-alive timeout, an hour); a whole request is still served."""
    import time

    async def go():
        loop = asyncio.get_running_loop()
        a = Backend("a")
        router = await loop.run_in_executor(None, GenerationRouter, router_cfg(connect_timeout_s=0.5),
                                            [await a.start()])
        try:
            port = int(router.url.rsplit(":", 1)[1])

            def stall() -> tuple[float, bytes]:
                with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                    t0 = time.monotonic()
                    sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Ty")
                    got = sock.recv(65536)  # b"": closed by the router
                    return time.monotonic() - t0, got

            stalled = loop.run_in_executor(None, stall)
            async with aiohttp.ClientSession() as http:
                async with http.post(router.url + "/tokenize", json={}) as r:
                    whole = r.status
            return (*await stalled, whole)
        finally:
            await loop.run_in_executor(None, router.stop)
            await a.runner.cleanup()

    took, got, whole = asyncio.run(go())
    assert got == b"" and 0.4 < took < 3.0, (took, got)
    assert whole == 200


# ------------------------------------------------------------------------------- review A: the outage's class,
# set_health, the 413's body, a failed start's loop
def test_an_outage_through_the_router_is_infra_as_one_straight_to_a_worker():
    """No worker accepts the connection: sent straight to one, minirl's model client raises
    GenerationUnavailable (INFRA, the agent's /run answers 500); through the router (fleet health on:
    minirl's agents go through it) the router's 409 must be the same outage, for the chat call and for
    the context guard's count alike, not ModelCallFailed(409), which is DATA and a terminal /run 400."""
    from minirl.agents.model_client import HttpModelClient
    from minirl.wire import INFRA, GenerationUnavailable, classify, run_error_status

    async def failures(urls):
        async with aiohttp.ClientSession() as http:
            client = HttpModelClient(urls, "m", http)
            out = []
            for call in (lambda: client.chat([{"role": "user", "content": "hi"}], None, {}, "s0.g0.r0.a0.c0", None),
                         lambda: client.count_tokens([{"role": "user", "content": "hi"}], None, "s0.g0.r0.a0.c0",
                                                     None)):
                with pytest.raises(Exception) as failed:
                    await call()
                out.append(failed.value)
            return out

    async def go():
        loop = asyncio.get_running_loop()
        worker = dead_url()
        direct = await failures([worker])
        router = await loop.run_in_executor(None, GenerationRouter, router_cfg(), [worker])
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(router.url + "/v1/chat/completions", json={}) as r:
                    answer = r.status, await r.json()
            return direct, await failures([router.url]), router.url, answer
        finally:
            await loop.run_in_executor(None, router.stop)

    direct, routed, url, (status, body) = asyncio.run(go())
    for exc in direct + routed:
        assert isinstance(exc, GenerationUnavailable), repr(exc)
        assert classify(exc) == INFRA and run_error_status(exc) == 500, repr(exc)
    assert status == 409 and body["error"]["type"] == "NoHealthyBackendError"  # still a status Gym does not retry
    for exc in routed:
        assert str(exc).startswith(f"generation router {url} has no eligible worker (HTTP 409): "
                                   "no healthy generation worker: all 1 are unreachable"), str(exc)


def test_a_request_in_flight_across_set_health_is_failed_when_its_worker_is_quarantined():
    """A run attaching to a running router re-applies fleet health (`set_health`) while a request is in
    flight on a worker: when that worker is quarantined later, the request is answered 503 at once, as
    any in flight on a quarantined worker is (before, it waited on a future `set_health` had replaced)."""
    async def go():
        loop = asyncio.get_running_loop()
        a, b = Backend("a"), Backend("b")
        urls = [await a.start(), await b.start()]
        health = GenerationFleetHealthConfig(**FAST, min_healthy_shards=1)
        router = await loop.run_in_executor(None, lambda: GenerationRouter(router_cfg(), urls, health=health))
        try:
            async with aiohttp.ClientSession() as http:
                async def post(path):
                    async with http.post(router.url + path, json={}) as r:
                        return r.status, await r.json()
                held = asyncio.ensure_future(post("/hold"))  # goes to a (tie: first in list order), never released
                await until(lambda: router.outstanding[urls[0]] == 1, what="the held request on a")
                await loop.run_in_executor(None, router.set_health, health)  # a run attaches
                a.answering.clear()  # a wedges
                await until(lambda: urls[0] in router.quarantined, what="a's quarantine")
                done, _ = await asyncio.wait([held], timeout=3)
                return (held.result() if done else None), dict(router.outstanding)
        finally:
            a.answering.set()
            a.release.set()
            await loop.run_in_executor(None, router.stop)
            await a.runner.cleanup()
            await b.runner.cleanup()

    answer, outstanding = asyncio.run(go())
    assert answer is not None, f"still in flight 3 s after its worker's quarantine: outstanding {outstanding}"
    status, body = answer
    assert status == 503 and "was quarantined with this request in flight" in body["error"]["message"], answer
    assert outstanding == dict.fromkeys(outstanding, 0)


def test_a_body_over_the_limit_gets_the_routers_json_413():
    """A request body over ROUTER_MAX_BODY_BYTES is answered 413 in the router's JSON error body, as every
    other error of the router's own is (aiohttp's own answer is plain text); the router serves on."""
    import io
    import json

    from minirl.config import ROUTER_MAX_BODY_BYTES

    async def go():
        loop = asyncio.get_running_loop()
        a = Backend("a")
        router = await loop.run_in_executor(None, GenerationRouter, router_cfg(), [await a.start()])
        try:
            async with aiohttp.ClientSession() as http:
                big = io.BytesIO(b"x" * (ROUTER_MAX_BODY_BYTES + 1024))  # raw bytes this large: aiohttp warns
                async with http.post(router.url + "/v1/chat/completions", data=big,
                                     headers={"Content-Type": "application/json"}) as r:
                    big = r.status, r.content_type, await r.read()
                async with http.post(router.url + "/tokenize", json={}) as r:
                    return big, (r.status, await r.json())
        finally:
            await loop.run_in_executor(None, router.stop)
            await a.runner.cleanup()

    (status, content_type, raw), (after, body) = asyncio.run(go())
    assert status == 413 and content_type == "application/json", (status, content_type, raw[:200])
    error = json.loads(raw)["error"]
    assert error["type"] == "RequestEntityTooLargeError" and error["code"] == 413, error
    assert error["message"].startswith("the request body is over the router's limit of 67108864 bytes"), error
    assert after == 200 and body["backend"] == "a"


def test_a_router_whose_first_ports_are_taken_leaks_no_file_descriptors():
    """Each port the router finds taken is a failed HttpThread start: its event loop (5 fds) is closed
    with it, so a start after many taken ports, then `stop`, leaves the process's fds as they were."""
    import subprocess
    import sys

    child = """
import gc, os, socket
from minirl.config import GenerationRouterConfig
from minirl.generation.router import GenerationRouter
fds = lambda: len(os.listdir("/proc/self/fd"))
first = socket.socket(); first.bind(("127.0.0.1", 0)); first.listen()
low, taken = first.getsockname()[1], [first]
for port in range(low + 1, low + 10):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port)); s.listen(); taken.append(s)
    except OSError:
        s.close(); break
cfg = lambda lo, hi: GenerationRouterConfig(port_range_low=lo, port_range_high=hi, connect_timeout_s=2.0)
GenerationRouter(cfg(low + 20, low + 40), ["http://127.0.0.1:9"]).stop()  # lazily opened fds do not count
gc.collect(); before = fds()
router = GenerationRouter(cfg(low, low + len(taken) + 5), ["http://127.0.0.1:9"])
assert int(router.url.rsplit(":", 1)[1]) >= low + len(taken), router.url
router.stop(); gc.collect()
print(len(taken), before, fds(), flush=True)
"""
    from minirl.config import REPO_ROOT

    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    taken, before, after = map(int, done.stdout.split())
    assert taken >= 2 and after == before, f"{after - before} fds leaked by {taken} taken ports"
