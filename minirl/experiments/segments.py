"""The segments experiment: segment weighting (three ways) and segment validity (two ways) on the
sweep's harness, with what each one does to the difficulty of what is trained and to held-out reward.

    python -m minirl.experiments.segments --out runs/segments      # 9 cells, ~8 min on 2 CPU cores

Cells are the sweep's (minirl.experiments.cells: no faults, a task mix of 1-4 rooms), one per policy
(`minirl defaults` and grid.py's `segments ...` policies) and seed; a seed sets the prompts and the
sampling, so policies pair by seed. Invariant: the report is a function of results.csv and the cells'
run directories only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from minirl.experiments.grid import DEFAULTS, SEGMENT_POLICIES, Grid

WEIGHTINGS = tuple(p for p in SEGMENT_POLICIES if p != "segments any")

GRID = Grid(kinds=("guard_reject@room",), rates=(0.0,), policies=(DEFAULTS, *WEIGHTINGS), budgets=(4,),
            fractions=(0.75,), seeds=(0, 1, 2), steps=10, prompts=4, generations=4, val_period=5, val_prompts=16)
"""`segments any` is left out by default: only the ledger marks a single segment (a call a restarted
generation server lost), and this grid loses none, so it trains exactly what `all` does. `--policies`
adds it back."""


def mass_skew(run_dir: Path) -> dict:
    """The loss-mass room mean of the run's steps and its shift from the dispatched mean, and the
    mean number of segments (traces) per trained rollout.

    The report shows skew two ways: the sweep's rollout-count skew (mean rooms of the rollouts
    trained minus those dispatched: what masks and drops remove), and this loss-mass skew: each
    step's `loss_mass_by_group` (a group's trained tokens x their segment weight, as a share of the
    step's; one per group the step took, in `prompt_seeds`' order) weighted by its prompt's room
    count, minus the mean room count dispatched. Weighting moves the second and never the first (it
    trains the same rollouts, with other weights). A step that trained no token (every rollout
    masked: its shares are all 0) places no mass, and is left out of both means rather than read as
    mass on 0 rooms."""
    from minirl.config import load_config
    from minirl.data import num_rooms

    path = Path(run_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []
    massed = [r for r in rows if any(r["loss_mass_by_group"])]
    trained = sum(r["rollouts_trained"] for r in rows)
    out = {"segments_per_rollout": sum(r["traces_trained"] for r in rows) / trained if trained else float("nan")}
    if not massed:
        return {**out, "mass_rooms_mean": float("nan"), "mass_shift": float("nan")}
    cfg = load_config(str(Path(run_dir) / "config.yaml"))
    mass = dispatched = 0.0
    for r in massed:
        rooms = [num_rooms(cfg, seed) for seed in r["prompt_seeds"]]  # loss_mass_by_group's order
        mass += sum(m * k for m, k in zip(r["loss_mass_by_group"], rooms))
        dispatched += sum(rooms) / len(rooms)
    return {**out, "mass_rooms_mean": mass / len(massed), "mass_shift": (mass - dispatched) / len(massed)}


def report(rows: list[dict], grid: Grid) -> list[str]:
    """segments.md: per policy, mean ± 95% t-interval over seeds; against token_mean, paired by seed.
    A seed without a value (nan: a run that died before its first step) drops out of that field only,
    and a cell says how many seeds it holds where that is fewer than the policy ran, as the sweep's
    estimates do (minirl.experiments.estimates: the mean alone for one value, "–" for none)."""
    from minirl.experiments.estimates import Estimate, _ci, _values
    from minirl.experiments.stats import paired_ci

    fields = [("segments_per_rollout", "segments / rollout"), ("rooms_shift", "rollout-count skew (rooms)"),
              ("mass_shift", "loss-mass skew (rooms)"), ("val_reward_start", "held-out reward, start"),
              ("val_reward_final", "held-out reward, final")]
    by = {p: {r["seed"]: {**r, **mass_skew(r["run_dir"])} for r in rows if r["policy"] == p} for p in grid.policies}
    out = ["| policy | " + " | ".join(label for _, label in fields) + " |", "|---" * (len(fields) + 1) + "|"]
    for p, runs in by.items():
        rs = [{f: float(x[f]) for f, _ in fields} for x in runs.values()]
        n = {f: len(_values(rs, f)) for f, _ in fields}
        out.append(f"| {p} | " + " | ".join(_ci(rs, f, 3) + (f" (n={n[f]})" if 0 < n[f] < len(rs) else "")
                                            for f, _ in fields) + " |")
    out += ["", f"Against `{DEFAULTS}` (token_mean, all), per-seed differences (mean ± 95% t-interval, n pairs):", "",
            "| policy | loss-mass skew | held-out reward, final |", "|---|---|---|"]
    base = by[DEFAULTS]
    for p, runs in by.items():
        if p == DEFAULTS:
            continue
        d = [paired_ci({s: float(x[f]) for s, x in runs.items()}, {s: float(x[f]) for s, x in base.items()})
             for f in ("mass_shift", "val_reward_final")]
        out.append(f"| {p} | " + " | ".join(f"{Estimate('', *e).text(3)} (n={e[2]})" for e in d) + " |")
    return out


def main(argv=None) -> int:
    from minirl.experiments.cells import run_sweep

    ap = argparse.ArgumentParser(prog="python -m minirl.experiments.segments", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the sweep's output directory (results.csv, cells/)")
    ap.add_argument("--seeds", type=int, help="seeds 0..N-1 (default 3)")
    ap.add_argument("--steps", type=int, help="steps per cell (default 10)")
    ap.add_argument("--policies", help=f"comma-separated, of {DEFAULTS!r} and {', '.join(SEGMENT_POLICIES)}")
    args = ap.parse_args(argv)
    grid = Grid(**{**GRID.__dict__, **({"seeds": tuple(range(args.seeds))} if args.seeds else {}),
                   **({"steps": args.steps} if args.steps else {}),
                   **({"policies": tuple(args.policies.split(","))} if args.policies else {})})
    rows = run_sweep(grid, Path(args.out), False)
    text = "\n".join(report(rows, grid))
    (Path(args.out) / "segments_table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
