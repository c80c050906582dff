"""The prompt stream: the `/run` row of prompt group (step, group), as a pure function, from one of
two datasets.

- doors (the default, `data.train_jsonl` unset): the row of the task whose seed is drawn from
  (`env.data_seed`, step, group); its room count (its difficulty) is a function of that seed too
  (`env.num_rooms_choices`), so the mix of any set of prompts can be recomputed from their
  coordinates. Held-out prompts (minirl.validation) never use a training seed.
- a JSONL file of NeMo Gym rows (`data.train_jsonl`, `data.validation_jsonl`), as Gym's rollout
  collection takes them: `responses_create_params`, `agent_ref`, and any fields of the environment
  (its resources server reads them). Prompt group (step, group) is row i = step * P + group of the
  epoch i // N's order (N rows; a permutation drawn from `env.data_seed` and the epoch when
  `data.shuffle`, else file order). A row passes through unchanged except where it leaves out what
  Gym's collection or the trainer would set: a missing `agent_ref` becomes {"name": agent.name}
  (Gym's `+agent_name`), a missing `temperature` / `top_p` the run's `policy.generation` value
  (the trainer's logprobs are taken at it, so a row that sets another is refused). The rollout
  manager then adds only the per-rollout seed (in `metadata.extra_body`), its bookkeeping
  (`_rowidx`, `_minirl`) and Gym's collector keys (`_ng_task_index`: `prompt_key`, unless the row
  has its own; minirl.wire.collector_keys), repeats the row G times and groups the rollouts by prompt.

Nothing above this module reads an environment's fields: `prompt_key` (the prompt's identity in
its dataset: the doors task seed, or the row's index in the file) and `difficulty` (a doors row's
room count, which scales `faults.rate_per_room`; None for any other environment's row) are the
accessors the manager, the controller and validation use.

Invariant: the prompt of (step, group) depends on `env.*`, `data.*` and the dataset file and nothing
else (not on earlier drops, retries or a resume), so a resumed run sees exactly the prompts it would
have seen, and every failure policy is compared on the same prompts. A bad row is a ConfigError
naming the config key, the file and the line, raised before anything is sent.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
from pathlib import Path

from minirl.agents.env import TASKS, TOOLS, DoorsEnv
from minirl.config import ConfigError, MinirlConfig
from minirl.wire import extra_body


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
    if cfg.data.train_jsonl is None:
        return task_row(cfg, task_seed(cfg, step, group))
    rows = dataset_rows(cfg, "train_jsonl")
    return copy.deepcopy(rows[_row_index(cfg, len(rows), step, group)])


def prompt_key(cfg: MinirlConfig, step: int, group: int) -> int:
    """The identity of prompt group (step, group)'s prompt in its dataset (a step's `prompt_seeds`):
    the doors task seed, or the row's 0-based index in `data.train_jsonl`."""
    if cfg.data.train_jsonl is None:
        return task_seed(cfg, step, group)
    return _row_index(cfg, len(dataset_rows(cfg, "train_jsonl")), step, group)


def _row_index(cfg: MinirlConfig, n: int, step: int, group: int) -> int:
    i = step * cfg.grpo.num_prompts_per_step + group
    epoch, pos = divmod(i, n)
    if not cfg.data.shuffle:
        return pos
    order = list(range(n))
    random.Random(_seed(cfg.env.data_seed, "epoch", epoch)).shuffle(order)
    return order[pos]


def difficulty(row: dict) -> int | None:
    """The room count of a doors row (what `faults.rate_per_room` scales with); None for a row of any
    other environment, which has no such count."""
    task = row.get("task")
    if not isinstance(task, dict) or task.get("env", "doors") not in TASKS:
        return None
    rooms = task.get("num_rooms")
    return rooms if isinstance(rooms, int) and not isinstance(rooms, bool) else None


def describe(row: dict) -> str:
    """A held-out row for an error message: ` (seed S, N rooms)` for a doors row, else ``."""
    rooms = difficulty(row)
    return f" (seed {row['task'].get('seed')}, {rooms} rooms)" if rooms is not None else ""


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


# -------------------------------------------------------------------------------- JSONL datasets
_CACHE: dict[tuple, list[dict]] = {}


def dataset_rows(cfg: MinirlConfig, key: str) -> list[dict]:
    """The rows of `data.<key>` (`train_jsonl` or `validation_jsonl`), checked and completed as the
    module docstring says; read once per process and file version. Callers copy before changing one."""
    path = Path(getattr(cfg.data, key))
    gen = cfg.policy.generation
    try:
        stat = path.stat()
    except OSError as exc:
        raise ConfigError(f"data.{key}", f"cannot read {path}: {exc.strerror or exc}") from None
    cache_key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size, cfg.agent.name, gen.temperature, gen.top_p)
    if cache_key not in _CACHE:
        _CACHE[cache_key] = read_rows(path, f"data.{key}", cfg)
    return _CACHE[cache_key]


