"""The experiment script end to end: a 2-cell sweep, real runs on one shared engine."""

import csv
import subprocess
import sys

import pytest

from minirl.config import REPO_ROOT

pytestmark = pytest.mark.slow


def test_two_cell_sweep_writes_csv_report_and_plots(tmp_path):
    out = tmp_path / "cmp"
    cmd = [sys.executable, "scripts/compare_drop_budgets.py", "--out", str(out), "--kinds", "guard_reject",
           "--rates", "0.2", "--policies", "upstream,all fixes", "--budgets", "0", "--steps", "2", "--seeds", "1"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "results.csv") as f:
        reader = csv.DictReader(f)
        rows = {r["policy"]: r for r in reader}
    import importlib.util

    spec = importlib.util.spec_from_file_location("cmp", REPO_ROOT / "scripts" / "compare_drop_budgets.py")
    cmp = sys.modules["cmp"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cmp)
    assert reader.fieldnames == cmp.COLUMNS
    up, fixed = rows["upstream"], rows["all fixes"]
    assert up["survived"] == "False" and up["died_at_step"] == "0"
    assert up["died_reason"].startswith("RolloutRedispatchExhausted:")
    assert int(up["groups_dropped"]) >= 1  # counted from the dying step's events: it wrote no metrics line
    assert fixed["survived"] == "True" and fixed["steps_completed"] == "2"
    assert int(fixed["rollouts_masked"]) > 0 and float(fixed["fraction_trained"]) > float(up["fraction_trained"])
    assert (out / "report.md").exists() and len(list(out.glob("*.png"))) >= 3
    # learning, measured: held-out validation at start and at the end, and the trained-difficulty skew
    assert up["val_reward_start"] != "" and fixed["val_reward_final"] != "" and fixed["rooms_shift"] != ""
    assert float(fixed["rooms_trained_mean"]) - float(fixed["rooms_dispatched_mean"]) == pytest.approx(
        float(fixed["rooms_shift"]), abs=1e-3)
    report = (out / "report.md").read_text()
    assert "## What to pick" in report and "## Bias: what reached the optimizer" in report
    assert (out / "validation_curves.png").exists() and (out / "difficulty_skew.png").exists()
    # a second invocation resumes: nothing left to run
    again = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "0 to run" in again.stdout
