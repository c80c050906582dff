"""Issue 30's experiments 1 and 3 on summarizing compaction, and their report
(docs/experiments/summarize/report.md; Q-train's segments.md in the same folder is experiment 2).

    python scripts/summarize_experiments.py                  # run the missing cells, then write the report
    python scripts/summarize_experiments.py --report-only    # rewrite the report from results.csv

Every cell is one real `python -m minirl.train --config configs/summarize.yaml` subprocess (the
doors_memory task, models/tiny-summarize), run under the machine's shared lock
(/tmp/minirl-slow.lock), so it waits for other Ray/vLLM runs instead of competing with them.
A seed s sets `grpo.seed=42+s`, `env.data_seed=1234+s` and `faults.seed=s`: within a seed every
arm meets the same prompts, the same held-out set and the same fault draws, so arms are compared by
their per-seed differences (minirl.experiments.stats.paired_ci).

Experiment 1 (same context limit: the guard's `max_total_tokens` is the same in every arm):
- `recency`: recency compaction keeping the last KEEP pictures (the most that fit the limit);
- `summarize`: the summarizing policy of configs/summarize.yaml.
Each run validates at start (the untrained model) and after its last step, so one run per arm gives
"untrained" and "after RL"; a summarizing run's `summary_recall` per step is the recall curve.

Experiment 3 (summary faults at 5%): the summarize arm with each summary fault kind at rate 5%
(`faults.rate.summary_empty`, `summary_tool_call`, `summary_overflow`), under row redispatch (fix 3,
the shipped default) and under the drop budget alone (redispatch off).

Invariant: a cell runs at most once per output folder (results.csv is the resume point: a row is
written as its cell ends), and the report reads only results.csv and the runs' own files.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from minirl.experiments.stats import mean_ci, paired_ci  # noqa: E402

CONFIG = "configs/summarize.yaml"
KEEP = 2
"""Recency's kept pictures: with the guard's limit of configs/summarize.yaml, keeping 3 would overflow it
in a 4-room episode (no picture dropped), and keeping 2 drops the note's picture before the last room."""
FAULT_RATE = 0.05
SUMMARY_FAULTS = ("summary_empty", "summary_tool_call", "summary_overflow")
ARMS = {
    "recency": ["agent.context_history.policy.type=recency",
                f"agent.context_history.policy.config.images.keep_last_groups={KEEP}"],
    "summarize": [],
    "summarize+faults, redispatch": [f"faults.rate.{k}={FAULT_RATE}" for k in SUMMARY_FAULTS]
    + ["context_compaction.redispatch_dropped_groups=true"],
    "summarize+faults, drop budget": [f"faults.rate.{k}={FAULT_RATE}" for k in SUMMARY_FAULTS]
    + ["context_compaction.redispatch_dropped_groups=false"],
}
EXPERIMENT = {"recency": 1, "summarize": 1, "summarize+faults, redispatch": 3, "summarize+faults, drop budget": 3}
COLUMNS = ["arm", "seed", "survived", "died_reason", "steps", "wall_s", "val_reward_start", "val_reward_final",
           "val_success_start", "val_success_final", "recall_first", "recall_last", "recall_curve", "summaries_mean",
           "summary_tokens_mean", "compaction_ratio", "rejected", "failed", "groups_dropped", "groups_redispatched",
           "rollouts_generated", "rollouts_trained", "fraction_trained", "reward_first", "reward_last", "load_avg",
           "run_dir"]
EDGE = 3
"""Steps averaged at each end of a run for the first/last reward figures."""
RECALL_EDGE = 10
"""Steps averaged at each end of a run for the first/last recall (the acceptance's "recall rises": one
step's recall is a few dozen summaries, so 3 steps were too noisy to read a trend from)."""


