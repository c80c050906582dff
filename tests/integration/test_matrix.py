"""The switch matrix (minirl/experiments/matrix.py): its table reads the config's own values, its pairwise
cells cover every allowed pair and each loads, every refusal is a ConfigError naming its key (exit 2 through
the CLI), the invariant checker catches each kind of broken book, and the risky cells, run for real under
faults on shared workers, keep their books balanced."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import SHARED_WORKERS
from minirl.config import REPO_ROOT, SAMPLER_TRAITS, ConfigError, load_config
from minirl.experiments import matrix
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


def _write(run_dir: Path, rows: list[dict], events: list[dict], ledger: dict[int, list[dict]]) -> None:
    (run_dir / "ledger").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    for step, lines in ledger.items():
        (run_dir / "ledger" / f"step_{step}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


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
    _write(tmp_path, rows, events, ledger)
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
    ready_first), summarize under faults in async mode, a driver SIGKILLed after a checkpoint and resumed:
    every invariant holds in every cell. (The other risky cells run in the whole matrix.)"""
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
    cell = next(c for c in matrix.risky_cells() if c["cell"] == "risky-windowed-kept-S2")
    assert "async_rl.rollout_failure.nemo_gym.keep_returned_rows=true" in cell_overrides(
        {k: v for k, v in cell.items() if k not in ("cell", "kill")})


def test_async_events_named_by_prompt_step_still_balance(tmp_path):
    """The pump runs ahead: a group of prompt step 15 trains at step 2, so its `mask` event names step 15
    (found by the whole matrix's first run, where the sync rule read 0 mask events against 2 counted)."""
    cfg = load_config(None, ["grpo.num_prompts_per_step=4", "async_rl.enabled=true", "async_rl.sampler.name=windowed",
                             "loss_fn.use_importance_sampling_correction=true",
                             "async_rl.rollout_failure.max_consecutive_dropped_prompts=0",
                             "async_rl.rollout_failure.max_skipped_prompts=0"])
    rows = [_row(0), _row(1, rollouts_masked=1, policy_version=1)]
    ledger = {0: [_call(0, 0, 0)], 1: [_call(15, 3, 1)]}
    _write(tmp_path, rows, [{"type": "mask", "step": 15, "group": 3}], ledger)
    assert check_run(tmp_path, 0, "", cfg) is None
    _write(tmp_path / "lost", rows, [], ledger)  # a counted mask without its event is still caught
    assert check_run(tmp_path / "lost", 0, "", cfg) == "events: 0 mask events, the metrics count 1"
