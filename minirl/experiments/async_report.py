"""report.md of the async bias experiment (async_bias.py): per mode, the trained-difficulty skew, the
tokens thrown away by evictions, samples/s and held-out reward as means with 95% t-intervals over
seeds; each dispatched group's fate by room count; and paired (per-seed) differences against sync
and of each paced sampler against its eager twin. Invariant: the report is a function of the rows
of results.jsonl alone, and a difference is called resolved only as minirl.experiments.estimates.Estimate
calls one: its interval excludes 0, and seeds that all differ by the same amount (no spread) give no
interval, so never a resolved one."""

from __future__ import annotations

import datetime as dt
import math
from pathlib import Path

from minirl.experiments.estimates import Estimate
from minirl.experiments.stats import mean_ci, paired_ci

FIELDS = (("rooms_shift", "rooms trained − stream", 2), ("skew_tv", "TV against the stream", 3),
          ("rooms_shift_resolved", "rooms trained − resolved", 2),
          ("eviction_fraction", "generated tokens evicted", 3), ("samples_per_s", "samples/s", 2),
          ("reward_last3", "train reward, last 3 steps", 3), ("val_reward_final", "held-out reward", 3))


def _ci(xs: list[float], digits: int) -> str:
    xs = [x for x in xs if not math.isnan(x)]
    mean, half = mean_ci(xs)
    if math.isnan(mean):
        return "–"
    return f"{mean:.{digits}f}" + ("" if math.isnan(half) else f" ± {half:.{digits}f}")


def _by_mode(rows: list[dict], grid) -> dict[str, list[dict]]:
    return {m: [r for r in rows if r["mode"] == m and r["survived"]] for m in grid.modes}


def _per_seed(rs: list[dict], field: str) -> dict[int, float]:
    return {r["seed"]: float(r[field]) for r in rs}


def _diff(a: list[dict], b: list[dict], field: str, digits: int) -> str:
    e = Estimate("", *paired_ci(_per_seed(a, field), _per_seed(b, field)))
    if e.n == 0 or math.isnan(e.mean):
        return "–"
    if math.isnan(e.half):
        return f"{e.mean:+.{digits}f} (1 seed)"
    verdict = ("resolved" if e.sign else "not resolved" if e.mean == 0 or not e.spreadless
               else f"the same in all {e.n} seeds: no t-interval, not resolved")
    return f"{e.mean:+.{digits}f} ± {e.half:.{digits}f} ({verdict})"


def _summary_table(modes: dict[str, list[dict]], rows: list[dict]) -> list[str]:
    head = "| mode | seeds | " + " | ".join(label for _, label, _ in FIELDS) + " | staleness | pace holds |"
    lines = [head, "|" + "---|" * (len(FIELDS) + 4)]
    for m, rs in modes.items():
        died = sum(1 for r in rows if r["mode"] == m and not r["survived"])
        cells = [_ci([float(r[f]) for r in rs], d) for f, _, d in FIELDS]
        lines.append(f"| {m} | {len(rs)}{f' (+{died} died)' if died else ''} | " + " | ".join(cells)
                     + f" | {_ci([r['staleness_mean'] for r in rs], 2)} | {_ci([r['pace_holds'] for r in rs], 1)} |")
    return lines


def _rooms_table(modes: dict[str, list[dict]]) -> list[str]:
    """Per mode and room count: groups dispatched, evicted, trained and unresolved (mean per seed), and
    the share of the groups that met a fate which trained (mean ± interval over seeds)."""
    rooms = sorted({int(k) for rs in modes.values() for r in rs for k in r["dispatched"]})
    lines = ["| mode | rooms | dispatched | evicted | trained | unresolved at end "
             "| trained / (trained + evicted + dropped) |",
             "|---|---|---|---|---|---|---|"]
    for m, rs in modes.items():
        for k in rooms:
            get = lambda r, f: float(r[f].get(str(k), r[f].get(k, 0)))  # noqa: E731 (JSON keys are strings)
            share = [get(r, "trained") / met for r in rs
                     if (met := get(r, "trained") + get(r, "evicted") + get(r, "dropped"))]
            lines.append(f"| {m} | {k} | " + " | ".join(_ci([get(r, f) for r in rs], 1) for f in
                                                       ("dispatched", "evicted", "trained", "unresolved"))
                         + f" | {_ci(share, 2)} |")
    return lines


