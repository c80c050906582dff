"""Issue 54's sweep tooling without a training run: scripts/summarize_experiments.py's resume and skip
(which cells still run, read from results.csv and each run directory's own files), its rows (the step that
killed a run counted from its events), its report's paired statistics per seed (read by
minirl.experiments.estimates.Estimate's rule), the claim judged on rule.md's seeds whatever seeds the report
reads, and validation's `val_fact_success_rate` (held-out success on the rooms that need a fact)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
from pathlib import Path

import pytest

from minirl.agents.env import DoorsEnv, make_rooms
from minirl.config import load_config
from minirl.data import fact_rooms, task_row
from minirl.experiments.stats import paired_ci
from minirl.trainer.checkpoint import save
from minirl.validation import summarize

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("summarize_experiments", REPO / "scripts/summarize_experiments.py")
sweep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sweep)


# ------------------------------------------------------------------------------------- fact rooms
def opened(task: dict, wrong_at: set[int]) -> list[dict]:
    """`open_door` calls for every room in turn, one wrong try first at each room of `wrong_at`."""
    out = []
    for i, room in enumerate(make_rooms(task["seed"], task["num_rooms"])):
        codes = [room.code + 1, room.code] if i in wrong_at else [room.code]
        out += [{"type": "function_call", "name": "open_door", "arguments": json.dumps({"code": c})} for c in codes]
    return out


@pytest.mark.parametrize("task,needed", [("doors_memory", 1), ("doors_notes", 2)])
def test_fact_rooms_counts_first_tries_on_the_rooms_that_need_a_fact(task, needed):
    cfg = load_config(overrides=[f"env.task={task}", f"env.num_rooms={4 if task == 'doors_memory' else 7}"])
    row = task_row(cfg, 3)
    rooms = sorted(f["needed_in_room"] for f in DoorsEnv(3, row["task"]["num_rooms"], task).memory_facts())
    assert len(rooms) == needed
    result = lambda wrong: {"response": {"output": opened(row["task"], wrong)}}  # noqa: E731
    assert fact_rooms(row, result(set())) == (needed, needed)
    assert fact_rooms(row, result({0})) == (needed, needed)  # a room needing no fact does not count
    assert fact_rooms(row, result({rooms[-1]})) == (needed - 1, needed)  # a second try is not success
    assert fact_rooms(row, {}) == (0, needed) and fact_rooms(row, {"response": {"output": "junk"}}) == (0, needed)
    plain = task_row(load_config(), 3)  # the `doors` task has no such room
    assert fact_rooms(plain, result(set())) is None


def test_val_fact_success_rate_pools_the_rooms_and_scores_policy_ends_zero():
    cfg = load_config(overrides=["env.task=doors_notes", "env.num_rooms=7"])
    rows = [task_row(cfg, s) for s in (1, 2, 3)]
    res = [{"reward": 1.0, "response": {"status": "completed"}, "evidence": {}, "mask": None, "fact_rooms": (2, 2)},
           {"reward": 0.5, "response": {"status": "completed"}, "evidence": {}, "mask": None, "fact_rooms": (1, 2)},
           {"reward": 0.0, "response": {"status": "incomplete"}, "evidence": {"end_reason": "guard_reject"},
            "mask": None, "fact_rooms": (2, 2)}]
    assert summarize(rows, res)["val_fact_success_rate"] == pytest.approx(3 / 6)
    assert "val_fact_success_rate" not in summarize(rows, [{**r, "fact_rooms": None} for r in res])


# ---------------------------------------------------------------------------------- resume and skip
def write_jsonl(path: Path, lines: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def checkpoint(run_dir: Path, step: int, verified: bool = True) -> None:
    def policy(d: str) -> None:
        (Path(d) / "policy").mkdir()
        (Path(d) / "policy" / "weights.bin").write_bytes(b"w" * 10)

    ck = save(run_dir, step, {"next_step": step}, policy, str(run_dir), keep_last_k=1)
    if not verified:  # the process died while the weights were rewritten
        (ck / "policy" / "weights.bin").write_bytes(b"w" * 3)


def test_cell_state_reads_the_run_directory(tmp_path):
    runs = tmp_path / "runs"
    d = {name: sweep.run_dir_of(runs, "doors_notes", "summarize", s) for s, name in enumerate(
        ["none", "done", "died", "mid", "unverified"])}
    write_jsonl(d["done"] / "events.jsonl", [{"type": "resumed"}, {"type": "run_end", "step": 40}])
    write_jsonl(d["done"] / "metrics.jsonl", [{"step": s} for s in range(40)])
    write_jsonl(d["died"] / "events.jsonl", [{"type": "run_failed", "error": "RuntimeError: lost 3 of 8"},
                                             {"type": "run_end", "step": 5}])
    write_jsonl(d["mid"] / "events.jsonl", [{"type": "run_failed", "error": "Terminated: SIGTERM"},
                                            {"type": "run_end", "step": 27}])  # stopped with the sweep
    checkpoint(d["mid"], 20)
    write_jsonl(d["unverified"] / "metrics.jsonl", [{"step": 0}])
    checkpoint(d["unverified"], 20, verified=False)  # the process died while writing it
    assert {k: sweep.cell_state(v, 40) for k, v in d.items()} == {
        "none": "fresh", "done": "done", "died": "fresh", "mid": "resume", "unverified": "fresh"}
    args = type("A", (), {"steps": 40, "save_every": 20, "val_prompts": 16})
    resume = sweep.cell_args("doors_notes", "summarize", 3, args, d["mid"], True)
    fresh = sweep.cell_args("doors_notes", "summarize", 3, args, d["none"], False)
    assert "checkpoint.resume=auto" in resume and "run_dir_exists=overwrite" not in resume
    assert "checkpoint.resume=none" in fresh and "run_dir_exists=overwrite" in fresh
    assert fresh[:2] == ["--config", "configs/summarize_notes.yaml"] and "checkpoint.save_period=20" in fresh
    args.steps = None  # each task's config's own length
    for task, config in sweep.TASKS.items():
        own = load_config(str(REPO / config)).grpo.max_num_steps
        assert f"grpo.max_num_steps={own}" in sweep.cell_args(task, "summarize", 3, args, d["none"], False)
    row = sweep.summarize_run("doors_notes", "summarize", 2, d["died"], 12.0, 1)
    assert row["survived"] is False and row["died_reason"].startswith("RuntimeError: lost 3")
    write_jsonl(d["mid"] / "events.jsonl", [{"type": "run_failed", "error": "Terminated: SIGTERM"},
                                            {"type": "run_end", "step": 27}, {"type": "resumed", "from_step": 20},
                                            {"type": "run_end", "step": 40}])  # the stopped part, then its resume
    row = sweep.summarize_run("doors_notes", "summarize", 3, d["mid"], 12.0, 2)
    assert row["survived"] is True and row["died_reason"] == ""


def test_pending_skips_recorded_cells_seed_outermost_and_old_rows_are_doors_memory():
    done = {sweep.cell_key({"arm": "summarize", "seed": "1"}),  # a row from before tasks were named
            sweep.cell_key({"task": "doors_notes", "arm": "recency", "seed": "0"})}
    left = sweep.pending(done, [0, 1], ["doors_memory", "doors_notes"], ["recency", "summarize"])
    assert left == [("doors_memory", "recency", 0), ("doors_memory", "summarize", 0), ("doors_notes", "summarize", 0),
                    ("doors_memory", "recency", 1), ("doors_notes", "recency", 1), ("doors_notes", "summarize", 1)]


def test_a_finished_run_without_a_row_is_read_not_rerun(tmp_path, monkeypatch):
    """The sweep stopped after a run closed but before its row was written: the next invocation writes
    the row from the run's files and starts no process; a run stopped mid-way resumes from its checkpoint."""
    runs, out = tmp_path / "runs", tmp_path / "out"
    done = sweep.run_dir_of(runs, "doors_memory", "summarize", 0)
    write_jsonl(done / "events.jsonl", [{"type": "run_end", "step": 2}])
    write_jsonl(done / "metrics.jsonl", [{"step": 0, "summary_recall": 0.1, "rollouts_generated": 32,
                                         "rollouts_trained": 30, "rollouts_masked": 2, "segments_masked": 3},
                                        {"step": 1, "summary_recall": 0.3, "rollouts_generated": 32,
                                         "rollouts_trained": 32}])
    write_jsonl(done / "validation.jsonl", [{"val_success_rate": 0.25, "val_reward_mean": 0.6,
                                            "val_fact_success_rate": 0.1},
                                           {"val_success_rate": 0.5, "val_reward_mean": 0.7,
                                            "val_fact_success_rate": 0.4}])
    (done.parent / f".{done.name}.wall").write_text(json.dumps({"wall_s": 100.0, "parts": 2}))
    mid = sweep.run_dir_of(runs, "doors_memory", "recency", 0)
    checkpoint(mid, 1)
    calls = []
    monkeypatch.setattr(sweep, "train_part", lambda run_dir, argv: calls.append(argv) or (137, "killed", 5.0))
    args = type("A", (), {"out": str(out), "runs": str(runs), "seeds": [0], "tasks": ["doors_memory"],
                          "arms": ["recency", "summarize"], "steps": 2, "save_every": 1, "val_prompts": 16})
    sweep.run_cells(args)
    assert len(calls) == 1 and "checkpoint.resume=auto" in calls[0]  # only the stopped one, from its checkpoint
    rows = sweep.read_rows(out / "results.csv")
    assert [(r["task"], r["arm"], r["seed"]) for r in rows] == [("doors_memory", "summarize", "0")]
    r = rows[0]
    assert (r["wall_s"], r["parts"], r["rollouts_masked"], r["segments_masked"]) == ("100.0", "2", "2", "3")
    assert (float(r["val_fact_start"]), float(r["val_fact_final"])) == (0.1, 0.4)
    assert json.loads((mid.parent / f".{mid.name}.wall").read_text()) == {"wall_s": 5.0, "parts": 1}
    sweep.run_cells(args)  # again: the recorded cell is skipped, the stopped one tried again
    assert len(calls) == 2 and len(sweep.read_rows(out / "results.csv")) == 1


