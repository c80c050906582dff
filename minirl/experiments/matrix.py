"""`python -m minirl.experiments.matrix`: every supported combination of switches, run under faults, with
its books balanced, or refused up front.

    python -m minirl.experiments.matrix                      # the whole matrix -> docs/experiments/matrix/
    python -m minirl.experiments.matrix --subset risky       # the risky cells only
    python -m minirl.experiments.matrix --subset suite       # the four `make test` runs

Cells and books: docs/experiments.md, "The switch matrix". Invariant: a cell runs at most once per output
directory (results.csv is the resume point), every row's verdict comes from the run's own files, and a
cell's seed (its fault stream and worker hang) is `--seed` plus its position in the whole matrix, whether it
runs in a fresh matrix, a resumed one, a `--subset` or `--cells`.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import signal
import subprocess
import sys
import time
from itertools import combinations
from pathlib import Path

from minirl.config import REPO_ROOT, ConfigError, load_config
from minirl.experiments.invariants import check_run, read_jsonl
from minirl.experiments.switches import cell_overrides, refusal_examples, refused, switches

FAULT_RATE = 0.0125
"""Each of the five kinds (six with summarize) fires on 1.25% of rollout attempts: about 6% in all."""
FAULTS = ("agent_exception", "transport", "guard_reject", "model_error", "call_log_lost")
"""`call_log_lost` (the server answers, its record of call 0 never reaches the call log) takes the ledger's
mask path under every switch: the rollout, or under `segment_validity=any` its segment, is masked."""
SUMMARIZE = ["policy.model_name=models/tiny-summarize", "env.task=doors_memory", "env.num_rooms=4",
             "agent.max_steps=4", "agent.context_history.guards.max_total_tokens=256",
             "agent.context_history.policy.summarize.threshold_tokens=[210,250]"]
"""configs/summarize.yaml's task and model: the tiny-doors model writes no summaries to speak of."""
HEALTH = ["cluster.num_generation_workers=2", "async_rl.generation_fleet_health.enabled=true",
          "async_rl.generation_fleet_health.probe_interval_s=2", "async_rl.generation_fleet_health.probe_timeout_s=1.5"]
"""Every cell runs on both of its model's shared workers with fleet health on: the router's probes
quarantine the worker its `worker_hang` wedges, and the run trains on, on the other. A probe has 1.5 s to
answer (upstream: 2 s every 5 s): at 0.5 s, a suite on a saturated 2-core machine (2026-12-07, fresh
clone) saw the healthy worker miss three probes in a row beside the hung one, and the cell died with
GenerationFleetUnhealthy, 0 of 2 healthy."""
HANG_STEP = 1
"""The prompt step whose rollout a cell's `worker_hang` waits at (a weight update behind it, the run still
young); 2 under `replace:stream`, whose first refill diverts prompt step 1 into the spare pool."""
WORKERS = {"doors": ["cluster.num_generation_workers=2", "cluster.cpus_per_generation_worker=0.5",
                     "cluster.num_cpus=4"],
           "summarize": ["cluster.num_generation_workers=2", "cluster.cpus_per_generation_worker=0.5"]}
"""The matrix's shared workers per model, half a CPU each: two of the tiny-doors model, two of tiny-summarize
(a cell attaches to both of its model's). The cluster advertises 4 CPUs (the first model's config starts it),
so a cell's own actors still fit beside 2 CPUs of workers. A hung worker serves again once the next cell
attaches: attaching resets it (`GenerationWorker.reset`)."""
KILL_EVERY = 4
"""Every 4th cell is SIGKILLed after its first checkpoint and resumed."""
COLUMNS = ["cell", *[s.name for s in switches()], "kill", "rc", "steps", "groups_trained", "groups_dropped",
           "groups_skipped", "groups_evicted", "rollouts_masked", "redispatched", "faults_fired", "hangs",
           "quarantined", "groups_unfinished", "resumed_from", "verdict", "wall_s"]


def _row_dict(row, names) -> dict:
    return dict(zip(names, row))


def pairwise_cells() -> list[dict]:
    from allpairspy import AllPairs

    table = switches()
    names = [s.name for s in table]
    rows = [_row_dict(row, names) for row in
            AllPairs([list(s.values) for s in table], filter_func=lambda row: refused(_row_dict(row, names)) is None)]
    rows += _completion(coverage(rows)[2])  # a filter can leave pairs out of allpairspy's greedy cover
    return [{"cell": f"pw{i:02d}", **row, "kill": i % KILL_EVERY == KILL_EVERY - 1} for i, row in enumerate(rows)]


