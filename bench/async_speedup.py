"""Async against sync (issue K): samples trained per second, and reward against samples trained, on
the same seeds, side by side in one run, with a latency-bound environment (`env.tool_latency_s`).

    python bench/async_speedup.py                 # 20 steps, seeds 0 1 2, staleness 1 and 2 (the README's figures)
    python bench/async_speedup.py --quick         # 6 steps, one seed
    python bench/async_speedup.py --default-run   # the default run (no tool latency, its own threads), sync vs async s=1

Each seed runs sync, then async at each staleness bound, back to back on one shared generation
worker (started once, as the sweep does). Every run gives the engine and the trainer `--threads`
torch threads each (default 1: on the 2-core build machine that partitions the cores, where 2 + 2
threads overlapping would spin against each other; sync runs measured no slower at 1 + 1).
Async runs truncate the importance weights with `tis` at `--tis` (2.0): untruncated, one seed's
async runs collapsed to reward 0 (twice, reproducibly), and truncated the same run ended at 0.83.
Samples per second = rollouts trained / the summed `step_time_s` (start-up excluded; in async a
step's time includes its wait for the buffer).
Also the median `step_time_s` (the README's "default run" figure). Reward = mean `reward_mean` over
the last 5 steps. Targets: async >= 1.8x sync at staleness 1,
and its reward not worse than sync's beyond the seeds' spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(mode: str, staleness: int, seed: int, steps: int, latency: float, out: Path, attach: list[str],
        truncation: list[str]) -> dict:
    run_dir = out / f"{mode}{staleness if mode == 'async' else ''}_seed{seed}"
    args = [f"grpo.max_num_steps={steps}", f"grpo.seed={seed}", f"env.data_seed={1234 + seed}", f"faults.seed={seed}",
            f"env.tool_latency_s={latency}", "checkpoint.enabled=false", "logger.tensorboard=false", f"run_dir={run_dir}"]
    if mode == "async":
        args += ["async_rl.enabled=true", f"async_rl.sampler.max_staleness_versions={staleness}",
                 "loss_fn.use_importance_sampling_correction=true", *truncation]
    proc = subprocess.run([sys.executable, "-m", "minirl.train", *args, *attach], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{run_dir.name} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    trained = sum(r["rollouts_trained"] for r in rows)
    seconds = sum(r["step_time_s"] for r in rows)
    return {"mode": f"{mode}" + (f" s={staleness}" if mode == "async" else ""), "seed": seed, "samples": trained,
            "seconds": seconds, "samples_per_s": trained / seconds,
            "reward_last5": statistics.mean(r["reward_mean"] for r in rows[-5:]),
            "staleness_mean": statistics.mean(r.get("staleness_mean", 0.0) for r in rows),
            "step_time_median_s": statistics.median(r["step_time_s"] for r in rows)}


def main(argv=None, attach: list[str] | None = None) -> int:
    """`attach`: overrides that attach every run to generation workers already running (the suite's
    shared engine, tests/test_benches.py), plus any more for every run; None starts the bench's own."""
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
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
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
            base = run("sync", 0, seed, steps, args.tool_latency, out, attach, truncation)
            results.append({**base, "ratio": 1.0})
            print(f"seed {seed}: sync {base['samples_per_s']:.2f} samples/s, median step {base['step_time_median_s']:.2f} s, "
                  f"reward(last 5) {base['reward_last5']:.3f}", flush=True)
            for s in args.staleness:
                r = run("async", s, seed, steps, args.tool_latency, out, attach, truncation)
                r["ratio"] = r["samples_per_s"] / base["samples_per_s"]
                results.append(r)
                print(f"seed {seed}: async s={s} {r['samples_per_s']:.2f} samples/s ({r['ratio']:.2f}x sync), "
                      f"median step {r['step_time_median_s']:.2f} s, reward(last 5) {r['reward_last5']:.3f}, staleness {r['staleness_mean']:.2f}", flush=True)
    finally:
        ray.shutdown()
    print(f"\n{steps} steps per run, env.tool_latency_s={args.tool_latency}, seeds {seeds}; cells in {out}")
    print(f"{'mode':<12}{'samples/s':>12}{'x sync':>9}{'median step s':>15}{'reward(last 5)':>18}{'samples':>9}")
    for mode in dict.fromkeys(r["mode"] for r in results):
        rs = [r for r in results if r["mode"] == mode]
        spread = lambda xs: f" ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else ""  # noqa: E731
        rew = [r["reward_last5"] for r in rs]
        print(f"{mode:<12}{statistics.mean(r['samples_per_s'] for r in rs):>12.2f}"
              f"{statistics.mean(r['ratio'] for r in rs):>8.2f}x"
              f"{statistics.mean(r['step_time_median_s'] for r in rs):>15.2f}{statistics.mean(rew):>11.3f}{spread(rew):<7}"
              f"{statistics.mean(r['samples'] for r in rs):>9.0f}")
    (out / "results.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
