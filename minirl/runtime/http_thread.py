"""Serve an aiohttp app from a dedicated thread and event loop (uvloop's where it is installed).

Invariant: `url` is answered once the constructor returns; `stop` closes the listener and
everything `setup` opened, on the server's own loop; a start that fails (a port taken) runs the
app's cleanup and closes its loop before the constructor raises.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Awaitable, Callable

from aiohttp import web


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where it is installed (vLLM depends on it), as vLLM's API server and Ray's async
    actors (the controller) run; else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def resolve_host(host: str) -> str:
    """`auto` (cluster.host=auto on a cluster of several nodes): the address of the Ray node this
    process runs on, which the other nodes reach it at; any other host as it is. Resolved where
    the server starts: the driver cannot know on which node Ray puts an actor."""
    if host != "auto":
        return host
    import ray

    return ray.util.get_node_ip_address()


class HttpThread:
    """An aiohttp app served from its own thread and loop, started in the constructor.

    Servers start in their actor's constructor, so a restarted actor (Ray re-runs `__init__`, never
    a later method) serves again at the same address without anyone asking. A handler whose client
    disconnects is cancelled (aiohttp's `handler_cancellation`), so no work goes on for a caller
    that left: a model server aborts the engine request, an agent server ends the episode."""

    def __init__(self, setup: Callable[[], Awaitable[web.Application]], host: str, port: int, name: str):
        self.host, self.port = resolve_host(host), port
        self.loop = new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._setup = setup
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            app = self.loop.run_until_complete(self._setup())
            self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0, handler_cancellation=True)
            self.loop.run_until_complete(self.runner.setup())
            site = web.TCPSite(self.runner, self.host, self.port, reuse_address=True)
            self.loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]
        except BaseException as exc:  # report start-up failures to the constructor
            self._error = exc
            if hasattr(self, "runner"):  # close what the app opened (its cleanup_ctx), as `stop` would
                try:
                    self.loop.run_until_complete(self.runner.cleanup())
                except Exception:
                    pass
            self.loop.close()  # its selector and self-pipe fds: a router's port scan fails once per taken port
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()

    def run(self, coro, timeout: float | None = None):
        """Run a coroutine on the server's loop from another thread; return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, *closers: Callable[[], Awaitable]) -> None:
        async def shutdown():
            for close in closers:
                await close()
            await self.runner.cleanup()
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:  # handlers still running (a hung /run): end them here, quietly
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        self.run(shutdown(), timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


INLINE_BYTES = 16 * 1024
"""Bodies up to this size are parsed on the event loop: a thread hop costs more than their parsing
(~0.3 ms for a chat request, measured in the front end), and under a burst the hops queue behind
the GIL. Larger bodies go to a worker thread, so the loop keeps answering `/health` meanwhile."""


async def off_loop(fn: Callable, raw: bytes, *args):
    """`fn(raw, *args)`: inline for a small body, in a worker thread for a large one."""
    if len(raw) <= INLINE_BYTES:
        return fn(raw, *args)
    return await asyncio.to_thread(fn, raw, *args)