def read_rows(path: Path, key: str, cfg: MinirlConfig) -> list[dict]:
    """Every row of the JSONL file at `path`; a line that is not a usable row is a ConfigError naming
    `key`, the file and the line (a line that is not JSON in Gym's own words)."""
    rows = []
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(key, f"cannot read {path}: {exc}") from None
    for line_no, raw in enumerate(lines, 1):
        try:
            row = json.loads(raw)
        except ValueError as exc:
            raise ConfigError(key, f"Malformed JSON in '{path}' at line {line_no}: {exc}") from None
        problem = row_problem(row, cfg)
        if problem:
            raise ConfigError(key, f"'{path}' line {line_no}: {problem}")
        rows.append(_completed(row, cfg))
    if not rows:
        raise ConfigError(key, f"'{path}' holds no rows")
    return rows


def row_problem(row, cfg: MinirlConfig) -> str | None:
    """What makes `row` unusable as a `/run` row of this run, or None."""
    if not isinstance(row, dict):
        return f"a row must be a JSON object, got {type(row).__name__}"
    params = row.get("responses_create_params")
    if not isinstance(params, dict):
        return "responses_create_params must be an object (the row's request to the model), got " + (
            "nothing" if params is None else type(params).__name__)
    if not isinstance(params.get("input"), (str, list)):
        return "responses_create_params.input must be a string or a list of input items"
    if "seed" in params:
        return ("responses_create_params.seed: Gym's request parameters forbid it; minirl sets each rollout's "
                "seed in responses_create_params.metadata.extra_body")
    try:
        extra_body(params)
    except ValueError as exc:
        return str(exc)
    agent_ref = row.get("agent_ref")
    if agent_ref is not None and not (isinstance(agent_ref, dict) and isinstance(agent_ref.get("name"), str)):
        return f"agent_ref must be an object with a string name, got {json.dumps(agent_ref)[:200]}"
    gen = cfg.policy.generation
    for name, want in (("temperature", gen.temperature), ("top_p", gen.top_p)):
        if params.get(name) is not None and params[name] != want:
            return (f"responses_create_params.{name}={params[name]} differs from policy.generation.{name}={want}, "
                    f"at which the trainer takes its logprobs (leave it out, or set policy.generation.{name})")
    return None


def _completed(row: dict, cfg: MinirlConfig) -> dict:
    """`row` with what Gym's collection or the trainer would set where the row leaves it out."""
    params = dict(row["responses_create_params"])
    for name in ("temperature", "top_p"):
        if params.get(name) is None:
            params[name] = getattr(cfg.policy.generation, name)
    return {**row, "responses_create_params": params, "agent_ref": row.get("agent_ref") or {"name": cfg.agent.name}}


def prepare(cfg: MinirlConfig) -> None:
    """Before a run starts: the dataset paths made absolute (the run's processes may have another
    working directory), every row read and checked, and the rules that need the rows: a validation
    on JSONL training rows needs `data.validation_jsonl` with at least `grpo.val_num_prompts` rows,
    and `faults.rate_per_room` needs every training row to have a room count. ConfigError otherwise."""
    g = cfg.grpo
    validates = g.val_period > 0 or g.val_at_start
    for key in ("train_jsonl", "validation_jsonl"):
        if getattr(cfg.data, key) is not None:
            setattr(cfg.data, key, str(Path(getattr(cfg.data, key)).resolve()))
            dataset_rows(cfg, key)
    if validates and cfg.data.train_jsonl is not None and cfg.data.validation_jsonl is None:
        raise ConfigError("data.validation_jsonl", "must be set to validate a run on data.train_jsonl "
                          f"(grpo.val_period={g.val_period}, grpo.val_at_start={g.val_at_start}): "
                          "the doors task's held-out prompts are not that environment's")
    if validates and cfg.data.validation_jsonl is not None:
        n = len(dataset_rows(cfg, "validation_jsonl"))
        if n < g.val_num_prompts:
            raise ConfigError("data.validation_jsonl", f"holds {n} rows, fewer than grpo.val_num_prompts={g.val_num_prompts}")
    if any(q > 0 for q in cfg.faults.rate_per_room.values()) and cfg.data.train_jsonl is not None:
        rows = dataset_rows(cfg, "train_jsonl")
        lacking = [i for i, row in enumerate(rows) if difficulty(row) is None]
        if lacking:
            raise ConfigError("faults.rate_per_room", f"scales with a row's room count, and rows {lacking[:5]} (0-based) of "
                              f"data.train_jsonl have none (only doors rows do)")
