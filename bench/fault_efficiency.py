"""P3: the fraction of generated rollouts that reach an optimizer step, per failure policy, at
0%, 2%, 5% and 10% injected `agent_exception` rates, on identical fault streams.

    python bench/fault_efficiency.py --quick        # the 5% rate only, 4 steps per cell
    python bench/fault_efficiency.py                # all four rates, 20 steps per cell (the README's figures)

A thin preset of the sweep, minirl.experiments (same cells, same engine reuse): the upstream
preset, fix 1 alone (+shrink), fix 3 alone (+redispatch) and all fixes, drop budget 5, floor
0.75 where fix 1 allows a floor below 1; and `python -m minirl.train` as shipped ("minirl
defaults", its own budgets). 8 groups x 4 rollouts per step. "Generated" counts the
rollouts `/run` returned (a crashed attempt returns none); "trained" those in an optimizer step
with mask 1. Targets at 5%: >= 0.99 with redispatch, >= 0.95 with shrink alone; upstream dies.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from minirl.experiments.cells import run_sweep
from minirl.experiments.grid import Grid


def main(argv=None, attach: list[str] | None = None) -> int:
    """`attach`: overrides that attach the cells to generation workers already running (the suite's
    shared engine, tests/integration/test_benches.py); None: the sweep starts its own, once."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None, help="keep the cells here (default: a temporary directory)")
    ap.add_argument("--rates", help="comma-separated rates (overrides the preset)")
    ap.add_argument("--policies", help="comma-separated policies (overrides the preset)")
    ap.add_argument("--steps", type=int, help="steps per cell (overrides the preset)")
    args = ap.parse_args(argv)
    rates = (0.05,) if args.quick else (0.0, 0.02, 0.05, 0.1)
    rates = tuple(float(r) for r in args.rates.split(",")) if args.rates else rates
    policies = ("upstream", "+shrink", "+redispatch", "all fixes", "minirl defaults")
    policies = tuple(args.policies.split(",")) if args.policies else policies
    grid = Grid(kinds=("agent_exception",), rates=rates, policies=policies, budgets=(5,), fractions=(0.75,),
                seeds=(0,), steps=args.steps or (4 if args.quick else 20), prompts=8, generations=4)
    with tempfile.TemporaryDirectory() as tmp:
        rows = run_sweep(grid, Path(args.out or tmp), fresh_engines=False, attach=attach)
    print()
    print("| policy | " + " | ".join(f"{r:.0%}" for r in rates) + " |")
    print("|---|" + "---|" * len(rates))
    for policy in policies:
        cells = []
        for rate in rates:
            r = next(x for x in rows if x["policy"] == policy and x["rate"] == rate)
            alive = "" if r["survived"] else f" (died at step {r['died_at_step']})"
            cells.append(f"{r['fraction_trained']:.3f}{alive}")
        print(f"| {policy} | " + " | ".join(cells) + " |")
    own = next((f" (minirl defaults: its own, {r['budget']})" for r in rows if r["policy"] == "minirl defaults"), "")
    print(f"\nP3 fraction of generated rollouts trained, agent_exception, {grid.steps} steps of 8 x 4, "
          f"drop budget 5{own}. Targets at 5%: >= 0.99 with redispatch, >= 0.95 with shrink alone; upstream dies.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
