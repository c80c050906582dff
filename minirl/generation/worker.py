"""The generation worker: a Ray actor hosting one engine, and its OpenAI-style HTTP endpoint in a
child process (minirl.generation.frontend), so that this process only steps the engine.

Invariant: the endpoint serves only after the engine holds the newest weights the trainer has
published (caught up from the weights store in the constructor, then `update_weights` after every
optimizer step), at a port fixed at creation, so a restarted worker comes back at the same URL
with current weights before it answers anyone.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from minirl.config import MinirlConfig
from minirl.faults import FaultPlan
from minirl.generation.frontend import FrontEnd


def make_engine(cfg: MinirlConfig, rank: int, on_dead=None):
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
        on_dead=on_dead,
        step_timeout_s=gen.vllm_cfg.step_timeout_s,
        gather_gap_s=gen.vllm_cfg.gather_gap_s,
        gather_max_s=gen.vllm_cfg.gather_max_s,
        gather_first_s=gen.vllm_cfg.gather_first_s,
        gather_rule=gen.vllm_cfg.gather_rule,
        gather_burst_n=gen.vllm_cfg.gather_burst_n,
    )


class GenerationWorker:
    """A worker whose engine dies (a step fails, or a step or a weight reload does not return within
    `vllm_cfg.step_timeout_s`) ends its process, as `vllm serve` exits when its engine dies, so Ray restarts
    it whole (at most `cluster.generation_worker_max_restarts` times) rather than keeping a worker that
    fails or hangs every call. A weight update refused before vLLM's reload
    (weights of another model) leaves the engine serving its last good weights; one that fails inside
    the reload marks the engine dead (`/health` 503, so fleet health routes around it) without ending
    the process, since Ray would re-run the same update on the restarted worker; the next run's
    `reset` then restarts the worker whole."""

    def __init__(self, cfg: MinirlConfig, rank: int, host: str, port: int, weights_store=None):
        self.rank = rank
        self.drain = not cfg.async_rl.in_flight_weight_updates
        self.epoch = f"{os.getpid()}-{time.time_ns()}"  # this life's: a restarted worker's clocks count from 0
        self.engine = make_engine(cfg, rank, on_dead=self._engine_died)
        if weights_store is not None:  # after a restart: catch up before serving
            import ray

            latest = ray.get(weights_store.latest.remote())
            if latest is not None:
                version, (ref,) = latest
                try:
                    self.engine.update_weights(ray.get(ref), version).result()
                except ray.exceptions.ObjectLostError:  # shared workers: the run that published them has ended
                    print(f"minirl: generation worker {rank} restarted after the run that published version {version} "
                          "ended; serving the model's own weights until the next run publishes",
                          file=sys.stderr, flush=True)
        self.front = FrontEnd(self.engine, cfg, rank, host, port)

    def _engine_died(self, exc: BaseException) -> None:
        print(f"minirl: generation worker {self.rank}'s engine died ({exc!r}); "
              "ending the worker so that Ray restarts it whole", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # its front end follows (it polls its parent)

    def start(self) -> str:
        """The base URL (the server is already up: it starts in the constructor)."""
        return self.front.url

    def served_model(self) -> str:
        """The model the engine was built from (`policy.model_name` of the config that started the worker)."""
        return self.engine.model

    def reset(self, cfg: MinirlConfig) -> str:
        """Serve a new run (sweeps reuse workers): its fault plan, reasoning parser and gather, an empty call log. The
        run then publishes its initial weights before its first step. A worker whose engine an earlier run left
        dead (a weight update that failed inside vLLM's reload) ends its process first: Ray restarts it with the
        model's own weights, catches it up from the weights store, and runs this reset there."""
        if self.engine.dead is not None:
            print(f"minirl: generation worker {self.rank}'s engine is dead ({self.engine.dead!r}); "
                  "restarting the worker for the new run", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        self.drain = not cfg.async_rl.in_flight_weight_updates
        vllm_cfg = cfg.policy.generation.vllm_cfg
        self.engine.set_gather(vllm_cfg.gather_gap_s, vllm_cfg.gather_max_s, vllm_cfg.gather_first_s,
                               vllm_cfg.gather_rule, vllm_cfg.gather_burst_n)
        self.engine.unhang()  # an `engine_hang` of the previous run ends with it
        self.front.call("reset", FaultPlan(cfg.faults), cfg.policy.generation.reasoning_parser)
        return self.front.url

    def update_weights(self, named: list, version: int) -> dict:
        """Returns once the engine serves `version` and the front end's /health says so: the version and
        the engine's clock read then (`clock`), which the controller's `published` takes as its reading
        of this worker rather than asking for it in another round trip."""
        self.engine.update_weights(named, version, drain=self.drain).result()
        self.front.call("version", version)
        return {"version": version, **self.clock()}

    def weights_finite(self) -> bool:
        return self.engine.weights_finite().result()

    def take_calls(self, step: int | None) -> list[dict]:
        """The call log of `step`; None: the calls that came without a rollout header."""
        return self.front.call("take_calls", step)

    def finish_run(self) -> dict:
        """The run ends: the call records no step took and the keys of every call this run served
        (`CallLog.finish`), for the controller's end-of-run ledger."""
        return {"rank": self.rank, **self.front.call("finish_run")}

    def clock(self) -> dict:
        """The engine's run totals of stepping, loading weights, draining for an update and gathering
        bursts, in seconds (minirl.timeline), and this worker process's `epoch` (totals restart from 0 in
        a restarted worker); read on this actor, without the front end."""
        e = self.engine
        return {"busy_s": e.busy_s, "weights_s": e.weights_s, "drain_s": e.drain_s, "gather_s": e.gather_s,
                "epoch": self.epoch}

    def stats(self) -> dict:
        front = self.front.call("stats")
        engine = self.engine
        return {"busy_s": engine.busy_s, "steps": engine.steps, "tokens": front["tokens"], "version": engine.version,
                "calls_dropped": front["calls_dropped"], "unkeyed_calls_dropped": front["unkeyed_calls_dropped"],
                "aborted": engine.aborted, "first_add_t": engine.first_add_t,
                "last_add_t": engine.last_add_t, "gather_s": engine.gather_s, "gathers_lone": engine.gathers_lone,
                "gathers_burst": engine.gathers_burst, "gather_learned_s": engine.gather_learned_s}

    def steps_since(self, t: float) -> list[tuple[float, float, int]]:
        """The engine's steps that began at or after `t` (time.monotonic(), this machine's clock):
        (start, seconds, requests in the engine) each."""
        return [entry for entry in list(self.engine.step_log) if entry[0] >= t]

    def pid(self) -> int:
        return os.getpid()

    def frontend_pid(self) -> int:
        return self.front.proc.pid