def _completion(missing: list[tuple]) -> list[dict]:
    """Cells that hold the `missing` pairs (a, va, b, vb): each new cell takes every pair that fits it
    (its switches still free or already at those values) and that the table does not refuse there. A pair
    no cell can hold is an error naming it (a refusal the table lacks), not a loop."""
    unfit = [p for p in missing if _fill({p[0]: p[1], p[2]: p[3]}) is None]
    if unfit:
        raise ValueError(f"the table allows pairs no cell can hold, e.g. {unfit[0]}: add the refusal that implies it")
    cells = []
    while missing:
        fixed: dict = {}
        rest = []
        for a, va, b, vb in missing:
            trial = fixed | {a: va, b: vb}
            if all(fixed.get(k, v) == v for k, v in ((a, va), (b, vb))) and _fill(trial) is not None:
                fixed = trial
            else:
                rest.append((a, va, b, vb))
        cells.append(_fill(fixed))
        missing = rest
    return cells


def _fill(fixed: dict) -> dict | None:
    """The default cell under `fixed`, in in_order or sync mode, with or without IS correction, with CC or
    without (and recency compaction) where those are free: the first the table does not refuse, or None."""
    for cc in (True, False):
        for mode in ("in_order", "sync"):
            for correction in ("tis", None):
                cell = _default_cell() | {"mode": mode, "is_correction": correction, "cc": cc} | fixed
                if refused(cell) is None:
                    return cell
    return None


def _default_cell() -> dict:
    return {s.name: s.values[0] for s in switches()} | {
        "preset": "default", "cc": True, "fix1": True, "fix2": "end_episode", "fix3": True, "keep_returned_rows": True,
        "compaction": "recency", "is_correction": "tis", "admission": "eager", "on_dropped": "shrink"}


def risky_cells() -> list[dict]:
    """Each async sampler with a group retry that keeps its returned rows at staleness >= 1 (a kept row
    is older than its retry), and summarizing compaction under faults in async mode."""
    out = []
    for sampler in ("in_order", "windowed", "weight_fifo", "ready_first"):
        for s in ((1, 2) if sampler == "windowed" else (1,)):
            out.append(_default_cell() | {"cell": f"risky-{sampler}-kept-S{s}", "mode": sampler, "staleness": s,
                                          "kill": False})
    out.append(_default_cell() | {"cell": "risky-summarize-async", "mode": "in_order", "staleness": 1,
                                  "compaction": "summarize", "on_summary_failure": "raise", "kill": False})
    out.append(_default_cell() | {"cell": "risky-in_order-kill", "mode": "in_order", "staleness": 1, "kill": True})
    return out


SUITE_CELLS = ("risky-windowed-kept-S2", "risky-ready_first-kept-S1", "risky-summarize-async", "risky-in_order-kill")
"""The risky cells `make test` runs (tests/integration/test_matrix.py): kept rows under the two samplers that re-stamp,
summarize under faults in async mode, a kill and a resume. The rest run in the whole matrix."""


def coverage(cells: list[dict]) -> tuple[int, int, list[tuple]]:
    """(pairs covered, pairs allowed, the allowed pairs no cell holds, as (a, va, b, vb)). A pair is allowed
    unless a refusal rule of those two switches alone refuses it."""
    table = switches()
    covered = {(a, c[a], b, c[b]) for c in cells for a, b in combinations([s.name for s in table], 2)}
    allowed, missing = 0, []
    for sa, sb in combinations(table, 2):
        for va in sa.values:
            for vb in sb.values:
                if refused({sa.name: va, sb.name: vb}) is not None:
                    continue
                allowed += 1
                if (sa.name, va, sb.name, vb) not in covered:
                    missing.append((sa.name, va, sb.name, vb))
    return allowed - len(missing), allowed, missing


def cell_args(cell: dict, run_dir: Path, steps: int, attach: list[str], seed: int) -> list[str]:
    """A cell's `minirl.train` overrides: a few steps of the tiny model attached to both of its model's
    shared generation workers with fleet health on, a seeded fault mix of about 6% (FAULTS; a summary
    fault where summarize is on) and one worker hang (`hang`), checkpoints where the driver is killed."""
    summarize = cell["compaction"] == "summarize"
    rates = [f"faults.rate.{k}={FAULT_RATE}" for k in (*FAULTS, *(("summary_empty",) if summarize else ()))]
    ckpt = (["checkpoint.enabled=true", "checkpoint.save_period=1", "checkpoint.keep_last_k=2"] if cell["kill"]
            else ["checkpoint.enabled=false"])
    args = cell_overrides({k: v for k, v in cell.items() if k not in ("cell", "kill")})
    return [*args, *(SUMMARIZE if summarize else []), *rates, f"faults.seed={seed}",
            hang(seed, rates, HANG_STEP + (cell["on_dropped"] == "replace:stream")), f"grpo.seed={seed}",
            f"grpo.max_num_steps={steps}", "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
            "async_rl.rollout_failure.backoff_base_s=0.1",
            "async_rl.rollout_failure.max_backoff_s=0.5", *ckpt, "logger.tensorboard=false", "logger.progress=false",
            f"run_dir={run_dir}", *attach, *HEALTH]


