"""Helpers the tests import (`from helpers import ...`): plain functions and constants, no fixtures.
pytest's default `prepend` import mode puts tests/ on sys.path (it has no __init__.py), so every test
module and conftest.py imports this file as `helpers`. Fixtures stay in conftest.py."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

from minirl.config import REPO_ROOT

SHARED_WORKERS = 2
"""Generation workers in the shared cluster: runs attach to the first (`cluster.num_generation_workers`
defaults to 1); the fleet-health test attaches to both. Half a CPU each, so that a run's policy
worker still fits in the 2 CPUs Ray advertises."""


async def serve_run(handler, **app_kwargs):
    """A stand-in agent's `POST /run` handler served on 127.0.0.1 (a real aiohttp server on the running
    loop) -> (runner, url); the caller ends it with `await runner.cleanup()`."""
    from aiohttp import web

    app = web.Application(**app_kwargs)
    app.router.add_post("/run", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


def serve_run_in_thread(handler) -> tuple[str, asyncio.AbstractEventLoop]:
    """`serve_run` on an event loop of its own in a daemon thread, for a stand-in agent that a `minirl.train`
    subprocess calls while the test waits -> (url, loop); stop it with `loop.call_soon_threadsafe(loop.stop)`."""
    loop, started, holder = asyncio.new_event_loop(), threading.Event(), {}

    def serve():
        asyncio.set_event_loop(loop)
        _, holder["url"] = loop.run_until_complete(serve_run(handler))
        started.set()
        loop.run_forever()

    threading.Thread(target=serve, daemon=True).start()
    started.wait(10)
    return holder["url"], loop


def connect(shared_engine: list[str]):
    """Connect this process to the shared engine's cluster (`ray.shutdown()` then only disconnects)."""
    import ray

    address = next(o.split("=", 1)[1] for o in shared_engine if o.startswith("cluster.ray_address="))
    ray.init(address=address, namespace="minirl", logging_level="error", log_to_driver=False)
    return ray


def run_cli(*args, timeout=600, env=None) -> subprocess.CompletedProcess:
    """`python -m minirl.train ARGS` in a subprocess, as a user would run it."""
    full_env = {**os.environ, "RAY_AUTH_MODE": "disabled", **(env or {})}
    return subprocess.run([sys.executable, "-m", "minirl.train", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO_ROOT, env=full_env)


def child_result(code: str, tmp_path, timeout: int, env=None) -> dict:
    """Run CODE in a fresh `python -c` (repo root as cwd) and return the JSON it dumps to the path it gets as
    sys.argv[1]. A file, not stdout: the engine's own processes share the child's stdout and can cut into a
    long line (a 128 KiB result line broke mid-way in CI)."""
    result = tmp_path / "child-result.json"
    proc = subprocess.run([sys.executable, "-c", code, str(result)], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO_ROOT, env={**os.environ, "RAY_AUTH_MODE": "disabled", **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(result.read_text())


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def build_module():
    """scripts/build_tiny_model.py as a module (scripts/ is no package), for the tests of its teachers."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_tiny_model", REPO_ROOT / "scripts" / "build_tiny_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def play_episodes(cfg, model, groups: int) -> list[dict]:
    """Prompt groups 0..groups-1 of step 0 through the real agent loop (`run_episode`) against a
    scripted `model`, one rollout each, with one seed: the results `/run` would return."""
    from minirl.agents.agent import run_episode
    from minirl.data import prompt_row
    from minirl.wire import with_extra_body

    async def run():
        out = []
        for group in range(groups):
            row = {**prompt_row(cfg, 0, group), "_rowidx": 0,
                   "_minirl": {"step": 0, "group": group, "rollout": 0, "attempt": 0}}
            row["responses_create_params"] = with_extra_body(row["responses_create_params"], seed=7)
            out.append(await run_episode(row, cfg.agent, model))
        return out
    return asyncio.run(run())


def first_step_size(engine, spacings_s) -> int:
    """Requests in the engine at its first step, when requests reach the idle engine with `spacings_s`
    between them (one request more than spacings: `[]` is a lone request)."""
    import time

    from vllm import SamplingParams

    assert engine.sampler_compiled.wait(300)  # the engine's first request waits for it: a burst would gather itself
    t0 = time.monotonic()
    futures = []
    for i, pause in enumerate([*spacings_s, 0.0]):
        futures.append(engine.generate([1, 388, 201, 300 + i], SamplingParams(max_tokens=8, ignore_eos=True, seed=i)))
        time.sleep(pause)
    for f in futures:
        f.result(timeout=60)
    return next(size for start, _, size in list(engine.step_log) if start >= t0)


def wait_held_in_step(engine, timeout: float = 60.0) -> None:
    """Wait until `engine`, hung with `engine.hang()`, is held inside a step: what it accepted before has
    begun its first step, and what is sent now is taken after that step."""
    deadline = time.monotonic() + timeout
    while engine._step_t0 is None and time.monotonic() < deadline:
        time.sleep(0.005)
