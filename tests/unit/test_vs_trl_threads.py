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
    monkeypatch.setattr(vt, "compare", lambda name, model, steps, prompts, gens, lr, threads: seen.append(threads)
                        or {"name": name, "steps": steps, "minirl_step_s": 1.0, "trl_step_s": 1.0, "ratio": 1.0,
                            "minirl_reward_first": 0.0, "minirl_reward": 0.0, "trl_reward_first": 0.0,
                            "trl_reward": 0.0})
    assert vt.main(["--quick", "--threads", "1"]) == 0 and seen == [1]
    assert vt.main(["--quick"]) == 0 and seen == [1, 2]
