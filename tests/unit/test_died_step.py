"""The step that killed a run writes no metrics line; the sweep's rows (minirl.experiments.cells.summarize) add
its rollouts generated and groups dropped from the run's events (`died_step`), a `run_failed` event without a
step (the controller's before its first collect, or the driver's when the controller does not answer) being
that step's."""

from __future__ import annotations

import json
from types import SimpleNamespace

from minirl.experiments.cells import died_step, summarize
from minirl.experiments.grid import Grid


def test_a_stepless_run_failed_is_the_dying_steps(tmp_path):
    grid = Grid(kinds=("guard_reject",), rates=(0.2,), policies=("upstream",), budgets=(0,), fractions=(1.0,),
                seeds=(0,), steps=2, prompts=2, generations=2)
    events = [{"type": "drop", "step": 0, "group": 1, "decision": "dropped"},
              {"type": "run_failed", "step": None, "error": "RuntimeError: the pump died", "rollout_attempts": 8,
               "rollouts_generated": 6}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    died = SimpleNamespace(returncode=1, stderr="RuntimeError: the pump died\n")
    row = summarize(next(grid.cells()), grid, tmp_path, died, 1.0)
    assert (row["rollouts_generated"], row["groups_dropped"], row["fraction_trained"]) == (6, 1, 0.0)
    # the driver's own event (no count) beside the controller's leaves the controller's count standing
    assert died_step([{"type": "run_failed", "step": 3, "rollouts_generated": 5},
                      {"type": "run_failed", "step": None, "error": "x"}], 3) == (5, 0)
    # another step's events are not the dying step's
    assert died_step([{"type": "drop", "step": 2}, {"type": "run_failed", "step": 2, "rollouts_generated": 4}], 3) == (
        0, 0)
