"""The sweep's PNG plots: survival and fraction trained against the rate, validation curves with seed
bands, the trained-difficulty skew, reward and effective batch per step, and the estimates behind the
four questions. Invariant: plots only read results.csv's rows and the cells' run directories; a
policy keeps one marker and dash in every plot."""

from __future__ import annotations

import itertools

import json
import math
from pathlib import Path

from minirl.experiments.cells import validations
from minirl.experiments.estimates import _rate, _values
from minirl.experiments.grid import ON_DEFAULTS, POLICIES, Grid
from minirl.experiments.stats import mean_ci

# a marker and dash per policy, so that policies with equal results stay visible on top of each other
STYLES = dict(zip(POLICIES, itertools.cycle([("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", "-"),
                                             ("x", "--"), ("P", "-.")])))
"""A marker and a dash per policy (cycled: the policies outnumber the markers)."""


def _style(policy: str) -> dict:
    marker, dash = STYLES[policy]
    return {"marker": marker, "linestyle": dash, "label": policy, "alpha": 0.85, "markersize": 7}


def _in_plot(r: dict, kind: str, policy: str, budget: int) -> bool:
    return r["kind"] == kind and r["policy"] == policy and (r["budget"] == budget or policy in ON_DEFAULTS)


def make_plots(rows: list[dict], grid: Grid, out: Path, answers: dict) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    kind, budget = grid.kinds[0], grid.budgets[0]
    save(_survival(plt, rows, grid, kind, budget), "survival_and_fraction_vs_rate.png")
    save(_validation_curves(plt, rows, grid, budget), "validation_curves.png")  # mean and 95% band over seeds
    save(_difficulty_skew(plt, rows, grid, budget), "difficulty_skew.png")  # per mode at its highest rate
    _step_curves(plt, rows, grid, kind, budget, save)
    # the estimates behind the answers to the four questions: skews (rooms) and held-out reward differences
    for (k, rate), qs in answers.items():
        ests = [e for _, _, es in qs for e in es]
        if ests:
            save(_estimates(plt, ests, k, rate),
                 f"four_questions{'' if len(answers) == 1 else '_' + k.replace('@', '_')}.png")
    return paths


def _survival(plt, rows: list[dict], grid: Grid, kind: str, budget: int):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for policy in grid.policies:
        by_rate: dict[float, list[dict]] = {}
        for r in rows:
            if _in_plot(r, kind, policy, budget):
                by_rate.setdefault(r["rate"], []).append(r)
        pts = sorted((rate, sum(r["steps_completed"] / r["steps_target"] for r in rs) / len(rs),
                      mean_ci(_values(rs, "fraction_trained"))[0]) for rate, rs in by_rate.items())
        if pts:
            axes[0].plot([100 * p[0] for p in pts], [p[1] for p in pts], **_style(policy))
            axes[1].plot([100 * p[0] for p in pts], [p[2] for p in pts], **_style(policy))
    axes[0].set(xlabel=f"{kind} rate (%)", ylabel="steps survived / steps planned (mean over seeds)",
                title=f"Survival ({kind}, drop budget {budget}; minirl defaults: its own)", ylim=(-0.05, 1.05))
    axes[1].set(xlabel=f"{kind} rate (%)", ylabel="rollouts trained / rollouts generated",
                title=f"Fraction trained ({kind}, drop budget {budget})", ylim=(-0.05, 1.05))
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def _validation_curves(plt, rows: list[dict], grid: Grid, budget: int):
    """Validation learning curves, one panel per fault mode at its highest rate."""
    fig, axes = plt.subplots(1, len(grid.kinds), figsize=(5.5 * len(grid.kinds), 4), squeeze=False)
    for ax, k in zip(axes[0], grid.kinds):
        rate = max(r["rate"] for r in rows if r["kind"] == k)
        for policy in grid.policies:
            curve: dict[int, list[float]] = {}
            for r in rows:
                if r["rate"] == rate and _in_plot(r, k, policy, budget):
                    for v in validations(Path(r["run_dir"])):
                        curve.setdefault(v["val_policy_version"], []).append(v["val_reward_mean"])
            if not curve:
                continue
            xs = sorted(curve)
            ms = [mean_ci(curve[x]) for x in xs]
            line = ax.plot(xs, [m for m, _ in ms], **_style(policy))[0]
            lo = [m - (h if not math.isnan(h) else 0) for m, h in ms]
            hi = [m + (h if not math.isnan(h) else 0) for m, h in ms]
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.12)
        ax.set(xlabel="optimizer steps trained (policy version)", ylabel="held-out reward (no faults)",
               title=f"Validation: {k} {_rate(k, rate)}", xlim=(-0.3, grid.steps + 0.3))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return fig


