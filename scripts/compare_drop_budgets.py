"""Compare failure policies and drop budgets on identical, seeded fault streams, and measure what
each policy makes the model learn.

    python scripts/compare_drop_budgets.py --quick --out /tmp/cmp     # <= 10 min on 2 CPU cores
    python scripts/compare_drop_budgets.py --out docs/experiments/default   # the README's grid

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
group of step s is a prompt (s, k) of minirl.data), answers issue M's four questions for each
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
import contextlib
import csv
import datetime as dt
import itertools
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from minirl.stats import mean_ci, paired_ci  # noqa: E402

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
    "minirl defaults (masked in baseline)": ["grpo.baseline_excludes_masked=false"],
}
DEFAULTS = "minirl defaults"  # no preset: `python -m minirl.train` as shipped (fixes on, its own budgets)
MASKED_IN_BASELINE = "minirl defaults (masked in baseline)"  # the same, but upstream's baseline (issue I)
ON_DEFAULTS = {DEFAULTS, MASKED_IN_BASELINE}  # policies built on the shipped config rather than the preset
SHRINKS = {"+shrink", "all fixes"} | ON_DEFAULTS  # upstream forces the floor to 100% without fix 1

COLUMNS = [
    "cell", "kind", "rate", "policy", "budget", "fraction", "seed", "survived", "died_at_step", "died_reason",
    "steps_completed", "steps_target", "groups_dropped", "rollouts_masked", "groups_redispatched",
    "rollouts_generated", "rollouts_trained", "fraction_trained", "mean_groups_trained", "mean_rollouts_trained",
    "final_reward", "val_reward_start", "val_reward_final", "val_success_final", "val_final_by_rooms",
    "rooms_dispatched_mean", "rooms_trained_mean", "rooms_shift", "skew_tv", "wall_s", "run_dir",
]
FLOATS = ("rate", "fraction", "fraction_trained", "mean_groups_trained", "mean_rollouts_trained", "wall_s",
          "final_reward", "val_reward_start", "val_reward_final", "val_success_final", "rooms_dispatched_mean",
          "rooms_trained_mean", "rooms_shift", "skew_tv")
OVERFLOW_TOKENS = 270
"""Guard limit of the `overflow` mode. Measured on the initial tiny model under the upstream preset (with
default.yaml's compaction under it), 6 calls at most, 32 held-out prompts: the largest prompt of an episode was 67-199 tokens
with 1 room, 67-272 with 2 (3 of 10 above 268), 166-279 with 3 or 4 (11 of 17 above 268). 240 ended so
many long episodes that whole groups were masked and every policy died at step 0."""


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
    mix: tuple = (1, 2, 3, 4)
    max_calls: int = 6
    val_period: int = 2
    val_prompts: int = 8

    def cells(self):
        seen = set()
        for seed, kind, rate, policy, budget, fraction in itertools.product(  # seed outermost: a sweep cut
            self.seeds, self.kinds, self.rates, self.policies, self.budgets, self.fractions  # short stays paired
        ):
            rate = 0.0 if kind == "overflow" else rate
            if policy in ON_DEFAULTS:  # the shipped budgets, whatever the grid's
                rf = _defaults().async_rl.rollout_failure
                budget, fraction = rf.max_consecutive_dropped_prompts, rf.min_step_batch_fraction
            frac = fraction if policy in SHRINKS else 1.0
            cell = {"kind": kind, "rate": rate, "policy": policy, "budget": budget, "fraction": frac, "seed": seed}
            if cell_id(cell) not in seen:
                seen.add(cell_id(cell))
                yield cell


def _defaults():
    from minirl.config import load_config

    return load_config()


# one correlated mode, the four policies that survive it, 2 seeds: 8 cells fit the 10-minute budget
QUICK = Grid(kinds=("guard_reject@room",), rates=(0.05,), policies=("+shrink", "+redispatch", "all fixes", DEFAULTS),
             budgets=(4,), fractions=(0.5,), seeds=(0, 1), steps=4, prompts=4, generations=2)
# The four questions of issue M on one correlated mode, 5 seeds (seeds, not cells, narrow the intervals):
# at a per-room hazard of 7% shrink drops about half the groups (a 4-room group of 4 rollouts fails
# with 1 - 0.93**16 = 69%, a 1-room one with 25%) and end_episode masks 16% of the rollouts; the
# floor of one group (0.125) and a budget of 16 keep +shrink alive, so its skew is measured, not its death.
# +shrink, +end_episode and +redispatch are the upstream preset plus one fix. The baseline flag: +end_episode
# (upstream's baseline_excludes_masked=false) and minirl defaults (true) differ in the flag, the budgets
# and fixes 1 and 3; in this mode nothing is dropped or re-sent under either (guard rejections are masks),
# so fixes 1 and 3 and the budgets never act and the pair isolates the flag (the report checks this per
# seed). The literal twin, MASKED_IN_BASELINE, measured the same run as +end_episode. Other modes:
# --kinds guard_reject,overflow,agent_exception@room,... (`timeout` fails like agent_exception, but each
# hit costs rollout_timeout_s of wall time).
DEFAULT = Grid(kinds=("guard_reject@room",), rates=(0.07,),
               policies=("+shrink", "+end_episode", "+redispatch", DEFAULTS), budgets=(16,), fractions=(0.125,),
               seeds=tuple(range(5)), steps=6, prompts=8, generations=4, val_period=3, val_prompts=24)


def kind_args(kind: str, rate: float) -> list[str]:
    """The overrides of a fault mode (see the module docstring)."""
    if kind == "overflow":
        return [f"agent.context_history.guards.max_total_tokens={OVERFLOW_TOKENS}"]
    if kind.endswith("@room"):
        return [f"faults.rate_per_room.{kind[:-len('@room')]}={rate}"]
    return [f"faults.rate.{kind}={rate}"]


def cell_id(c: dict) -> str:
    policy = c["policy"].replace("+", "plus_").replace("(", "").replace(")", "").replace(" ", "_")
    return f"{c['kind']}-{c['rate']}-{policy}-b{c['budget']}-f{c['fraction']}-s{c['seed']}"


def cell_args(c: dict, grid: Grid, run_dir: Path, attach: list[str]) -> list[str]:
    if c["policy"] in ON_DEFAULTS:
        args = list(POLICIES[c["policy"]])
    else:
        args = [
            "--config", str(REPO / "configs" / "upstream_pr4124.yaml"), *POLICIES[c["policy"]],
            f"async_rl.rollout_failure.max_consecutive_dropped_prompts={c['budget']}",
            f"async_rl.rollout_failure.min_step_batch_fraction={c['fraction']}",
        ]
    args += [
        *kind_args(c["kind"], c["rate"]), f"faults.seed={c['seed']}", f"grpo.seed={42 + c['seed']}",
        f"env.data_seed={1234 + c['seed']}", f"env.num_rooms_choices=[{','.join(map(str, grid.mix))}]",
        f"agent.max_steps={grid.max_calls}", "grpo.val_at_start=true", f"grpo.val_period={grid.val_period}",
        f"grpo.val_num_prompts={grid.val_prompts}",
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
    from minirl.stats import difficulty_skew, rooms_mix

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


# ------------------------------------------------------------------------------------------ report
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
        return list(grid.kinds).index(r["kind"]), r["rate"], list(grid.policies).index(r["policy"]), r["budget"]

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


def _by_rooms(rs: list[dict]) -> str:
    per: dict[str, list[float]] = {}
    for r in rs:
        for k, v in json.loads(r["val_final_by_rooms"] or "{}").items():
            per.setdefault(k, []).append(v)
    return " / ".join(f"{sum(v) / len(v):.2f}" for _, v in sorted(per.items())) or "–"


@dataclass(frozen=True)
class Estimate:
    """A mean over seeds and the half-width of its 95% t-interval: one policy's value, or the paired
    (per-seed) difference of two policies' values."""

    label: str
    mean: float
    half: float
    n: int

    @property
    def sign(self) -> int:
        """+1 or -1 where the interval excludes 0, 0 where it holds 0 or there is no interval."""
        if math.isnan(self.mean) or math.isnan(self.half):
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
    """A mode's rows at one rate by policy (the grid's first budget; the defaults at their own)."""
    out: dict[str, list[dict]] = {}
    for (k, r, policy, budget, _), rs in cells.items():
        if k == kind and r == rate and (budget == grid.budgets[0] or policy in ON_DEFAULTS):
            out.setdefault(policy, rs)
    return out


def four_questions(here: dict[str, list[dict]]) -> list[tuple[str, list[str], list[Estimate]]]:
    """Issue M's questions, each as (question, answer lines, the estimates drawn in four_questions.png),
    for the policies of one mode and rate that the grid ran; a question whose policies are missing
    is left out."""
    out = []
    shift = {p: _level(rs, "rooms_shift", f"{p}: rooms trained − dispatched") for p, rs in here.items()}

    def val_vs(a: str, b: str) -> Estimate:
        return _paired(here[a], here[b], "val_reward_final", f"val reward: {a} − {b}")

    def skew_answer(p: str, what: str) -> tuple[list[str], list[Estimate]]:
        rs, e = here[p], shift[p]
        ans = {-1: "**Yes**", 1: "**No, toward hard prompts**", 0: "**Not resolvable**"}[e.sign]
        lines = [f"{ans}. {p} {what} and trained {e.resolved()} rooms against the mix dispatched "
                 f"(TV distance {_ci(rs, 'skew_tv')}); it trained {_ci(rs, 'fraction_trained')} of the rollouts "
                 "returned."]
        died = [r for r in rs if not r["survived"]]
        if died:
            steps = ", ".join(str(r["died_at_step"]) for r in died)
            lines.append(f"{len(died)} of {len(rs)} runs died (at step {steps}): "
                         "their skew covers the steps they completed, their final validation is the last they reached.")
        if "+redispatch" not in here:
            return lines, [e]
        v = val_vs(p, "+redispatch")
        return lines + [f"Its final held-out reward against +redispatch, paired by seed: {v.resolved()}."], [e, v]

    if "+shrink" in here:
        rs = here["+shrink"]
        out.append(("Does dropping under shrink skew training toward easy prompts?",
                    *skew_answer("+shrink", f"dropped {_mean(rs, 'groups_dropped'):.1f} groups a run "
                                 "(mean over seeds)")))
    if "+end_episode" in here:
        rs = here["+end_episode"]
        lines, ests = skew_answer("+end_episode", f"masked {_mean(rs, 'rollouts_masked'):.1f} rollouts a run "
                                  f"of {_mean(rs, 'rollouts_generated'):.0f}")
        if DEFAULTS in here:  # the shipped config masks guard rejections too
            lines.append(f"{DEFAULTS} (end_episode on) trained {shift[DEFAULTS].resolved()} rooms against dispatched.")
            ests.append(shift[DEFAULTS])
        out.append(("Does masking under end_episode skew it?", lines, ests))
    if "+redispatch" in here:
        rs, e = here["+redispatch"], shift["+redispatch"]
        gaps = [_paired(here[p], rs, "rooms_shift", f"skew: {p} − +redispatch")
                for p in ("+shrink", "+end_episode", DEFAULTS) if p in here]
        ans = "**No**" if e.sign else "**Yes**" if all(g.sign for g in gaps) else "**Not resolvably**"
        lines = [f"{ans}. +redispatch re-sent {_mean(rs, 'groups_redispatched'):.1f} groups a run, dropped "
                 f"{_mean(rs, 'groups_dropped'):.1f} and masked {_mean(rs, 'rollouts_masked'):.1f}; it trained "
                 f"{e.resolved()} rooms against dispatched."]
        lines += [f"Skew of {g.label.split(': ')[1]}, paired by seed: {g.resolved()}." for g in gaps]
        out.append(("Does redispatch avoid the skew?", lines, [e, *gaps]))
    twin = next((p for p in (MASKED_IN_BASELINE, "+end_episode") if p in here), None)
    if DEFAULTS in here and twin:  # flag true against flag false, both masking
        a, b = here[DEFAULTS], here[twin]
        unmasked = [p for p, rs in here.items() if all(r["rollouts_masked"] == 0 for r in rs)]
        inert = all(r["groups_dropped"] == 0 and r["groups_redispatched"] == 0 for r in a + b)
        v = _paired(a, b, "val_reward_final", f"val reward: {DEFAULTS} − {twin}")
        succ = _paired(a, b, "val_success_final", f"val success: {DEFAULTS} − {twin}")
        sk = _paired(a, b, "rooms_shift", f"skew: {DEFAULTS} − {twin}")
        if twin == MASKED_IN_BASELINE:
            pair = f"The two runs of a seed differ only in the flag (true in {DEFAULTS}, false in its twin)."
        elif inert:
            pair = (f"{DEFAULTS} (flag true) and +end_episode (the upstream preset with masking, flag false, as in "
                    "configs/upstream_pr4124.yaml) also differ in fixes 1 and 3 and the budgets, but those never "
                    "acted: neither policy dropped or re-sent a group in any seed. So the pair isolates the flag.")
        else:
            pair = (f"{DEFAULTS} and +end_episode differ in more than the flag here (some seed dropped or re-sent a "
                    f"group): run `{MASKED_IN_BASELINE}` to isolate it.")
        ans = ("**Not isolated**" if twin != MASKED_IN_BASELINE and not inert else
               "**Not resolvably**" if v.sign == 0 and succ.sign == 0 else "**Yes**")
        lines = [f"{ans}. {pair} Both runs of a seed meet the same prompts and faults; they masked "
                 f"{_mean(a, 'rollouts_masked'):.1f} and {_mean(b, 'rollouts_masked'):.1f} rollouts a run. The flag "
                 "acts only on the advantages of groups with a masked rollout, so masking is where it can matter"
                 + (f" (it does nothing under {', '.join(unmasked)}, which masked no rollout in any seed)."
                    if unmasked else "."),
                 f"Final held-out reward (true − false), paired by seed: {v.resolved()}; "
                 f"success rate: {succ.resolved()}.",
                 f"Skew (true − false): {sk.resolved()}: the flag cannot change which rollouts are masked, only "
                 "how the unmasked ones are weighted."]
        ests = [v, succ]
        if twin == MASKED_IN_BASELINE and "+end_episode" in here:
            w = _paired(a, here["+end_episode"], "val_reward_final", f"val reward: {DEFAULTS} − +end_episode")
            lines.append(f"The same against +end_episode (the upstream preset with masking, flag false): "
                         f"{w.resolved()}.")
            ests.append(w)
        out.append(("Does `grpo.baseline_excludes_masked` change the outcome?", lines, ests))
    return out


def _differs(a: list[dict], b: list[dict], field: str) -> str:
    return _paired(a, b, field).resolved()


def write_report(rows: list[dict], grid: Grid, out: Path, title: str) -> list[Path]:
    cells = _cells(rows, grid)
    answers = {(kind, rate): four_questions(_at(cells, grid, kind, rate))  # each mode at its highest rate
               for kind in grid.kinds for rate in [max(r for (k, r, *_) in cells if k == kind)]}
    plots = make_plots(rows, grid, out, answers)
    lines = [f"# {title}", "", f"Generated {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC by "
             f"`scripts/compare_drop_budgets.py`; {len(rows)} runs ({len(cells)} cells x "
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
    for kind in grid.kinds:
        lines += [f"## {kind}", "", kind_text(kind) + ".", "",
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
                         f"| {_ci(rs, 'val_reward_final')} | {_ci(rs, 'val_success_final')} | {_by_rooms(rs)} "
                         f"| {_ci(rs, 'rooms_shift')} | {_ci(rs, 'skew_tv')} |")
        rooms = " / ".join(f"{k} room(s)" for k in grid.mix)
        lines += ["", f"Final val reward by rooms: {rooms}, mean over seeds. Dropped / masked / re-sent: prompt "
                  "groups dropped, rollouts masked, groups redispatched, mean per run.", ""]

    for (kind, rate), qs in answers.items():
        if qs:
            lines += [f"## The questions of issue M: {kind} {_rate(kind, rate)}", ""]
            for q, ans, _ in qs:
                lines += [f"**{q}** " + " ".join(ans), ""]

    base = DEFAULTS if DEFAULTS in grid.policies else grid.policies[0]
    lines += ["## Which differences are real", "",
              f"Each policy against `{base}` in the same mode and rate: the per-seed difference (policy − {base}), "
              "mean ± its 95% t-interval.", ""]
    for (kind, rate, policy, budget, frac), rs in cells.items():
        ref = next((v for (k2, r2, p2, _, _), v in cells.items() if (k2, r2, p2) == (kind, rate, base)), None)
        if ref is None or policy == base:
            continue
        lines.append(f"- {kind} {_rate(kind, rate)}, {policy} (budget {budget}): final val reward "
                     f"{_differs(rs, ref, 'val_reward_final')}; skew {_differs(rs, ref, 'rooms_shift')}.")
    if len(grid.policies) < 2:
        lines.append("- One policy only: nothing to compare.")
    lines += ["", "## Bias: what reached the optimizer", ""]
    for (kind, rate, policy, budget, frac), rs in cells.items():
        lines.append(f"- {kind} {_rate(kind, rate)}, {policy} (budget {budget}): {_skew_verdict(rs)}.")
    lines += ["", "## What to pick", "", *what_to_pick(cells, grid), ""]
    died = [r for r in rows if not r["survived"]]
    if died:
        lines += ["## Why runs died", ""]
        reasons = {}
        for r in died:
            key = r["died_reason"].split(":")[0]
            reasons.setdefault(key, []).append(r)
        for key, rs in sorted(reasons.items()):
            lines.append(f"- `{key}` ({len(rs)} runs), e.g. {rs[0]['cell']}: `{rs[0]['died_reason'][:200]}`")
        lines.append("")
    lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    (out / "report.md").write_text("\n".join(lines))
    return plots


def what_to_pick(cells: dict[tuple, list[dict]], grid: Grid) -> list[str]:
    """One line per fault mode at its highest rate, from the estimates the skew and validation plots
    draw: the policies without a resolvable skew, the best final validation reward and which
    policies are not resolvably below it (paired by seed), and the pick that follows."""
    lines = []
    for kind in grid.kinds:
        rate = max(r for (k, r, *_) in cells if k == kind)
        here = {(p, b): rs for (k, r, p, b, _), rs in cells.items() if k == kind and r == rate}
        alive = {key: rs for key, rs in here.items() if all(r["survived"] for r in rs)}
        name = lambda key: f"{key[0]} (budget {key[1]})"  # noqa: E731
        if not alive:
            lines.append(f"- **{kind} {_rate(kind, rate)}**: no policy survived every seed.")
            continue
        shift = {key: _level(rs, "rooms_shift") for key, rs in alive.items()}
        best = max(alive, key=lambda key: _level(alive[key], "val_reward_final").mean)
        gap = {key: _paired(alive[key], alive[best], "val_reward_final") for key in alive if key != best}
        below = [key for key, e in gap.items() if e.sign < 0]
        fair = [key for key in alive if shift[key].sign == 0]
        pick = max(fair, key=lambda key: _level(alive[key], "val_reward_final").mean) if fair else best
        dead = [name(key) for key in here if key not in alive]
        skewed = [f"{name(k)} ({shift[k].text()} rooms)" for k in alive if shift[k].sign]
        lines.append(
            f"- **{kind} {_rate(kind, rate)}**: without a resolvable skew: {', '.join(map(name, fair)) or 'none'}; "
            f"skewed: {', '.join(skewed) or 'none'}. Highest final validation reward: {name(best)}, "
            f"{_ci(alive[best], 'val_reward_final')}; resolvably below it (paired by seed): "
            f"{', '.join(f'{name(k)} ({gap[k].text()})' for k in below) or 'none'}; "
            f"not resolvable from it: {', '.join(name(k) for k in gap if k not in below) or 'none'}. "
            f"Died in some seed: {', '.join(dead) or 'none'}. "
            + (f"Nothing here separates the survivors (no skew and no validation difference is resolvable); "
               f"**{name(pick)}** only has the highest mean." if len(fair) == len(alive) and not below else
               f"Pick **{name(pick)}**: "
               + ("the policy without a resolvable skew that validates best" if pick in fair else
                  "every survivor skews; it validates best")
               + ("." if pick == best or gap[pick].sign == 0 else
                  f", though it validates resolvably below {name(best)} ({gap[pick].text()}).")
               + (" Its validation lead is not resolvable, so the pick rests on the skew." if pick in fair and not below
                  else ""))
            + (" With one seed per cell these are single runs, not evidence."
               if max(map(len, alive.values())) < 2 else ""))
    return lines


# a marker and dash per policy, so that policies with equal results stay visible on top of each other
STYLES = dict(zip(POLICIES, [("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", "-"), ("x", "--"), ("P", "-.")]))


def _style(policy: str) -> dict:
    marker, dash = STYLES[policy]
    return {"marker": marker, "linestyle": dash, "label": policy, "alpha": 0.85, "markersize": 7}


def _in_plot(r: dict, kind: str, policy: str, budget: int) -> bool:
    return r["kind"] == kind and r["policy"] == policy and (r["budget"] == budget or policy in ON_DEFAULTS)


def make_plots(rows: list[dict], grid: Grid, out: Path, answers: dict) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kind, budget = grid.kinds[0], grid.budgets[0]
    paths = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for policy in grid.policies:
        by_rate: dict[float, list[dict]] = {}
        for r in rows:
            if _in_plot(r, kind, policy, budget):
                by_rate.setdefault(r["rate"], []).append(r)
        pts = sorted((rate, sum(r["steps_completed"] / r["steps_target"] for r in rs) / len(rs),
                      sum(r["fraction_trained"] for r in rs) / len(rs)) for rate, rs in by_rate.items())
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
    save(fig, "survival_and_fraction_vs_rate.png")

    # validation learning curves, one panel per fault mode at its highest rate, mean and 95% band over seeds
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
    save(fig, "validation_curves.png")

    # the difficulty skew of what was trained, per mode at its highest rate
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
    save(fig, "difficulty_skew.png")

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

    # the estimates behind the answers to issue M's questions: skews (rooms) and held-out reward differences
    for (k, rate), qs in answers.items():
        ests = [e for _, _, es in qs for e in es]
        if not ests:
            continue
        panels = (([e for e in ests if e.label.startswith("val")],
                   "held-out reward or success, difference paired by seed"),
                  ([e for e in ests if not e.label.startswith("val")],
                   "rooms trained − dispatched, or its paired difference"))
        panels = [(es, xlabel) for es, xlabel in panels if es]
        fig, axes = plt.subplots(len(panels), 1, figsize=(9, 1.6 * len(panels) + 0.4 * len(ests)), squeeze=False,
                                 gridspec_kw={"height_ratios": [len(es) + 1.5 for es, _ in panels]})
        for ax, (es, xlabel) in zip(axes[:, 0], panels):
            ys = list(range(len(es)))[::-1]
            for y, e in zip(ys, es):
                half = 0 if math.isnan(e.half) else e.half
                color = "tab:red" if e.sign < 0 else "tab:blue" if e.sign > 0 else "tab:gray"
                ax.errorbar([e.mean], [y], xerr=[[half], [half]], fmt="o", color=color, capsize=4)
            ax.set_yticks(ys, [e.label for e in es], fontsize=8)
            ax.set_ylim(-0.7, len(es) - 0.3)
            ax.axvline(0, color="black", linewidth=0.8)
            ax.set(xlabel=xlabel, title=f"{k} {_rate(k, rate)}: mean ± 95% interval over seeds")
            ax.grid(alpha=0.3, axis="x")
        save(fig, f"four_questions{'' if len(answers) == 1 else '_' + k.replace('@', '_')}.png")
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    from minirl.config import AGENT_SIDE_KINDS, FAULT_KINDS

    for kind in grid.kinds:
        if not (kind == "overflow" or kind in FAULT_KINDS or kind.endswith("@room") and kind[:-5] in AGENT_SIDE_KINDS):
            ap.error(f"unknown fault mode {kind!r}: overflow, one of {', '.join(FAULT_KINDS)}, "
                     f"or KIND@room for one of {', '.join(AGENT_SIDE_KINDS)}")
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
