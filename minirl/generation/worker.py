"""The generation worker: a Ray actor hosting one engine and its OpenAI-style HTTP endpoint.

Invariant: the endpoint serves only after the engine holds the newest weights the trainer has
published (caught up from the weights store in the constructor, then `update_weights` after every
optimizer step), at a port fixed at creation, so a restarted worker comes back at the same URL
with current weights before it answers anyone.
"""

from __future__ import annotations

import os

from minirl.config import MinirlConfig
from minirl.faults import FaultPlan
from minirl.http_thread import HttpThread


def make_engine(cfg: MinirlConfig, rank: int):
    gen = cfg.policy.generation
    from minirl.generation.engine import VllmEngine, configure_cpu_env

    configure_cpu_env(gen.vllm_cfg.kv_cache_space_gb, gen.vllm_cfg.omp_threads)
    return VllmEngine(
        cfg.policy.model_name,
        max_model_len=gen.vllm_cfg.max_model_len,
        seed=cfg.grpo.seed + rank,
        dtype=cfg.policy.precision,
        tensor_parallel_size=gen.vllm_cfg.tensor_parallel_size,
        gpu_memory_utilization=gen.vllm_cfg.gpu_memory_utilization,
        enforce_eager=gen.vllm_cfg.enforce_eager,
    )


class GenerationWorker:
    def __init__(self, cfg: MinirlConfig, rank: int, host: str, port: int, weights_store=None):
        from transformers import AutoTokenizer

        from minirl.generation.server import ModelServer

        self.rank = rank
        self.drain = not cfg.async_rl.in_flight_weight_updates
        self.engine = make_engine(cfg, rank)
        if weights_store is not None:  # after a restart: catch up before serving
            import ray

            latest = ray.get(weights_store.latest.remote())
            if latest is not None:
                version, (ref,) = latest
                self.update_weights(ray.get(ref), version)
        tokenizer = AutoTokenizer.from_pretrained(cfg.policy.model_name)
        self.server = ModelServer(self.engine, tokenizer, cfg.policy.model_name, FaultPlan(cfg.faults))
        self.server.reasoning_parser = cfg.policy.generation.reasoning_parser

        async def setup():
            return self.server.app(cfg.policy.generation.vllm_cfg.max_request_bytes)

        self.http = HttpThread(setup, host, port, name=f"model-server-{rank}")

    def start(self) -> str:
        """The base URL (the server is already up: it starts in the constructor)."""
        return self.http.url

    def reset(self, cfg: MinirlConfig) -> str:
        """Serve a new run (sweeps reuse workers): its fault plan and reasoning parser, an empty call log. The run then
        publishes its initial weights before its first step."""

        async def apply():
            self.server.plan = FaultPlan(cfg.faults)
            self.server.reasoning_parser = cfg.policy.generation.reasoning_parser
            self.server.calls.clear()

        self.drain = not cfg.async_rl.in_flight_weight_updates
        self.http.run(apply())
        return self.http.url

    def update_weights(self, named: list, version: int) -> int:
        self.engine.update_weights(named, version, drain=self.drain).result()
        return version

    def weights_finite(self) -> bool:
        return self.engine.weights_finite().result()

    def take_calls(self, step: int | None) -> list[dict]:
        """The call log of `step`; None: the calls that came without a rollout header."""
        async def take():
            return self.server.take_calls(step)

        return self.http.run(take())

    def stats(self) -> dict:
        return {"busy_s": self.engine.busy_s, "steps": self.engine.steps, "tokens": self.server.tokens_generated, "version": self.engine.version,
                "calls_dropped": self.server.calls.dropped}

    def pid(self) -> int:
        return os.getpid()