def hang(seed: int, rates: list[str], step: int) -> str:
    """The cell's `worker_hang`: at call 0 of attempt 0 of one rollout of prompt step `step`, the first in
    a seeded order that no agent-side fault of the mix ends before its first model call."""
    from minirl.faults import FaultPlan
    from minirl.wire import Coords

    plan = FaultPlan(load_config(None, [*rates, f"faults.seed={seed}"]).faults)
    slots = [(g, r) for g in range(4) for r in range(4)]
    for g, r in slots[seed % 16:] + slots[:seed % 16]:
        if all(plan.call_of(k, Coords(step, g, r, 0)) is None
               for k in ("agent_exception", "transport", "guard_reject")):
            break
    return f"faults.inject=[{{kind: worker_hang, step: {step}, group: {g}, rollout: {r}, attempt: 0}}]"


def cell_config(args: list[str]):
    """The MinirlConfig a cell's `minirl.train` arguments resolve to, loaded without Ray (its attach
    overrides left out: they name a cluster, not a setting the books read)."""
    return load_config(args[args.index("--config") + 1] if "--config" in args else None,
                       [a for a in args if "=" in a and not a.startswith("cluster.")])


def _last_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _train(args: list[str], log: Path, kill_after: Path | None = None) -> tuple[int, str, bool]:
    """One `minirl.train` process: (exit code, last stderr line, killed); its stderr is appended to `log`
    (a broken invariant's cause is often there). With `kill_after`, SIGKILL the driver's process group
    once that checkpoint's state file exists."""
    proc = subprocess.Popen([sys.executable, "-m", "minirl.train", *args], cwd=REPO_ROOT,
                            env={**os.environ, "RAY_AUTH_MODE": "disabled"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    killed = False
    if kill_after is not None:
        while proc.poll() is None and not kill_after.exists():
            time.sleep(0.2)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            killed = True
    _, stderr = proc.communicate()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        f.write(stderr)
    return (-9, "", True) if killed else (proc.returncode, _last_line(stderr), False)


def run_cell(cell: dict, out: Path, steps: int, attach: dict[str, list[str]], seed: int) -> dict:
    run_dir = out / "cells" / cell["cell"]
    model = "summarize" if cell["compaction"] == "summarize" else "doors"
    args = cell_args(cell, run_dir, steps, attach[model], seed)
    t0 = time.time()
    try:
        cfg = cell_config(args)
    except ConfigError as exc:
        return {**cell, "rc": 2, "verdict": f"table: the config refuses a cell the table allows: {exc}"}
    resumed_from = None
    log = run_dir.parent / f"{cell['cell']}.stderr"  # beside the run directory, which the run claims whole
    log.unlink(missing_ok=True)
    rc, last, killed = _train([*args, "run_dir_exists=overwrite"], log,  # a cell re-run replaces its earlier files
                              run_dir / "checkpoints" / "step_1" / "state.json" if cell["kill"] else None)
    if killed:
        rc, last, _ = _train([*args, "checkpoint.resume=auto"], log)
        resumed = [e for e in read_jsonl(run_dir / "events.jsonl") if e.get("type") == "resumed"]
        resumed_from = resumed[-1]["from_step"] if resumed else None
    verdict = check_run(run_dir, rc, last, cfg, resumed_from) or "ok"
    return {**{k: cell[k] for k in cell}, "rc": rc, **_totals(run_dir), "resumed_from": resumed_from,
            "verdict": verdict, "wall_s": round(time.time() - t0, 1)}


def _totals(run_dir: Path) -> dict:
    rows = list({r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl")}.values())
    events = read_jsonl(run_dir / "events.jsonl")

    def total(key: str) -> int:
        return sum(r.get(key, 0) for r in rows)

    return {"steps": len(rows), "groups_trained": total("groups_trained"),
            "groups_dropped": total("dropped_prompt_groups"),
            "groups_skipped": total("skipped_prompt_groups"), "groups_evicted": total("stale_groups_evicted"),
            "rollouts_masked": total("rollouts_masked"), "redispatched": total("redispatched_groups"),
            "faults_fired": sum(e.get("type") == "fault" for e in events),
            "hangs": sum(e.get("type") == "fault" and e.get("kind") == "worker_hang" for e in events),
            "quarantined": sum(e.get("type") == "worker_quarantined" for e in events),
            "groups_unfinished": sum(e.get("groups_unfinished", 0) for e in events if e.get("type") == "run_end")}


def check_refusals() -> list[dict]:
    """Each refusal run through the real CLI: exit 2, its key named on the last line."""
    out = []
    for overrides, key, reason in refusal_examples():
        proc = subprocess.run([sys.executable, "-m", "minirl.train", *overrides, "run_dir=/nonexistent/matrix"],
                              cwd=REPO_ROOT, capture_output=True, text=True,
                              env={**os.environ, "RAY_AUTH_MODE": "disabled"}, timeout=300)
        last = _last_line(proc.stderr)
        ok = proc.returncode == 2 and last.startswith(f"ConfigError: {key}:")
        out.append({"overrides": " ".join(overrides), "key": key, "reason": reason, "rc": proc.returncode,
                    "last_line": last, "ok": ok})
    return out


@contextlib.contextmanager
def shared_workers(names: set[str]):
    """The matrix's Ray cluster with one shared generation worker per model the cells need."""
    import ray

    from minirl.cluster import start_shared_generation

    configs = {"doors": load_config(None, WORKERS["doors"]),
               "summarize": load_config(str(REPO_ROOT / "configs" / "summarize.yaml"), WORKERS["summarize"])}
    try:
        yield {name: start_shared_generation(configs[name], f"matrix-{name}") for name in sorted(names)}  # doors first
    finally:
        ray.shutdown()


def run_matrix(cells: list[dict], out: Path, steps: int, seed: int, attach: dict | None = None,
               order: list[str] | None = None) -> list[dict]:
    """Runs the cells not yet in out/results.csv, on `attach` (model name -> the overrides that attach a
    run to its shared workers; started here when None), and returns every cell's row. A cell's seed is
    `seed` plus its position in `order`, the whole matrix's cell names (default: `cells`'s), never among
    the cells still to run: resumed, or run alone, a cell meets the faults a fresh whole run gives it."""
    position = {name: k for k, name in enumerate(order or [c["cell"] for c in cells])}
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.csv"
    done = {}
    if path.exists():
        with open(path) as f:
            done = {row["cell"]: row for row in csv.DictReader(f)}
    todo = [c for c in cells if c["cell"] not in done]
    print(f"matrix: {len(cells)} cells, {len(done)} already in {path}, {len(todo)} to run", flush=True)
    if todo:
        models = {"summarize" if c["compaction"] == "summarize" else "doors" for c in todo}
        new = not path.exists()
        with (contextlib.nullcontext(attach) if attach else shared_workers(models)) as attach, \
                open(path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
            if new:
                writer.writeheader()
            for k, cell in enumerate(todo):
                row = run_cell(cell, out, steps, attach, seed + position[cell["cell"]])
                writer.writerow(row)
                f.flush()
                done[cell["cell"]] = {c: str(row.get(c, "")) for c in COLUMNS}
                print(f"[{k + 1}/{len(todo)}] {cell['cell']}: {row['verdict']} ({row.get('wall_s', '')} s)", flush=True)
    return [done[c["cell"]] for c in cells]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO_ROOT / "docs" / "experiments" / "matrix"))
    parser.add_argument("--subset", choices=("all", "risky", "pairwise", "suite"), default="all")
    parser.add_argument("--cells", nargs="*", help="run only these cell names")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    pairwise = pairwise_cells()
    whole = pairwise + risky_cells()
    cells = {"all": whole, "risky": risky_cells(), "pairwise": pairwise,
             "suite": [c for c in risky_cells() if c["cell"] in SUITE_CELLS]}[args.subset]
    if args.cells:
        cells = [c for c in cells if c["cell"] in args.cells]
    t0 = time.time()
    refusals = check_refusals()
    rows = run_matrix(cells, Path(args.out), args.steps, args.seed, order=[c["cell"] for c in whole])
    from minirl.experiments.matrix_report import write_report

    broken = write_report(Path(args.out), rows, refusals, coverage(pairwise), time.time() - t0)
    print(f"matrix: {len(rows)} cells, {broken} with a broken invariant; {sum(not r['ok'] for r in refusals)} of "
          f"{len(refusals)} refusals not refused with exit 2; report in {args.out}/report.md", flush=True)
    return 1 if broken or not all(r["ok"] for r in refusals) else 0


if __name__ == "__main__":
    sys.exit(main())
