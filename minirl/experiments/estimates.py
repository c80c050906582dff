"""Estimates over seeds: a cell's rows grouped by seed, a mean ± the half-width of its 95% t-interval
(minirl.experiments.stats.mean_ci), and two policies compared by their per-seed (paired) differences
(minirl.experiments.stats.paired_ci). Invariant: every number the report prints or plots comes through here,
and a difference is called resolved only when its interval excludes 0. Seeds that all give the same value
(no spread) give no t-interval, as one seed gives none: mean / (0 / sqrt n) is no t statistic, so such an
estimate is reported as "the same in every seed", never as resolved."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from minirl.experiments.grid import ON_DEFAULTS, OVERFLOW_TOKENS, Grid
from minirl.experiments.stats import mean_ci, paired_ci


def kind_text(kind: str) -> str:
    if kind == "overflow":
        return f"a real context guard of {OVERFLOW_TOKENS} tokens, no injected fault (longer episodes cross it)"
    if kind.endswith("@room"):
        return (f"`{kind[:-5]}` with a per-room hazard q (an n-room attempt fails with 1 - (1 - q)^n). Each attempt "
                "draws anew, so a re-sent rollout passes with probability (1 - q)^n: this mode is kind to redispatch. "
                "A failure that recurs on the same prompt (a real overflow, the `overflow` mode) would fail its "
                "re-sends too")
    return f"`{kind}` at a per-rollout-attempt rate, independent of the episode"


def _rate(kind: str, rate: float) -> str:
    return "–" if kind == "overflow" else f"{rate:.0%}"


def _cells(rows: list[dict], grid: Grid) -> dict[tuple, list[dict]]:
    """Rows by (kind, rate, policy, budget, floor), seeds together, in the grid's order."""
    out: dict[tuple, list[dict]] = {}
    def order(r: dict) -> tuple:
        return (list(grid.kinds).index(r["kind"]), r["rate"], list(grid.policies).index(r["policy"]), r["budget"],
                r["fraction"])

    for r in sorted(rows, key=order):
        out.setdefault((r["kind"], r["rate"], r["policy"], r["budget"], r["fraction"]), []).append(r)
    return out


def _values(rs: list[dict], field: str) -> list[float]:
    return [r[field] for r in rs if not math.isnan(r[field])]


def _ci(rs: list[dict], field: str, digits: int = 2) -> str:
    """`mean ± half-width` of the 95% t-interval over seeds; the mean alone for one seed."""
    mean, half = mean_ci(_values(rs, field))
    if math.isnan(mean):
        return "–"
    return f"{mean:.{digits}f}" + ("" if math.isnan(half) else f" ± {half:.{digits}f}")


def _by_rooms(rs: list[dict], mix: tuple) -> str:
    """The final validation reward per room count of `mix` (the grid's, the table header's order), each
    the mean over the seeds that measured it; "–" for a room count none did (the held-out set had none)."""
    per: dict[str, list[float]] = {}
    for r in rs:
        for k, v in json.loads(r["val_final_by_rooms"] or "{}").items():
            per.setdefault(k, []).append(v)
    return " / ".join(f"{sum(per[k]) / len(per[k]):.2f}" if k in per else "–" for k in map(str, mix))


