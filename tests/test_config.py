"""Config loading: layering, interpolation, and one clear error naming the key."""

import subprocess
import sys
from pathlib import Path

import pytest

from minirl.config import REPO_ROOT, ConfigError, load_config

CONFIGS = REPO_ROOT / "configs"


def test_defaults_load_and_resolve_the_model_path():
    cfg = load_config()
    assert Path(cfg.policy.model_name).is_absolute() and (Path(cfg.policy.model_name) / "config.json").exists()
    assert cfg.context_compaction.enabled and cfg.agent.name == "compaction_agent"
    assert cfg.policy.train_global_batch_size == cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt


def test_train_global_batch_size_follows_the_grpo_keys():
    cfg = load_config(None, ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=2"])
    assert cfg.policy.train_global_batch_size == 8


@pytest.mark.parametrize("name", ["default.yaml", "cc.yaml", "plain.yaml", "upstream_pr4124.yaml"])
def test_shipped_configs_load(name):
    load_config(str(CONFIGS / name))


def test_upstream_preset_sets_every_switch():
    cfg = load_config(str(CONFIGS / "upstream_pr4124.yaml"))
    assert cfg.context_compaction.enabled
    assert not cfg.context_compaction.allow_step_shrink
    assert not cfg.context_compaction.redispatch_dropped_groups
    assert cfg.agent.context_history.guards.on_reject == "raise"
    assert cfg.async_rl.rollout_failure.min_step_batch_fraction == 1
    assert cfg.async_rl.rollout_failure.max_consecutive_dropped_prompts == 0
    # one key turns a fix back on
    assert load_config(str(CONFIGS / "upstream_pr4124.yaml"), ["context_compaction.redispatch_dropped_groups=true"]).context_compaction.redispatch_dropped_groups


def test_fault_list_in_yaml_flow_style():
    cfg = load_config(None, ["faults.inject=[{kind: guard_reject, step: 0, group: 1, rollout: 0}]", "faults.rate.agent_exception=0.05"])
    spec = cfg.faults.inject[0]
    assert (spec.kind, spec.step, spec.group, spec.rollout, spec.attempt) == ("guard_reject", 0, 1, 0, None)
    assert cfg.faults.rate == {"agent_exception": 0.05}


@pytest.mark.parametrize(
    "overrides,key,text",
    [
        (["no.such.key=1"], "no.such.key", "unknown config key"),
        (["grpo.max_num_steps=abc"], "grpo.max_num_steps", "could not be converted"),
        (["policy.train_global_batch_size=5"], "policy.train_global_batch_size", "must equal"),
        (["async_rl.rollout_failure.max_backoff_s=0.1"], "async_rl.rollout_failure.max_backoff_s", ">= backoff_base_s"),
        (["async_rl.rollout_failure.min_step_batch_fraction=0"], "async_rl.rollout_failure.min_step_batch_fraction", "(0, 1]"),
        (["context_compaction.allow_step_shrink=false"], "async_rl.rollout_failure.min_step_batch_fraction",
         "context compaction requires min_step_batch_fraction=1"),
        (["loss_fn.token_level_loss=false"], "loss_fn.token_level_loss", "requires token_level_loss"),
        (["agent.context_history.schedule.actions_per_chunk=2"], "agent.context_history.schedule.actions_per_chunk", "must be 1"),
        (["faults.rate.meteor=0.1"], "faults.rate.meteor", "unknown fault kind"),
        (["faults.inject=[{kind: timeout}]", "async_rl.rollout_failure.nemo_gym.rollout_timeout_s=null"],
         "async_rl.rollout_failure.nemo_gym.rollout_timeout_s", "would hang"),
        (["grpo.num_prompts_per_step=0"], "grpo.num_prompts_per_step", ">= 1"),
    ],
)
def test_errors_name_the_key(overrides, key, text):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value).startswith(key + ":") and text in str(err.value)


def test_cli_bad_key_exits_2_with_one_line():
    proc = subprocess.run([sys.executable, "-m", "minirl.train", "no.such.key=1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["ConfigError: no.such.key: unknown config key"]
