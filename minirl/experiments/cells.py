"""Running the cells: one real `python -m minirl.train` subprocess per cell, attached to the sweep's
one shared generation worker, and each cell's row of results.csv summarised from its run directory.
Invariant: a cell runs at most once per output directory (results.csv is the resume point, a row
written and flushed as each cell ends), every row there ran the same run shape (steps, step size,
room mix, call cap, validation: `shape.json`, so a resume with another shape is refused rather than
mixed in), and a row's counts come from the run's own metrics.jsonl and events.jsonl, including the
step that ended a run (it wrote no metrics line)."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from minirl.experiments.grid import COLUMNS, FLOATS, REPO, Grid, cell_args, cell_id
from minirl.experiments.invariants import read_jsonl

def summarize(c: dict, grid: Grid, run_dir: Path, proc: subprocess.CompletedProcess, wall: float) -> dict:
    rows = []
    if (run_dir / "metrics.jsonl").exists():
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    died = proc.returncode != 0
    generated = sum(r["rollouts_generated"] for r in rows)
    trained = sum(r["rollouts_trained"] for r in rows)
    dropped = sum(r["dropped_prompt_groups"] for r in rows)
    if died:  # the step that died generated rollouts (and dropped groups) too, and trained none
        more_generated, more_dropped = died_step(read_jsonl(run_dir / "events.jsonl"), len(rows))
        generated, dropped = generated + more_generated, dropped + more_dropped
    return {
        **c, "cell": cell_id(c), "survived": not died, "died_at_step": len(rows) if died else "",
        "died_reason": (lines[-1][:240] if lines else f"exit {proc.returncode}") if died else "",
        "steps_completed": len(rows), "steps_target": grid.steps,
        "groups_dropped": dropped,
        "rollouts_masked": sum(r["rollouts_masked"] for r in rows),
        "groups_redispatched": sum(r["redispatched_groups"] for r in rows),
        "rollouts_generated": generated, "rollouts_trained": trained,
        "fraction_trained": round(trained / generated, 4) if generated else "",  # none generated: no value
        "mean_groups_trained": round(sum(r["groups_trained"] for r in rows) / len(rows), 3) if rows else 0.0,
        "mean_rollouts_trained": round(trained / len(rows), 3) if rows else 0.0,
        "final_reward": rows[-1]["reward_mean"] if rows else "", **learning(run_dir, rows),
        "wall_s": round(wall, 1), "run_dir": str(run_dir),
    }


def validations(run_dir: Path) -> list[dict]:
    path = run_dir / "validation.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def learning(run_dir: Path, rows: list[dict]) -> dict:
    """Validation at start and at the last validation, and the difficulty skew of the completed steps."""
    from minirl.config import load_config
    from minirl.data import num_rooms, task_seed
    from minirl.experiments.stats import difficulty_skew, rooms_mix

    vals = validations(run_dir)
    out = {"val_reward_start": vals[0]["val_reward_mean"] if vals else "",
           "val_reward_final": vals[-1]["val_reward_mean"] if vals else "",
           "val_success_final": vals[-1]["val_success_rate"] if vals else "",
           "val_final_by_rooms": json.dumps({k.rsplit("_", 1)[1]: v for k, v in (vals[-1] if vals else {}).items()
                                             if k.startswith("val_reward_mean_rooms_")})}
    if not rows:
        return {**out, "rooms_dispatched_mean": "", "rooms_trained_mean": "", "rooms_shift": "", "skew_tv": ""}
    cfg = load_config(str(run_dir / "config.yaml"))
    g = cfg.grpo
    for r in rows:  # the prompt stream recomputed is the one the run trained on
        if r["prompt_seeds"] != [task_seed(cfg, r["step"], k) for k in range(g.num_prompts_per_step)]:
            raise RuntimeError(f"{run_dir}: step {r['step']} dispatched other prompts than minirl.data gives")
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line]
    dispatched, trained = rooms_mix(lambda s, k: num_rooms(cfg, task_seed(cfg, s, k)), len(rows),
                                    g.num_prompts_per_step, g.num_generations_per_prompt, events)
    if sum(trained.values()) != sum(r["rollouts_trained"] for r in rows):
        raise RuntimeError(f"{run_dir}: the trained mix counts {sum(trained.values())} rollouts, the metrics "
                           f"{sum(r['rollouts_trained'] for r in rows)}")
    return {**out, **{k: round(v, 4) for k, v in difficulty_skew(dispatched, trained).items()}}


def died_step(events: list[dict], step: int) -> tuple[int, int]:
    """(rollouts generated, groups dropped) in `step`, the step that ended the run (the one after its last
    metrics line, which it never wrote), from the run's `events`: its `run_failed` event counts the first,
    its `drop` events the second. A `run_failed` without a step (the driver writes one when the controller
    does not answer) is this step's; it carries no count, so it leaves the controller's, if any, standing.
    scripts/summarize_experiments.py reads its rows the same way."""
    generated = drops = 0
    for e in events:
        if e.get("type") == "run_failed" and e.get("step") in (step, None):
            generated = max(generated, int(e.get("rollouts_generated") or 0))
        drops += e.get("type") == "drop" and e.get("step") == step
    return generated, drops


@contextlib.contextmanager
def shared_engines(fresh: bool, attach: list[str] | None = None):
    """Yields the overrides that attach a cell to the sweep's one generation worker, started here
    in the sweep's own Ray cluster (it ends with the sweep); with `fresh`, none: each cell starts
    its own; with `attach`, those overrides: the workers are someone else's and outlive the sweep."""
    if fresh or attach:
        yield [] if fresh else attach
        return
    import ray

    from minirl.cluster import start_shared_generation
    from minirl.config import load_config

    t0 = time.time()
    try:
        attach = start_shared_generation(load_config(str(REPO / "configs" / "upstream_pr4124.yaml")), "sweep-gen")
        print(f"engines started once for the sweep in {time.time() - t0:.1f}s", flush=True)
        yield attach
    finally:
        ray.shutdown()


