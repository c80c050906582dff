"""Start-up and placement: Ray, then the generation workers, the agent pool, the policy workers
and the controller, each a Ray actor with the resources `cluster.*` gives it (docs/scale-out.md).

Invariant: after `Cluster.__enter__` every server answers on its URL and every generation worker
serves the policy's current weights; `__exit__` always shuts Ray down. A run that ends with an
exception, wherever it is raised, leaves exactly one `run_failed` event naming it in events.jsonl.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Callable

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from minirl.agents.process import AgentProcess
from minirl.config import ConfigError, MinirlConfig, probe_ray_address, resource_shortfall
from minirl.controller import Controller
from minirl.generation.router import run_router, start_router, write_endpoints
from minirl.generation.worker import GenerationWorker
from minirl.trainer import checkpoint
from minirl.trainer.policy_worker import PolicyWorker
from minirl.trainer.weight_sync import WeightsStore, publish

ACTOR_ENV = {
    "VLLM_LOGGING_LEVEL": "ERROR",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TQDM_DISABLE": "1",
    "PYTHONWARNINGS": "ignore",
}


RAY_DAEMON_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
}
"""Set in this process's environment (unless set already) before it starts a local Ray, whose daemons inherit
it. The log monitor then lists Ray's log folder for new files every 0.5 s rather than every 0.1 s: its five
globs a pass were 13 of its 15 ms of CPU a second with 61 files tracked (a 21-minute shared cluster of the
suite), and its 11 processes took 96 CPU-s of the suite (bench/history/2026-12.md). A new actor's first lines
reach the driver up to 0.5 s later; none is lost (each file is read from its start)."""

NAMESPACE = "minirl"


SERVER_PORTS = (20000, 32767)
"""Where `free_port` looks: above Ray's worker ports (10002-19999 by default) and below Linux's
ephemeral range (32768-60999 by default), from which every outgoing connection takes its local
port. A port chosen by binding port 0 comes from that range, and an outgoing connection (Ray opens
many) could take it before the server that was handed it binds: "address already in use", seen
once in the suite. (A kernel whose ephemeral range starts lower makes that possible again.)"""


def free_port(host: str) -> int:
    """A port no one listens on now, for a server that binds it later (and again after a restart)."""
    host = "0.0.0.0" if host == "auto" else host  # the server's node is not known here: probe this one
    for _ in range(64):
        with socket.socket() as s:
            port = random.randint(*SERVER_PORTS)
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the range is taken: any port the kernel has
        s.bind((host, 0))
        return s.getsockname()[1]


def node_host(cfg: MinirlConfig) -> str:
    """127.0.0.1 on one node; `auto` when the cluster spans several: each server then binds its
    own node's address (http_thread.resolve_host), wherever Ray places it."""
    if cfg.cluster.host != "auto":
        return cfg.cluster.host
    return "auto" if len(ray.nodes()) > 1 else "127.0.0.1"


def cause(exc: BaseException) -> BaseException:
    """The user's exception behind Ray's wrapper (RayTaskError carries it as `.cause`)."""
    while getattr(exc, "cause", None) is not None and type(exc).__name__.startswith("RayTaskError"):
        exc = exc.cause
    return exc


INTERRUPTED_BY: list[BaseException] = []
"""The exception the entry point's SIGTERM handler raised (minirl.shutdown's `Terminated`), once a
SIGTERM arrived: the driver spends nearly all its time blocked in `ray.get`, whose own signal check
replaces the handler's exception with a bare KeyboardInterrupt, which `describe` reports as this.
(The handler fills it: this floor cannot import the entry points'.)"""


def describe(exc: BaseException) -> str:
    """`ExceptionClass: message`, as the run's last stderr line and its `run_failed` event say it (a
    bare KeyboardInterrupt after a SIGTERM as the SIGTERM's: `INTERRUPTED_BY`)."""
    exc = cause(exc)
    exc = INTERRUPTED_BY[0] if INTERRUPTED_BY and type(exc) is KeyboardInterrupt else exc
    return f"{type(exc).__name__}: {exc if str(exc) or not isinstance(exc, KeyboardInterrupt) else 'interrupted'}"


