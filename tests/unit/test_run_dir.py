"""A run's folder and the checkpoint it resumes, checked before Ray starts: the default run_dir is one
run's alone, and a checkpoint of the same model resumes whatever keys its base config.json leaves to
transformers' defaults."""

from __future__ import annotations

import datetime as real_dt
import json
from types import SimpleNamespace

from minirl.trainer import checkpoint


class OneSecond(real_dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return real_dt.datetime(2026, 1, 1, 12, 0, 0, 123456, tzinfo=tz)


def test_two_runs_started_in_one_second_get_two_default_run_dirs(tmp_path, monkeypatch):
    """Before, both wrote into runs/<timestamp>: the second found only the first's config.yaml (no earlier
    run yet, its first step still to come), and their metrics, events and checkpoints mixed."""
    monkeypatch.setattr(checkpoint.dt, "datetime", OneSecond)
    dirs = [checkpoint.new_run_dir(tmp_path / "runs") for _ in range(3)]
    assert [d.name for d in dirs] == ["20260101T120000Z", "20260101T120000Z-2", "20260101T120000Z-3"]
    assert all(d.is_dir() for d in dirs)


def test_a_checkpoint_of_the_same_model_resumes_when_its_config_leaves_a_key_to_the_default(tmp_path):
    """A base config.json without `num_key_value_heads` (Llama-1-era, hand-written): save_pretrained writes
    every key, so the raw files differed (`num_key_value_heads 4 there, None here`) and the run's own
    checkpoint was refused. A checkpoint of another shape is still refused, naming the key."""
    import pytest
    from transformers import AutoConfig, AutoModelForCausalLM

    from minirl.config import ConfigError

    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
            "num_attention_heads": 4, "num_hidden_layers": 1, "vocab_size": 64, "max_position_embeddings": 64}
    model_dir, ckpt = tmp_path / "model", tmp_path / "run" / "checkpoints" / "step_0"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(base))
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).save_pretrained(ckpt / "policy")
    (ckpt / "state.json").write_text(json.dumps({"config": {"policy": {"model_name": str(model_dir)}}}))
    cfg = SimpleNamespace(policy=SimpleNamespace(model_name=str(model_dir)))
    checkpoint.check_model(cfg, ckpt)
    (model_dir / "config.json").write_text(json.dumps(base | {"num_key_value_heads": 2}))
    with pytest.raises(ConfigError, match="num_key_value_heads 4 there, 2 here"):
        checkpoint.check_model(cfg, ckpt)