def test_a_resumed_part_killed_before_its_own_run_end_is_left_for_the_next_invocation(tmp_path, monkeypatch):
    """events.jsonl is appended across parts: the run_end of the part the sweep stopped does not close the part
    that resumed from its checkpoint and was then SIGKILLed (no row, resumed again next time); one that closes
    its own books gets its row."""
    runs, out = tmp_path / "runs", tmp_path / "out"
    run_dir = sweep.run_dir_of(runs, "doors_memory", "recency", 0)
    write_jsonl(run_dir / "metrics.jsonl", [{"step": s} for s in range(25)])
    write_jsonl(run_dir / "events.jsonl", [{"type": "run_failed", "step": 25, "error": "KeyboardInterrupt: "},
                                           {"type": "run_end", "step": 25}])  # part 1, stopped with the sweep
    checkpoint(run_dir, 20)
    parts = []

    def part(rd, argv, closes):
        parts.append(argv)
        with open(rd / "events.jsonl", "a") as f:
            f.write(json.dumps({"type": "resumed", "from_step": 20}) + "\n")
            if closes:
                f.write(json.dumps({"type": "run_end", "step": 40}) + "\n")
        write_jsonl(rd / "metrics.jsonl", [{"step": s} for s in range(40 if closes else 22)])
        return (0, "", 30.0) if closes else (-9, "", 3.0)

    args = type("A", (), {"out": str(out), "runs": str(runs), "seeds": [0], "tasks": ["doors_memory"],
                          "arms": ["recency"], "steps": 40, "save_every": 20, "val_prompts": 16})
    monkeypatch.setattr(sweep, "train_part", lambda rd, argv: part(rd, argv, closes=False))
    sweep.run_cells(args)
    assert len(parts) == 1 and "checkpoint.resume=auto" in parts[0]
    assert not sweep.ended(run_dir) and sweep.read_rows(out / "results.csv") == []
    assert sweep.cell_state(run_dir, 40) == "resume"
    monkeypatch.setattr(sweep, "train_part", lambda rd, argv: part(rd, argv, closes=True))
    sweep.run_cells(args)
    assert len(parts) == 2 and "checkpoint.resume=auto" in parts[1]
    (row,) = sweep.read_rows(out / "results.csv")
    assert (row["survived"], row["steps"], row["parts"], row["wall_s"]) == ("True", "40", "2", "33.0")  # both parts


