"""Issue 49 (hardening round 3): a run_dir belongs to one run, a resume names what it changes, and
settings that cannot work are refused before Ray starts. A fresh run into an earlier run's folder
exits 2 and leaves it untouched (or, with run_dir_exists=overwrite, removes it whole); a checkpoint
of another model, a Ray address that does not answer, one rollout per group, and an attach name
without an address are ConfigErrors naming the key; a missing attach name is one too, once Ray is up."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from helpers import last_line, run_cli
from minirl.config import REPO_ROOT, ConfigError, load_config, probe_ray_address, ray_endpoint
from minirl.trainer import checkpoint


def snapshot(run_dir: Path) -> dict[str, bytes]:
    return {p.relative_to(run_dir).as_posix(): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def earlier_run(run_dir: Path, model: str = "models/tiny-doors") -> None:
    """What run A of the issue leaves (4 steps, a checkpoint each, keep_last_k 2): metrics of steps
    0-3, events, a ledger, its config, checkpoints step_2 and step_3 holding a saved model config."""
    from dataclasses import asdict

    cfg = load_config(None, [f"run_dir={run_dir}", f"policy.model_name={model}"])
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text("grpo:\n  seed: 42\n")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(4)))
    (run_dir / "events.jsonl").write_text(json.dumps({"type": "resumed"}) + "\n")
    (run_dir / "ledger").mkdir()
    (run_dir / "ledger" / "step_0.jsonl").write_text("{}\n")

    def write(d: str) -> None:
        (Path(d) / "policy").mkdir()
        (Path(d) / "policy" / "model.safetensors").write_bytes(b"w" * 64)
        (Path(d) / "policy" / "config.json").write_text((Path(cfg.policy.model_name) / "config.json").read_text())
        (Path(d) / "trainer_state.pt").write_bytes(b"optimizer")

    for step in range(4):
        state = {"step": step, "next_step": step + 1, "rollout_manager": {},
                 "config": json.loads(json.dumps(asdict(cfg)))}
        checkpoint.save(run_dir, step, state, write, cfg.policy.model_name, keep_last_k=2)


def test_a_fresh_run_into_an_earlier_runs_folder_is_refused_before_ray_and_leaves_it_whole(tmp_path):
    """Issue 49 HIGH 1, run B: rc 0 and A's metrics gone before; now exit 2, one line, nothing touched."""
    run = tmp_path / "run"
    earlier_run(run)
    before = snapshot(run)
    proc = run_cli(f"run_dir={run}", "grpo.max_num_steps=1", "grpo.seed=99", timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-3000:]
    assert [x for x in proc.stderr.splitlines() if x.strip()] == [
        f"ConfigError: run_dir: {run} holds an earlier run (metrics.jsonl, events.jsonl, ledger, checkpoints/step_2, "
        "checkpoints/step_3), and checkpoint.resume=none starts a fresh one that would write over it: continue it with "
        "checkpoint.resume=auto, choose another run_dir, or set run_dir_exists=overwrite to remove it first"]
    assert snapshot(run) == before, "the earlier run's files are intact"
    # overwrite cannot be asked of a resume from inside the folder: it would remove the checkpoint
    proc = run_cli(f"run_dir={run}", "checkpoint.resume=auto", "run_dir_exists=overwrite", timeout=120)
    assert proc.returncode == 2 and last_line(proc.stderr).startswith(
        "ConfigError: run_dir_exists: overwrite would remove the checkpoint checkpoint.resume=auto resumes from"), \
        proc.stderr
    assert snapshot(run) == before


def test_overwrite_removes_every_file_a_run_writes_and_nothing_else_and_a_resume_removes_nothing(tmp_path):
    run = tmp_path / "run"
    earlier_run(run)
    (run / "notes.txt").write_text("mine")
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out").write_bytes(b"tb")
    (run / "endpoints.json").write_text("{}")
    before = snapshot(run)
    for resume in ("auto", str(run / "checkpoints" / "step_3")):  # C of the issue: a resume continues the run in place
        assert checkpoint.claim_run_dir(load_config(None, [f"run_dir={run}", f"checkpoint.resume={resume}"]), run) == []
        assert snapshot(run) == before
    removed = checkpoint.claim_run_dir(load_config(None, [f"run_dir={run}", "run_dir_exists=overwrite"]), run)
    assert removed == ["config.yaml", "endpoints.json", "metrics.jsonl", "events.jsonl", "ledger", "tensorboard",
                       "checkpoints"]
    assert [p.name for p in run.iterdir()] == ["notes.txt"] and checkpoint.earlier_run(run) == []
    # a folder with only what every run writes whole (a start that wrote nothing else) is no earlier run
    (run / "config.yaml").write_text("x")
    assert checkpoint.claim_run_dir(load_config(None, [f"run_dir={run}"]), run) == []


def test_a_resume_from_another_folders_checkpoint_does_not_mix_with_an_earlier_run_in_run_dir(tmp_path):
    """A run that resumes another run's checkpoint into a folder holding an earlier run: refused, as a fresh
    run is (it kept that run's metrics lines as its own and pruned its checkpoints), or, with
    run_dir_exists=overwrite, that run removed first (overwrite was silently ignored)."""
    run, other = tmp_path / "run", tmp_path / "other"
    earlier_run(run)
    earlier_run(other)
    before, step3 = snapshot(run), other / "checkpoints" / "step_3"
    with pytest.raises(ConfigError) as err:
        checkpoint.claim_run_dir(load_config(None, [f"run_dir={run}", f"checkpoint.resume={step3}"]), run)
    assert err.value.key == "run_dir" and str(err.value).startswith(
        f"run_dir: {run} holds an earlier run (metrics.jsonl, events.jsonl, ledger, checkpoints/step_2, checkpoints/"
        f"step_3), and checkpoint.resume={step3} starts a run from another folder's checkpoint"), str(err.value)
    assert snapshot(run) == before
    removed = checkpoint.claim_run_dir(
        load_config(None, [f"run_dir={run}", f"checkpoint.resume={step3}", "run_dir_exists=overwrite"]), run)
    assert "metrics.jsonl" in removed and checkpoint.earlier_run(run) == [] and step3.is_dir()