def _differences(modes: dict[str, list[dict]]) -> list[str]:
    pairs = [(m, "sync") for m in modes if m != "sync" and "sync" in modes]
    pairs += [(m, m.split("+")[0]) for m in modes if m.endswith("+paced") and m.split("+")[0] in modes]
    lines = ["| comparison | " + " | ".join(label for _, label, _ in FIELDS) + " |", "|" + "---|" * (len(FIELDS) + 1)]
    for a, b in pairs:
        lines.append(f"| {a} − {b} | " + " | ".join(_diff(modes[a], modes[b], f, d) for f, _, d in FIELDS) + " |")
    return lines


def _ratio(modes: dict[str, list[dict]]) -> list[str]:
    if "sync" not in modes:
        return []
    sync = _per_seed(modes["sync"], "samples_per_s")
    out = []
    for m, rs in modes.items():
        ratios = [r["samples_per_s"] / sync[r["seed"]] for r in rs if r["seed"] in sync and m != "sync"]
        if ratios:
            out.append(f"- {m}: {_ci(ratios, 2)}× sync's samples/s "
                       f"(per-seed ratios {', '.join(f'{x:.2f}' for x in ratios)})")
    return out


def write_report(rows: list[dict], grid, out: Path) -> Path:
    modes = _by_mode(rows, grid)
    lines = [
        "# Async without starving slow rollouts: discard against pacing (issue 35)", "",
        f"Generated {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC by `python -m minirl.experiments.async_bias "
        f"--out {out}` (minirl/experiments/async_bias.py; the method is its `cell_args` and `summarize`).", "",
        f"Task mix: {', '.join(map(str, grid.mix))} rooms, `env.tool_latency_per_room_s={grid.latency_per_room_s}` "
        f"(each tool call of an n-room episode sleeps n × {grid.latency_per_room_s} s), "
        f"at most {grid.max_calls} model calls, compaction agent as shipped. "
        f"{grid.steps} steps of {grid.prompts} groups × {grid.generations} rollouts, "
        f"staleness S = {grid.staleness}, seeds {', '.join(map(str, grid.seeds))}; held-out reward on "
        f"{grid.val_prompts} prompts after the last step.", "",
        "Mean ± 95% t-interval over seeds. *rooms trained − stream*: the mean room count of the rollouts trained "
        "minus that of the stream's first T × N prompts (T steps completed), which is what sync trains: within a "
        "seed every mode draws the same prompt stream; below 0, training saw an easier mix than the task's. *TV*: "
        "the total-variation distance between those two room mixes. *rooms trained − resolved*: against the groups "
        "that met a fate (trained, evicted or dropped), leaving out those still in flight when the run ended, so it "
        "counts what eviction threw away and not what was merely late. *generated tokens evicted*: the tokens of "
        "evicted groups over all tokens generated. samples/s = rollouts trained / summed step time; the machine's "
        "2 cores were shared with other jobs, so compare modes within a seed (paired, and the ratio to sync "
        "below), not absolute figures.", "",
        "## Per mode", "", *_summary_table(modes, rows), "",
        "## Paired differences (per seed)", "", *_differences(modes), "",
        "## Samples/s against sync, per seed", "", *(_ratio(modes) or ["- (no sync cells)"]), "",
        "## Each dispatched group's fate, by room count (mean per seed)", "", *_rooms_table(modes), "",
    ]
    died = [r for r in rows if not r["survived"]]
    if died:
        lines += ["## Runs that died", ""] + [f"- {r['cell']}: {r['died_reason']}" for r in died] + [""]
    (out / "report.md").write_text("\n".join(lines))
    return out / "report.md"