# ------------------------------------------------------------------------------------ paired report
def test_the_report_pairs_arms_by_seed():
    rows = []
    for seed, (base, rl, rec) in enumerate([(0.1, 0.6, 0.2), (0.2, 0.6, 0.1), (0.0, 0.5, 0.2), (0.1, 0.2, 0.3)]):
        curve = [0.1] * 20 + [0.5 if seed < 3 else 0.15] * 20
        rows.append({"task": "doors_memory", "arm": "summarize", "seed": str(seed), "val_fact_start": str(base),
                     "val_fact_final": str(rl), "recall_curve": json.dumps(curve), "survived": "True"})
        rows.append({"task": "doors_memory", "arm": "recency", "seed": str(seed), "val_fact_final": str(rec),
                     "recall_curve": "[]"})
    rows.append({"task": "doors_memory", "arm": "summarize", "seed": "9", "val_fact_start": "0",
                 "val_fact_final": "1", "recall_curve": "[]", "survived": "True"})  # seed 9: no recency, no pair
    m, h, n = paired_ci({0: 0.6, 1: 0.6, 2: 0.5, 3: 0.2}, {0: 0.2, 1: 0.1, 2: 0.2, 3: 0.3})
    got = sweep.paired(rows, "doors_memory", ("summarize", "val_fact_final"), ("recency", "val_fact_final"))
    assert got == pytest.approx((m, h, n)) and n == 4 and m == pytest.approx(0.275)
    per = sweep.per_seed(rows, "doors_memory", "summarize", "recall_rise")
    assert per[0] == pytest.approx(0.4) and per[3] == pytest.approx(0.05) and math.isnan(per[9])
    assert sweep.rises(rows, "doors_memory", "summarize") == (3, 5)  # a rise of >= 0.3 on 3 of the 5 seeds run


