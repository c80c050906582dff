"""Async against sync (issue K): samples trained per second, and reward against samples trained, on
the same seeds, side by side in one run, with a latency-bound environment (`env.tool_latency_s`).

    python bench/async_speedup.py                 # 20 steps, seeds 0 1 2, staleness 1 and 2 (the README's)
    python bench/async_speedup.py --quick         # 6 steps, one seed
    python bench/async_speedup.py --default-run   # the default run (no tool latency, own threads), sync vs s=1

Each seed runs sync and async at each staleness bound back to back, counterbalanced (sync first on an
even seed, last on an odd one), on one shared generation worker (started once, as the sweep does).
Every run gives the engine and the trainer `--threads` torch threads each (default 1: on the 2-core
build machine that partitions the cores, where 2 + 2 threads overlapping would spin against each other;
sync runs measured no slower at 1 + 1).
Async runs truncate the importance weights with `tis` at `--tis` (2.0): untruncated, one seed's
async runs collapsed to reward 0 (twice, reproducibly), and truncated the same run ended at 0.83.
Samples per second = rollouts trained / the summed `step_time_s` (start-up excluded; in async a
step's time includes its wait for the buffer).
Also the median `step_time_s` (the README's "default run" figure). Reward = mean `reward_mean` over
the last 5 steps. Targets: async >= 1.8x sync at staleness 1,
and its reward not worse than sync's beyond the seeds' spread.

The ratio is the mean of the per-seed ratios with its 95% t-interval (minirl.experiments.stats; each seed's arms
meet the same prompts). Where the time goes: each arm's `timing/*` metrics (minirl/timeline.py), in
seconds per step: the trainer's lane (its wait for the groups, their processing, the policy update,
the weight sync) and the generation lane (the engine stepping, loading weights, waiting on rollouts'
tools, idle); and the cores busy over the steps (/proc/stat, the whole machine's), with the ceiling
they set: 2 cores ÷ sync's cores busy is the ratio async reaches if it fills both cores with the
CPU work sync's steps took. `--variant LABEL KEY=VALUE ...` adds an async arm with more overrides.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class CpuMeter:
    """The machine's busy CPU time (/proc/stat, every process, others' too), sampled every 0.25 s by
    a thread of the bench, so a run's cores busy can be read over its steps alone."""

    def __init__(self):
        self.samples: list[tuple[float, int, int]] = []
        self.stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while not self.stop.is_set():
            with open("/proc/stat") as f:
                ticks = [int(x) for x in f.readline().split()[1:]]
            self.samples.append((time.time(), sum(ticks) - ticks[3] - ticks[4], sum(ticks)))  # busy: not idle, iowait
            time.sleep(0.25)

    def cores_busy(self, t0: float, t1: float) -> float:
        """Cores busy on average from t0 to t1 (the samples nearest inside; nan when too few)."""
        inside = [x for x in self.samples if t0 <= x[0] <= t1]
        if len(inside) < 2 or inside[-1][2] == inside[0][2]:
            return float("nan")
        return (inside[-1][1] - inside[0][1]) / (inside[-1][2] - inside[0][2]) * os.cpu_count()


METER: CpuMeter | None = None  # started by main


