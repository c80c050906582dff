"""The failure-policy sweep (`python -m minirl.experiments.sweep`): end to end, a 2-cell sweep of real runs on one
shared engine; and its answers to issue M's questions, its differences and its pick on constructed results with
known answers."""

import csv
import subprocess
import sys

import pytest

from minirl.config import REPO_ROOT
from minirl.experiments.estimates import _at, _cells, _paired, at_text
from minirl.experiments.grid import COLUMNS, DEFAULT, DEFAULTS, MASKED_IN_BASELINE, ON_DEFAULTS, Grid
from minirl.experiments.questions import four_questions, what_to_pick
from minirl.experiments.report import _differences


@pytest.mark.parametrize("flag", [["--rates", "1.5"], ["--rates", "nan"], ["--rates", "0.1,-0.1"], ["--rates", "x"],
                                  ["--budgets", "-1"], ["--seeds", "0"], ["--steps", "0"], ["--steps", "-3"]])
def test_a_bad_grid_value_is_refused_before_any_cell(monkeypatch, tmp_path, capsys, flag):
    """A rate outside [0, 1] or a negative budget went to the cells, after the shared engine started: each
    cell's `minirl.train` exited 2, recorded in results.csv as a death at step 0 (a cell there never runs
    again); `--seeds 0` and `--steps 0` were dropped as unset, running the preset's instead."""
    from minirl.experiments import sweep

    ran = []
    monkeypatch.setattr(sweep, "run_sweep", lambda grid, *a: ran.append(grid) or [])
    monkeypatch.setattr(sweep, "write_report", lambda *a: [])
    (tmp_path / "report.md").write_text("")  # what a sweep that went on would print at its end
    with pytest.raises(SystemExit) as exc:
        sweep.main(["--quick", "--out", str(tmp_path), *flag])
    assert exc.value.code == 2 and ran == []
    assert f"error: {flag[0]}: " in capsys.readouterr().err


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
    # one of another run shape is refused before anything runs, whether the folder says its shape
    # (shape.json) or is an older one whose rows do (`steps_target`): 2-step cells are never a 3-step result
    kept = (out / "results.csv").read_bytes()
    longer = [*cmd[:cmd.index("--steps") + 1], "3", *cmd[cmd.index("--steps") + 2:]]
    for older in (False, True):
        if older:
            (out / "shape.json").unlink()
        refused = subprocess.run(longer, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
        assert refused.returncode == 1 and (
            f"{out / 'results.csv'} holds cells of another run shape (steps 2 there, 3 here)") in refused.stderr, \
            refused.stderr[-2000:]
        assert (out / "results.csv").read_bytes() == kept


def test_answers_and_pick_follow_the_numbers():
    """4 seeds of 5 policies, built so that: shrink skews easy by ~0.4 rooms and end_episode by ~0.1,
    redispatch trains the dispatched mix exactly, the baseline flag moves validation by noise only,
    and seed-to-seed spread (0.1 a seed) is larger than any policy's effect on validation (0.03)."""
    shift = {"+shrink": [-0.45, -0.38, -0.41, -0.36], "+end_episode": [-0.09, -0.12, -0.08, -0.11],
             "+redispatch": [0.0] * 4, DEFAULTS: [-0.09, -0.12, -0.08, -0.11],
             MASKED_IN_BASELINE: [-0.09, -0.12, -0.08, -0.11]}
    val = {"+shrink": -0.03, "+end_episode": 0.0, "+redispatch": 0.0, DEFAULTS: 0.0, MASKED_IN_BASELINE: 0.0}
    noise = {DEFAULTS: [0.01, -0.01, 0.02, -0.02], MASKED_IN_BASELINE: [-0.01, 0.01, -0.02, 0.02],
             "+shrink": [0.004, -0.004, 0.002, -0.002]}  # a spread: the same -0.03 in every seed is no t-test
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
    assert "Its final held-out reward against +redispatch, paired by seed: -0.03 ± 0.01 (resolved" in shrink
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


def _row(policy: str, seed: int, budget: int = 16, fraction: float = 1.0, shift: float = 0.0, val: float = 0.5) -> dict:
    return {"kind": "guard_reject@room", "rate": 0.07, "policy": policy, "budget": budget, "fraction": fraction,
            "seed": seed, "survived": True, "died_at_step": "", "rooms_shift": shift, "skew_tv": abs(shift) / 3,
            "val_reward_final": val, "val_success_final": val / 2, "fraction_trained": 0.9, "groups_dropped": 0,
            "groups_redispatched": 3, "rollouts_masked": 0, "rollouts_generated": 100}


def test_redispatch_avoids_the_skew_only_where_the_others_resolvably_skew_further():
    """Yes needs a gap to stand on: with no other policy in the grid (one seed, or an interval holding 0) and
    with the other policy skewing toward hard prompts against +redispatch, the answer is not Yes."""
    def answer(here: dict) -> str:
        return next(" ".join(lines) for q, lines, _ in four_questions(here) if q == "Does redispatch avoid the skew?")

    assert answer({"+redispatch": [_row("+redispatch", 0, shift=-0.9)]}).startswith("**Not resolvably**")
    wide = [_row("+redispatch", s, shift=x) for s, x in enumerate((-0.5, 0.4, -0.3))]
    assert answer({"+redispatch": wide}).startswith("**Not resolvably**")
    # +shrink − +redispatch is resolvably above 0: the other policy trains the harder mix
    shrink = [_row("+shrink", s, shift=x + 0.3 + 0.01 * s) for s, x in enumerate((-0.5, 0.4, -0.3))]
    assert answer({"+redispatch": wide, "+shrink": shrink}).startswith("**Not resolvably**")
    easy = [_row("+shrink", s, shift=x - 0.3 - 0.01 * s) for s, x in enumerate((-0.5, 0.4, -0.3))]
    assert answer({"+redispatch": wide, "+shrink": easy}).startswith("**Yes**")


def test_differences_pair_each_policy_with_the_base_at_its_own_budget():
    """Budgets 4 and 16 without the defaults: +redispatch at 16 is compared with +shrink at 16 (not at 4,
    the base's first cell), and each line names the two cells compared."""
    grid = Grid(kinds=("guard_reject@room",), rates=(0.07,), policies=("+shrink", "+redispatch"), budgets=(4, 16),
                fractions=(0.5,), seeds=(0, 1, 2), steps=6, prompts=8, generations=4)
    rows = [r for s in grid.seeds for r in (
        _row("+shrink", s, 4, 0.5, val=0.1 + 0.05 * s), _row("+shrink", s, 16, 0.5, val=0.6 + 0.03 * s),
        _row("+redispatch", s, 4, val=0.1 + 0.04 * s), _row("+redispatch", s, 16, val=0.6 + 0.02 * s))]
    lines = _differences(_cells(rows, grid), grid)
    at16 = next(line for line in lines if "+redispatch (budget 16)" in line)
    assert "+redispatch (budget 16) − +shrink (budget 16): final val reward -0.01 ± 0.02" in at16, at16
    assert "+redispatch (budget 4) − +shrink (budget 4): final val reward -0.01 ± 0.02" in "\n".join(lines)
    assert "same drop budget" in lines[2]


def test_cells_that_differ_only_in_floor_stay_apart():
    """Two floors in the grid: what_to_pick weighs +shrink at each floor as its own cell, naming the floor
    (the best, at floor 0.25, is not overwritten by floor 0.5), and the questions take the grid's first floor
    whatever order results.csv holds the rows in, and say so."""
    grid = Grid(kinds=("guard_reject@room",), rates=(0.07,), policies=("+shrink", "+redispatch"), budgets=(16,),
                fractions=(0.25, 0.5), seeds=(0, 1, 2), steps=6, prompts=8, generations=4)
    rows = [r for s in grid.seeds for r in (
        _row("+shrink", s, fraction=0.5, val=0.30 + 0.01 * s + 0.002 * (s == 1), shift=0.02 * (s - 1)),
        _row("+shrink", s, fraction=0.25, val=0.90 + 0.01 * s, shift=0.01 * (s - 1)),
        _row("+redispatch", s, val=0.50 + 0.01 * s + 0.003 * (s == 2)))]
    cells = _cells(rows, grid)
    pick = what_to_pick(cells, grid)[0]
    assert "Highest final validation reward: +shrink (budget 16, floor 0.25), 0.91 ± 0.02" in pick, pick
    assert "resolvably below it (paired by seed): +shrink (budget 16, floor 0.5) (-0.60" in pick, pick
    assert [r["fraction"] for r in _at(cells, grid, "guard_reject@room", 0.07)["+shrink"]] == [0.25] * 3
    assert at_text(grid).startswith(" (floor 0.25;")


def test_seeds_without_spread_resolve_nothing():
    """Two seeds that each differ by one held-out prompt of 8 give a zero-width interval: no t statistic
    (mean / (0 / sqrt n)), so the difference is reported as the same in every seed, not as resolved."""
    a = [{"seed": 0, "v": 0.625}, {"seed": 1, "v": 0.5}]
    b = [{"seed": 0, "v": 0.5}, {"seed": 1, "v": 0.375}]
    e = _paired(a, b, "v")
    assert (e.mean, e.half, e.n) == (0.125, 0.0, 2) and e.sign == 0
    assert e.resolved() == "+0.12 ± 0.00 (the same in all 2 seeds: no spread, so no t-interval; not resolved)"
    assert _paired(a, [{**r, "v": r["v"] - 0.02 * r["seed"]} for r in b], "v").sign == 1  # a spread: a t-test


def test_a_run_that_generated_nothing_has_no_fraction_and_rooms_keep_their_columns(tmp_path):
    """A cell whose run died before any rollout came back has no fraction trained (it was 0.0, which
    pulled its policy's mean down as if every rollout had been thrown away), and the final reward by
    rooms stands under its own room count even where the held-out set had none of one (the values were
    sorted as strings and shifted left under the table's `1 / 2 / 3 / 4 room(s)`)."""
    import math
    from types import SimpleNamespace

    from minirl.experiments.cells import _typed, summarize
    from minirl.experiments.estimates import _by_rooms

    grid = Grid(kinds=("guard_reject",), rates=(0.2,), policies=("upstream",), budgets=(0,), fractions=(1.0,),
                seeds=(0,), steps=2, prompts=2, generations=2, mix=(1, 2, 3, 10))
    cell = next(grid.cells())
    died = SimpleNamespace(returncode=1, stderr="RuntimeError: the engine did not start\n")
    row = _typed({k: str(v) for k, v in summarize(cell, grid, tmp_path, died, 1.0).items()})
    assert row["rollouts_generated"] == 0 and math.isnan(row["fraction_trained"])
    rooms = [{"val_final_by_rooms": '{"1": 1.0, "10": 0.0, "2": 0.5}'}, {"val_final_by_rooms": '{"1": 0.5}'}]
    assert _by_rooms(rooms, grid.mix) == "0.75 / 0.50 / – / 0.00"