def test_resuming_a_checkpoint_of_another_model_is_refused_before_ray_naming_both(tmp_path):
    """Issue 49 MEDIUM 8: the load's `\\tsize mismatch for model.embed_tokens.weight` after Ray started."""
    run = tmp_path / "run"
    earlier_run(run, model="models/tiny-summarize")
    step3 = run / "checkpoints" / "step_3"
    proc = run_cli(f"run_dir={run}", "checkpoint.resume=auto", timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-3000:]
    assert [x for x in proc.stderr.splitlines() if x.strip()] == [
        f"ConfigError: policy.model_name: {REPO_ROOT / 'models' / 'tiny-doors'} is not the model of the checkpoint "
        f"resumed ({step3}, written with policy.model_name={REPO_ROOT / 'models' / 'tiny-summarize'}): vocab_size 576 "
        "there, 512 here; resume with that model, or start a new run_dir"]
    checkpoint.check_resume(load_config(None, [f"run_dir={run}", "checkpoint.resume=auto",
                                               "policy.model_name=models/tiny-summarize"]))


def test_a_resume_names_each_change_of_the_prompt_stream(tmp_path):
    from dataclasses import asdict

    old = json.loads(json.dumps(asdict(load_config(None, []))))
    assert checkpoint.dataset_changes(old, load_config(None, ["grpo.max_num_steps=99"])) == []
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"responses_create_params": {"input": [{"role": "user", "content": "hi"}]}}) + "\n")
    assert checkpoint.dataset_changes(old, load_config(None, ["env.data_seed=7", f"data.train_jsonl={rows}"])) == [
        f"data.train_jsonl: None -> {str(rows)!r}", "env.data_seed: 1234 -> 7"]
    assert checkpoint.dataset_changes(None, load_config(None, [])) == [], \
        "a checkpoint without a config: nothing to compare"


def test_a_ray_address_that_does_not_answer_is_refused_in_seconds_naming_it_as_typed(tmp_path):
    """Issue 49 MEDIUM 9: 831 s and 61 warnings, the last naming a rewritten host."""
    t0 = time.monotonic()
    proc = run_cli("cluster.ray_address=127.0.0.1:1", f"run_dir={tmp_path / 'run'}", timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-3000:]
    assert [x for x in proc.stderr.splitlines() if x.strip()] == [
        "ConfigError: cluster.ray_address: nothing answers at '127.0.0.1:1' (Connection refused): start that cluster "
        "(`ray start --head`) or fix the address; null starts a local Ray"]
    assert took < 30 and not (tmp_path / "run").exists(), "refused before anything is written"
    with socket.socket() as listener:  # an address that answers passes
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
            probe_ray_address(load_config(None, [f"cluster.ray_address={address}"]), timeout_s=2)


@pytest.mark.parametrize("address,endpoint", [
    ("10.0.0.1:6379", ("10.0.0.1", 6379)), ("ray://head:10001", ("head", 10001)), ("[::1]:6379", ("::1", 6379)),
    ("10.0.0.1", None), ("http://10.0.0.1:6379", None), ("head:port", None), ("10.0.0.1:6379/x", None),
])
def test_ray_endpoint_reads_host_and_port(address, endpoint):
    assert ray_endpoint(address) == endpoint


@pytest.mark.parametrize("overrides,line", [
    (["cluster.ray_address=10.0.0.1"],
     "cluster.ray_address: must be auto, host:port or ray://host:port, got '10.0.0.1'"),
    (["cluster.attach_generation_workers=shared-gen"],
     "cluster.attach_generation_workers: needs cluster.ray_address, the cluster whose workers are named 'shared-gen': "
     "without it a new local Ray starts, which runs no such workers"),
    (["grpo.num_generations_per_prompt=1"],  # issue 49 LOW: every advantage 0, the run trained nothing silently
     "grpo.num_generations_per_prompt: must be >= 2, got 1: GRPO's advantage is a rollout's reward against the rest of "
     "its group, and a group with at most one valid rollout gets advantage 0 (as upstream), so every step would train "
     "nothing"),
])
def test_settings_that_cannot_work_are_refused_naming_the_key(overrides, line):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value) == line


@pytest.mark.slow
def test_a_missing_attach_name_is_a_config_error_naming_the_key(tmp_path, shared_engine):
    """Issue 49 LOW: Ray's `ValueError: Failed to look up actor ...` named no config key (exit 1)."""
    address = next(o for o in shared_engine if o.startswith("cluster.ray_address="))
    proc = run_cli(address, "cluster.attach_generation_workers=no-such-gen", f"run_dir={tmp_path}", timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = last_line(proc.stderr)
    assert line.startswith("ConfigError: cluster.attach_generation_workers: no actor 'no-such-gen-store' in namespace "
                           f"'minirl' of the cluster at {address}"), line
    assert "shared-gen-store" in line and "or set it to null to start this run's own" in line
