"""Compare failure policies and drop budgets on identical, seeded fault streams.

    python scripts/compare_drop_budgets.py --quick --out /tmp/cmp     # <= 10 min on 2 CPU cores
    python scripts/compare_drop_budgets.py --out runs/compare          # the README's grid

Each cell is a real `python -m minirl.train` run of the upstream preset
(configs/upstream_pr4124.yaml) with some of the review's fixes turned back on, one drop budget,
one floor, and one fault kind at one per-rollout rate. Faults come from the seeded fault
injection, a pure function of (seed, kind, step, group, rollout, attempt), so every policy meets
the same failure stream.

Ray and the vLLM engine start once per sweep: the script starts a Ray head and a detached,
named generation worker, and each cell attaches to it (`cluster.attach_generation_workers`),
resetting its fault plan and weights. A cell then skips ~20 s of engine start-up; `--fresh-engines`
starts everything per cell instead. Cells run in the order printed at the start; the sweep resumes
from `results.csv` (cells already there are skipped). Outputs in --out: results.csv, report.md,
and PNG plots.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as dt
import itertools
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

POLICIES = {
    "upstream": [],
    "+shrink": ["context_compaction.allow_step_shrink=true"],
    "+end_episode": ["agent.context_history.guards.on_reject=end_episode"],
    "+redispatch": ["context_compaction.redispatch_dropped_groups=true"],
    "all fixes": [
        "context_compaction.allow_step_shrink=true",
        "agent.context_history.guards.on_reject=end_episode",
        "context_compaction.redispatch_dropped_groups=true",
    ],
    "minirl defaults": [],
}
DEFAULTS = "minirl defaults"  # no preset: `python -m minirl.train` as shipped (fixes on, its own budgets)
SHRINKS = {"+shrink", "all fixes"}  # upstream forces the floor to 100% without fix 1

COLUMNS = [
    "cell", "kind", "rate", "policy", "budget", "fraction", "seed", "survived", "died_at_step", "died_reason",
    "steps_completed", "steps_target", "groups_dropped", "rollouts_masked", "groups_redispatched",
    "rollouts_generated", "rollouts_trained", "fraction_trained", "mean_groups_trained", "mean_rollouts_trained",
    "final_reward", "wall_s", "run_dir",
]


@dataclass(frozen=True)
class Grid:
    kinds: tuple
    rates: tuple
    policies: tuple
    budgets: tuple
    fractions: tuple
    seeds: tuple
    steps: int
    prompts: int
    generations: int

    def cells(self):
        seen = set()
        for kind, rate, policy, budget, fraction, seed in itertools.product(
            self.kinds, self.rates, self.policies, self.budgets, self.fractions, self.seeds
        ):
            if policy == DEFAULTS:  # the shipped budgets, whatever the grid's
                rf = _defaults().async_rl.rollout_failure
                budget, fraction = rf.max_consecutive_dropped_prompts, rf.min_step_batch_fraction
            frac = fraction if policy in SHRINKS | {DEFAULTS} else 1.0
            cell = {"kind": kind, "rate": rate, "policy": policy, "budget": budget, "fraction": frac, "seed": seed}
            if cell_id(cell) not in seen:
                seen.add(cell_id(cell))
                yield cell


def _defaults():
    from minirl.config import load_config

    return load_config()


# ~25 s a cell, ~15 s of it process start-up: 12 cells fit the 10-minute budget; budget 5 is in DEFAULT
QUICK = Grid(kinds=("guard_reject",), rates=(0.05, 0.15), policies=tuple(POLICIES), budgets=(0,), fractions=(0.75,),
             seeds=(0,), steps=4, prompts=4, generations=2)  # the review's 4 groups x 2 rollouts
# `timeout` is lane B too (INFRA, like agent_exception) but each hit costs rollout_timeout_s of wall
# time; add it with --kinds guard_reject,agent_exception,timeout
DEFAULT = Grid(kinds=("guard_reject", "agent_exception"), rates=(0.02, 0.05, 0.1), policies=tuple(POLICIES),
               budgets=(0, 5), fractions=(0.75,), seeds=(0,), steps=8, prompts=8, generations=4)


def cell_id(c: dict) -> str:
    return f"{c['kind']}-{c['rate']}-{c['policy'].replace(' ', '_').replace('+', 'plus_')}-b{c['budget']}-f{c['fraction']}-s{c['seed']}"


def cell_args(c: dict, grid: Grid, run_dir: Path, attach: list[str]) -> list[str]:
    if c["policy"] == DEFAULTS:
        args = []
    else:
        args = [
            "--config", str(REPO / "configs" / "upstream_pr4124.yaml"), *POLICIES[c["policy"]],
            f"async_rl.rollout_failure.max_consecutive_dropped_prompts={c['budget']}",
            f"async_rl.rollout_failure.min_step_batch_fraction={c['fraction']}",
        ]
    args += [
        f"faults.rate.{c['kind']}={c['rate']}", f"faults.seed={c['seed']}",
        f"grpo.max_num_steps={grid.steps}", f"grpo.num_prompts_per_step={grid.prompts}",
        f"grpo.num_generations_per_prompt={grid.generations}",
        "async_rl.rollout_failure.nemo_gym.rollout_timeout_s=8", "async_rl.rollout_failure.backoff_base_s=0.25",
        "async_rl.rollout_failure.max_backoff_s=2", "checkpoint.enabled=false", "logger.tensorboard=false",
        "logger.progress=false", f"run_dir={run_dir}",
    ]
    return args + attach


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
        more_generated, more_dropped = _died_step(run_dir, len(rows))
        generated, dropped = generated + more_generated, dropped + more_dropped
    return {
        **c, "cell": cell_id(c), "survived": not died, "died_at_step": len(rows) if died else "",
        "died_reason": (lines[-1][:240] if lines else f"exit {proc.returncode}") if died else "",
        "steps_completed": len(rows), "steps_target": grid.steps,
        "groups_dropped": dropped,
        "rollouts_masked": sum(r["rollouts_masked"] for r in rows),
        "groups_redispatched": sum(r["redispatched_groups"] for r in rows),
        "rollouts_generated": generated, "rollouts_trained": trained,
        "fraction_trained": round(trained / generated, 4) if generated else 0.0,
        "mean_groups_trained": round(sum(r["groups_trained"] for r in rows) / len(rows), 3) if rows else 0.0,
        "mean_rollouts_trained": round(trained / len(rows), 3) if rows else 0.0,
        "final_reward": rows[-1]["reward_mean"] if rows else "", "wall_s": round(wall, 1), "run_dir": str(run_dir),
    }


def _died_step(run_dir: Path, step: int) -> tuple[int, int]:
    """(rollouts generated, groups dropped) in the step that ended the run, which wrote no
    metrics line: its `run_failed` event counts the first, its `drop` events the second."""
    events = run_dir / "events.jsonl"
    if not events.exists():
        return 0, 0
    generated = drops = 0
    for line in events.read_text().splitlines():
        e = json.loads(line)
        if e.get("step") != step:
            continue
        if e.get("type") == "run_failed":
            generated = int(e.get("rollouts_generated", 0))
        drops += e.get("type") == "drop"
    return generated, drops


@contextlib.contextmanager
def shared_engines(fresh: bool):
    """Yields the overrides that attach a cell to the sweep's one generation worker, started here
    in the sweep's own Ray cluster (it ends with the sweep); with `fresh`, none: each cell starts
    its own."""
    if fresh:
        yield []
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


def run_sweep(grid: Grid, out: Path, fresh_engines: bool) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.csv"
    done = {}
    if results_path.exists():
        with open(results_path) as f:
            done = {row["cell"]: row for row in csv.DictReader(f)}
    cells = list(grid.cells())
    todo = [c for c in cells if cell_id(c) not in done]
    print(f"sweep: {len(cells)} cells, {len(done)} already in {results_path}, {len(todo)} to run "
          f"(order: kind, rate, policy, budget, fraction, seed)", flush=True)
    for i, c in enumerate(cells):
        print(f"  {i + 1:>3}. {cell_id(c)}{'  (done)' if cell_id(c) in done else ''}", flush=True)
    new_file = not results_path.exists()
    with shared_engines(fresh_engines or not todo) as attach, open(results_path, "a", newline="") as f:
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
    for k in ("rate", "fraction", "fraction_trained", "mean_groups_trained", "mean_rollouts_trained", "wall_s"):
        out[k] = float(out[k])
    for k in ("budget", "seed", "steps_completed", "steps_target", "groups_dropped", "rollouts_masked",
              "groups_redispatched", "rollouts_generated", "rollouts_trained"):
        out[k] = int(out[k])
    out["survived"] = str(out["survived"]) == "True"
    out["final_reward"] = float(out["final_reward"]) if out["final_reward"] not in ("", None) else None
    return out


# ------------------------------------------------------------------------------------------ report
def write_report(rows: list[dict], grid: Grid, out: Path, title: str) -> list[Path]:
    plots = make_plots(rows, grid, out)
    lines = [f"# {title}", "", f"Generated {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC by "
             f"`scripts/compare_drop_budgets.py`; {len(rows)} cells, {grid.steps} steps of "
             f"{grid.prompts} groups x {grid.generations} rollouts each, on the tiny default model.", "",
             "Each cell: the upstream preset plus the named fixes, one drop budget "
             "(`max_consecutive_dropped_prompts`), the floor (`min_step_batch_fraction`, forced to 1 without "
             "fix 1), and one fault kind at one per-rollout-attempt rate from `faults.seed`. "
             "Survival: ✓, or the step the run died at. Fraction trained: rollouts that reached an optimizer step "
             "over the rollouts `/run` returned (a crashed attempt returns none).", ""]
    for kind in grid.kinds:
        lines += [f"## {kind}", "", "| policy | budget | floor | " + " | ".join(f"{r:.0%}" for r in grid.rates) + " |",
                  "|---|---|---|" + "---|" * len(grid.rates)]
        combos = sorted({(r["policy"], r["budget"], r["fraction"]) for r in rows if r["kind"] == kind},
                        key=lambda k: (list(grid.policies).index(k[0]), k[1]))
        for policy, budget, frac in combos:
            cells = []
            for rate in grid.rates:
                rs = [r for r in rows if r["kind"] == kind and r["rate"] == rate and r["policy"] == policy
                      and r["budget"] == budget and r["fraction"] == frac]
                if not rs:
                    cells.append("–")
                    continue
                alive = all(r["survived"] for r in rs)
                surv = "✓" if alive else "✗ step " + ",".join(str(r["died_at_step"]) for r in rs if not r["survived"])
                ft = sum(r["fraction_trained"] for r in rs) / len(rs)
                steps = sum(r["steps_completed"] for r in rs) / len(rs)
                cells.append(f"{surv}; {ft:.2f}; {steps:.0f}/{grid.steps}")
            lines.append(f"| {policy} | {budget} | {frac} | " + " | ".join(cells) + " |")
        lines += ["", "Cell: survival; fraction trained; steps completed.", ""]
    died = [r for r in rows if not r["survived"]]
    if died:
        lines += ["## Why runs died", ""]
        reasons = {}
        for r in died:
            key = r["died_reason"].split(":")[0]
            reasons.setdefault(key, []).append(r)
        for key, rs in sorted(reasons.items()):
            lines.append(f"- `{key}` ({len(rs)} cells), e.g. {rs[0]['cell']}: `{rs[0]['died_reason'][:200]}`")
        lines.append("")
    lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    (out / "report.md").write_text("\n".join(lines))
    return plots


# a marker and dash per policy, so that policies with equal results stay visible on top of each other
STYLES = dict(zip(POLICIES, [("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", "-"), ("x", "--")]))


def _style(policy: str) -> dict:
    marker, dash = STYLES[policy]
    return {"marker": marker, "linestyle": dash, "label": policy, "alpha": 0.85, "markersize": 7}


def _in_plot(r: dict, kind: str, policy: str, budget: int) -> bool:
    return r["kind"] == kind and r["policy"] == policy and (r["budget"] == budget or policy == DEFAULTS)


def make_plots(rows: list[dict], grid: Grid, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kind, budget = grid.kinds[0], grid.budgets[0]
    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for policy in grid.policies:
        pts = sorted((r["rate"], r["steps_completed"] / r["steps_target"], r["fraction_trained"]) for r in rows
                     if _in_plot(r, kind, policy, budget))
        if pts:
            axes[0].plot([100 * p[0] for p in pts], [p[1] for p in pts], **_style(policy))
            axes[1].plot([100 * p[0] for p in pts], [p[2] for p in pts], **_style(policy))
    axes[0].set(xlabel=f"{kind} rate per rollout attempt (%)", ylabel="steps survived / steps planned",
                title=f"Survival ({kind}, drop budget {budget}; minirl defaults: its own)", ylim=(-0.05, 1.05))
    axes[1].set(xlabel=f"{kind} rate per rollout attempt (%)", ylabel="rollouts trained / rollouts generated",
                title=f"Fraction trained ({kind}, drop budget {budget})", ylim=(-0.05, 1.05))
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "survival_and_fraction_vs_rate.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    rate = max(grid.rates)
    for name, field, ylabel in (("reward_curve", "reward_mean", "mean reward (0-1)"),
                                ("effective_batch", "rollouts_trained", "rollouts trained per step")):
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for policy in grid.policies:
            r = next((r for r in rows if r["rate"] == rate and _in_plot(r, kind, policy, budget)), None)
            metrics = Path(r["run_dir"]) / "metrics.jsonl" if r else None
            if metrics and metrics.exists():
                m = [json.loads(line) for line in metrics.read_text().splitlines() if line]
                if m:
                    ax.plot([x["step"] + 1 for x in m], [x[field] for x in m], **_style(policy))
        ax.set(xlabel="optimizer step", ylabel=ylabel, title=f"{ylabel} ({kind} at {rate:.0%}, budget {budget})",
               xlim=(0.5, grid.steps + 0.5))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out / f"{name}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small grid, <= 10 min on 2 CPU cores")
    ap.add_argument("--out", default=None, help="output directory (default runs/compare-<UTC time>)")
    ap.add_argument("--fresh-engines", action="store_true", help="start Ray and vLLM per cell instead of once")
    ap.add_argument("--kinds", help="comma-separated fault kinds (overrides the preset)")
    ap.add_argument("--rates", help="comma-separated rates (overrides the preset)")
    ap.add_argument("--policies", help="comma-separated policies (overrides the preset)")
    ap.add_argument("--budgets", help="comma-separated drop budgets (overrides the preset)")
    ap.add_argument("--seeds", help="comma-separated fault seeds (overrides the preset)")
    ap.add_argument("--steps", type=int, help="steps per cell (overrides the preset)")
    args = ap.parse_args(argv)
    grid = QUICK if args.quick else DEFAULT
    changes = {}
    for key, conv in (("kinds", str), ("rates", float), ("policies", str), ("budgets", int), ("seeds", int)):
        if getattr(args, key):
            changes[key] = tuple(conv(v) for v in getattr(args, key).split(","))
    if args.steps:
        changes["steps"] = args.steps
    if changes:
        grid = Grid(**{**grid.__dict__, **changes})
    unknown = set(grid.policies) - set(POLICIES)
    if unknown:
        ap.error(f"unknown policies {sorted(unknown)}; known: {list(POLICIES)}")
    out = Path(args.out or REPO / "runs" / f"compare-{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%SZ}")
    t0 = time.time()
    rows = run_sweep(grid, out, args.fresh_engines)
    plots = write_report(rows, grid, out, "Drop budgets and failure policies" + (" (quick)" if args.quick else ""))
    print(f"\nwrote {out / 'results.csv'}, {out / 'report.md'} and {len(plots)} plots in {(time.time() - t0) / 60:.1f} min")
    print((out / "report.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