def ray_env() -> dict:
    """RAY_DAEMON_ENV into this process's environment (what is set already wins); returns the actors' env_vars."""
    for key, value in RAY_DAEMON_ENV.items():
        os.environ.setdefault(key, value)
    return {**ACTOR_ENV, "RAY_AUTH_MODE": os.environ["RAY_AUTH_MODE"]}


class Cluster:
    """The run's actors, started in `__enter__` and shut down (with Ray) in `__exit__`.

    Generation and policy workers take the real CPUs (or GPUs); the controller, the agent servers and
    the weights store are light (`num_cpus=0`): on a 2-core machine four actors asking for a CPU each
    would leave some pending forever. One placement group reserves all the heavy actors' bundles at
    once (STRICT_PACK on one node, PACK across several), so a run never starts half-placed.
    Resources are checked before anything is placed: the workers' bundles must fit in what Ray offers
    (else a ConfigError naming the keys and numbers), and a placement group that still does not
    become ready says what it asked for and what was free.

    A run that ends with an exception (start-up, the step path, the update, the weight sync, a
    checkpoint) gets its one `run_failed` event from the controller (which writes it once), or from
    the driver when the controller cannot (`_run_failed`).
    """

    def __init__(self, cfg: MinirlConfig, run_dir: Path):
        self.cfg, self.run_dir = cfg, run_dir
        self.controller = None

    def __enter__(self) -> "Cluster":
        cl = self.cfg.cluster
        env = ray_env()
        term = signal.getsignal(signal.SIGTERM)
        try:
            probe_ray_address(self.cfg)  # Ray itself would retry an address that does not answer for minutes
            ray.init(
                address=cl.ray_address or "local",  # never join a cluster that merely happens to run here
                num_cpus=cl.num_cpus if cl.ray_address is None else None,
                num_gpus=cl.num_gpus if cl.ray_address is None else None,
                include_dashboard=False,
                namespace=NAMESPACE,
                runtime_env={"env_vars": env},
                logging_level="warning",
                log_to_driver=True,
            )
            if callable(term) and threading.current_thread() is threading.main_thread():
                # ray.init put its own in (a stack dump, then death): keep the caller's
                signal.signal(signal.SIGTERM, term)
            self._start()
        except BaseException as exc:
            self._run_failed(exc)
            ray.shutdown()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """The run's `run_failed` (when it failed) and its end-of-run books, then Ray down. A SIGTERM or Ctrl-C
        while they are written ends a run that had ended well, with its own `run_failed`; a run that had
        failed already ends with that failure (a KeyboardInterrupt here would have replaced it)."""
        try:
            if exc is not None:
                self._run_failed(exc)
            self._finish()
        except KeyboardInterrupt as stop:
            if exc is None:
                self._run_failed(stop)
                raise
        finally:
            ray.shutdown()

    def _finish(self) -> None:
        """The controller's `finish`: the run's `run_end` event and end-of-run ledger (unfinished groups,
        leftover call records, what each server served). Best effort: a controller that does not answer
        in 30 s leaves no `run_end`, which the books then read as a run that did not close."""
        if self.controller is None:
            return
        try:
            ray.get(self.controller.finish.remote(), timeout=30)
        except Exception as exc:
            print(f"minirl: the run's end-of-run books were not written: {describe(exc)}", file=sys.stderr, flush=True)
            try:  # where the controller waits, for the report that follows
                print(f"minirl: the controller's tasks:\n{ray.get(self.controller.stacks.remote(), timeout=5)}",
                      file=sys.stderr, flush=True)
            except Exception:
                pass

    def _run_failed(self, exc: BaseException) -> None:
        """The run's `run_failed` event: through the controller (which writes it once, with the step),
        or straight into events.jsonl when there is none or it does not answer."""
        error = describe(exc)
        if self.controller is not None:
            try:
                ray.get(self.controller.run_failed.remote(error), timeout=10)
                return
            except Exception:
                pass
        from minirl.metrics import EventLog

        log = EventLog(Path(self.run_dir) / "events.jsonl")
        log.write({"type": "run_failed", "step": None, "error": error})
        log.f.close()

    def _check_resources(self) -> None:
        """What the workers need against what Ray offers (ConfigError naming the keys and numbers)."""
        total = ray.cluster_resources()
        for res in ("CPU", "GPU"):
            have = total.get(res, 0.0)
            problem = resource_shortfall(self.cfg, res, have, f"ray.cluster_resources() {have:g}")
            if problem is not None:
                raise ConfigError(f"cluster.num_{res.lower()}s", problem)

    def _placement(self) -> Callable[[int], dict]:
        """Reserve the workers' placement group (generation workers first, unless attached, then the
        policy workers); returns bundle index -> the actor options that place an actor on it."""
        cl = self.cfg.cluster
        attach = cl.attach_generation_workers
        gen_bundle = {"CPU": cl.cpus_per_generation_worker, "GPU": cl.gpus_per_generation_worker}
        pol_bundle = {"CPU": cl.cpus_per_policy_worker, "GPU": cl.gpus_per_policy_worker}
        bundles = ([] if attach else [gen_bundle] * cl.num_generation_workers) + [pol_bundle] * cl.num_policy_workers
        bundles = [{k: v for k, v in b.items() if v > 0} or {"CPU": 0.001} for b in bundles]
        self._check_resources()
        strategy = "STRICT_PACK" if len(ray.nodes()) == 1 else "PACK"
        self.pg = placement_group(bundles, strategy=strategy)
        try:
            ray.get(self.pg.ready(), timeout=120)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"the workers' placement group ({strategy}, bundles {bundles}) "
                               "was not ready within 120 s: "
                               f"Ray has {ray.available_resources()} free of {ray.cluster_resources()} "
                               "(another job holds them, or no single node fits the bundles)") from None

        def on(bundle: int) -> dict:
            return {"scheduling_strategy":
                    PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle)}

        return on

    def _bundle_ip(self, bundle: int) -> str:
        """The address of the node Ray put the placement group's bundle on."""
        node = ray.util.placement_group_table(self.pg)["bundles_to_node_id"][bundle]
        return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node)

    def _start_agents(self, model_urls: list[str], host: str) -> list[str]:
        """The agent servers (none for an external agent), serving through `model_urls`: their URLs."""
        cfg = self.cfg
        if cfg.agent.external_url:
            self.agents = []
            return cfg.agent.external_urls()
        self.agents = [
            ray.remote(AgentProcess).options(num_cpus=0, max_restarts=-1)
            .remote(cfg, model_urls, host, free_port(host))
            for _ in range(cfg.cluster.num_agent_servers)
        ]
        return ray.get([a.start.remote() for a in self.agents])

    def _start(self) -> None:
        cfg, cl = self.cfg, self.cfg.cluster
        host = node_host(cfg)
        light = {"num_cpus": 0}
        attach = cl.attach_generation_workers
        on = self._placement()
        if attach:  # the shared workers' store, so that one Ray restarts mid-run catches up with this run's weights
            self.store, *self.gen = attached(attach, cl.num_generation_workers, cl.ray_address)
            check_served_model(cfg, ray.get([g.served_model.remote() for g in self.gen]))
            model_urls = ray.get([g.reset.remote(cfg) for g in self.gen])
        else:
            self.store = ray.remote(WeightsStore).options(**light).remote()
            self.gen = start_generation_workers(cfg, host, self.store, placement=on)
        world = cl.num_policy_workers
        first = 0 if attach else cl.num_generation_workers
        master = f"{self._bundle_ip(first) if host == 'auto' else host}:{free_port(host)}"  # rank 0's node
        self.policy = [
            ray.remote(PolicyWorker)
            .options(num_cpus=cl.cpus_per_policy_worker, num_gpus=cl.gpus_per_policy_worker, **on(first + r))
            .remote(cfg, r, world, master)
            for r in range(world)
        ]
        if not attach:
            model_urls = ray.get([g.start.remote() for g in self.gen])  # the policy workers start meanwhile
        # the router, agent and controller processes start while the policy workers load the model
        self.router, router = run_router(cfg, model_urls, host)
        health = cfg.async_rl.generation_fleet_health.enabled  # then the agents honour quarantine: via the router
        agent_urls = self._start_agents([router] if health else model_urls, host)
        model_cfg = json.loads((Path(cfg.policy.model_name) / "config.json").read_text())
        pad_id = model_cfg.get("pad_token_id") or 0
        self.controller = (
            ray.remote(Controller).options(**light, max_concurrency=4)
            .remote(cfg, str(self.run_dir), agent_urls, self.gen, model_cfg["vocab_size"], pad_id,
                    self.router if health else None)
        )
        if attach:  # a reused engine may hold another run's weights (nothing is dispatched before the first step)
            publish(self.policy[0].get_weights.remote(), self.gen, self.store, version=0)
        self.urls = {"model": model_urls, "agents": agent_urls, "router": router}
        ends = write_endpoints(self.run_dir, self.urls["router"], model_urls, agent_urls)
        print("minirl: endpoints " + " ".join(f"{k}={v}" for k, v in ends.items()), flush=True)

    # -- used by the training loop ---------------------------------------------------------------
    def sync_weights(self, version: int, weights=None) -> dict:
        """Every generation worker serves `version`; then the controller dispatches under it. `weights`:
        policy rank 0's `get_weights` ObjectRef, asked for already (else asked here). Async:
        the rollout pump dispatches nothing while the weights move (upstream's pause during a sync).
        Returns the controller's generation lane of the cycle this sync ends (minirl.timeline). Sync, no
        group is in flight between steps, so there is no pump to pause and no round trip to wait for."""
        if self.controller is not None and self.cfg.async_rl.enabled:
            ray.get(self.controller.syncing.remote())
        announce = None if self.controller is None else (lambda s: self.controller.published.remote(version, s))
        weights = self.policy[0].get_weights.remote() if weights is None else weights
        return publish(weights, self.gen, self.store, version, announce) or {}

    def save_checkpoint(self, step: int) -> None:
        from dataclasses import asdict

        snap = ray.get(self.controller.snapshot.remote())
        state = {"step": step, "next_step": step + 1, "rollout_manager": snap["rollout_manager"],
                 "config": json.loads(json.dumps(asdict(self.cfg), default=str))}  # checkpoint.check_resume reads it

        def write(d: str) -> None:
            ray.get([w.save.remote(d) for w in self.policy])
            if snap["async_buffer"] is not None:
                (Path(d) / checkpoint.ASYNC_BUFFER).write_bytes(snap["async_buffer"])

        try:
            checkpoint.save(self.run_dir, step, state, write, self.cfg.policy.model_name,
                            self.cfg.checkpoint.keep_last_k)
        except OSError as exc:
            raise checkpoint.CheckpointError(f"cannot write the checkpoint of step {step} under "
                                             f"{checkpoint.directory(self.run_dir)}: {exc}") from exc

    def resume(self) -> int:
        """Load the checkpoint `checkpoint.resume` names; returns the first step to run. Each newer
        checkpoint `auto` skips because it does not verify is reported in events.jsonl and on stderr.
        An explicit path older than the run_dir's newest checkpoints abandons their continuation: each
        `step_M` from the first step to run on is renamed `abandoned_step_M` (`checkpoint.set_aside_newer`:
        nothing is lost, and neither pruning nor `auto` takes it for this run's), said in one stdout line
        and a `checkpoint_abandoned` event each. The resume is one line on stdout and a `resumed` event,
        naming any change of the prompt stream."""
        path, skipped = checkpoint.select(self.run_dir, self.cfg.checkpoint.resume)
        for bad, reason in skipped:
            print(f"minirl: skipping checkpoint {bad}: {reason}", file=sys.stderr, flush=True)
            ray.get(self.controller.note.remote(
                {"type": "checkpoint_skipped", "checkpoint": str(bad), "reason": reason}))
        if path is None:
            return 0
        state = checkpoint.read_state(path)
        ray.get([w.load.remote(str(path)) for w in self.policy])
        buffer = path / checkpoint.ASYNC_BUFFER
        buffered = buffer.read_bytes() if buffer.exists() else None
        ray.get(self.controller.load_state.remote(state["rollout_manager"], buffered))
        self.sync_weights(version=state["next_step"])
        if self.cfg.checkpoint.resume != "auto":  # auto's newer ones are the damaged it skipped, reported above
            moved = checkpoint.set_aside_newer(Path(self.run_dir), state["next_step"])
            if moved:
                print(f"minirl: resuming from {path} abandons the continuation after it: moved "
                      + ", ".join(f"{a.name} to {b}" for a, b in moved), flush=True)
            for old, new in moved:
                ray.get(self.controller.note.remote({"type": "checkpoint_abandoned", "checkpoint": str(old),
                                                     "moved_to": str(new), "resumed_from": str(path)}))
        changes = checkpoint.dataset_changes(state.get("config"), self.cfg)
        print(f"minirl: resumed from {path} at step {state['next_step']}" + (
            f"; the dataset differs from the checkpoint's ({'; '.join(changes)}): "
            "the steps from here draw their prompts from the new one" if changes else ""), flush=True)
        ray.get(self.controller.note.remote({"type": "resumed", "checkpoint": str(path),
                                             "from_step": state["next_step"], "dataset_changes": changes}))
        return state["next_step"]