def run(mode: str, staleness: int, seed: int, steps: int, latency: float, out: Path, attach: list[str],
        truncation: list[str], variant: list[str] | None = None) -> dict:
    """One run; `variant`: [label, override, ...], an async arm with more overrides."""
    label = f"{mode}" + (f" s={staleness}" if mode == "async" else "") + (f" {variant[0]}" if variant else "")
    run_dir = out / (f"{mode}{staleness if mode == 'async' else ''}" + (f"_{variant[0]}" if variant else "")
                     + f"_seed{seed}")
    args = [f"grpo.max_num_steps={steps}", f"grpo.seed={seed}", f"env.data_seed={1234 + seed}", f"faults.seed={seed}",
            f"env.tool_latency_s={latency}", "checkpoint.enabled=false", "logger.tensorboard=false",
            f"run_dir={run_dir}"]
    if mode == "async":
        args += ["async_rl.enabled=true", f"async_rl.sampler.max_staleness_versions={staleness}",
                 "loss_fn.use_importance_sampling_correction=true", *truncation, *(variant or [None])[1:]]
    proc = subprocess.run([sys.executable, "-m", "minirl.train", *args, *attach], cwd=REPO, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{run_dir.name} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    trained = sum(r["rollouts_trained"] for r in rows)
    seconds = sum(r["step_time_s"] for r in rows)
    end = (run_dir / "metrics.jsonl").stat().st_mtime  # the last step's line: the steps ran in [end - seconds, end]
    return {"mode": label, "seed": seed, "samples": trained,
            "seconds": seconds, "samples_per_s": trained / seconds,
            "reward_last5": statistics.mean(r["reward_mean"] for r in rows[-5:]),
            "staleness_mean": statistics.mean(r.get("staleness_mean", 0.0) for r in rows),
            "step_time_median_s": statistics.median(r["step_time_s"] for r in rows),
            "split": {k: statistics.mean(r.get(k) or 0.0 for r in rows) for k in SPLIT},
            "cores_busy": METER.cores_busy(end - seconds, end) if METER else float("nan")}


SPLIT = {  # the timeline's fields (minirl.timeline) the bench prints, per step, with a short name
    "timing/train/exposed_generation": "exposed", "timing/train/data_processing": "process",
    "timing/train/policy_training": "train", "timing/train/policy_compute": "(compute)",
    "timing/train/weight_sync": "sync", "timing/generation/weight_drain": "(drain)",
    "timing/generation/engine_busy": "engine", "timing/generation/weight_load": "load",
    "timing/generation/gather": "gather",
    "timing/generation/rollout_wait": "tools", "timing/generation/idle": "idle", "timing/generation/cycle": "cycle",
}
SPLIT_DOC = ("trainer lane: exposed + process + train + sync = the step, (compute) inside train, (drain) inside sync; "
             "generation lane: engine + load + gather + tools + idle = cycle "
             "(the step and the loop's work between steps)")


def report(results: list[dict]) -> None:
    """The table per mode: samples/s, the ratio to sync over seeds (mean ± 95% t-interval of the
    per-seed ratios: each seed's arms meet the same prompts), the reward (mean ± 95% t over seeds) and
    its paired difference to sync (per seed, mean ± 95% t: the reward rule's test); then where each
    step's time goes, the cores busy, and the ceiling that the cores set on the ratio. Every ± is a
    95% t half-width; one seed prints its value alone."""
    from minirl.experiments.stats import mean_ci, paired_ci

    def ci(xs: list[float], digits: int = 2) -> str:
        mean, half = mean_ci([x for x in xs if x == x])
        return f"{mean:.{digits}f} ± {half:.{digits}f}" if half == half else f"{mean:.{digits}f}"

    modes = list(dict.fromkeys(r["mode"] for r in results))
    by = {m: [r for r in results if r["mode"] == m] for m in modes}
    sync = {r["seed"]: r["reward_last5"] for r in by.get("sync", [])}
    print(f"{'mode':<20}{'samples/s':>10}{'x sync (95% CI)':>18}{'median step s':>15}{'reward(last 5)':>18}"
          f"{'- sync, paired':>18}{'samples':>9}")
    for mode, rs in by.items():
        diff, half, n = paired_ci({r["seed"]: r["reward_last5"] for r in rs}, sync)
        paired = "" if mode == "sync" or not n else f"{diff:+.3f}" + (f" ± {half:.3f}" if half == half else "")
        print(f"{mode:<20}{statistics.mean(r['samples_per_s'] for r in rs):>10.2f}{ci([r['ratio'] for r in rs]):>18}"
              f"{statistics.mean(r['step_time_median_s'] for r in rs):>15.2f}"
              f"{ci([r['reward_last5'] for r in rs], 3):>18}{paired:>18}"
              f"{statistics.mean(r['samples'] for r in rs):>9.0f}")
    print("\nwhere a step's time goes, seconds per step (mean over steps and seeds); " + SPLIT_DOC)
    print(f"{'mode':<20}" + "".join(f"{name:>10}" for name in SPLIT.values()) + f"{'cores busy':>12}")
    for mode, rs in by.items():
        print(f"{mode:<20}" + "".join(f"{statistics.mean(r['split'][k] for r in rs):>10.2f}" for k in SPLIT)
              + f"{ci([r['cores_busy'] for r in rs]):>12}")
    ceiling = [os.cpu_count() / r["cores_busy"] for r in by.get("sync", [])]
    print(f"\ncores busy: the machine's, every process (others' too), over the steps. Ceiling on x sync if async "
          f"used all {os.cpu_count()} cores for the CPU work that sync's steps took: {ci(ceiling)}")


def seed_arms(seed: int, arms: list[tuple], run_arm) -> list[dict]:
    """One seed: sync and each (mode, staleness, variant) arm, back to back, counterbalanced: sync first on an
    even seed, last on an odd one (the arms reversed too), so a machine that drifts over the hour, or warms up,
    weighs on both sides alike. Returns sync's result first, then the arms', each with its ratio to sync."""
    order = [("sync", 0, None), *arms]
    if seed % 2:
        order.reverse()
    results = []
    for mode, s, variant in order:
        r = run_arm(mode, s, seed, variant)
        results.append(r)
        print(f"seed {seed}: {r['mode']} {r['samples_per_s']:.2f} samples/s, median step "
              f"{r['step_time_median_s']:.2f} s, reward(last 5) {r['reward_last5']:.3f}"
              + (f", staleness {r['staleness_mean']:.2f}" if mode != "sync" else ""), flush=True)
    results = results[::-1] if seed % 2 else results  # sync first, then the arms in their order
    for r in results:
        r["ratio"] = r["samples_per_s"] / results[0]["samples_per_s"]
    print(f"seed {seed}: " + ", ".join(f"{r['mode']} {r['ratio']:.2f}x sync" for r in results[1:]), flush=True)
    return results


def main(argv=None, attach: list[str] | None = None) -> int:
    """`attach`: overrides that attach every run to generation workers already running (the suite's
    shared engine, tests/integration/test_benches.py), plus any more for every run; None starts the bench's own."""
    import ray

    from minirl.cluster import start_shared_generation
    from minirl.config import load_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--seeds", type=int, nargs="*")
    ap.add_argument("--staleness", type=int, nargs="*", help="async staleness bounds (default 1 2; --default-run: 1)")
    ap.add_argument("--tool-latency", type=float, default=0.2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the engine and of the trainer")
    ap.add_argument("--tis", type=float, default=2.0,
                    help="async runs truncate the importance weights at this ratio (tis); 0: untruncated")
    ap.add_argument("--default-run", action="store_true",
                    help="`python -m minirl.train` as shipped (its steps and threads, no tool latency) against "
                         "the same with async at staleness 1 (`--staleness` to change)")
    ap.add_argument("--variant", nargs="+", action="append", default=[], metavar="LABEL KEY=VALUE",
                    help="one more async arm at the first staleness bound, named LABEL, with these overrides "
                         "(repeatable), e.g. --variant inflight async_rl.in_flight_weight_updates=true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    global METER
    METER = METER or CpuMeter()
    if args.default_run:
        args.tool_latency, args.threads = 0.0, None
    args.staleness = args.staleness or ([1] if args.default_run else [1, 2])
    steps = args.steps or (6 if args.quick else load_config().grpo.max_num_steps if args.default_run else 20)
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2])
    out = Path(args.out or tempfile.mkdtemp(prefix="async_speedup_"))
    results = []
    threads = [] if args.threads is None else [f"policy.train_threads={args.threads}",
                                                f"policy.generation.vllm_cfg.omp_threads={args.threads}"]
    truncation = ["loss_fn.truncated_importance_sampling_type=tis",
                  f"loss_fn.truncated_importance_sampling_ratio={args.tis}"] if args.tis > 0 else []
    try:
        if attach is None:
            attach = start_shared_generation(load_config(None, threads), "async-bench-gen")
        attach = attach + threads
        for seed in seeds:
            arms = [("async", s, None) for s in args.staleness]
            arms += [("async", args.staleness[0], v) for v in args.variant]
            results += seed_arms(seed, arms,
                                 lambda *a: run(*a[:3], steps, args.tool_latency, out, attach, truncation, a[3]))
    finally:
        ray.shutdown()
    print(f"\n{steps} steps per run, env.tool_latency_s={args.tool_latency}, seeds {seeds}; cells in {out}")
    report(results)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