def cell_args(arm: str, seed: int, args, run_dir: Path) -> list[str]:
    return ["--config", CONFIG, *ARMS[arm], f"grpo.seed={42 + seed}", f"env.data_seed={1234 + seed}",
            f"faults.seed={seed}", f"grpo.max_num_steps={args.steps}", "grpo.val_at_start=true",
            f"grpo.val_period={args.steps}", f"grpo.val_num_prompts={args.val_prompts}",
            f"checkpoint.save_period={args.steps}", "checkpoint.keep_last_k=1",  # the trained policy, for offline_eval
            "logger.tensorboard=false", "logger.progress=false", f"run_dir={run_dir}"]


CURVE_BLOCK = 20
"""Steps per block in the report's recall curves."""


def blocks(curve: list) -> list:
    """A per-step curve as the means of its CURVE_BLOCK-step blocks, rounded."""
    return [round(_mean(curve[i:i + CURVE_BLOCK]), 3) for i in range(0, len(curve), CURVE_BLOCK)]


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def summarize_run(arm: str, seed: int, run_dir: Path, rc: int, stderr: str, wall: float) -> dict:
    """One cell's row, from the run's metrics.jsonl and validation.jsonl."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x] \
        if (run_dir / "metrics.jsonl").exists() else []
    vals = [json.loads(x) for x in (run_dir / "validation.jsonl").read_text().splitlines() if x] \
        if (run_dir / "validation.jsonl").exists() else []
    recall = [r.get("summary_recall") for r in rows]
    generated = sum(r.get("rollouts_generated", 0) for r in rows)
    trained = sum(r.get("rollouts_trained", 0) for r in rows)
    lines = [x for x in stderr.splitlines() if x.strip()]
    return {
        "arm": arm, "seed": seed, "survived": rc == 0,
        "died_reason": "" if rc == 0 else (lines[-1][:200] if lines else f"exit {rc}"),
        "steps": len(rows), "wall_s": round(wall, 1),
        "val_reward_start": vals[0]["val_reward_mean"] if vals else "",
        "val_reward_final": vals[-1]["val_reward_mean"] if len(vals) > 1 else "",
        "val_success_start": vals[0]["val_success_rate"] if vals else "",
        "val_success_final": vals[-1]["val_success_rate"] if len(vals) > 1 else "",
        "recall_first": _mean(recall[:RECALL_EDGE]), "recall_last": _mean(recall[-RECALL_EDGE:]),
        "recall_curve": json.dumps([None if x is None else round(x, 3) for x in recall]),
        "summaries_mean": _mean([r.get("summaries") for r in rows]),
        "summary_tokens_mean": _mean([r.get("summary_tokens_mean") for r in rows]),
        "compaction_ratio": _mean([r.get("compaction_ratio") for r in rows]),
        "rejected": sum(r.get("summary_attempts_rejected", 0) or 0 for r in rows),
        "failed": sum(r.get("summaries_failed", 0) or 0 for r in rows),
        "groups_dropped": sum(r.get("dropped_prompt_groups", 0) for r in rows),
        "groups_redispatched": sum(r.get("redispatched_groups", 0) for r in rows),
        "rollouts_generated": generated, "rollouts_trained": trained,
        "fraction_trained": round(trained / generated, 4) if generated else 0.0,
        "reward_first": _mean([r.get("reward_mean") for r in rows[:EDGE]]),
        "reward_last": _mean([r.get("reward_mean") for r in rows[-EDGE:]]), "run_dir": str(run_dir),
    }


def run_cells(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.csv"
    done = {(r["arm"], int(r["seed"])) for r in read_rows(path)}
    for seed in args.seeds:  # seed outermost: a sweep cut short stays paired
        for arm in args.arms:
            if (arm, seed) in done:
                continue
            run_dir = Path(args.runs) / f"{arm.replace(' ', '').replace(',', '_').replace('+', '_')}-s{seed}"
            stamp = Path(args.runs) / f".{run_dir.name}.locked"  # when the lock was granted: wall_s excludes the wait
            stamp.parent.mkdir(parents=True, exist_ok=True)
            cmd = ["flock", "/tmp/minirl-slow.lock", "sh", "-c", 'date +%s.%N > "$0" && exec "$@"', str(stamp),
                   sys.executable, "-m", "minirl.train", *cell_args(arm, seed, args, run_dir)]
            print(f"[{time.strftime('%H:%M:%S')}] {arm} seed {seed}", flush=True)
            t0, load0 = time.time(), os.getloadavg()[0]
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                                  env={**os.environ, "RAY_AUTH_MODE": "disabled"})
            t0 = float(stamp.read_text()) if stamp.exists() else t0
            row = summarize_run(arm, seed, run_dir, proc.returncode, proc.stderr, time.time() - t0)
            # the shared machine's 1-min load, start and end
            row["load_avg"] = round((load0 + os.getloadavg()[0]) / 2, 2)
            print(f"    {row['wall_s']} s, rc {proc.returncode}, val success {row['val_success_start']} -> "
                  f"{row['val_success_final']}, recall {row['recall_first']} -> {row['recall_last']}", flush=True)
            rows = read_rows(path) + [row]  # rewritten whole: a row written by an older column set keeps its values
            with path.open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=COLUMNS, restval="")
                w.writeheader()
                w.writerows([{k: r.get(k, "") for k in COLUMNS} for r in rows])


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


def num(x) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def fmt(m: float, h: float) -> str:
    if m != m:
        return "n/a"
    return f"{m:.3f}" if h != h else f"{m:.3f} ± {h:.3f}"


def verdict(m: float, h: float) -> str:
    if m != m or h != h:
        return "not resolvable (fewer than 2 seeds)"
    if m - h > 0:
        return "higher (the interval excludes 0)"
    if m + h < 0:
        return "lower (the interval excludes 0)"
    return "not resolvable (the interval holds 0)"


def by_seed(rows, arm, key) -> dict:
    return {int(r["seed"]): num(r[key]) for r in rows if r["arm"] == arm}


def stat(rows, arm, key) -> str:
    return fmt(*mean_ci([v for v in by_seed(rows, arm, key).values() if v == v]))


def diff(rows, arm_a, key_a, arm_b, key_b) -> str:
    m, h, n = paired_ci(by_seed(rows, arm_a, key_a), by_seed(rows, arm_b, key_b))
    return f"{fmt(m, h)} over {n} seeds: {verdict(m, h)}"


def warm_start() -> str:
    path = REPO / "models" / "tiny-summarize" / "build_info.json"
    if not path.exists():
        return "n/a"
    info = json.loads(path.read_text())
    return (f"its summary carries the note {info['summary_recall']:.2f} of the time (the teacher, p_recall "
            f"{info['args']['p_recall']}), it opens the hidden door from a note in its context "
            f"{info['hidden_door_rate']:.2f} and reads an ordinary room's door {info['door_rate']:.2f}")


def offline_label(model: str) -> str:
    """`untrained`, or `after RL (<arm>)` for a run's checkpoint (`RUNS/<arm>-s<seed>/checkpoints/step_N/policy`)."""
    if model.rstrip("/").endswith("models/tiny-summarize"):
        return "untrained"
    return f"after RL ({re.sub(r'-s[0-9]+$', '', Path(model).parts[-4])})"


