"""report.md of a sweep: the method, a table per fault mode (mean ± 95% interval over seeds), the
answers to the four questions (questions.py), which differences are real (paired by seed), the
skew verdicts, what to pick, why runs died, and the plots. Invariant: the report is a function of
results.csv's rows and the cells' run directories only, so a resumed sweep writes the same report."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from minirl.experiments.estimates import (_at, _by_rooms, _ci, _cells, _differs, _mean, _rate, _skew_verdict, at_text,
                                          cell_name, kind_text)
from minirl.experiments.grid import DEFAULTS, ON_DEFAULTS, Grid
from minirl.experiments.plots import make_plots
from minirl.experiments.questions import four_questions, what_to_pick

def write_report(rows: list[dict], grid: Grid, out: Path, title: str) -> list[Path]:
    cells = _cells(rows, grid)
    answers = {(kind, rate): four_questions(_at(cells, grid, kind, rate))  # each mode at its highest rate
               for kind in grid.kinds for rate in [max(r for (k, r, *_) in cells if k == kind)]}
    plots = make_plots(rows, grid, out, answers)
    lines = _method(rows, grid, cells, title)
    for kind in grid.kinds:
        lines += _mode_table(cells, grid, kind)
    for (kind, rate), qs in answers.items():
        if qs:
            lines += [f"## The questions of issue M: {kind} {_rate(kind, rate)}{at_text(grid)}", ""]
            for q, ans, _ in qs:
                lines += [f"**{q}** " + " ".join(ans), ""]
    lines += _differences(cells, grid)
    lines += ["", "## Bias: what reached the optimizer", ""]
    for (kind, rate, policy, budget, frac), rs in cells.items():
        lines.append(f"- {kind} {_rate(kind, rate)}, {cell_name(grid, policy, budget, frac)}: {_skew_verdict(rs)}.")
    lines += ["", "## What to pick", "", *what_to_pick(cells, grid), ""]
    lines += _why_died(rows)
    lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    (out / "report.md").write_text("\n".join(lines))
    return plots


def _method(rows: list[dict], grid: Grid, cells: dict[tuple, list[dict]], title: str) -> list[str]:
    lines = [f"# {title}", "", f"Generated {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC by "
             f"`python -m minirl.experiments.sweep`; {len(rows)} runs ({len(cells)} cells x "
             f"{len({r['seed'] for r in rows})} seeds), "
             f"{grid.steps} steps of {grid.prompts} groups x {grid.generations} rollouts each, on the tiny default "
             f"model, a task mix of {'/'.join(map(str, grid.mix))} rooms, at most {grid.max_calls} model calls "
             "per episode.", "",
             "Each cell: the upstream preset plus the named fixes (minirl defaults: the shipped config), one drop "
             "budget (`max_consecutive_dropped_prompts`), the floor (`min_step_batch_fraction`, forced to 1 without "
             "fix 1), and one fault mode at one rate. A seed sets the fault stream, the sampling and the prompts, "
             "so within a seed every policy meets the same prompts, held-out set and fault draws. Numbers are "
             "mean ± the 95% t-interval over seeds; two policies are compared by their per-seed differences "
             "(mean ± the 95% t-interval of the differences: an interval that excludes 0 is a paired t-test at 5%). "
             "Fraction trained: rollouts that reached an optimizer step over the rollouts `/run` returned. "
             "Validation: the mean reward of held-out prompts (never trained "
             f"on, no faults), {grid.val_prompts} per validation, at start and every {grid.val_period} steps; final = "
             "the last one the run reached. Skew: the mean room count of the rollouts trained minus that of the "
             "rollouts dispatched (negative: training saw an easier mix than it was given), and the total-variation "
             "distance between the two mixes.", ""]
    return lines


def _mode_table(cells: dict[tuple, list[dict]], grid: Grid, kind: str) -> list[str]:
    lines = [f"## {kind}", "", kind_text(kind) + ".", "",
             "| policy | budget | floor | rate | survived | dropped / masked / re-sent a run | fraction trained "
             "| val reward start | val reward final | val success final | final val reward by rooms "
             "| rooms trained − dispatched | TV skew |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (k, rate, policy, budget, frac), rs in cells.items():
        if k != kind:
            continue
        died = [str(r["died_at_step"]) for r in rs if not r["survived"]]
        surv = f"{len(rs) - len(died)}/{len(rs)}" + (f" (died at step {','.join(died)})" if died else "")
        counts = " / ".join(f"{_mean(rs, f):.1f}"
                            for f in ("groups_dropped", "rollouts_masked", "groups_redispatched"))
        lines.append(f"| {policy} | {budget} | {frac} | {_rate(kind, rate)} | {surv} | {counts} "
                     f"| {_ci(rs, 'fraction_trained')} | {_ci(rs, 'val_reward_start')} "
                     f"| {_ci(rs, 'val_reward_final')} | {_ci(rs, 'val_success_final')} | {_by_rooms(rs, grid.mix)} "
                     f"| {_ci(rs, 'rooms_shift')} | {_ci(rs, 'skew_tv')} |")
    rooms = " / ".join(f"{k} room(s)" for k in grid.mix)
    lines += ["", f"Final val reward by rooms: {rooms}, mean over seeds. Dropped / masked / re-sent: prompt "
              "groups dropped, rollouts masked, groups redispatched, mean per run.", ""]

    return lines


def _base_cell(cells: dict[tuple, list[dict]], grid: Grid, base: str, cell: tuple) -> tuple | None:
    """The `base` cell that `cell` (kind, rate, policy, budget, floor) is compared with: the same mode, rate
    and drop budget, and the same floor where base ran it (else base's first). A policy on the shipped config
    runs at its own budget, so a base on it matches any budget, and a policy on it meets the base at the
    grid's first budget (as `_at` takes them). None where base ran no such cell."""
    kind, rate, policy, budget, frac = cell
    same = [key for key in cells if key[:3] == (kind, rate, base) and (
        key[3] == budget or base in ON_DEFAULTS or policy in ON_DEFAULTS and key[3] == grid.budgets[0])]
    return next((key for key in same if key[4] == frac), same[0] if same else None)


def _differences(cells: dict[tuple, list[dict]], grid: Grid) -> list[str]:
    base = DEFAULTS if DEFAULTS in grid.policies else grid.policies[0]
    lines = ["## Which differences are real", "",
             f"Each policy against `{base}` in the same mode and rate, at the same drop budget (and floor, where "
             f"`{base}` ran it; a policy on the shipped config runs at its own): the per-seed difference "
             f"(policy − {base}), mean ± its 95% t-interval. Each line names the two cells compared.", ""]
    for (kind, rate, policy, budget, frac), rs in cells.items():
        if policy == base or not any(k[:3] == (kind, rate, base) for k in cells):
            continue
        ref = _base_cell(cells, grid, base, (kind, rate, policy, budget, frac))
        this = f"- {kind} {_rate(kind, rate)}, {cell_name(grid, policy, budget, frac)}"
        if ref is None:
            lines.append(f"{this}: no `{base}` cell at budget {budget} to compare with.")
            continue
        lines.append(f"{this} − {cell_name(grid, *ref[2:])}: final val reward "
                     f"{_differs(rs, cells[ref], 'val_reward_final')}; "
                     f"skew {_differs(rs, cells[ref], 'rooms_shift')}.")
    if len(grid.policies) < 2:
        lines.append("- One policy only: nothing to compare.")
    return lines


def _why_died(rows: list[dict]) -> list[str]:
    died = [r for r in rows if not r["survived"]]
    if not died:
        return []
    lines = ["## Why runs died", ""]
    reasons = {}
    for r in died:
        key = r["died_reason"].split(":")[0]
        reasons.setdefault(key, []).append(r)
    for key, rs in sorted(reasons.items()):
        lines.append(f"- `{key}` ({len(rs)} runs), e.g. {rs[0]['cell']}: `{rs[0]['died_reason'][:200]}`")
    return lines + [""]
