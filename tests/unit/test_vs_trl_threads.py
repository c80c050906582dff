"""bench/vs_trl.py gives both sides the same torch threads (`--threads`): minirl's engine and trainer
take it through their config, TRL's process through `torch.set_num_threads`; the default stays the
2 cores the earlier P2 figures used."""

from __future__ import annotations

import importlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _vs_trl(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    return importlib.import_module("vs_trl")


def _compare_recording(seen: list):
    """`compare` without the runs: records (name, threads, staleness) and returns a result row."""
    def compare(name, model, steps, prompts, gens, lr, threads, staleness=0):
        seen.append((name, threads, staleness))
        return {"name": name, "steps": steps, "minirl_step_s": 1.0, "trl_step_s": 1.0, "ratio": 1.0,
                "minirl_reward_first": 0.0, "minirl_reward": 0.0, "trl_reward_first": 0.0, "trl_reward": 0.0}
    return compare


def test_threads_reach_minirls_engine_and_trainer(monkeypatch):
    from minirl.config import load_config

    vt = _vs_trl(monkeypatch)
    model = str(REPO / "models" / "tiny-doors")
    for threads in (1, 3):
        args = vt.common(model, 2, 4, 2, 5e-4, threads)
        cfg = load_config(args[1], args[2:])
        assert (cfg.policy.generation.vllm_cfg.omp_threads, cfg.policy.train_threads) == (threads, threads)
    default = vt.common(model, 2, 4, 2, 5e-4)
    cfg = load_config(default[1], default[2:])
    assert (cfg.policy.generation.vllm_cfg.omp_threads, cfg.policy.train_threads) == (2, 2)


def test_threads_is_a_command_line_option(monkeypatch):
    vt = _vs_trl(monkeypatch)
    seen = []
    monkeypatch.setattr(vt, "compare", _compare_recording(seen))
    assert vt.main(["--quick", "--threads", "1"]) == 0 and [t for _, t, _ in seen] == [1]
    assert vt.main(["--quick"]) == 0 and [t for _, t, _ in seen] == [1, 2]


def test_async_staleness_makes_minirls_side_async_and_only_when_asked(monkeypatch):
    """`--async-staleness S` turns minirl's side async at staleness S with the K bench's truncated
    importance weights; without it (P2's figure) the config is sync as before."""
    from minirl.config import load_config

    vt = _vs_trl(monkeypatch)
    model = str(REPO / "models" / "tiny-doors")
    sync = vt.common(model, 2, 4, 2, 5e-4, 1)
    cfg = load_config(sync[1], sync[2:])
    assert not cfg.async_rl.enabled and not cfg.loss_fn.use_importance_sampling_correction
    overlapped = vt.common(model, 2, 4, 2, 5e-4, 1, staleness=1)
    cfg = load_config(overlapped[1], overlapped[2:])
    assert cfg.async_rl.enabled and cfg.async_rl.sampler.max_staleness_versions == 1
    assert cfg.loss_fn.truncated_importance_sampling_type == "tis"
    assert cfg.loss_fn.truncated_importance_sampling_ratio == 2.0
    seen = []
    monkeypatch.setattr(vt, "compare", _compare_recording(seen))
    assert vt.main(["--quick", "--async-staleness", "1"]) == 0
    assert seen == [("tiny 0.46M, minirl async S=1", 2, 1)]
