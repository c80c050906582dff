"""Does async's discard-and-requeue starve slow rollouts, and does admission pacing remove the skew?

    python -m minirl.experiments.async_bias --out docs/experiments/async          # the committed report
    python -m minirl.experiments.async_bias --seeds 1 --steps 3 --out /tmp/ab     # a smoke run

Each cell is a real `python -m minirl.train` run of one mode (sync, or an async sampler, eager or
paced) and one seed on a long-tail task mix (`cell_args`); `summarize` reads its row from the run's
files, async_report.py writes the report. Invariant: a cell runs at most once per output directory
(results.jsonl is the resume point), and a row's numbers come from its run directory alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from minirl.config import REPO_ROOT as REPO

ASYNC = ["async_rl.enabled=true"]
MODES = {
    "sync": [],
    "windowed": [*ASYNC, "async_rl.sampler.name=windowed"],
    "windowed+paced": [*ASYNC, "async_rl.sampler.name=windowed", "async_rl.sampler.admission=paced"],
    "weight_fifo": [*ASYNC, "async_rl.sampler.name=weight_fifo"],
    "weight_fifo+paced": [*ASYNC, "async_rl.sampler.name=weight_fifo", "async_rl.sampler.admission=paced"],
    "ready_first": [*ASYNC, "async_rl.sampler.name=ready_first"],
}
THREADS = ["policy.train_threads=1", "policy.generation.vllm_cfg.omp_threads=1"]


@dataclass(frozen=True)
class AsyncGrid:
    modes: tuple = tuple(MODES)
    seeds: tuple = (0, 1, 2)
    steps: int = 8
    prompts: int = 4
    generations: int = 2
    staleness: int = 1
    mix: tuple = (1, 2, 4, 8)
    max_calls: int = 10
    latency_per_room_s: float = 0.05
    val_prompts: int = 8

    @property
    def inflight(self) -> int:
        """`async_rl.max_inflight_prompts`: the window's groups, N * (S + 1), so an ungated sampler runs
        ahead by at most what the window can train (the default, 32, is 8 steps of 4 groups here)."""
        return self.prompts * (self.staleness + 1)


def cell_id(mode: str, seed: int) -> str:
    return f"{mode.replace('+', '_')}-s{seed}"


def cell_args(mode: str, seed: int, grid: AsyncGrid, run_dir: Path, attach: list[str]) -> list[str]:
    """The `minirl.train` overrides of one cell: prompts of 1, 2, 4 or 8 rooms (`env.num_rooms_choices`),
    tool time that grows with the rooms (`env.tool_latency_per_room_s`: an 8-room episode's every tool
    call sleeps 8x a 1-room one's), the compaction agent as shipped (recency compaction on). Modes
    (`MODES`): sync; async at staleness S with `windowed`, `weight_fifo` and upstream's `ready_first`,
    and `windowed` / `weight_fifo` with `async_rl.sampler.admission=paced`. Every mode has the same
    loss (importance-sampling correction truncated by `tis` at 2, as the async bench), one torch
    thread for the engine and one for the trainer, and no drop budget (the samplers that stamp no
    target step take none). A seed s sets `grpo.seed=42+s` and `env.data_seed=1234+s`, so within a
    seed every mode meets the same prompt stream and held-out set; the modes of a seed run side by
    side (`run_cells`), so their samples/s are compared under the same load (the machine is shared)."""
    return [
        *MODES[mode], f"async_rl.sampler.max_staleness_versions={grid.staleness}",
        f"async_rl.max_inflight_prompts={grid.inflight}",
        "loss_fn.use_importance_sampling_correction=true", "loss_fn.truncated_importance_sampling_type=tis",
        "loss_fn.truncated_importance_sampling_ratio=2.0",
        "async_rl.rollout_failure.max_skipped_prompts=0", "async_rl.rollout_failure.max_consecutive_dropped_prompts=0",
        f"grpo.seed={42 + seed}", f"env.data_seed={1234 + seed}", f"faults.seed={seed}",
        f"env.num_rooms_choices=[{','.join(map(str, grid.mix))}]",
        f"env.tool_latency_per_room_s={grid.latency_per_room_s}",
        f"agent.max_steps={grid.max_calls}", f"grpo.max_num_steps={grid.steps}",
        f"grpo.num_prompts_per_step={grid.prompts}",
        f"grpo.num_generations_per_prompt={grid.generations}", f"grpo.val_period={grid.steps}",
        f"grpo.val_num_prompts={grid.val_prompts}", *THREADS,
        "checkpoint.enabled=false", "logger.tensorboard=false", "logger.progress=false", f"run_dir={run_dir}",
        "run_dir_exists=overwrite", *attach,  # a cell not in results.jsonl runs again whole
    ]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def fates(run_dir: Path) -> tuple[dict, list[dict], list[dict]]:
    """(group fates by room count, metrics rows, events) of a run: minirl.experiments.stats.group_fates over the
    groups it dispatched (sync: every group of its completed steps) and those its steps took, and
    `stream`: the rollouts of the stream's first T * N prompts (T steps completed), which sync trains."""
    from minirl.config import load_config
    from minirl.data import num_rooms, task_seed
    from minirl.experiments.stats import group_fates

    cfg = load_config(str(run_dir / "config.yaml"))
    rows, events = _jsonl(run_dir / "metrics.jsonl"), _jsonl(run_dir / "events.jsonl")
    n = cfg.grpo.num_prompts_per_step
    if cfg.async_rl.enabled:
        dispatched = [(e["step"], e["group"]) for e in events if e.get("type") == "dispatch"]
    else:
        dispatched = [(s, g) for s in range(len(rows)) for g in range(n)]
    by_seed = {task_seed(cfg, *c): c for c in dispatched}
    trained = [by_seed[seed] for r in rows for seed in r["prompt_seeds"]]
    out = group_fates(lambda s, g: num_rooms(cfg, task_seed(cfg, s, g)), dispatched, trained,
                      cfg.grpo.num_generations_per_prompt, events)
    out["stream"] = Counter({})
    for s, g in ((s, g) for s in range(len(rows)) for g in range(n)):
        out["stream"][num_rooms(cfg, task_seed(cfg, s, g))] += cfg.grpo.num_generations_per_prompt
    if sum(out["rollouts_trained"].values()) != sum(r["rollouts_trained"] for r in rows):
        raise RuntimeError(f"{run_dir}: the fates count {sum(out['rollouts_trained'].values())} rollouts trained, "
                           f"the metrics {sum(r['rollouts_trained'] for r in rows)}")
    return out, rows, events


def summarize(mode: str, seed: int, run_dir: Path, proc: subprocess.CompletedProcess, wall: float) -> dict:
    """One cell's row, from its run's own files: every dispatched group's fate by room count
    (`fates`: trained, evicted, dropped, or unresolved at the end), the trained-difficulty skew (the
    room mix of the rollouts trained against the stream's first T * N prompts, which a sync run of T
    steps trains: within a seed every mode draws the same stream; and against the groups that met a
    fate, which leaves out those still in flight at the end), the generated tokens thrown away by
    evictions (the `evict` events' `gen_tokens` over the steps' `gen_tokens`), samples/s (rollouts
    trained / the summed `step_time_s`), the last steps' reward and the held-out reward after the
    last step; or, for a run that died, the last line of its stderr."""
    from minirl.experiments.stats import difficulty_skew

    row = {"cell": cell_id(mode, seed), "mode": mode, "seed": seed, "survived": proc.returncode == 0,
           "wall_s": round(wall, 1), "run_dir": str(run_dir)}
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        return {**row, "died_reason": lines[-1][:240] if lines else f"exit {proc.returncode}"}
    out, rows, events = fates(run_dir)
    vals = _jsonl(run_dir / "validation.jsonl")
    evicted_tokens = sum(e.get("gen_tokens", 0) for e in events if e.get("type") == "evict")
    gen_tokens = sum(r["gen_tokens"] for r in rows)
    pace = [e for e in events if e.get("type") == "pace"]
    return {
        **row, "steps": len(rows), **{k: dict(sorted(v.items())) for k, v in out.items()},
        **difficulty_skew(out["stream"], out["rollouts_trained"]),
        **{f"{k}_resolved": v for k, v in difficulty_skew(out["resolved"], out["rollouts_trained"]).items()},
        "rollouts_trained_total": sum(r["rollouts_trained"] for r in rows),
        "samples_per_s": sum(r["rollouts_trained"] for r in rows) / sum(r["step_time_s"] for r in rows),
        "gen_tokens": gen_tokens, "evicted_tokens": evicted_tokens,
        "eviction_fraction": evicted_tokens / gen_tokens if gen_tokens else 0.0,
        "staleness_mean": statistics.mean(r.get("staleness_mean", 0.0) for r in rows),
        "reward_last3": statistics.mean(r["reward_mean"] for r in rows[-3:]),
        "val_reward_final": vals[-1]["val_reward_mean"] if vals else float("nan"),
        "pace_holds": sum(e["decision"] == "hold" for e in pace),
        "pace_admitted_starving": sum(e["decision"] == "admit_starving" for e in pace),
        "pace_held_s": sum(e.get("held_s", 0.0) for e in pace),
    }


def run_cells(grid: AsyncGrid, out: Path, attach: list[str] | None) -> list[dict]:
    """Every (seed, mode) cell not in `out/results.jsonl` yet, seed-major, on one shared engine."""
    import ray

    from minirl.cluster import start_shared_generation
    from minirl.config import load_config

    out.mkdir(parents=True, exist_ok=True)
    done = {r["cell"]: r for r in _jsonl(out / "results.jsonl")}
    todo = [(m, s) for s in grid.seeds for m in grid.modes if cell_id(m, s) not in done]
    print(f"async bias: {len(todo)} cells to run, {len(done)} in {out / 'results.jsonl'}", flush=True)
    own = attach is None and bool(todo)
    try:
        if own:
            attach = start_shared_generation(load_config(None, THREADS), "async-bias-gen")
        for k, (mode, seed) in enumerate(todo):
            run_dir, t0 = out / "cells" / cell_id(mode, seed), time.time()
            proc = subprocess.run([sys.executable, "-m", "minirl.train", *cell_args(mode, seed, grid, run_dir, attach)],
                                  capture_output=True, text=True, cwd=REPO,
                                  env={**os.environ, "RAY_AUTH_MODE": "disabled"})
            row = summarize(mode, seed, run_dir, proc, time.time() - t0)
            with open(out / "results.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            done[row["cell"]] = row
            print(f"[{k + 1}/{len(todo)}] {row['cell']}: " + (f"shift {row['rooms_shift']:+.2f} rooms, evicted "
                  f"{row['eviction_fraction']:.0%} of tokens, {row['samples_per_s']:.2f} samples/s" if row["survived"]
                  else f"died: {row['died_reason']}") + f", {row['wall_s']}s", flush=True)
    finally:
        if own:
            ray.shutdown()
    return [done[cell_id(m, s)] for s in grid.seeds for m in grid.modes if cell_id(m, s) in done]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minirl.experiments.async_bias", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output directory (default runs/async-bias-<UTC time>)")
    ap.add_argument("--seeds", type=int, help="seeds 0..N-1 (default 3)")
    ap.add_argument("--steps", type=int, help="steps per cell (default 8)")
    ap.add_argument("--modes", help=f"comma-separated modes (default all: {','.join(MODES)})")
    ap.add_argument("--attach", nargs=2, metavar=("RAY_ADDRESS", "NAME"), help="attach to running generation workers")
    args = ap.parse_args(argv)
    grid = AsyncGrid()
    if args.seeds:
        grid = replace(grid, seeds=tuple(range(args.seeds)))
    if args.steps:
        grid = replace(grid, steps=args.steps)
    if args.modes:
        if unknown := set(args.modes.split(",")) - set(MODES):
            ap.error(f"unknown modes {sorted(unknown)}; known: {list(MODES)}")
        grid = replace(grid, modes=tuple(args.modes.split(",")))
    out = Path(args.out or REPO / "runs" / f"async-bias-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
    attach = None
    if args.attach:
        attach = [f"cluster.ray_address={args.attach[0]}", f"cluster.attach_generation_workers={args.attach[1]}"]
    t0 = time.time()
    rows = run_cells(grid, out, attach)
    from minirl.experiments.async_report import write_report

    write_report(rows, grid, out)
    print(f"\nwrote {out / 'results.jsonl'} and {out / 'report.md'} in {(time.time() - t0) / 60:.1f} min")
    print((out / "report.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
