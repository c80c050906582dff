"""Every bench in bench/ runs (issue 35 item 6): each bench's core at its smallest size, so a bench
cannot rot unseen (controller_overhead.py failed before printing anything once the ledger began
masking rollouts whose calls no server recorded).

Fully run here, through the bench's own functions: controller_overhead (P5 on 2 groups, traced and
untraced; P4 on a 2-step run), async_speedup (sync and async s=1, one step each, at 4 x 2) and
fault_efficiency (one cell, one step), all runs attached to the session's shared engine.
Smoke only (each needs an engine of its own, or a package or a device the suite lacks): engine_overhead
and hop_floor (their `--help`; engine_overhead's phase split of a round's steps, its CPU reading, its
`vllm serve` command line and its load mode against a stub server are checked on their own), vs_trl
(the minirl side of its command line is a valid config; TRL's side skipped without trl), gpu_check (its
pure batch building; the run skipped without CUDA).
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
SMALL = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=2"]


@pytest.fixture
def bench(monkeypatch):
    """Imports a bench script as a module (bench/ is not a package)."""
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module


def test_every_bench_is_covered_here():
    covered = {"controller_overhead", "async_speedup", "fault_efficiency", "engine_overhead", "hop_floor", "vs_trl",
               "gpu_check"}
    assert {p.stem for p in BENCH.glob("*.py")} == covered


# ---------------------------------------------------------------------------------- P5: no Ray, no engine
def test_p5_trains_every_rollout_with_its_calls_in_the_servers_record(bench):
    co = bench("controller_overhead")
    for traced in (False, True):
        r = co._p5_pass(2, 16, trace_memory=traced)
        assert r["rollouts"] == 32 and r["batch_mib"] > 0
        assert (r["peak_mib"] > 0) == traced


def test_p5_instant_backend_records_what_the_ledger_checks(bench):
    """The instant backend's record is the ledger's evidence: a lost record masks its rollout, as a
    restarted server's would, and a record of other tokens is a ledger mismatch."""
    import asyncio

    from minirl.config import load_config
    from minirl.data import prompt_row
    from minirl.rollout.evidence import Ledger
    from minirl.rollout.manager import RolloutManager

    co = bench("controller_overhead")
    cfg = load_config(None, ["grpo.num_prompts_per_step=1", "grpo.num_generations_per_prompt=2"])
    backend = co.InstantRunBackend()
    manager = RolloutManager(cfg, ["http://instant"], lambda e: None, vocab_size=512, post=backend)

    async def step():
        try:
            return await manager.run_step(0, [prompt_row(cfg, 0, 0)])
        finally:
            await manager.session.close()

    (outcome,) = asyncio.run(step())
    rollouts = list(outcome.rollouts.values())
    records = backend.take_calls(0)
    assert sorted(r["key"] for r in records) == ["s0.g0.r0.a0.c0", "s0.g0.r0.a0.c1", "s0.g0.r1.a0.c0", "s0.g0.r1.a0.c1"]
    assert backend.take_calls(0) == []  # handed over once, as the server's call log
    counts = Ledger(None).close_step(0, records[1:], rollouts, version=0)  # s0.g0.r0.a0.c0 lost
    assert counts["calls_unrecorded"] == 1 and [r.mask_reason for r in rollouts] == ["unrecorded_calls", None]
    forged = [{**records[0], "generation_token_ids": [5]}, *records[1:]]
    with pytest.raises(RuntimeError, match="ledger mismatch"):
        # both of r0's calls recorded, one with other tokens
        Ledger(None).close_step(0, forged, rollouts[:1], version=0)


# ------------------------------------------------------------- runs attached to the shared engine
@pytest.mark.slow
def test_p4_reads_its_figures_from_a_real_run(bench, shared_engine):
    co = bench("controller_overhead")
    four = co.p4(2, (*SMALL, *shared_engine))
    (step,) = four["steps"]
    assert step["step"] == 1 and 0 < step["engine_s"] < step["step_s"] and step["train_s"] > 0
    assert four["fraction"] == step["fraction"] < 1


