"""Compare failure policies and drop budgets on identical, seeded fault streams, and measure what
each policy makes the model learn (the method and the grids: docs/experiments.md).

    python -m minirl.experiments.sweep --quick --out /tmp/cmp     # <= 10 min on 2 CPU cores
    python -m minirl.experiments.sweep --out docs/experiments/default   # the README's grid

Each cell is a real `python -m minirl.train` run (grid.py, cells.py) attached to one generation worker
that the sweep starts once. Writes results.csv, report.md and PNG plots to --out. Invariant: within a
seed every policy meets the same prompts and fault stream, and a cell in results.csv never runs again.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import sys
import time
from pathlib import Path

from minirl.experiments.cells import run_sweep
from minirl.experiments.grid import DEFAULT, POLICIES, QUICK, REPO, Grid
from minirl.experiments.report import write_report

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minirl.experiments.sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small grid, <= 10 min on 2 CPU cores")
    ap.add_argument("--out", default=None, help="output directory (default runs/compare-<UTC time>)")
    ap.add_argument("--fresh-engines", action="store_true", help="start Ray and vLLM per cell instead of once")
    ap.add_argument("--attach", nargs=2, metavar=("RAY_ADDRESS", "NAME"),
                    help="attach every cell to running detached generation workers NAME-<rank> in the Ray "
                    "cluster at RAY_ADDRESS")
    ap.add_argument("--kinds", help="comma-separated fault modes (overrides the preset): KIND, a coin per rollout "
                    "attempt (faults.rate.KIND); KIND@room, a per-room hazard q, so an n-room attempt fails with "
                    "1 - (1 - q)**n (faults.rate_per_room); overflow, no injected fault but a real context guard "
                    "that long episodes cross")
    ap.add_argument("--rates", help="comma-separated rates, each in [0, 1] (overrides the preset)")
    ap.add_argument("--policies", help="comma-separated policies (overrides the preset)")
    ap.add_argument("--budgets", help="comma-separated drop budgets, each >= 0 (overrides the preset)")
    ap.add_argument("--seeds", type=int, help="seeds per cell, 0..N-1, N >= 1 (overrides the preset)")
    ap.add_argument("--steps", type=int, help="steps per cell, >= 1 (overrides the preset)")
    args = ap.parse_args(argv)
    grid = QUICK if args.quick else DEFAULT
    changes = {}
    for key, conv in (("kinds", str), ("rates", float), ("policies", str), ("budgets", int)):
        if getattr(args, key) is not None:
            try:
                changes[key] = tuple(conv(v) for v in getattr(args, key).split(","))
            except ValueError as exc:
                ap.error(f"--{key}: {exc}")
    # refused here, before the engine starts: a cell's own ConfigError would be recorded as a death at step 0
    if any(not (math.isfinite(r) and 0 <= r <= 1) for r in changes.get("rates", ())):
        ap.error(f"--rates: each must be a probability in [0, 1], got {args.rates}")
    if any(b < 0 for b in changes.get("budgets", ())):
        ap.error(f"--budgets: each must be >= 0, got {args.budgets}")
    for key in ("seeds", "steps"):
        if getattr(args, key) is not None and getattr(args, key) < 1:
            ap.error(f"--{key}: must be >= 1, got {getattr(args, key)}")
    if args.seeds is not None:
        changes["seeds"] = tuple(range(args.seeds))
    if args.steps is not None:
        changes["steps"] = args.steps
    if changes:
        grid = Grid(**{**grid.__dict__, **changes})
    unknown = set(grid.policies) - set(POLICIES)
    if unknown:
        ap.error(f"unknown policies {sorted(unknown)}; known: {list(POLICIES)}")
    from minirl.faults import AGENT_SIDE_KINDS, FAULT_KINDS

    for kind in grid.kinds:
        if not (kind == "overflow" or kind in FAULT_KINDS or kind.endswith("@room") and all(
                k in AGENT_SIDE_KINDS for k in kind[:-5].split("+"))):
            ap.error(f"unknown fault mode {kind!r}: overflow, one of {', '.join(FAULT_KINDS)}, "
                     f"or KIND@room (KIND+KIND@room for several) for one of {', '.join(AGENT_SIDE_KINDS)}")
    out = Path(args.out or REPO / "runs" / f"compare-{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%SZ}")
    t0 = time.time()
    attach = None
    if args.attach:
        attach = [f"cluster.ray_address={args.attach[0]}", f"cluster.attach_generation_workers={args.attach[1]}"]
    rows = run_sweep(grid, out, args.fresh_engines, attach)
    plots = write_report(rows, grid, out, "Drop budgets and failure policies" + (" (quick)" if args.quick else ""))
    print(f"\nwrote {out / 'results.csv'}, {out / 'report.md'} and {len(plots)} plots "
          f"in {(time.time() - t0) / 60:.1f} min")
    print((out / "report.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