def test_a_run_that_dies_on_its_own_is_recorded_as_it_ends(tmp_path, monkeypatch):
    def dies(run_dir, argv):
        write_jsonl(run_dir / "events.jsonl", [{"type": "run_failed", "error": "RuntimeError: training step 0 lost 3"},
                                               {"type": "run_end", "step": 0}])
        return 1, "RuntimeError: training step 0 lost 3", 7.0

    monkeypatch.setattr(sweep, "train_part", dies)
    args = type("A", (), {"out": str(tmp_path / "out"), "runs": str(tmp_path / "runs"), "seeds": [4],
                          "tasks": ["doors_notes"], "arms": ["summarize+faults, drop budget"], "steps": 20,
                          "save_every": 20, "val_prompts": 16})
    sweep.run_cells(args)
    (row,) = sweep.read_rows(tmp_path / "out" / "results.csv")
    assert (row["task"], row["survived"], row["steps"], row["wall_s"]) == ("doors_notes", "False", "0", "7.0")
    assert row["died_reason"] == "RuntimeError: training step 0 lost 3"


def summary_training(cfg) -> tuple:
    return (cfg.grpo.summary_credit, cfg.agent.context_history.policy.summarize.on_summary_failure,
            cfg.loss_fn.reference_policy_kl_penalty)