def _same_shape(out: Path, grid: Grid, done: dict) -> None:
    """Every cell of a results.csv ran one run shape (`shape.json`, written by the sweep that began it;
    an older one without it: each row's `steps_target`); a sweep of another shape into it is refused."""
    shape = {k: list(v) if isinstance(v, tuple) else v for k, v in (
        ("steps", grid.steps), ("prompts", grid.prompts), ("generations", grid.generations), ("mix", grid.mix),
        ("max_calls", grid.max_calls), ("val_period", grid.val_period), ("val_prompts", grid.val_prompts))}
    path = out / "shape.json"
    held = json.loads(path.read_text()) if path.exists() else None
    if held is None and done:
        held = {"steps": int(next(iter(done.values()))["steps_target"])}
        if any(int(row["steps_target"]) != held["steps"] for row in done.values()):
            raise SystemExit(f"{out / 'results.csv'} holds cells of several step counts: use another --out")
    differs = {k: (v, shape[k]) for k, v in (held or {}).items() if shape.get(k) != v}
    if differs:
        raise SystemExit(f"{out / 'results.csv'} holds cells of another run shape ("
                         + ", ".join(f"{k} {a} there, {b} here" for k, (a, b) in differs.items())
                         + "): use another --out, or the same shape to resume")
    if not path.exists():
        path.write_text(json.dumps(shape) + "\n")


def run_sweep(grid: Grid, out: Path, fresh_engines: bool, attach: list[str] | None = None) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.csv"
    done = {}
    if results_path.exists():
        with open(results_path) as f:
            reader = csv.DictReader(f)
            done = {row["cell"]: row for row in reader}
        if reader.fieldnames != COLUMNS:
            raise SystemExit(f"{results_path} has other columns (an older sweep): use another --out")
    _same_shape(out, grid, done)
    cells = list(grid.cells())
    todo = [c for c in cells if cell_id(c) not in done]
    print(f"sweep: {len(cells)} cells, {len(done)} already in {results_path}, {len(todo)} to run "
          f"(order: seed, kind, rate, policy, budget, fraction)", flush=True)
    for i, c in enumerate(cells):
        print(f"  {i + 1:>3}. {cell_id(c)}{'  (done)' if cell_id(c) in done else ''}", flush=True)
    new_file = not results_path.exists()
    with shared_engines(fresh_engines or not todo, attach) as attach, open(results_path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        if new_file:
            writer.writeheader()
        t_sweep = time.time()
        for k, c in enumerate(todo):
            run_dir = out / "cells" / cell_id(c)
            t0 = time.time()
            proc = subprocess.run(
                [sys.executable, "-m", "minirl.train", *cell_args(c, grid, run_dir, attach)],
                capture_output=True, text=True, cwd=REPO, env={**os.environ, "RAY_AUTH_MODE": "disabled"},
            )
            row = summarize(c, grid, run_dir, proc, time.time() - t0)
            writer.writerow(row)
            f.flush()
            done[row["cell"]] = row
            eta = (time.time() - t_sweep) / (k + 1) * (len(todo) - k - 1)
            status = "survived" if row["survived"] else f"died at step {row['died_at_step']}"
            print(f"[{k + 1}/{len(todo)}] {row['cell']}: {status}, fraction trained {row['fraction_trained']}, "
                  f"{row['wall_s']}s (eta {eta / 60:.1f} min)", flush=True)
    return [_typed(done[cell_id(c)]) for c in cells]


def _typed(row: dict) -> dict:
    out = dict(row)
    for k in FLOATS:  # nan where a cell has no value (a run that died before any step)
        out[k] = float(out[k]) if out[k] not in ("", None) else float("nan")
    for k in ("budget", "seed", "steps_completed", "steps_target", "groups_dropped", "rollouts_masked",
              "groups_redispatched", "rollouts_generated", "rollouts_trained"):
        out[k] = int(out[k])
    out["survived"] = str(out["survived"]) == "True"
    return out