def _difficulty_skew(plt, rows: list[dict], grid: Grid, budget: int):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(grid.policies)
    for i, policy in enumerate(grid.policies):
        for ax, field in zip(axes, ("rooms_shift", "skew_tv")):
            xs, ms, hs, seeds = [], [], [], []
            for j, k in enumerate(grid.kinds):
                rate = max(r["rate"] for r in rows if r["kind"] == k)
                vs = [r[field] for r in rows if r["rate"] == rate and _in_plot(r, k, policy, budget)
                      and not math.isnan(r[field])]
                m, h = mean_ci(vs)
                if not math.isnan(m):
                    xs.append(j + (i - (len(grid.policies) - 1) / 2) * width)
                    ms.append(m)
                    hs.append(0 if math.isnan(h) else h)
                    seeds += [(xs[-1], v) for v in vs]
            bars = ax.bar(xs, ms, width, yerr=hs, capsize=3, label=policy, alpha=0.6)
            if seeds:  # each seed's own value, so a wide interval shows what it is made of
                ax.scatter(*zip(*seeds), s=14, color=bars.patches[0].get_facecolor(), edgecolor="black", zorder=3)
    for ax, ylabel in zip(axes, ("mean rooms trained − dispatched", "TV distance, trained vs dispatched mix")):
        ax.set_xticks(range(len(grid.kinds)), [f"{k} {_rate(k, max(r['rate'] for r in rows if r['kind'] == k))}"
                                               for k in grid.kinds], fontsize=8)
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set(ylabel=ylabel, title="Trained-difficulty skew (95% interval over seeds)")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    return fig


def _step_curves(plt, rows: list[dict], grid: Grid, kind: str, budget: int, save) -> None:
    """Training reward and rollouts trained per step, one seed."""
    rate = max(r["rate"] for r in rows if r["kind"] == kind)
    for name, field, ylabel in (("reward_curve", "reward_mean", "training reward (0-1)"),
                                ("effective_batch", "rollouts_trained", "rollouts trained per step")):
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for policy in grid.policies:
            r = next((r for r in rows if r["rate"] == rate and _in_plot(r, kind, policy, budget)), None)
            metrics = Path(r["run_dir"]) / "metrics.jsonl" if r else None
            if metrics and metrics.exists():
                m = [json.loads(line) for line in metrics.read_text().splitlines() if line]
                if m:
                    ax.plot([x["step"] + 1 for x in m], [x[field] for x in m], **_style(policy))
        ax.set(xlabel="optimizer step", ylabel=ylabel, xlim=(0.5, grid.steps + 0.5),
               title=f"{ylabel} ({kind} {_rate(kind, rate)}, budget {budget}, seed {grid.seeds[0]})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, f"{name}.png")


def _estimates(plt, ests: list, k: str, rate: float):
    panels = (([e for e in ests if e.label.startswith("val")],
               "held-out reward or success, difference paired by seed"),
              ([e for e in ests if not e.label.startswith("val")],
               "rooms trained − dispatched, or its paired difference"))
    panels = [(es, xlabel) for es, xlabel in panels if es]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 1.6 * len(panels) + 0.4 * len(ests)), squeeze=False,
                             gridspec_kw={"height_ratios": [len(es) + 1.5 for es, _ in panels]})
    for ax, (es, xlabel) in zip(axes[:, 0], panels):
        ys = list(range(len(es)))[::-1]
        bare = [math.isnan(e.half) or e.spreadless for e in es]  # one seed, or seeds all alike: no t-interval
        for y, e, no_interval in zip(ys, es, bare):
            color = "tab:red" if e.sign < 0 else "tab:blue" if e.sign > 0 else "tab:gray"
            if no_interval:  # a hollow point, not an interval of zero width
                ax.plot([e.mean], [y], "o", color=color, mfc="none")
            else:
                ax.errorbar([e.mean], [y], xerr=[[e.half], [e.half]], fmt="o", color=color, capsize=4)
        ax.set_yticks(ys, [e.label + (" (no interval)" if b else "") for e, b in zip(es, bare)], fontsize=8)
        ax.set_ylim(-0.7, len(es) - 0.3)
        ax.axvline(0, color="black", linewidth=0.8)
        ax.set(xlabel=xlabel, title=f"{k} {_rate(k, rate)}: mean ± 95% interval over seeds")
        ax.grid(alpha=0.3, axis="x")
    return fig