@dataclass(frozen=True)
class Estimate:
    """A mean over seeds and the half-width of its 95% t-interval: one policy's value, or the paired
    (per-seed) difference of two policies' values."""

    label: str
    mean: float
    half: float
    n: int

    @property
    def spreadless(self) -> bool:
        """Two or more values, all the same (a half-width of 0, up to rounding): no t-interval, as R's
        t.test refuses "essentially constant" data. Two seeds that each differ by one held-out prompt of 8
        (+0.125, +0.125) are no evidence, yet the zero-width interval would exclude 0."""
        return self.half <= 1e-9 * abs(self.mean)

    @property
    def sign(self) -> int:
        """+1 or -1 where the interval excludes 0, 0 where it holds 0 or there is no interval (one seed,
        or seeds without spread)."""
        if math.isnan(self.mean) or math.isnan(self.half) or self.spreadless:
            return 0
        return 1 if self.mean - self.half > 0 else -1 if self.mean + self.half < 0 else 0

    def text(self, digits: int = 2) -> str:
        if math.isnan(self.mean):
            return "no value"
        if math.isnan(self.half):
            return f"{self.mean:+.{digits}f} (one seed: no interval)"
        return f"{self.mean:+.{digits}f} ± {self.half:.{digits}f}"

    def resolved(self, digits: int = 2) -> str:
        """The estimate, and whether it excludes 0 (a paired t-test at 5% for a difference)."""
        if math.isnan(self.half):
            return self.text(digits)
        if self.sign:
            return f"{self.text(digits)} (resolved: the interval excludes 0)"
        if self.half == 0 and self.mean == 0:
            return f"{self.text(digits)} (exactly 0 in every seed)"
        if self.spreadless:
            return f"{self.text(digits)} (the same in all {self.n} seeds: no spread, so no t-interval; not resolved)"
        return f"{self.text(digits)} (not resolvable: the interval holds 0)"


def _level(rs: list[dict], field: str, label: str = "") -> Estimate:
    vals = _values(rs, field)
    return Estimate(label, *mean_ci(vals), len(vals))


def _paired(a: list[dict], b: list[dict], field: str, label: str = "") -> Estimate:
    return Estimate(label, *paired_ci({r["seed"]: r[field] for r in a}, {r["seed"]: r[field] for r in b}))


def _skew_verdict(rs: list[dict]) -> str:
    e = _level(rs, "rooms_shift")
    if math.isnan(e.mean):
        return "no step completed"
    toward = {-1: "skews toward easy prompts", 1: "skews toward hard prompts"}
    if e.sign:
        return f"{toward[e.sign]}: {e.text()} rooms"
    return "no skew: " + e.resolved() if e.half == 0 and e.mean == 0 else f"no skew resolvable: {e.resolved()}"


def _mean(rs: list[dict], field: str) -> float:
    return sum(r[field] for r in rs) / len(rs)


def _at(cells: dict[tuple, list[dict]], grid: Grid, kind: str, rate: float) -> dict[str, list[dict]]:
    """A mode's rows at one rate by policy: the grid's first budget, and of a policy's floors the first the
    grid names (a policy without fix 1 runs at floor 1, which the grid need not name; the policies on the
    shipped config at their own budget and floor). `at_text` names them where the grid has more than one."""
    keys = [key for key in cells if key[:2] == (kind, rate) and (key[3] == grid.budgets[0] or key[2] in ON_DEFAULTS)]
    rank = {f: i for i, f in enumerate(grid.fractions)}
    first: dict[str, tuple] = {}
    for key in sorted(keys, key=lambda key: rank.get(key[4], len(rank))):
        first.setdefault(key[2], key)
    return {key[2]: cells[key] for key in keys if first[key[2]] == key}


def cell_name(grid: Grid, policy: str, budget: int, frac: float) -> str:
    """`policy (budget B)`, and its floor where the grid has more than one: the name of one cell."""
    return f"{policy} (budget {budget}" + (f", floor {frac}" if len(grid.fractions) > 1 else "") + ")"


def at_text(grid: Grid) -> str:
    """The budget and floor `_at` takes, where the grid has more than one of either; else ""."""
    parts = ([f"budget {grid.budgets[0]}"] if len(grid.budgets) > 1 else []) + (
        [f"floor {grid.fractions[0]}"] if len(grid.fractions) > 1 else [])
    return f" ({', '.join(parts)}; the policies on the shipped config at their own)" if parts else ""


def _differs(a: list[dict], b: list[dict], field: str) -> str:
    return _paired(a, b, field).resolved()