def test_the_arms_spell_out_their_summary_training_and_the_memory_config_carries_the_recipe():
    """Every summarizing arm sets the summary training it ran with, so a config that changes under it does not
    change what its rows mean; issue 54's summarizing arm is what configs/summarize.yaml trains."""
    path = str(REPO / sweep.TASKS["doors_memory"])
    recipe = summary_training(load_config(path, sweep.ARMS[sweep.EXPERIMENT_ARMS[-1]]))
    assert recipe == summary_training(load_config(path)) == ("next_segment", "end_episode_scored", sweep.KL)
    for arm in ("summarize", "summarize+faults, redispatch", "lost log, any"):  # rollout credit, on either config
        for task in sweep.TASKS:
            assert summary_training(load_config(str(REPO / sweep.TASKS[task]), sweep.ARMS[arm])) == (
                "rollout", "raise", 0.0), (task, arm)


def test_the_report_reads_only_the_seeds_asked_for(tmp_path):
    arm = sweep.EXPERIMENT_ARMS[-1]  # the summarizing arm of issue 54's experiment
    rows = [{"task": "doors_memory", "arm": arm, "seed": str(s), "steps": "3", "wall_s": "1",
             "val_fact_start": "0", "val_fact_final": "1", "recall_curve": "[0.1, 0.5]", "survived": "True"}
            for s in (0, 11)]
    with (tmp_path / "results.csv").open("w", newline="") as f:
        w = sweep.csv.DictWriter(f, fieldnames=sweep.COLUMNS, restval="")
        w.writeheader()
        w.writerows(rows)
    args = type("A", (), {"out": str(tmp_path), "val_prompts": 16, "report_seeds": [11]})
    text = sweep.report(args)
    assert f"| {arm} | 11 |" in text and f"| {arm} | 0 |" not in text and "reads seeds [11] alone" in text
    # the header names the command that rewrites this report, the seeds it read included
    command = f"python scripts/summarize_experiments.py --report-only --out {tmp_path} --report-seeds 11"
    assert f"by `{command}` from results.csv" in text, text[:400]
    links = re.findall(r"\]\(([^)]+\.md)\)", text)  # rule.md and segments.md, from wherever the report stands
    assert {Path(link).name for link in links} >= {"rule.md", "segments.md"}, links
    assert all((tmp_path / link).resolve().is_file() for link in links), links


def test_the_claims_verdict_follows_the_declared_rule():
    """rule.md: recall rises by >= 0.3 on >= 9 of the 10 seeds (a run that ended early fails its seed), and both
    fact-room intervals lie above 0; fewer than 10 seeds are not judged."""
    arm = sweep.EXPERIMENT_ARMS[-1]

    def rows(seeds=sweep.CLAIM_SEEDS, flat=(), died=(), fact_final=0.7):
        out = [{"task": "doors_memory", "arm": "recency", "seed": str(s), "val_fact_final": str(0.1 + s % 3 / 20),
                "survived": "True"} for s in seeds]
        return out + [{"task": "doors_memory", "arm": arm, "seed": str(s), "survived": str(s not in died),
                       "val_fact_start": str(0.05 + s % 2 / 20), "val_fact_final": str(fact_final - s % 4 / 20),
                       "recall_curve": json.dumps([0.1] * 20 + [0.1 if s in flat else 0.45] * 20)} for s in seeds]

    assert sweep.claim(rows(flat=[13]), "doors_memory", arm).startswith("holds: recall rose by >= 0.3 on 9 of 10")
    assert sweep.claim(rows(flat=[13], died=[15]), "doors_memory", arm).startswith("does not hold: recall rose by "
                                                                                     ">= 0.3 on 8 of 10")
    assert sweep.claim(rows(fact_final=0.12), "doors_memory", arm).startswith("does not hold: recall rose by >= "
                                                                              "0.3 on 10 of 10")
    nine = "not judged yet: 9 of its 10 seeds (10-19) run by both arms"
    assert sweep.claim(rows(seeds=range(10, 19)), "doors_memory", arm) == nine
    # development seeds beside the declared ones: judged on 10-19 alone, not as 9 risen of 15 run
    dev = rows(seeds=range(5))
    assert sweep.claim(dev + rows(flat=[13, 14]), "doors_memory", arm).startswith(
        "does not hold: recall rose by >= 0.3 on 8 of 10")
    assert sweep.claim(dev + rows(seeds=range(10, 19)), "doors_memory", arm) == nine  # 14 seeds, 9 declared
    no_recency = [r for r in rows() if not (r["arm"] == "recency" and r["seed"] == "19")]
    assert sweep.claim(no_recency, "doors_memory", arm) == nine
    rule = (REPO / "docs/experiments/summarize/rule.md").read_text()
    assert f"**Seeds {sweep.CLAIM_SEEDS[0]}-{sweep.CLAIM_SEEDS[-1]}**" in rule  # the set rule.md declares