@pytest.mark.slow
def test_async_speedup_runs_sync_and_async(bench, shared_engine, tmp_path, capsys):
    import json

    au = bench("async_speedup")
    assert au.main(["--quick", "--steps", "1", "--staleness", "1", "--tool-latency", "0", "--out", str(tmp_path)],
                   attach=[*shared_engine, *SMALL]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["mode"] for r in results] == ["sync", "async s=1"]
    assert all(r["samples"] == 8 and r["samples_per_s"] > 0 for r in results)
    # the timeline (minirl.timeline) reached each run's metrics: both lanes, each adding up
    assert all(r["split"]["timing/train/policy_compute"] > 0 and r["split"]["timing/generation/engine_busy"] > 0
               for r in results)
    trainer = ("exposed_generation", "data_processing", "policy_training", "weight_sync")
    for r in results:
        assert sum(r["split"][f"timing/train/{k}"] for k in trainer) == pytest.approx(r["seconds"], rel=1e-6)
    out = capsys.readouterr().out
    assert "async s=1" in out and "where a step's time goes" in out


@pytest.mark.slow
def test_fault_efficiency_runs_a_cell(bench, shared_engine, tmp_path, capsys):
    fe = bench("fault_efficiency")
    assert fe.main(["--rates", "0.05", "--policies", "all fixes", "--steps", "1", "--out", str(tmp_path)],
                   attach=shared_engine) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| all fixes |"))
    assert float(row.split("|")[2].split()[0]) > 0


# ------------------------------------------------------------------------------------- smoke only
@pytest.mark.parametrize("name", ["engine_overhead", "hop_floor"])
def test_engine_benches_parse_their_arguments(name):
    """Each starts a vLLM engine of its own (raw `LLM.generate` beside minirl's), which the suite
    does not afford: their command lines and imports only."""
    proc = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), "--help"], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--quick" in proc.stdout and "--small" in proc.stdout


def test_engine_overhead_splits_steps_by_phase(bench):
    """P1's phase table: a round's steps split by how many of its n requests the engine held."""
    phases = bench("engine_overhead").phases
    minirl = [(0.0, 0.08, 1), (0.1, 0.2, 3), (0.3, 0.05, 4), (0.4, 0.07, 4), (0.5, 0.03, 4), (0.6, 0.04, 3),
              (0.7, 0.01, 1)]
    got = phases(minirl, 4)
    assert {k: v[0] for k, v in got.items()} == {"filling": 2, "full": 3, "draining": 2}
    assert (got["filling"][1] == pytest.approx(0.28) and got["full"][2] == pytest.approx(50.0)
            and got["draining"][2] == pytest.approx(25.0))
    raw = phases([(0.0, 0.2, 4), (0.2, 0.05, 4), (0.3, 0.01, 2)], 4)  # every prompt in before the first step
    assert raw["filling"] == (0, 0, 0.0) and raw["full"][0] == 2 and raw["draining"][0] == 1
    never_full = phases([(0.0, 0.1, 2), (0.1, 0.1, 3), (0.2, 0.1, 1)], 4)  # the first finished before the last came in
    assert never_full["filling"][0] == 3 and never_full["full"][0] == never_full["draining"][0] == 0


def test_engine_overhead_reads_cpu_below_a_clock_tick(bench):
    """P1's CPU table reads the scheduler's per-thread run time: 3 ms of work shows as at least 3 ms
    and not as a whole number of `/proc/<pid>/stat`'s 10 ms clock ticks (psutil's 0 or 10), and a
    second thread's work is counted with the main thread's."""
    import os
    import threading
    import time

    cpu_s = bench("engine_overhead")._cpu_s

    def spin(seconds: float) -> None:
        t0 = time.thread_time()
        while time.thread_time() - t0 < seconds:
            pass

    c0 = cpu_s(os.getpid())
    spin(0.003)
    c1 = cpu_s(os.getpid())
    # not a whole number of ticks
    assert 0.003 <= c1 - c0 < 0.5 and abs(100 * (c1 - c0) - round(100 * (c1 - c0))) > 1e-6
    spun, leave = threading.Event(), threading.Event()
    worker = threading.Thread(target=lambda: (spin(0.02), spun.set(), leave.wait()))
    worker.start()
    spun.wait()
    assert cpu_s(os.getpid()) - c1 >= 0.02  # read while the thread lives: an exited thread's time leaves with it
    leave.set()
    worker.join()


