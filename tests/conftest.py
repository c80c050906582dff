"""Shared fixtures. Everything here is a real part: the committed tiny model loaded with
`from_pretrained`, a real in-process vLLM engine, real aiohttp servers on 127.0.0.1.

`make test` runs two pytest-xdist workers: each builds its own session fixtures (its engine, its
shared cluster), so no test shares a process or a Ray cluster with a test running beside it.

What goes where: tests/unit/ runs in the test's own process and starts nothing (no Ray, no vLLM
engine, no HTTP server, no subprocess or child process): pure functions, config checks, the torch
step and the tokenizer in-process, the `ast` reads of test_layering.py and test_readme.py. A test that
starts any real process or server, or uses a fixture below that does, goes in tests/integration/.
`pytest tests` (`make test`) runs both; `pytest tests/unit` is the fast loop. This file, helpers.py and
data/ stay in tests/ for both folders (pytest's `prepend` import mode puts each test's folder and
tests/ on sys.path): test basenames must be unique across the two folders, and a test module imports
another only from its own folder (test_readme.py's FLOORS from test_layering.py)."""

from __future__ import annotations

import asyncio
import copy
import os
import subprocess
import sys

import pytest

from helpers import SHARED_WORKERS
from minirl.config import REPO_ROOT, MinirlConfig, load_config

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# The suite's two pytest workers each run engines (in-process and in their shared cluster) on the same
# cores, which minirl.cluster.engine_env cannot see: every engine the suite starts throttles libgomp's
# spin, as libgomp itself does when one process's threads outnumber the cores (two spinning engines
# stepped 3x slower). Set before anything loads torch, and inherited by every process the suite starts.
os.environ.setdefault("GOMP_SPINCOUNT", "100")


@pytest.fixture(scope="session")
def base_cfg() -> MinirlConfig:
    return load_config()


@pytest.fixture(scope="session")
def engine(base_cfg):
    """One vLLM engine for the whole session (start-up is ~15 s on this machine), handed out once its
    thread has compiled the sampler (3-15 s more, before its first step): otherwise whichever test
    came first paid that inside its own group deadlines, and with `rollout_timeout_s=6` every group of
    test_failure_policy's lane-B case timed out when it was first on its pytest worker."""
    from minirl.generation.engine import VllmEngine, configure_cpu_env

    configure_cpu_env(1, 2)
    engine = VllmEngine(base_cfg.policy.model_name, max_model_len=base_cfg.policy.generation.vllm_cfg.max_model_len,
                        seed=0)
    assert engine.sampler_compiled.wait(300) and engine.dead is None, f"the session's engine: {engine.dead!r}"
    return engine


@pytest.fixture(scope="session")
def tokenizer(base_cfg):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base_cfg.policy.model_name)


class Stack:
    """A model server and an agent server over the shared engine, with this test's config."""

    def __init__(self, cfg, engine, tokenizer):
        self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer

    async def __aenter__(self):
        from aiohttp import web

        from minirl.agents.server import AgentServer
        from minirl.faults import FaultPlan
        from minirl.generation.server import ModelServer

        self.model = ModelServer(self.engine, self.tokenizer, self.cfg.policy.model_name, FaultPlan(self.cfg.faults))
        # as HttpThread
        self.runner = web.AppRunner(self.model.app(), access_log=None, shutdown_timeout=2.0, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.model_url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self.agent = AgentServer(self.cfg, [self.model_url])
        self.agent_url = self.agent.url
        return self

    async def __aexit__(self, *exc):
        await asyncio.get_running_loop().run_in_executor(None, self.agent.stop)
        await self.runner.cleanup()


@pytest.fixture
def stack(engine, tokenizer, base_cfg):
    """`async with stack(cfg) as s:` -> s.model_url, s.agent_url, s.model (call log)."""

    def make(cfg=None):
        return Stack(cfg or copy.deepcopy(base_cfg), engine, tokenizer)

    return make


SHARED_ENGINE_CHILD = f"""
import sys
from minirl.cluster import start_shared_generation
from minirl.config import load_config
cfg = load_config(None, ["cluster.num_generation_workers={SHARED_WORKERS}", "cluster.cpus_per_generation_worker=0.5"])
print(" ".join(start_shared_generation(cfg, "shared-gen")), flush=True)
sys.stdin.read()  # until the test session closes this pipe (or dies): then Ray's exit hook stops the cluster
"""


@pytest.fixture(scope="session")
def shared_engine():
    """One Ray cluster and its detached generation workers (SHARED_WORKERS) for the whole session's
    CLI runs: they attach with the returned overrides (`cluster.attach_generation_workers`) and so
    skip Ray and vLLM start-up. A run resets the workers it attaches to (its faults, an empty call
    log, a `worker_hang` of an earlier run undone) and publishes its initial weights. A child
    process owns the cluster, so tests that start Ray in this process (test_ddp) do not collide
    with it; it stops that cluster, and nothing else, when the session ends."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    child = subprocess.Popen([sys.executable, "-c", SHARED_ENGINE_CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT, env=env)
    try:
        overrides = child.stdout.readline().split()
        assert overrides, f"the shared engine did not start (exit {child.poll()})"
        yield overrides
    finally:
        child.stdin.close()
        try:
            child.wait(timeout=120)
        except subprocess.TimeoutExpired:
            child.kill()