def offline_section(path: Path) -> list[str]:
    """Experiment 1 on more held-out episodes: scripts/summarize_offline_eval.py's lines (offline.jsonl)."""
    if not path.exists():
        return []
    evals = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    groups: dict[tuple, dict] = {}
    for e in evals:
        groups.setdefault((offline_label(e["model"]), e["policy"]), {})[e["seed"]] = e
    n = sorted({e["episodes"] for e in evals})
    lines = ["", "## Experiment 1 on more held-out episodes (offline)", "",
             f"`scripts/summarize_offline_eval.py`: {n} held-out prompts per seed (minirl.validation's rows for "
             "that seed, one rollout each) through `run_episode` with the real policy and guard of "
             "configs/summarize.yaml, sampled at temperature 1 by Hugging Face `generate` in-process instead of "
             "the vLLM engine (no Ray/vLLM: the machine's lock was busy). Last room: the hidden door opened on its "
             "only try (chance about 1/7). Lines: offline.jsonl.", "",
             "| model | policy | seeds | success | reward | last room | summary recall |",
             "|---|---|---|---|---|---|---|"]
    for (label, policy), by in sorted(groups.items()):
        cells = [fmt(*mean_ci([v[k] for v in by.values() if v[k] is not None]))
                 for k in ("success", "reward", "last_room", "summary_recall")]
        lines.append(f"| {label} | {policy} | {len(by)} | " + " | ".join(cells) + " |")
    pairs = [(a, b) for a in groups
             for b in groups if a != b and a[
                 0] != "untrained" or (a == ("untrained", "summarize") and b == ("untrained", "recency"))]
    lines += ["", "Paired by seed (same held-out prompts and sampling seeds):", ""]
    for a, b in pairs:
        if b[0] == "untrained" or a[0] == b[0] or (a[1], b[1]) == ("summarize", "recency"):
            for k in ("last_room", "success"):
                m, h, cnt = paired_ci({s_: v[k] for s_, v in groups[a].items()},
                                      {s_: v[k] for s_, v in groups[b].items()})
                lines.append(f"- {k.replace('_', ' ')}, {a[0]} {a[1]} − {b[0]} {b[1]}: {fmt(m, h)} over {cnt} seeds: "
                             f"{verdict(m, h)}")
    return lines


