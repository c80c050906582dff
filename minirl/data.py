"""The prompt stream: the `/run` row of prompt group (step, group), as a pure function.

Invariant: the prompt of (step, group) depends on `env.*` and nothing else (not on earlier drops,
retries or a resume), so a resumed run sees exactly the prompts it would have seen, and every
failure policy is compared on the same prompts. A prompt's room count (its difficulty) is a
function of its seed too (`env.num_rooms_choices`), so the mix of any set of prompts can be
recomputed from their coordinates. Held-out prompts (minirl.validation) never use a training seed.
"""

from __future__ import annotations

import hashlib

from minirl.agents.env import TOOLS, DoorsEnv
from minirl.config import MinirlConfig


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=4).digest(), "big")


def task_seed(cfg: MinirlConfig, step: int, group: int) -> int:
    """The task seed of training prompt group (step, group)."""
    return _seed(cfg.env.data_seed, step, group)


def num_rooms(cfg: MinirlConfig, seed: int) -> int:
    """The room count of the task with `seed`: `env.num_rooms`, or drawn from `env.num_rooms_choices`
    by the seed alone (so a prompt's difficulty is as reproducible as the prompt)."""
    choices = cfg.env.num_rooms_choices
    return choices[_seed("rooms", seed) % len(choices)] if choices else cfg.env.num_rooms


def prompt_row(cfg: MinirlConfig, step: int, group: int) -> dict:
    """The row shared by all rollouts of one prompt group (no rollout coordinates yet)."""
    return task_row(cfg, task_seed(cfg, step, group))


def task_row(cfg: MinirlConfig, seed: int) -> dict:
    """The `/run` row of the task with `seed`, sampled with the run's generation config."""
    env = DoorsEnv(seed=seed, num_rooms=num_rooms(cfg, seed), task=cfg.env.task)
    gen = cfg.policy.generation
    return {
        "responses_create_params": {
            "input": env.initial_input(),
            "tools": TOOLS,
            "temperature": gen.temperature,
            "top_p": gen.top_p,
            "max_output_tokens": gen.max_new_tokens,
        },
        "agent_ref": {"name": cfg.agent.name},
        "task": {"env": env.task, "seed": env.seed, "num_rooms": env.num_rooms},
    }


def sampling_seed(cfg: MinirlConfig, step: int, group: int, rollout: int, attempt: int) -> int:
    """Per-attempt sampling seed: reproducible runs, fresh samples on every retry."""
    return _seed(cfg.grpo.seed, step, group, rollout, attempt) % (2**31)
