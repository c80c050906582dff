"""The segments experiment's table (minirl.experiments.segments.report) on constructed rows and run
directories without metrics: a seed without a value drops out of its field only, printed as the sweep's
estimates print (the mean alone for one value, "–" for none, n where fewer seeds than ran)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from minirl.experiments.grid import DEFAULTS
from minirl.experiments.segments import GRID, report


def test_a_seed_without_a_value_leaves_the_rest_of_its_row(tmp_path: Path):
    rows = []
    for p in GRID.policies:
        for s in GRID.seeds:
            d = tmp_path / f"{p}-{s}".replace(" ", "_")
            d.mkdir()  # no metrics.jsonl: segments / rollout and the loss-mass skew are nan in every seed
            rows.append({"policy": p, "seed": s, "run_dir": str(d),
                         "rooms_shift": math.nan if (p == DEFAULTS and s == 2) else -0.1 * s,
                         "val_reward_start": 0.4 if s == 0 or p != DEFAULTS else math.nan,
                         "val_reward_final": 0.5 + 0.01 * s})
    lines = report(rows, GRID)
    cells = next(line for line in lines if line.startswith(f"| {DEFAULTS} |")).strip("| ").split(" | ")
    assert cells[1] == "–" and cells[3] == "–"  # no value in any seed
    assert cells[2].startswith("-0.050 ± ") and cells[2].endswith(" (n=2)")  # the two seeds that have one
    assert cells[4] == "0.400 (n=1)"  # one value: no interval
    assert cells[5].startswith("0.510 ± ") and "(n=" not in cells[5]
    paired = next(line for line in lines if line.startswith("| segments rollout_equal |") and "(n=" in line)
    assert "| no value (n=0) |" in paired and "nan" not in "\n".join(lines)


def test_a_step_that_trained_no_token_places_no_loss_mass(tmp_path: Path):
    """Every rollout of step 1 masked: its `loss_mass_by_group` shares are all 0. It is left out of the
    loss-mass skew, which was read as mass on 0 rooms and pulled the shift down by the dispatched mean."""
    from minirl.config import load_config, to_yaml
    from minirl.data import num_rooms, task_seed
    from minirl.experiments.segments import mass_skew

    cfg = load_config(None, ["grpo.num_prompts_per_step=2"])
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    rooms = {s: [num_rooms(cfg, task_seed(cfg, s, g)) for g in range(2)] for s in (0, 1)}
    steps = [{"step": 0, "loss_mass_by_group": [0.25, 0.75], "rollouts_trained": 8, "traces_trained": 8},
             {"step": 1, "loss_mass_by_group": [0.0, 0.0], "rollouts_trained": 0, "traces_trained": 0}]
    for r in steps:
        r["prompt_seeds"] = [task_seed(cfg, r["step"], g) for g in range(2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    out = mass_skew(tmp_path)
    placed = 0.25 * rooms[0][0] + 0.75 * rooms[0][1]
    assert out["mass_rooms_mean"] == placed and out["mass_shift"] == placed - sum(rooms[0]) / 2
    assert out["segments_per_rollout"] == 1.0