def attached(name: str, workers: int, address: str | None) -> list:
    """The detached actors `cluster.attach_generation_workers` names: `<name>-store`, then `<name>-0`
    .. `<name>-<workers - 1>`. One that is not there is a ConfigError naming the key and what runs
    (Ray's own ValueError names neither)."""
    names = [f"{name}-store", *(f"{name}-{i}" for i in range(workers))]
    try:
        return [ray.get_actor(n, namespace=NAMESPACE) for n in names]
    except ValueError:
        running = sorted(ray.util.list_named_actors())  # this driver's namespace: NAMESPACE
        missing = next((n for n in names if n not in running), names[0])
        raise ConfigError("cluster.attach_generation_workers",
                          f"no actor {missing!r} in namespace {NAMESPACE!r} of the cluster at "
                          f"cluster.ray_address={address} (named actors there: {', '.join(running) or 'none'}): "
                          "name workers started with start_shared_generation "
                          f"(cluster.num_generation_workers={workers} of them), "
                          "or set it to null to start this run's own") from None


def check_served_model(cfg: MinirlConfig, served: list[str]) -> None:
    """Attached workers must serve `policy.model_name`: another model's weights fail vLLM's reload."""
    want = os.path.realpath(cfg.policy.model_name)
    wrong = sorted({m for m in served if os.path.realpath(m) != want})
    if wrong:
        raise ConfigError("policy.model_name",
                          f"{cfg.policy.model_name} is not the model that the generation workers "
                          f"cluster.attach_generation_workers={cfg.cluster.attach_generation_workers} "
                          f"serve ({', '.join(wrong)}); attach to workers started for this model, or train theirs")


