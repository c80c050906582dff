"""The failure-policy sweep (`python -m minirl.experiments.sweep`): end to end, a 2-cell sweep of real runs on one
shared engine; and its answers to issue M's questions on constructed results with known answers."""

import csv
import subprocess
import sys

import pytest

from minirl.config import REPO_ROOT
from minirl.experiments.estimates import _at, _cells
from minirl.experiments.grid import COLUMNS, DEFAULT, DEFAULTS, MASKED_IN_BASELINE, ON_DEFAULTS, Grid
from minirl.experiments.questions import four_questions, what_to_pick


@pytest.mark.slow
def test_two_cell_sweep_writes_csv_report_and_plots(tmp_path, shared_engine):
    out = tmp_path / "cmp"
    opts = dict(o.split("=", 1) for o in shared_engine)  # the session's engine, not one of its own
    address, name = opts["cluster.ray_address"], opts["cluster.attach_generation_workers"]
    cmd = [sys.executable, "-m", "minirl.experiments.sweep", "--out", str(out), "--kinds", "guard_reject",
           "--rates", "0.2", "--policies", "upstream,all fixes", "--budgets", "0", "--steps", "2", "--seeds", "1",
           "--attach", address, name]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "results.csv") as f:
        reader = csv.DictReader(f)
        rows = {r["policy"]: r for r in reader}
    assert reader.fieldnames == COLUMNS
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


def test_answers_and_pick_follow_the_numbers():
    """4 seeds of 5 policies, built so that: shrink skews easy by ~0.4 rooms and end_episode by ~0.1,
    redispatch trains the dispatched mix exactly, the baseline flag moves validation by noise only,
    and seed-to-seed spread (0.1 a seed) is larger than any policy's effect on validation (0.03)."""
    shift = {"+shrink": [-0.45, -0.38, -0.41, -0.36], "+end_episode": [-0.09, -0.12, -0.08, -0.11],
             "+redispatch": [0.0] * 4, DEFAULTS: [-0.09, -0.12, -0.08, -0.11],
             MASKED_IN_BASELINE: [-0.09, -0.12, -0.08, -0.11]}
    val = {"+shrink": -0.03, "+end_episode": 0.0, "+redispatch": 0.0, DEFAULTS: 0.0, MASKED_IN_BASELINE: 0.0}
    noise = {DEFAULTS: [0.01, -0.01, 0.02, -0.02], MASKED_IN_BASELINE: [-0.01, 0.01, -0.02, 0.02]}
    rows = []
    for policy in shift:
        for seed in range(4):
            v = 0.4 + 0.1 * seed + val[policy] + noise.get(policy, [0.0] * 4)[seed] + 0.001 * (seed % 2)
            rows.append({"kind": "guard_reject@room", "rate": 0.07, "policy": policy, "seed": seed, "survived": True,
                         "budget": 4 if policy in ON_DEFAULTS else 16, "fraction": 1.0,
                         "rooms_shift": shift[policy][seed], "skew_tv": abs(shift[policy][seed]) / 3,
                         "val_reward_final": v, "val_success_final": v / 2, "fraction_trained": 0.9,
                         "groups_dropped": 20 * (policy == "+shrink"),
                         "groups_redispatched": 3 * (policy == "+redispatch"),
                         "rollouts_masked": 30 * (policy not in ("+shrink", "+redispatch")), "rollouts_generated": 192})
    grid = Grid(**{**DEFAULT.__dict__, "seeds": tuple(range(4)), "policies": tuple(shift)})
    cells = _cells(rows, grid)
    qs = four_questions(_at(cells, grid, "guard_reject@room", 0.07))
    answers = {q: " ".join(lines) for q, lines, _ in qs}
    assert [q.split()[1] for q in answers] == ["dropping", "masking", "redispatch", "`grpo.baseline_excludes_masked`"]
    shrink, mask, redispatch, flag = answers.values()
    assert shrink.startswith("**Yes**") and mask.startswith("**Yes**") and redispatch.startswith("**Yes**")
    assert "exactly 0 in every seed" in redispatch
    # unpaired, shrink's 0.03 below redispatch drowns in the 0.1-a-seed spread; paired, it is resolved
    assert "Its final held-out reward against +redispatch, paired by seed: -0.03" in shrink and "resolved" in shrink
    assert flag.startswith("**Not resolvably**") and "differ only in the flag" in flag and "not resolvable" in flag
    assert "it does nothing under +shrink, +redispatch" in flag
    pick = what_to_pick(cells, grid)[0]
    assert "Pick **+redispatch (budget 16)**" in pick and "skewed: +shrink (budget 16) (-0.40" in pick
    # without the twin, +end_episode is the flag-false arm: it isolates the flag while nothing drops or is re-sent
    here = {p: rs for p, rs in _at(cells, grid, "guard_reject@room", 0.07).items() if p != MASKED_IN_BASELINE}
    flag = " ".join(four_questions(here)[-1][1])
    assert flag.startswith("**Not resolvably**") and "So the pair isolates the flag" in flag
    here["+end_episode"] = [{**r, "groups_redispatched": r["seed"] == 2} for r in here["+end_episode"]]
    assert four_questions(here)[-1][1][0].startswith("**Not isolated**")
