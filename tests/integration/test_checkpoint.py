"""Checkpoints that can be trusted: a manifest of sizes and sha256 in `state.json`, verified before
any resume; `resume=auto` falls back past a damaged checkpoint (and says so), an explicit damaged
path ends the run naming the path and the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import last_line, run_cli
from minirl.config import REPO_ROOT, ConfigError, load_config
from minirl.trainer import checkpoint
from minirl.trainer.checkpoint import CheckpointError

MODEL = REPO_ROOT / "models" / "tiny-doors"


def write_policy(step: int):
    """Stands in for the policy workers' `save`: real files of the same layout."""

    def write(directory: str) -> None:
        d = Path(directory)
        (d / "policy").mkdir()
        (d / "policy" / "model.safetensors").write_bytes(bytes([step]) * 4096)
        (d / "trainer_state.pt").write_bytes(b"optimizer state %d" % step)

    return write


def save(run_dir: Path, step: int, keep_last_k: int = 0) -> Path:
    state = {"step": step, "next_step": step + 1, "rollout_manager": {}}
    return checkpoint.save(run_dir, step, state, write_policy(step), str(MODEL), keep_last_k)


def test_save_writes_a_manifest_of_every_file_and_it_verifies(tmp_path):
    path = save(tmp_path, 0)
    state = checkpoint.read_state(path)
    files = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - {"state.json"}
    assert set(state["manifest"]) == files
    assert {"policy/model.safetensors", "trainer_state.pt", "policy/tokenizer.json"} <= files
    assert state["manifest"]["policy/model.safetensors"]["size"] == 4096
    assert state["next_step"] == 1
    assert checkpoint.verify(path) is None
    assert not list(checkpoint.directory(tmp_path).glob(".tmp_*")), "no temporary directory left"


@pytest.mark.parametrize(
    "damage,reason",
    [
        (lambda p: p.joinpath("policy/model.safetensors").write_bytes(b"\0" * 123),
         "policy/model.safetensors: size 123 != 4096"),
        (lambda p: p.joinpath("trainer_state.pt").write_bytes(b"optimizer state 9"),
         "trainer_state.pt: sha256 mismatch"),
        (lambda p: p.joinpath("policy/tokenizer.json").unlink(), "policy/tokenizer.json: missing"),
        (lambda p: p.joinpath("state.json").write_text('{"step": 0, "manif'), "state.json unreadable"),
        (lambda p: p.joinpath("state.json").unlink(), "state.json unreadable"),
        (lambda p: p.joinpath("state.json").write_text('{"step": 0, "next_step": 1}'), "state.json has no manifest"),
        (lambda p: p.joinpath("state.json").write_text('{"step": 0, "next_step": 1, "manifest": {}}'),
         "state.json has an empty manifest"),
    ],
    ids=["truncated", "changed", "missing", "state_truncated", "state_missing", "old_format", "empty_manifest"],
)
def test_verify_names_the_damaged_file(tmp_path, damage, reason):
    path = save(tmp_path, 0)
    damage(path)
    assert checkpoint.verify(path).startswith(reason)