def start_shared_generation(cfg: MinirlConfig, name: str, router_host: str = "127.0.0.1") -> list[str]:
    """A Ray cluster owned by this process, with detached generation workers named `name` that many
    runs attach to (a sweep's cells, a test module's CLI runs), so each run skips vLLM start-up.
    Their weights store is detached and named `<name>-store` too: each attached run publishes through
    it, so a worker Ray restarts mid-run catches up with that run's weights, as an owned worker does.
    So is their router, `<name>-router` (on `router_host`; none when `async_rl.generation_router.enabled`
    is false): each attached run takes it over for the workers it attached (`run_router`), and so skips
    starting its own (1.9 CPU-s a run in the suite).
    Returns the overrides that attach a run; `ray.shutdown()` stops this cluster and nothing else."""
    if not ray.is_initialized():  # a second model's workers join the same cluster (the switch matrix's)
        ray.init(address="local", num_cpus=cfg.cluster.num_cpus, namespace=NAMESPACE, include_dashboard=False,
                 logging_level="error", log_to_driver=False, runtime_env={"env_vars": ray_env()})
    store = (ray.remote(WeightsStore)
             .options(num_cpus=0, name=f"{name}-store", namespace=NAMESPACE, lifetime="detached").remote())
    urls = ray.get([w.start.remote() for w in start_generation_workers(cfg, "127.0.0.1", store, name=name)])
    if cfg.async_rl.generation_router.enabled:
        start_router(cfg, urls, router_host, name=name)
    return [f"cluster.ray_address={ray.get_runtime_context().gcs_address}", f"cluster.attach_generation_workers={name}"]