def report(args) -> str:
    rows = read_rows(Path(args.out) / "results.csv")
    seeds = sorted({int(r["seed"]) for r in rows})
    steps = sorted({r["steps"] for r in rows})
    lines = [
        "# Summarizing compaction: what it buys (issue 30, experiments 1 and 3)", "",
        f"Generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `python scripts/summarize_experiments.py "
        f"--report-only` from results.csv ({len(rows)} runs, seeds {seeds}, steps per run {steps}); "
        f"{args.val_prompts} held-out prompts per validation. Experiment 2 (segment weighting and validity) is "
        "[segments.md](segments.md).", "",
        "Setup: `configs/summarize.yaml` (doors_memory with 4 rooms, models/tiny-summarize, the guard's "
        "`max_total_tokens` the same in every arm). Numbers are the mean ± the 95% t-interval over seeds; "
        "two arms are compared by their per-seed differences (paired t-interval; one that excludes 0 is a "
        "paired t-test at 5%). Held-out: `val_*` of minirl.validation (prompts never trained on, no faults), at "
        "start (the untrained warm start) and after the last step. Recall: `summary_recall`, the share of "
        "`DoorsEnv.memory_facts()` needed later that accepted summaries carry, mean of the first and last "
        f"{RECALL_EDGE} steps.", "",
        "Warm start (models/tiny-summarize/build_info.json, the teacher's held-out prompts at temperature 1): "
        f"{warm_start()}.", "",
        "Wall time: each run's `wall_s` is its whole `python -m minirl.train` (Ray and vLLM start-up, both "
        "validations, every step) on this 2-core machine, shared with other runs (the lock serialises the Ray/vLLM "
        f"runs, not the other load): the 1-minute load average was {stat(rows, 'summarize', 'load_avg')} over the "
        "summarizing runs (2.0 is both cores busy).", "",
        "## Experiment 1: recency vs summarizing, untrained and after RL", "",
        "| arm | steps | val success start | val success final | val reward start | val reward final | recall first | "
        "recall last | summaries / rollout | train reward first | train reward last | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in ("recency", "summarize"):
        lines.append(f"| {arm} | " + " | ".join(stat(rows, arm, k) for k in (
            "steps", "val_success_start", "val_success_final", "val_reward_start", "val_reward_final", "recall_first",
            "recall_last", "summaries_mean", "reward_first", "reward_last", "wall_s")) + " |")
    lines += [
        "", "The claim to test: RL raises summary recall and held-out success above both baselines "
        "(recency compaction, and summarizing before RL). Paired by seed:", "",
        "- summary recall, last − first steps of the summarizing run: "
        f"{diff(rows, 'summarize', 'recall_last', 'summarize', 'recall_first')}",
        "- held-out success, summarizing after RL − summarizing untrained: "
        f"{diff(rows, 'summarize', 'val_success_final', 'summarize', 'val_success_start')}",
        "- held-out success, summarizing after RL − recency after RL: "
        f"{diff(rows, 'summarize', 'val_success_final', 'recency', 'val_success_final')}",
        "- held-out success, summarizing after RL − recency untrained: "
        f"{diff(rows, 'summarize', 'val_success_final', 'recency', 'val_success_start')}",
        "- held-out reward, summarizing after RL − summarizing untrained: "
        f"{diff(rows, 'summarize', 'val_reward_final', 'summarize', 'val_reward_start')}",
        "- held-out reward, summarizing after RL − recency after RL: "
        f"{diff(rows, 'summarize', 'val_reward_final', 'recency', 'val_reward_final')}",
        "", f"Recall of each summarizing run, mean of each {CURVE_BLOCK} steps (seed: values; every step's is "
        "results.csv's `recall_curve`):", "",
    ]
    lines += [f"- seed {r['seed']}: {blocks(json.loads(r['recall_curve']))}" for r in rows if r["arm"] == "summarize"]
    lines += [
        "", f"## Experiment 3: summary faults at {FAULT_RATE:.0%}", "",
        f"Each summary fault kind ({', '.join(SUMMARY_FAULTS)}) at rate {FAULT_RATE} per compaction "
        "(minirl.faults), `on_summary_failure: raise` (a `summary_failed` is an INFRA harness failure). Under "
        "redispatch (fix 3) the failed rows are re-sent; under the drop budget alone their groups are dropped "
        "against `max_consecutive_dropped_prompts`.", "",
        "| arm | survived | steps | groups dropped | groups re-sent | summary attempts rejected | summaries failed | "
        "fraction trained | val success final | recall last |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in ("summarize", "summarize+faults, redispatch", "summarize+faults, drop budget"):
        mine = [r for r in rows if r["arm"] == arm]
        surv = f"{sum(r['survived'] == 'True' for r in mine)}/{len(mine)}"
        lines.append(f"| {arm} | {surv} | " + " | ".join(stat(rows, arm, k) for k in (
            "steps", "groups_dropped", "groups_redispatched", "rejected", "failed", "fraction_trained",
            "val_success_final", "recall_last")) + " |")
    trained = diff(rows, "summarize+faults, redispatch", "fraction_trained",
                   "summarize+faults, drop budget", "fraction_trained")
    success = diff(rows, "summarize+faults, redispatch", "val_success_final",
                   "summarize+faults, drop budget", "val_success_final")
    lines += [
        "", f"- fraction trained, redispatch − drop budget: {trained}",
        f"- held-out success after RL, redispatch − drop budget: {success}",
    ]
    lines += offline_section(Path(args.out) / "offline.jsonl")
    died = [f"- {r['arm']} seed {r['seed']}: {r['died_reason']}" for r in rows if r["survived"] != "True"]
    lines += ["", "Runs that ended early:" if died else "Every run completed.", "", *died]
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "docs/experiments/summarize"))
    ap.add_argument("--runs", default="/tmp/minirl-summarize-runs", help="where the cells' run directories go")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--steps", type=int, default=200,
                    help="steps per run (configs/summarize.yaml's; experiment 3 ran 20)")
    ap.add_argument("--val-prompts", type=int, default=16)
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args(argv)
    if not args.report_only:
        run_cells(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    text = report(args)
    (Path(args.out) / "report.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