def test_a_part_the_sweep_did_not_live_to_close_counts_to_the_runs_last_write(tmp_path):
    run_dir = sweep.run_dir_of(tmp_path, "doors_memory", "summarize", 0)
    write_jsonl(run_dir / "metrics.jsonl", [{"step": 0}])
    os.utime(run_dir / "metrics.jsonl", (1000.0, 1000.0))
    (run_dir.parent / f".{run_dir.name}.locked").write_text("940.5\n")  # the part's lock was granted then
    ledger = run_dir.parent / f".{run_dir.name}.wall"
    ledger.write_text(json.dumps({"wall_s": 30.0, "parts": 1, "open": True}))
    assert sweep.settled(run_dir, ledger) == {"wall_s": 89.5, "parts": 2}
    ledger.write_text(json.dumps({"wall_s": 30.0, "parts": 1}))  # closed: as written
    assert sweep.settled(run_dir, ledger) == {"wall_s": 30.0, "parts": 1}


def test_experiment_3_pairs_its_seeds_and_tables_the_kept_20_step_runs_beneath(tmp_path):
    def row(arm, seed, steps, survived=True, success=0.5):
        return {"task": "doors_memory", "arm": arm, "seed": str(seed), "steps": str(steps), "wall_s": "1",
                "survived": str(survived), "fraction_trained": "1.0" if survived else "0.0",
                "val_success_final": str(success) if survived else "", "recall_curve": "[0.1, 0.5]"}

    def write(path, rows):
        with path.open("w", newline="") as f:
            w = sweep.csv.DictWriter(f, fieldnames=sweep.COLUMNS, restval="")
            w.writeheader()
            w.writerows(rows)

    red, drop = "summarize+faults, redispatch", "summarize+faults, drop budget"
    write(tmp_path / "results.csv", [row("summarize", s, 200, success=0.25 * s) for s in range(4)]
          + [row(red, s, 200) for s in (0, 1)] + [row(drop, s, 3, survived=False) for s in (0, 1)])
    text = sweep.report(type("A", (), {"out": str(tmp_path), "val_prompts": 16, "report_seeds": None}))
    assert "Redispatch runs of 200 steps; seeds [0, 1]" in text
    assert "| summarize | 2/2 | 200.000 ± 0.000 |" in text  # seeds 2 and 3 ran no fault arm: not in the table
    assert "| summarize+faults, drop budget | 0/2 | 3.000 ± 0.000 |" in text
    m, h, _ = paired_ci({0: 0.5, 1: 0.5}, {0: 0.0, 1: 0.25})
    assert f"held-out success after RL, redispatch − no faults: {m:.3f} ± {h:.3f} over 2 seeds" in text
    assert sweep.FAULTS_SHORT not in text  # nothing kept yet
    write(tmp_path / sweep.FAULTS_SHORT, [row(red, s, 20) for s in (0, 1, 2)] + [row(drop, 2, 5, survived=False)])
    text = sweep.report(type("A", (), {"out": str(tmp_path), "val_prompts": 16, "report_seeds": None}))
    kept = text.split(f"[{sweep.FAULTS_SHORT}]({sweep.FAULTS_SHORT})")[1]
    assert "seeds [0, 1, 2]" in text and "| summarize+faults, redispatch | 3/3 | 20.000 ± 0.000 |" in kept
    assert "| summarize+faults, drop budget | 0/1 | 5.000 |" in kept and "| summarize |" not in kept
    write(tmp_path / "results.csv", [row(drop, 0, 3, survived=False)])  # no redispatch run at full length yet
    text = sweep.report(type("A", (), {"out": str(tmp_path), "val_prompts": 16, "report_seeds": None}))
    assert "No redispatch run at this length yet; seeds [0]" in text and f"[{sweep.FAULTS_SHORT}]" in text