THROTTLED_SPIN = "100"
"""libgomp's own spin count for a process whose OpenMP threads outnumber the cores (GOMP_SPINCOUNT in
GCC's libgomp manual; 300000 otherwise)."""


def engine_env(cfg: MinirlConfig) -> dict[str, str]:
    """The OpenMP environment a generation worker's process starts with (torch loads libgomp, which
    reads it once). OMP_NUM_THREADS: Ray would set num_cpus, and vLLM-CPU forbids changing torch's
    thread count once the engine is up. GOMP_SPINCOUNT: how long an idle engine thread spins for the
    next kernel before it sleeps. libgomp spins while its own process's threads fit the cores, which
    keeps an engine's steps ~10% shorter (bench/README.md), but two spinning engines
    on the same cores stepped 3x slower than throttled ones. libgomp sees only its process, so minirl
    applies its rule across the engines it starts on this machine: more engine threads than cores
    (cluster.num_generation_workers x vllm_cfg.omp_threads) get libgomp's throttled count. A joined
    cluster's placement is not known here, so its engines spin as libgomp decides. A GOMP_SPINCOUNT
    in the driver's environment wins (the test suite sets it: its two workers' engines share the cores)."""
    threads = cfg.policy.generation.vllm_cfg.omp_threads
    env = {"OMP_NUM_THREADS": str(threads)}
    spin = os.environ.get("GOMP_SPINCOUNT")
    oversubscribed = cfg.cluster.num_generation_workers * threads > (os.cpu_count() or 1)
    if spin is None and cfg.cluster.ray_address is None and oversubscribed:
        spin = THROTTLED_SPIN
    if spin is not None:
        env["GOMP_SPINCOUNT"] = spin
    return env


