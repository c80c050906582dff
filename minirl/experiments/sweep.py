"""Compare failure policies and drop budgets on identical, seeded fault streams, and measure what
each policy makes the model learn.

    python -m minirl.experiments.sweep --quick --out /tmp/cmp     # <= 10 min on 2 CPU cores
    python -m minirl.experiments.sweep --out docs/experiments/default   # the README's grid

Each cell is a real `python -m minirl.train` run of the upstream preset
(configs/upstream_pr4124.yaml) with some of the review's fixes turned back on, one drop budget,
one floor, one fault mode at one rate, and one seed, on a task mix of 1 to 4 rooms
(`env.num_rooms_choices`), validated on held-out prompts without faults (minirl.validation).
Fault modes (`--kinds`):
- `KIND`: a coin per rollout attempt at the rate (`faults.rate.KIND`), independent of the episode;
- `KIND@room`: correlated with difficulty, the rate is a per-room hazard q (`faults.rate_per_room`),
  so an n-room attempt fails with 1 - (1 - q)**n;
- `overflow`: no injected fault; a real context guard (`agent.context_history.guards.max_total_tokens`,
  OVERFLOW_TOKENS) that long, many-room episodes cross and short ones rarely do (the rate is unused).
A seed s sets `faults.seed=s`, `grpo.seed=42+s` and `env.data_seed=1234+s`: every policy meets the
same prompts and the same fault stream within a seed, and `--seeds N` repeats each cell N times.

The report gives each cell as mean ± the 95% t-interval over seeds, compares policies by their
per-seed (paired) differences (minirl.stats.paired_ci), measures the difficulty skew of what each
policy trained (minirl.stats: the room mix of rollouts that reached the optimizer against the mix
dispatched, recomputed from the prompt stream and events.jsonl, which assumes sync steps: every
group of step s is a prompt (s, k) of minirl.data), answers the four questions (questions.py) for each
mode (does shrink's dropping skew training toward easy prompts, does end_episode's masking, does
redispatch avoid it, does `grpo.baseline_excludes_masked` change the outcome), and draws validation
learning curves with seed bands, the skew, and the estimates behind the answers.

Ray and the vLLM engine start once per sweep: the script starts a Ray head and a detached,
named generation worker, and each cell attaches to it (`cluster.attach_generation_workers`),
resetting its fault plan and weights. A cell then skips ~20 s of engine start-up; `--fresh-engines`
starts everything per cell instead, and `--attach` attaches the cells to generation workers that
are already running (the test suite's, say) instead of starting the sweep's own. Cells run in the
order printed at the start; the sweep resumes from `results.csv` (cells already there are skipped).
Outputs in --out: results.csv, report.md, and PNG plots.
"""

from __future__ import annotations

import argparse
import datetime as dt
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
                    help="attach every cell to running detached generation workers NAME-<rank> in the Ray cluster at RAY_ADDRESS")
    ap.add_argument("--kinds", help="comma-separated fault kinds (overrides the preset)")
    ap.add_argument("--rates", help="comma-separated rates (overrides the preset)")
    ap.add_argument("--policies", help="comma-separated policies (overrides the preset)")
    ap.add_argument("--budgets", help="comma-separated drop budgets (overrides the preset)")
    ap.add_argument("--seeds", type=int, help="seeds per cell, 0..N-1 (overrides the preset)")
    ap.add_argument("--steps", type=int, help="steps per cell (overrides the preset)")
    args = ap.parse_args(argv)
    grid = QUICK if args.quick else DEFAULT
    changes = {}
    for key, conv in (("kinds", str), ("rates", float), ("policies", str), ("budgets", int)):
        if getattr(args, key):
            changes[key] = tuple(conv(v) for v in getattr(args, key).split(","))
    if args.seeds:
        changes["seeds"] = tuple(range(args.seeds))
    if args.steps:
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
    attach = [f"cluster.ray_address={args.attach[0]}", f"cluster.attach_generation_workers={args.attach[1]}"] if args.attach else None
    rows = run_sweep(grid, out, args.fresh_engines, attach)
    plots = write_report(rows, grid, out, "Drop budgets and failure policies" + (" (quick)" if args.quick else ""))
    print(f"\nwrote {out / 'results.csv'}, {out / 'report.md'} and {len(plots)} plots in {(time.time() - t0) / 60:.1f} min")
    print((out / "report.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