# ------------------------------------------------------------------------ Estimate's rule, the dying step
def test_a_difference_the_same_in_every_seed_is_neither_higher_nor_lower_and_holds_no_claim():
    """minirl.experiments.estimates.Estimate's rule: seeds that all differ by the same amount (one held-out
    prompt of 16 better in every seed: +0.0625, half-width 0) give no t-interval, so no higher or lower, and
    no interval whose lower end lies above 0 for the claim."""
    assert sweep.verdict(0.0625, 0.0) == "not resolvable (the same in every seed: no spread, so no t-interval)"
    assert sweep.verdict(-0.0625, 0.0).startswith("not resolvable (the same in every seed")
    assert sweep.verdict(0.0, 0.0) == "not resolvable (the interval holds 0)"
    assert sweep.verdict(0.1, 0.05).startswith("higher") and sweep.verdict(-0.1, 0.05).startswith("lower")
    arm = sweep.EXPERIMENT_ARMS[-1]
    rows = []
    for s in sweep.CLAIM_SEEDS:  # recall rises on every seed, fact-room success after RL beats recency's
        rows += [{"task": "doors_memory", "arm": arm, "seed": str(s), "survived": "True", "val_fact_start": "0.5",
                  "val_fact_final": "0.5625", "recall_curve": json.dumps([0.2] * 20 + [0.6] * 20)},
                 {"task": "doors_memory", "arm": "recency", "seed": str(s), "survived": "True",
                  "val_fact_final": str(0.1 + s % 3 / 20), "recall_curve": "[]"}]
    text = sweep.claim(rows, "doors_memory", arm)
    assert text.startswith("does not hold: recall rose by >= 0.3 on 10 of 10"), text
    assert "are 0.062 (the same in every seed: no t-interval) and " in text, text


def test_the_claim_is_judged_on_its_seeds_whatever_seeds_the_report_reads(tmp_path):
    """`--report-seeds` narrows the experiment's tables; rule.md's claim is still judged on CLAIM_SEEDS from
    every row of results.csv."""
    arm = sweep.EXPERIMENT_ARMS[-1]
    rows = []
    for i, s in enumerate(sweep.CLAIM_SEEDS):
        rows += [{"task": "doors_memory", "arm": arm, "seed": s, "survived": "True", "steps": 40, "wall_s": 100 + i,
                  "recall_curve": json.dumps([0.2] * 20 + [0.6 + 0.01 * i] * 20), "val_fact_start": 0.2 + 0.01 * i,
                  "val_fact_final": 0.8 - 0.02 * i},
                 {"task": "doors_memory", "arm": "recency", "seed": s, "survived": "True", "steps": 40,
                  "wall_s": 90 + i, "recall_curve": "[]", "val_fact_start": 0.2, "val_fact_final": 0.3 + 0.01 * i}]
    with (tmp_path / "results.csv").open("w", newline="") as f:
        w = sweep.csv.DictWriter(f, fieldnames=sweep.COLUMNS, restval="")
        w.writeheader()
        w.writerows(rows)
    text = sweep.report(type("A", (), {"out": str(tmp_path), "val_prompts": 16, "report_seeds": [10, 11, 12]}))
    verdict = sweep.claim(sweep.read_rows(tmp_path / "results.csv"), "doors_memory", arm)
    assert verdict.startswith("holds: recall rose by >= 0.3 on 10 of 10"), verdict
    assert f"Issue 54's claim on doors_memory, judged as rule.md declares: {verdict}.**" in text
    assert f"| {arm} | 12 |" in text and f"| {arm} | 13 |" not in text  # the tables read the seeds asked for