def start_generation_workers(cfg: MinirlConfig, host: str, store=None, placement=None, name: str | None = None) -> list:
    """Generation worker actors (restarted on death, at the same port, at most
    `cluster.generation_worker_max_restarts` times). Each is named, so that Ray's ActorDiedError names it
    once it stays dead: `generation-worker-<rank>` and this driver's job id (unique in the cluster). With
    `name`, they are detached and named `<name>-<rank>`, to outlive the driver for `attach_generation_workers`."""
    cl = cfg.cluster
    job = ray.get_runtime_context().get_job_id()
    workers = []
    for i in range(cl.num_generation_workers):
        # a call while the actor restarts waits for it (with fleet health the run goes on meanwhile, and the
        # controller drains its call log and publishes weights to every worker); once Ray stops restarting it,
        # the call fails
        options = {"num_cpus": cl.cpus_per_generation_worker, "num_gpus": cl.gpus_per_generation_worker,
                   "max_restarts": cl.generation_worker_max_restarts, "max_task_retries": -1,
                   "runtime_env": {"env_vars": engine_env(cfg)}, "name": f"generation-worker-{i}-job-{job}"}
        if placement is not None:
            options.update(placement(i))
        if name is not None:
            options.update(name=f"{name}-{i}", namespace=NAMESPACE, lifetime="detached")
        workers.append(ray.remote(GenerationWorker).options(**options).remote(cfg, i, host, free_port(host), store))
    return workers