def test_engine_overhead_load_mode_sends_fresh_calls_and_checks_the_call_log(bench, monkeypatch, capsys):
    """`--load` with a stub HTTP server in the generation worker's place (no Ray, no engine): the measured
    window sends none of the warm-up's calls again (its rollout keys and seeds are its own, so no prefix cache
    has seen them), and a call log that lost one of the window's records makes the bench exit 1."""
    import argparse
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import ray

    import minirl.cluster
    from minirl.wire import ROLLOUT_HEADER

    eo = bench("engine_overhead")
    seen: list[tuple[str, str, int]] = []  # (phase, rollout key, seed) of every call the stub answered
    phase = ["warm-up"]

    class Chat(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((phase[0], self.headers[ROLLOUT_HEADER], body["seed"]))
            reply = json.dumps({"usage": {"completion_tokens": 4}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    class Ref:  # a Ray object ref: `ray.get` (patched below) calls it
        def __init__(self, f):
            self.get = f

    class Worker:  # the generation-worker actor's handle
        def __init__(self, url: str, lost: int):
            self.url, self.lost, self.takes = url, lost, 0

        def __getattr__(self, name):
            f = {"start": lambda: self.url, "stats": lambda: {"busy_s": 0.0}, "take_calls": self.take}[name]
            return argparse.Namespace(remote=lambda *a: Ref(lambda: f(*a)))

        def take(self, step):
            self.takes += 1
            done, phase[0] = phase[0], "window"  # the first take ends the warm-up
            records = [c for c in seen if c[0] == done]
            return records[self.lost:] if self.takes == 2 else records  # the window's log loses `lost`

    server = ThreadingHTTPServer(("127.0.0.1", 0), Chat)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(eo, "WARM_UP_S", 0.5)
    monkeypatch.setattr(ray, "init", lambda *a, **k: None)
    monkeypatch.setattr(ray, "shutdown", lambda *a, **k: None)
    monkeypatch.setattr(ray, "get", lambda ref: ref.get())
    try:
        for lost, rc in ((0, 0), (1, 1)):
            seen.clear()
            phase[0] = "warm-up"
            worker = Worker(f"http://127.0.0.1:{server.server_port}", lost)
            monkeypatch.setattr(minirl.cluster, "start_generation_workers", lambda cfg, host: (worker,))
            assert eo.load(argparse.Namespace(overrides=[], agents=2, seconds=0.5)) == rc, capsys.readouterr()
            warm = {(key, seed) for p, key, seed in seen if p == "warm-up"}
            window = [(key, seed) for p, key, seed in seen if p == "window"]
            assert warm and window, seen
            assert not [c for c in window if c in warm], "the window re-sent warm-up calls"
            assert len({key for _, key, _ in seen}) == len({seed for _, _, seed in seen}) == len(seen)
        assert "error: the call log recorded" in capsys.readouterr().err
    finally:
        server.shutdown()
        server.server_close()


def test_engine_overhead_serves_vllm_with_the_raw_sides_engine(bench):
    """`--vllm-serve`'s command line is one vLLM's own server parser accepts, and builds the engine
    raw `LLM` builds (the server itself, a vLLM engine of its own, is not started here)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from minirl.config import load_config

    eo = bench("engine_overhead")
    assert (eo.SERVE_MODULE == "vllm.entrypoints.launchers.api_server.entry"
            and importlib.util.find_spec(eo.SERVE_MODULE))
    cfg = load_config(None, [])
    engine = eo.engine_args(cfg)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args([*eo.serve_flags(engine), *eo.SERVE_FLAGS])
    assert {key: getattr(args, key) for key in engine} == engine
    assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes"


def test_vs_trl_minirl_side_is_a_valid_config(bench):
    from minirl.config import load_config

    vt = bench("vs_trl")
    args = vt.common(str(REPO / "models" / "tiny-doors"), 2, 4, 2, 5e-4)
    assert args[0] == "--config"
    cfg = load_config(args[1], args[2:])
    assert cfg.grpo.num_prompts_per_step == 4 and cfg.grpo.num_generations_per_prompt == 2
    if importlib.util.find_spec("trl") is None:
        pytest.skip("trl not installed (pip install -e '.[bench]'): TRL's side of vs_trl not run")


def test_gpu_check_builds_its_batch(bench):
    gc = bench("gpu_check")
    seqs, plens = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 3], [1, 2, 3, 6, 7]], [2, 2, 2, 2]
    b = gc.batch_of(seqs, plens, [1.0, 0.0, 0.0, 0.0], gens=2)
    assert b.loss_mask.sum(axis=1).tolist() == [2, 1, 1, 3] and b.lengths.tolist() == [4, 3, 3, 5]
    assert b.advantages[0].max() > 0 > b.advantages[1].min() and not b.advantages[2:].any()
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU: gpu_check's training run not run (bench/gpu_check.sh exits 0 without one)")
    r = gc.check("tiny", str(REPO / "models" / "tiny-doors"), 2, 2, 2, use_vllm=False)
    assert r["update_s"] > 0 and r["gen_tok_s"] > 0