def test_the_step_that_killed_a_run_counts_its_drops_and_rollouts(tmp_path):
    """The dying step writes no metrics line: its dropped groups and generated rollouts come from the events of
    the run's last part (minirl.experiments.cells.died_step; an earlier part stopped in the same step was resumed
    from), and a run that generated nothing has no fraction_trained (0/0), which the report skips, not averages
    as 0. Rows written before that (a died row with 0/0 written as 0.0) get the dated caveat."""
    arm = "summarize+faults, drop budget"
    drops = lambda step, groups: [{"type": "drop", "step": step, "group": g, "decision": "dropped"}  # noqa: E731
                                  for g in groups]
    died = tmp_path / "died"
    write_jsonl(died / "metrics.jsonl", [{"step": s, "rollouts_generated": 16, "rollouts_trained": 16,
                                          "dropped_prompt_groups": 0} for s in range(5)])
    write_jsonl(died / "events.jsonl", [
        *drops(5, (0, 1)), {"type": "run_failed", "step": 5, "error": "Terminated: SIGTERM", "rollouts_generated": 9},
        {"type": "run_end", "step": 5}, {"type": "resumed", "from_step": 5},  # the sweep was stopped, then resumed
        *drops(5, (1, 4, 6)), {"type": "run_failed", "step": 5, "rollouts_generated": 20,
                               "error": "RuntimeError: training step 5 lost 3 of 8 prompt group(s)"},
        {"type": "run_end", "step": 5}])
    row = sweep.summarize_run("doors_memory", arm, 0, died, 10.0, 2, rc=1)
    assert (row["survived"], row["steps"], row["groups_dropped"]) == (False, 5, 3)
    assert (row["rollouts_generated"], row["rollouts_trained"], row["fraction_trained"]) == (100, 80, 0.8)
    nothing = tmp_path / "nothing"  # died before any rollout came back
    write_jsonl(nothing / "events.jsonl", [{"type": "run_failed", "step": None, "error": "RuntimeError: no engine"},
                                           {"type": "run_end", "step": None}])
    row = sweep.summarize_run("doors_memory", arm, 1, nothing, 10.0, 1, rc=1)
    assert (row["rollouts_generated"], row["fraction_trained"]) == (0, "")
    rows = [{"task": "doors_memory", "arm": arm, "seed": "0", "survived": "False", "rollouts_generated": "100",
             "fraction_trained": "0.8"},
            {"task": "doors_memory", "arm": arm, "seed": "1", "survived": "False", "rollouts_generated": "0",
             "fraction_trained": ""}]
    assert sweep.stat(rows, "doors_memory", arm, "fraction_trained") == "0.800"  # one value, not (0.8 + 0) / 2
    assert sweep.dying_step_caveat(rows) == []  # rows of the code that counts the dying step
    old = [{**rows[0], "rollouts_generated": "80"}, {**rows[1], "fraction_trained": "0.0"}]
    (caveat,) = [x for x in sweep.dying_step_caveat(old) if x]
    assert caveat.startswith(f"Caveat (2026-12-06): the rows of the runs that died here (`{arm}` seeds 0, 1)")
    assert f"the fraction_trained 0.0 of `{arm}` seed 1, which died in their first step, is 0/0" in caveat