def test_auto_takes_the_newest_that_verifies_and_reports_each_skipped(tmp_path):
    for step in range(3):
        save(tmp_path, step)
    assert checkpoint.latest_verified(tmp_path) == (checkpoint.directory(tmp_path) / "step_2", [])
    newest = checkpoint.directory(tmp_path) / "step_2"
    with open(newest / "policy" / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    (checkpoint.directory(tmp_path) / "step_1" / "trainer_state.pt").unlink()
    path, skipped = checkpoint.select(tmp_path, "auto")
    assert path == checkpoint.directory(tmp_path) / "step_0"
    assert [(p.name, r) for p, r in skipped] == [
        ("step_2", "policy/model.safetensors: size 1000 != 4096"),
        ("step_1", "trainer_state.pt: missing"),
    ]
    # nothing verifies: an error naming each (before, the run started again at step 0 over the run's records)
    (path / "state.json").unlink()
    with pytest.raises(CheckpointError) as err:
        checkpoint.select(tmp_path, "auto")
    assert str(err.value).startswith(
        f"checkpoint.resume=auto: no checkpoint in {checkpoint.directory(tmp_path)} verifies (step_2: "
        "policy/model.safetensors: size 1000 != 4096; step_1: trainer_state.pt: missing; step_0: state.json "
        "unreadable (")
    # none there at all: a run that never saved starts at step 0
    assert checkpoint.select(tmp_path / "fresh", "auto") == (None, [])


def test_auto_with_no_checkpoint_that_verifies_ends_the_run_before_anything_is_written(tmp_path, capsys):
    """From the command line: exit 1, one CheckpointError line, before Ray starts, the run's files as they were.
    Before, the run started at step 0 and dropped every metric line of the run it was to continue."""
    from minirl.train import main

    bad = save(tmp_path, 0)
    (bad / "trainer_state.pt").write_bytes(b"")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n")
    kept = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert main([f"run_dir={tmp_path}", "checkpoint.resume=auto"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"CheckpointError: checkpoint.resume=auto: no checkpoint in {tmp_path / 'checkpoints'} "
                           "verifies (step_0: trainer_state.pt: size 0 != 17): "), line
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == kept


def test_auto_skips_a_checkpoint_whose_manifest_is_empty(tmp_path):
    """An empty manifest verifies nothing: `auto` skips it (reported) and takes the one before."""
    good, empty = save(tmp_path, 0), save(tmp_path, 1)
    state = checkpoint.read_state(empty)
    (empty / "state.json").write_text(json.dumps({**state, "manifest": {}}))
    assert checkpoint.select(tmp_path, "auto") == (good,
                                                   [(empty, "state.json has an empty manifest: nothing to verify")])


def save_with_config(run_dir: Path, overrides: list[str]) -> Path:
    from dataclasses import asdict

    cfg = load_config(None, overrides)
    state = {"step": 0, "next_step": 1, "rollout_manager": {}, "config": json.loads(json.dumps(asdict(cfg)))}
    return checkpoint.save(run_dir, 0, state, write_policy(0), str(MODEL), 0)


ASYNC_ON = ["async_rl.enabled=true", "loss_fn.use_importance_sampling_correction=true"]


@pytest.mark.parametrize("old,new,message", [
    ([], ["grpo.num_prompts_per_step=3"],  # sync: groups_target would go [8, 3, ...] silently
     "grpo.num_prompts_per_step: differs from the checkpoint resumed (grpo.num_prompts_per_step: 8 -> 3; "),
    (ASYNC_ON, [*ASYNC_ON, "async_rl.sampler.max_staleness_versions=0", "grpo.num_generations_per_prompt=2"],
     "grpo.num_generations_per_prompt: differs from the checkpoint resumed (grpo.num_generations_per_prompt: 4 -> 2, "
     "async_rl.sampler.max_staleness_versions: 1 -> 0; "),
    (ASYNC_ON, [], "async_rl.enabled: differs from the checkpoint resumed (async_rl.enabled: True -> False; "),
])
def test_a_resume_that_changes_the_step_shape_is_refused_naming_the_keys(tmp_path, old, new, message):
    path = save_with_config(tmp_path, old)
    for resume in ("auto", str(path)):
        with pytest.raises(ConfigError) as err:
            checkpoint.check_resume(load_config(None, [*new, f"run_dir={tmp_path}", f"checkpoint.resume={resume}"]))
        assert str(err.value).startswith(message) and str(path) in str(err.value) and "\n" not in str(err.value)
    # what does not shape a step may change (max_num_steps grows on every resume); sync ignores the sampler keys
    checkpoint.check_resume(load_config(None,
                                        [*old, "grpo.max_num_steps=99", f"run_dir={tmp_path}",
                                         "checkpoint.resume=auto"]))
    if not old:
        checkpoint.check_resume(load_config(None, ["async_rl.sampler.name=windowed", f"run_dir={tmp_path}",
                                                   "checkpoint.resume=auto"]))


def test_cli_refuses_a_changed_resume_and_an_unwritable_checkpoint_dir_before_ray_starts(tmp_path):
    path = save_with_config(tmp_path, [])
    proc = run_cli(f"run_dir={tmp_path}", "checkpoint.resume=auto", "grpo.num_prompts_per_step=3", timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-2000:]
    assert [x for x in proc.stderr.splitlines() if x.strip()] == [
        "ConfigError: grpo.num_prompts_per_step: differs from the checkpoint resumed (grpo.num_prompts_per_step: 8 -> "
        f"3; {path}): "
        "a resume must keep the step's shape and the staleness window; set them back, or start a new run_dir"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "checkpoints").write_text("a file where the checkpoint directory goes")
    proc = run_cli(f"run_dir={other}", timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-2000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.strip()]
    assert line.startswith("ConfigError: checkpoint.enabled: checkpoints cannot be written to "
                           f"{other / 'checkpoints'}: ")
    assert line.endswith("(make it writable, or set checkpoint.enabled=false)")


def test_an_explicit_damaged_checkpoint_raises_naming_the_path_and_the_file(tmp_path):
    good, bad = save(tmp_path, 0), save(tmp_path, 1)
    (bad / "trainer_state.pt").write_bytes(b"")
    assert checkpoint.select(tmp_path, str(good)) == (good, [])
    with pytest.raises(CheckpointError,
                       match=rf"checkpoint.resume={bad} cannot be trusted: trainer_state.pt: size 0 != 17"):
        checkpoint.select(tmp_path, str(bad))
    assert checkpoint.select(tmp_path, "none") == (None, [])


def test_resaving_a_step_replaces_it_and_keep_last_k_prunes_the_oldest(tmp_path):
    for step in range(4):
        save(tmp_path, step, keep_last_k=2)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step_2", "step_3"]
    (checkpoint.directory(tmp_path) / "step_3" / "trainer_state.pt").write_bytes(b"x")
    save(tmp_path, 3, keep_last_k=2)  # a resumed run writes the step again
    assert checkpoint.verify(checkpoint.directory(tmp_path) / "step_3") is None


def test_save_never_prunes_the_checkpoint_it_writes(tmp_path):
    """A resumed run writes step 3 again while the abandoned continuation's step_4 and step_5 are still
    there: pruning by step number used to remove the step_3 just written and keep those two."""
    for step in range(6):
        save(tmp_path, step, keep_last_k=3)
    final = save(tmp_path, 3, keep_last_k=2)
    assert final.exists() and checkpoint.verify(final) is None
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step_3", "step_4", "step_5"], \
        "the older are pruned, this one and the newer (not this run's to prune) are kept"
    save(tmp_path, 6, keep_last_k=1)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step_6"]


def test_a_resume_from_an_older_checkpoint_sets_the_newer_aside(tmp_path):
    """Resuming step_3 of a run that has step_4 and step_5 abandons them: renamed, not deleted, and no
    longer listed, so pruning, `auto` and the SIGTERM line take the resumed run's own checkpoints."""
    for step in range(6):
        save(tmp_path, step, keep_last_k=3)
    root = checkpoint.directory(tmp_path)
    (root / "abandoned_step_5").mkdir()  # a second rollback: the first one's name is taken
    held = {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file() and "step_4" in str(p)}
    path, _ = checkpoint.select(tmp_path, str(root / "step_3"))
    moved = checkpoint.set_aside_newer(tmp_path, checkpoint.read_state(path)["next_step"])
    assert [(a.name, b.name) for a, b in moved] == [("step_4", "abandoned_step_4"), ("step_5", "abandoned_step_5.2")]
    assert {Path(*(("abandoned_step_4",) + p.parts[1:])): b for p, b in held.items()} == {
        p.relative_to(root): p.read_bytes() for p in (root / "abandoned_step_4").rglob("*") if p.is_file()}, \
        "nothing is lost"
    assert checkpoint.verify(root / "abandoned_step_5.2") is None
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step_3"]
    save(tmp_path, 4, keep_last_k=3)
    assert checkpoint.latest_verified(tmp_path) == (root / "step_4", [])
    assert checkpoint.set_aside_newer(tmp_path, 5) == [], "nothing newer: nothing moved"
    # resumed in place, a set-aside step would run on under this line's metrics and checkpoints (review: step 3 of
    # line A after line B's steps 1-2, with step 3 skipped and `auto` then taking line B): refused before Ray
    cfg = load_config(None, [f"run_dir={tmp_path}", f"checkpoint.resume={root / 'abandoned_step_4'}"])
    with pytest.raises(ConfigError, match=r"^checkpoint\.resume: .*abandoned_step_4 is a continuation this run_dir "
                                          r"abandoned; .* resume it into a new run_dir"):
        checkpoint.check_resume(cfg)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


@pytest.mark.slow
def test_auto_resume_falls_back_past_a_truncated_newest_checkpoint_with_no_gap(tmp_path, shared_engine):
    small = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
             "checkpoint.save_period=1", "checkpoint.keep_last_k=0", f"run_dir={tmp_path}", *shared_engine]
    first = run_cli(*small, "grpo.max_num_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert {p.name for p in tmp_path.iterdir()} <= set(checkpoint.RUN_OUTPUTS), \
        "run_dir_exists=overwrite removes a run whole"
    kept = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    # issue 49: a fresh run into it (B) wrote over it; now refused before Ray, and so is a resume under another model
    for extra, start in ((["grpo.seed=99"], f"ConfigError: run_dir: {tmp_path} holds an earlier run (metrics.jsonl, "
                          "events.jsonl, ledger, tensorboard, checkpoints/step_0, checkpoints/step_1), "
                          "and checkpoint.resume=none"),
                         (["checkpoint.resume=auto", "policy.model_name=models/tiny-summarize"],
                          f"ConfigError: policy.model_name: {REPO_ROOT / 'models' / 'tiny-summarize'} is not the model "
                          "of the "
                          f"checkpoint resumed ({tmp_path / 'checkpoints' / 'step_1'}, written with "
                          f"policy.model_name={MODEL}): "
                          "vocab_size 512 there, 576 here")):
        refused = run_cli(*small, "grpo.max_num_steps=1", *extra, timeout=120)
        assert refused.returncode == 2 and refused.stdout == "" and last_line(refused.stderr).startswith(start), \
            refused.stderr
        assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == kept, "the earlier run is intact"
    damaged = tmp_path / "checkpoints" / "step_1" / "policy" / "model.safetensors"
    size = damaged.stat().st_size
    with open(damaged, "r+b") as f:
        f.truncate(size // 2)

    second = run_cli(*small, "grpo.max_num_steps=4", "checkpoint.resume=auto", "env.data_seed=7")
    assert second.returncode == 0, second.stderr[-3000:]
    reason = f"policy/model.safetensors: size {size // 2} != {size}"
    assert f"skipping checkpoint {damaged.parent.parent}: {reason}" in second.stderr
    assert (f"minirl: resumed from {tmp_path / 'checkpoints' / 'step_0'} at step 1; the dataset differs from the "
            "checkpoint's (env.data_seed: 1234 -> 7): the steps from here draw their prompts from the new one"
            in second.stdout)
    assert [r["step"] for r in rows(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3], "no gap, no duplicate"
    events = rows(tmp_path / "events.jsonl")
    skipped = [(e["checkpoint"], e["reason"]) for e in events if e["type"] == "checkpoint_skipped"]
    assert skipped == [(str(damaged.parent.parent), reason)]
    assert [(e["from_step"], e["dataset_changes"]) for e in events if e["type"] == "resumed"] == [
        (1, ["env.data_seed: 1234 -> 7"])], "resumed from step_0, saying the prompt stream changed"
    assert checkpoint.verify(damaged.parent.parent) is None, "step 1 was written again, whole"

    # an explicit path to a damaged checkpoint ends the run naming the path and the file, before Ray starts
    # (no run directory line, nothing written: the earlier run's files as they were)
    with open(damaged, "r+b") as f:
        f.truncate(7)
    kept = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    third = run_cli(*small, "grpo.max_num_steps=4", f"checkpoint.resume={damaged.parent.parent}", timeout=120)
    assert third.returncode == 1 and third.stdout == "", third.stdout
    assert last_line(third.stderr).startswith(
        f"CheckpointError: checkpoint.resume={damaged.parent.parent} cannot be trusted: policy/model.safetensors: size "
        "7 != ")
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == kept, "the earlier run is intact"

    # an explicit older checkpoint of the same run_dir abandons the newer ones: set aside, said so
    root = tmp_path / "checkpoints"
    fourth = run_cli(*small, "grpo.max_num_steps=2", f"checkpoint.resume={root / 'step_0'}")
    assert fourth.returncode == 0, fourth.stderr[-3000:]
    assert (f"minirl: resuming from {root / 'step_0'} abandons the continuation after it: moved step_1 to "
            f"{root / 'abandoned_step_1'}, step_2 to {root / 'abandoned_step_2'}, step_3 to {root / 'abandoned_step_3'}"
            in fourth.stdout.splitlines())
    assert [(Path(e["checkpoint"]).name, Path(e["moved_to"]).name, e["resumed_from"]) for e in rows(
        tmp_path / "events.jsonl") if e["type"] == "checkpoint_abandoned"] == [
        (f"step_{m}", f"abandoned_step_{m}", str(root / "step_0")) for m in (1, 2, 3)]
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step_0", "step_1"]
    assert checkpoint.latest_verified(tmp_path) == (root / "step_1", []), "auto continues the resumed run"
    assert checkpoint.verify(root / "abandoned_step_3") is None, "the abandoned ones are kept whole"
    assert [r["step"] for r in rows(tmp_path / "metrics.jsonl")] == [0, 1]
    # TensorBoard shows what metrics.jsonl holds: each resume purged the scalars of the steps it ran again
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    shown = EventAccumulator(str(tmp_path / "tensorboard")).Reload().Scalars("reward_mean")
    assert [(e.step, e.value) for e in shown] == [
        (r["step"], pytest.approx(r["reward_mean"])) for r in rows(tmp_path / "metrics.jsonl")]
