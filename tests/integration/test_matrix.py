"""The switch matrix (minirl/experiments/matrix.py): its table reads the config's own values, its pairwise
cells cover every allowed pair and each loads, every refusal is a ConfigError naming its key (exit 2 through
the CLI), the invariant checker catches each kind of broken book, a cell keeps its seed however the matrix is
run, and the risky cells, run for real under faults on shared workers, keep their books balanced."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import SHARED_WORKERS
from minirl.config import REPO_ROOT, SAMPLER_TRAITS, ConfigError, load_config
from minirl.experiments import matrix, matrix_report
from minirl.experiments.invariants import check_run
from minirl.experiments.switches import cell_overrides, choices, refusal_examples, refused, switches


def test_the_table_reads_the_configs_own_values():
    table = {s.name: s.values for s in switches()}
    assert table["mode"] == ("sync", *SAMPLER_TRAITS)
    assert table["is_correction"] == (None, "tis", "icepop", "seq-mask-tis")
    assert set(table["compaction"]) == set(choices("agent.context_history.policy.type")) \
        >= {"identity", "recency", "summarize"}
    assert table["fix2"] == choices("agent.context_history.guards.on_reject")


def test_the_pairwise_cells_cover_every_allowed_pair_and_each_loads():
    cells = matrix.pairwise_cells()
    covered, allowed, missing = matrix.coverage(cells)
    assert covered == allowed and not missing and allowed > 800
    for cell in cells:
        assert refused(cell) is None, cell
        args = matrix.cell_args(cell, Path("/nonexistent"), 3, [], 0)
        cfg = matrix.cell_config(args)  # the table lets no cell through that the config refuses
        assert cfg.async_rl.enabled == (cell["mode"] != "sync")


def test_every_refusal_is_a_config_error_naming_its_key():
    examples = refusal_examples()
    assert len(examples) >= 9
    for overrides, key, _ in examples:
        with pytest.raises(ConfigError) as err:
            matrix.cell_config(overrides)
        assert err.value.key == key, (overrides, str(err.value))
    overrides, key, _ = examples[0]  # and through the CLI: exit 2 before Ray, the key on the last line
    proc = subprocess.run([sys.executable, "-m", "minirl.train", *overrides], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(f"ConfigError: {key}:")


def _write(run_dir: Path, rows: list[dict], events: list[dict], ledger: dict, served: list[str] | None = None,
           end: dict | None = None, evicted_from_log: int = 0) -> None:
    """A doctored run directory. `ledger`: step (or "run_end") -> its lines; `served`: the keys generation
    worker 0 says it served (default: every ledger line's); `end`: the `run_end` event's unfinished groups
    (default none), or {"absent": True} for a run that never closed its books."""
    (run_dir / "ledger").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    end = {"buffered": [], "in_flight": []} if end is None else end
    events = events + ([] if end.get("absent") else [{"type": "run_end", "unfinished": end}])
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    for step, lines in ledger.items():
        name = "run_end" if step == "run_end" else f"step_{step}"
        (run_dir / "ledger" / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    if served is None:
        served = [_key(x) for lines in ledger.values() for x in lines]
    (run_dir / "ledger" / "served.jsonl").write_text(json.dumps(
        {"rank": 0, "served_count": len(served), "dropped": evicted_from_log, "served": served}) + "\n")


def _key(line: dict) -> str:
    return "s{step}.g{group}.r{rollout}.a{attempt}.c{call}".format(**line)


def _row(step: int, **kw) -> dict:
    return {"step": step, "groups_target": 4, "groups_trained": 4, "dropped_prompt_groups": 0,
            "skipped_prompt_groups": 0,
            "rollouts_masked": 0, "stale_groups_evicted": 0, "policy_version": step, "loss": 0.1, "grad_norm": 1.0} | kw


def _call(step: int, group: int, version: int, status: str = "trained", call: int = 0) -> dict:
    return {"step": step, "group": group, "rollout": 0, "attempt": 0, "call": call, "version_start": version,
            "version_end": version, "ledger_status": status}


@pytest.mark.parametrize("case, expected", [
    ("balanced", None),
    ("nan_loss", "finite: step 1: loss"),
    ("short_target", "target: step 0: groups_target 3"),
    ("lost_fate", "fates: step 1: trained 3 + dropped 0 + skipped 0 = 3, target 4"),
    ("drop_without_event", "events: 0 drop events, the metrics count 1"),
    ("trained_twice", "ledger: call (0, 0, 0, 0, 0) is trained twice"),
    ("stale_call", "ledger: step 1 (version 1, S=0) trained call (1, 1, 0, 0, 0) of versions [0]"),
    ("foreign_error", "exit: exit 1 (1 groups with injected faults): AssertionError"),
    ("budget_without_fault", "exit: exit 1 (0 groups with injected faults; lost groups without one: [(1, 2)])"),
    ("budget_after_faults", None),
    ("budget_after_hang", None),
    ("served_call_lost", "served: call s1.g3.r0.a0.c2, served by generation worker 0, is in no ledger line"),
    ("served_call_retired_at_end", None),
    ("served_twice_ledgered_once", "served: call s1.g1.r0.a0.c0, served by generation worker 0, is in no ledger line"),
    ("no_run_end", "served: no run_end event: the run did not close its books"),
    ("call_log_evicted", "served: generation worker 0's call log evicted 2 records no ledger took"),
])
def test_the_invariants_name_the_first_broken_book(tmp_path, case, expected):
    cfg = load_config(None, ["grpo.num_prompts_per_step=4", "async_rl.rollout_failure.min_step_batch_fraction=0.75"])
    rows = [_row(0), _row(1, groups_trained=3, dropped_prompt_groups=1)]
    events = [{"type": "fault", "step": 1, "group": 2}, {"type": "drop", "step": 1, "group": 2}]
    ledger = {0: [_call(0, 0, 0), _call(0, 1, 0, "retired")], 1: [_call(1, 1, 1)]}
    rc, last = 0, ""
    if case == "nan_loss":
        rows[1]["loss"] = float("nan")
    elif case == "short_target":
        rows[0]["groups_target"] = 3
    elif case == "lost_fate":
        rows[1]["dropped_prompt_groups"] = 0
        events = events[:1]
    elif case == "drop_without_event":
        events = events[:1]
    elif case == "trained_twice":
        ledger[0].append(_call(0, 0, 0))
    elif case == "stale_call":
        ledger[1] = [_call(1, 1, 0)]
    elif case == "foreign_error":
        rc, last = 1, "AssertionError: "
    elif case == "budget_without_fault":
        rc, last, events = 1, "RolloutRedispatchExhausted: prompt idx=4 ...", events[1:]
    elif case == "budget_after_faults":
        rc, last = 1, "RolloutRedispatchExhausted: prompt idx=4 ..."
    elif case == "budget_after_hang":  # group 2's request was in flight on the worker another group's fault hung
        rc, last = 1, "RolloutRedispatchExhausted: prompt idx=4 ..."
        events = [{"type": "fault", "kind": "worker_hang", "step": 1, "group": 0}, *events[1:],
                  {"type": "failure", "step": 1, "group": 2, "decision": "dropped",
                   "error": "HTTP 503: generation worker http://w1 was quarantined with this request in flight: ..."}]
    served, end, evicted_from_log = [_key(x) for lines in ledger.values() for x in lines], None, 0
    if case == "served_call_lost":  # the server answered it; no step's ledger nor the run's end holds it
        served.append("s1.g3.r0.a0.c2")
    elif case == "served_call_retired_at_end":  # a late record of a retired attempt, retired when the run ended
        served.append("s1.g3.r0.a0.c2")
        ledger["run_end"] = [_call(1, 3, 1, "retired", call=2)]
    elif case == "served_twice_ledgered_once":  # the same key answered twice (a resent call): both must be in the books
        served.append("s1.g1.r0.a0.c0")
    elif case == "no_run_end":
        end = {"absent": True}
    elif case == "call_log_evicted":
        evicted_from_log = 2
    _write(tmp_path, rows, events, ledger, served, end, evicted_from_log)
    problem = check_run(tmp_path, rc, last, cfg)
    assert problem == expected if expected is None else problem.startswith(expected), problem


SUMMARIZE_WORKERS = f"""
import sys
from minirl.cluster import start_shared_generation
from minirl.config import load_config
cfg = load_config("configs/summarize.yaml",
                  ["cluster.num_generation_workers={SHARED_WORKERS}", "cluster.cpus_per_generation_worker=0.5"])
print(" ".join(start_shared_generation(cfg, "matrix-summarize")), flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
def test_the_risky_cells_keep_their_books(tmp_path, shared_engine):
    """The two samplers that re-stamp a retried group with kept rows at staleness >= 1 (windowed at 2,
    ready_first), summarize under faults in async mode, a driver SIGKILLed after a checkpoint and resumed,
    each with a worker hang in its fault mix: every invariant holds in every cell (the servers' own account
    of what they served included). (The other risky cells run in the whole matrix.)"""
    child = subprocess.Popen([sys.executable, "-c", SUMMARIZE_WORKERS], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, cwd=REPO_ROOT)
    try:
        attach = {"doors": shared_engine, "summarize": child.stdout.readline().split()}
        assert attach["summarize"], "the summarize workers did not start"
        cells = [c for c in matrix.risky_cells() if c["cell"] in matrix.SUITE_CELLS]
        rows = matrix.run_matrix(cells, tmp_path, 3, 0, attach)
    finally:
        child.stdin.close()
        child.wait(timeout=120)
    verdicts = {r["cell"]: r["verdict"] for r in rows}
    assert all(v == "ok" for v in verdicts.values()), verdicts
    assert len(rows) == len(matrix.SUITE_CELLS) and all(int(r["steps"]) >= 1 for r in rows), [
        (r["cell"], r["steps"], r["rc"]) for r in rows]
    assert any(r["resumed_from"] not in ("", "None") for r in rows if r["cell"] == "risky-in_order-kill")
    assert sum(int(r["faults_fired"]) for r in rows) > 0
    # every cell's mix wedges one of its two workers at step 1; the router quarantines it and the run trains on
    assert all(int(r["hangs"]) >= 1 for r in rows), [(r["cell"], r["hangs"]) for r in rows]
    assert all(int(r["quarantined"]) >= 1 for r in rows if r["cell"] != "risky-in_order-kill"), [
        (r["cell"], r["quarantined"]) for r in rows]
    cell = next(c for c in matrix.risky_cells() if c["cell"] == "risky-windowed-kept-S2")
    assert "async_rl.rollout_failure.nemo_gym.keep_returned_rows=true" in cell_overrides(
        {k: v for k, v in cell.items() if k not in ("cell", "kill")})


def _async_run() -> tuple:
    """A windowed run's books that balance: step 0 trains prompt step 0's groups, step 1 three of prompt step
    1's and group 3 of prompt step 15 (the pump ran ahead; one of its rollouts masked), group 3 of prompt step
    1 is evicted, and group 0 of prompt step 2 is still in the buffer when the run ends."""
    cfg = load_config(None, ["grpo.num_prompts_per_step=4", "async_rl.enabled=true", "async_rl.sampler.name=windowed",
                             "loss_fn.use_importance_sampling_correction=true",
                             "async_rl.rollout_failure.max_consecutive_dropped_prompts=0",
                             "async_rl.rollout_failure.max_skipped_prompts=0"])
    groups = [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3), (15, 3), (2, 0)]
    events = [{"type": "dispatch", "step": s, "group": g} for s, g in groups]
    events += [{"type": "evict", "step": 1, "group": 3}, {"type": "mask", "step": 15, "group": 3}]
    rows = [_row(0), _row(1, rollouts_masked=1, policy_version=1, stale_groups_evicted=1)]
    ledger = {0: [_call(0, g, 0) for g in range(4)],
              1: [_call(1, 0, 1), _call(1, 1, 1), _call(1, 2, 1), _call(15, 3, 1, "masked")],
              "run_end": [_call(2, 0, 1, "retired")]}
    return cfg, rows, events, ledger, {"buffered": [[2, 0]], "in_flight": []}


def test_async_events_named_by_prompt_step_still_balance(tmp_path):
    """The pump runs ahead: a group of prompt step 15 trains at step 1, so its `mask` event names step 15
    (found by the whole matrix's first run, where the sync rule read 0 mask events against 2 counted)."""
    cfg, rows, events, ledger, end = _async_run()
    _write(tmp_path, rows, events, ledger, end=end)
    assert check_run(tmp_path, 0, "", cfg) is None
    # a counted mask without its event
    _write(tmp_path / "lost", rows, [e for e in events if e["type"] != "mask"], ledger, end=end)
    assert check_run(tmp_path / "lost", 0, "", cfg) == "events: 0 mask events, the metrics count 1"


@pytest.mark.parametrize("case, expected", [
    ("balanced", None),
    ("no_fate", "dispatched: group [2, 0] was dispatched and has no fate"),
    ("two_fates", "dispatched: group [1, 3] has 2 fates: unfinished, evicted"),
    ("trained_by_two_steps", "dispatched: group [0, 0] is trained by steps [0, 1]"),
    ("step_count", "dispatched: step 0: its ledger trains 3 groups, its metrics count 4"),
    ("evictions_unsummed",
     "dispatched: 1 groups evicted and 0 dropped or skipped over the run, the metrics sum to 0 and 0"),
])
def test_every_dispatched_group_has_one_fate_under_an_unstamped_sampler(tmp_path, case, expected):
    """windowed (no target steps): every group the pump dispatched is trained once, evicted, dropped or skipped,
    or named unfinished by the run's `run_end` event; each step's ledger trains what its metrics count, and
    the run's evictions sum to the metrics'. (Before, only stamping samplers' steps were checked.)"""
    cfg, rows, events, ledger, end = _async_run()
    if case == "no_fate":  # the group left in the buffer, not named at the end
        end = {"buffered": [], "in_flight": []}
    elif case == "two_fates":
        end = {"buffered": [[2, 0], [1, 3]], "in_flight": []}
    elif case == "trained_by_two_steps":
        ledger[1].append(_call(0, 0, 1, call=1))
    elif case == "step_count":  # group 3 of step 0 dropped (its event), but the metrics count it trained
        ledger[0] = ledger[0][:3]
        events.append({"type": "drop", "step": 0, "group": 3})
    elif case == "evictions_unsummed":
        rows[1]["stale_groups_evicted"] = 0
    _write(tmp_path, rows, events, ledger, end=end)
    problem = check_run(tmp_path, 0, "", cfg)
    assert problem == expected if expected is None else problem.startswith(expected), problem


def test_a_cell_runs_on_its_seed_in_the_whole_matrix_however_it_is_run(tmp_path, monkeypatch):
    """A cell's seed (its fault stream and worker hang) is --seed plus its position in the whole matrix: a
    resumed matrix, a --subset and --cells run each cell on the seed a fresh whole run gives it, not on its
    position among the cells still to run."""
    seen: dict[str, dict[str, int]] = {}

    def run_cell(cell, out, steps, attach, seed):
        seen.setdefault(out.name, {})[cell["cell"]] = seed
        return {**cell, "rc": 0, "verdict": "ok"}

    pairwise = [matrix._default_cell() | {"cell": f"pw{i:02d}", "kill": False} for i in range(3)]
    monkeypatch.setattr(matrix, "pairwise_cells", lambda: pairwise)
    monkeypatch.setattr(matrix, "coverage", lambda cells: (0, 0, []))
    monkeypatch.setattr(matrix, "check_refusals", lambda: [])
    monkeypatch.setattr(matrix, "shared_workers", lambda models: contextlib.nullcontext({}))
    monkeypatch.setattr(matrix, "run_cell", run_cell)
    monkeypatch.setattr(matrix_report, "write_report", lambda *args: 0)
    for name, argv in [("whole", []), ("resumed", ["--cells", "pw01", "risky-in_order-kill"]), ("resumed", []),
                       ("risky", ["--subset", "risky"]), ("one", ["--cells", "risky-summarize-async"])]:
        assert matrix.main(["--out", str(tmp_path / name), "--seed", "7", *argv]) == 0
    whole = seen["whole"]
    assert list(whole.values()) == list(range(7, 7 + 3 + len(matrix.risky_cells())))  # a fresh whole run: as before
    assert seen["resumed"] == whole  # pw01 and the kill cell first, the rest on resume
    assert all(seen[name][c] == whole[c] for name in ("risky", "one") for c in seen[name])
    assert seen["one"] == {"risky-summarize-async": whole["risky-summarize-async"]}
