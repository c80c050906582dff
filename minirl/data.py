"""The prompt stream: the `/run` row of prompt group (step, group), as a pure function, from the
doors task (the default: a task seed and room count drawn from `env.data_seed`, step and group) or
from a JSONL file of NeMo Gym rows (`data.train_jsonl`; docs/gym.md, "Datasets of Gym rows").
Nothing above this module reads an environment's fields: it asks `prompt_key` and `difficulty`.

Invariant: the prompt of (step, group) depends on `env.*`, `data.*` and the dataset file and nothing
else (not on earlier drops, retries or a resume), so a resumed run sees exactly the prompts it would
have seen, and every failure policy is compared on the same prompts. A bad row is a ConfigError
naming the config key, the file and the line, raised before anything is sent.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import json
import random
from array import array
from pathlib import Path

from minirl.runtime import jsonio
from minirl.agents.env import TASKS, TOOLS, DoorsEnv, room_scores
from minirl.agents.server import BadRow, check_row, unknown_agent
from minirl.config import ConfigError, MinirlConfig
from minirl.gym.failures import MASK_SAMPLE, NG_FAILURE_PREFIX, RESULT_FACTS, without_result_facts
from minirl.wire import TASK_INDEX, BadCoordinates, Coords, collector_keys, extra_body, with_extra_body


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
    return rows[_row_index(cfg, len(rows), step, group)]


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
    return _order(cfg.env.data_seed, epoch, n)[pos]


@functools.lru_cache(maxsize=4)
def _order(data_seed: int, epoch: int, n: int) -> array:
    """Epoch `epoch`'s permutation of n rows, drawn once per process (a lookup is then O(1))."""
    order = list(range(n))
    random.Random(_seed(data_seed, "epoch", epoch)).shuffle(order)
    return array("q", order)


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


def fact_rooms(row: dict, result: dict) -> tuple[int, int] | None:
    """(rooms opened on their first try, rooms) over the rooms of a doors row that need a fact shown
    earlier (`DoorsEnv.memory_facts`: doors_memory's last room, doors_notes' two noted rooms), replayed
    from the result's `open_door` calls as `verify` scores them; None for a task without such rooms, and
    for one without an integer `seed` (a row for an external agent, which `prepare` accepts as that
    agent's to judge: its rooms cannot be replayed)."""
    if difficulty(row) is None or type(row["task"].get("seed")) is not int:
        return None
    task = row["task"]
    needed = {f["needed_in_room"] for f in DoorsEnv(task["seed"], task["num_rooms"], task.get("env", "doors"))
              .memory_facts()}
    if not needed:
        return None
    output = (result.get("response") or {}).get("output") if isinstance(result.get("response"), dict) else None
    items = [it for it in output if isinstance(it, dict)] if isinstance(output, list) else []
    opened = sum(score == 1.0 for room, (_, score) in enumerate(room_scores(task, items)) if room in needed)
    return opened, len(needed)


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


def run_body(cfg: MinirlConfig, row: dict, coords: Coords, gid: str, task_index: int | None = None) -> dict:
    """The `/run` body of one rollout attempt of `row`: the row, its sampling seed (in
    `metadata.extra_body`), minirl's bookkeeping (`_rowidx`, `_minirl`) and Gym's collector keys
    (`minirl.wire.collector_keys`; a row's own `_ng_task_index` wins, as in Gym, then `task_index`,
    else the prompt's `prompt_key`)."""
    if task_index is None:
        task_index = prompt_key(cfg, coords.step, coords.group)
    task_index = row.get(TASK_INDEX, task_index)
    body = {**row, "_rowidx": coords.rollout, "_minirl": {**coords.as_dict(), "group_attempt": gid},
            **collector_keys(coords, task_index)}
    body["responses_create_params"] = with_extra_body(
        row["responses_create_params"],
        seed=sampling_seed(cfg, coords.step, coords.group, coords.rollout, coords.attempt))
    return body


# -------------------------------------------------------------------------------- JSONL datasets
class Rows:
    """The rows of one JSONL file as a sequence, held as each row's byte span in the file (16 bytes a
    row): a row is read, parsed and completed (`_completed`) when asked for, so a process never holds
    the parsed dataset, and each lookup costs one row's read. Blank lines are skipped (a row's index
    counts rows, not lines), and so is a UTF-8 byte order mark."""

    def __init__(self, path: Path, cfg: MinirlConfig):
        self.path, self.fill = path, _fill(cfg)  # values, not `cfg`: a caller may change its config later
        self.starts, self.ends = array("q"), array("q")
        for _, start, end, _raw in _lines(path):
            self.starts.append(start)
            self.ends.append(end)

    def __len__(self) -> int:
        return len(self.starts)

    def __iter__(self):
        for _, _, _, raw in _lines(self.path):
            yield _completed(jsonio.loads(raw), self.fill)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        with open(self.path, "rb") as f:
            f.seek(self.starts[i])
            return _completed(jsonio.loads(f.read(self.ends[i] - self.starts[i])), self.fill)


def _lines(path: Path):
    """(line number, start, end, bytes) of each non-blank line of the file at `path` (a leading UTF-8
    byte order mark left out)."""
    with open(path, "rb") as f:
        offset = 0
        for line_no, raw in enumerate(f, 1):
            start, offset = offset, offset + len(raw)
            if line_no == 1 and raw.startswith(codecs.BOM_UTF8):
                raw, start = raw[len(codecs.BOM_UTF8):], start + len(codecs.BOM_UTF8)
            if raw.strip():
                yield line_no, start, offset, raw


_CACHE: dict[tuple, Rows] = {}


def dataset_rows(cfg: MinirlConfig, key: str) -> Rows:
    """The rows of `data.<key>` (`train_jsonl` or `validation_jsonl`), completed (`_completed`; each
    lookup returns a fresh dict); indexed once per process and file version.
    `prepare` checked every row before the run started."""
    path = Path(getattr(cfg.data, key))
    try:
        stat = path.stat()
    except OSError as exc:
        raise ConfigError(f"data.{key}", f"cannot read {path}: {exc.strerror or exc}") from None
    cache_key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size, *_fill(cfg))
    if cache_key not in _CACHE:
        _CACHE[cache_key] = Rows(path, cfg)
    return _CACHE[cache_key]


def check_rows(cfg: MinirlConfig, key: str) -> str | None:
    """Every row of `data.<key>` read and checked (`row_problem`; a training row also `class_problem`;
    when minirl's own agent pool serves, also `agent_problem`; then nemo-gym's request model,
    `gym.shapes.params_problem`): a line that is not a usable row is a
    ConfigError naming the key, the file and the line (a line that is not JSON in Gym's own words).
    Returns a line naming the result fields found (rows copied from a rollout dump), which every
    lookup leaves out, or None."""
    from minirl.gym.shapes import params_problem  # pydantic's models: loaded for a file of rows only

    path = Path(getattr(cfg.data, key))
    found: dict[str, None] = {}
    rows = carrying = 0
    try:
        for line_no, _, _, raw in _lines(path):
            try:
                row = jsonio.loads(raw.decode("utf-8"))  # json's results and errors (Gym's words), faster
            except UnicodeDecodeError as exc:
                raise ConfigError(f"data.{key}", f"'{path}' line {line_no} is not UTF-8: {exc}") from None
            except (ValueError, RecursionError) as exc:  # RecursionError: nested past json's recursion limit
                raise ConfigError(f"data.{key}", f"Malformed JSON in '{path}' at line {line_no}: {exc}") from None
            problem = row_problem(row, cfg)
            if problem is None and key == "train_jsonl":
                problem = class_problem(row, cfg)
            if problem is None and not cfg.agent.external_urls():
                problem = agent_problem(_completed(row, _fill(cfg)), cfg)
            if problem is None:  # last: the checks above name what minirl reads in their own words
                problem = params_problem(row["responses_create_params"])
            if problem:
                raise ConfigError(f"data.{key}", f"'{path}' line {line_no}: {problem}")
            fields = result_fields(row)
            found.update(dict.fromkeys(fields))
            rows, carrying = rows + 1, carrying + bool(fields)
    except OSError as exc:
        raise ConfigError(f"data.{key}", f"cannot read {path}: {exc.strerror or exc}") from None
    if not rows:
        raise ConfigError(f"data.{key}", f"'{path}' holds no rows")
    if not carrying:
        return None
    return (f"minirl: data.{key}: left out the result fields of {carrying} of {rows} rows of '{path}' "
            f"({', '.join(found)}): a row is sent as its prompt, never with a rollout's outcome")


def _json_type(value) -> str:
    names = {str: "a string", bool: "a boolean", list: "an array", dict: "an object", type(None): "null"}
    return names.get(type(value), "a number")


def row_problem(row, cfg: MinirlConfig) -> str | None:
    """What makes `row` unusable as a `/run` row of this run (any agent's), or None."""
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
        got = params.get(name)
        if got is not None and (isinstance(got, bool) or not isinstance(got, (int, float))):
            return f"responses_create_params.{name} must be a number, got {json.dumps(got)[:80]} ({_json_type(got)})"
        if got is not None and got != want:
            return (f"responses_create_params.{name}={got} differs from policy.generation.{name}={want}, "
                    f"at which the trainer takes its logprobs (leave it out, or set policy.generation.{name})")
    return None


def class_problem(row: dict, cfg: MinirlConfig) -> str | None:
    """Under paced admission (`async_rl.sampler.admission=paced`), what makes a training row's stated
    `difficulty`, its prompt class (`prompt_class`, minirl/async_rl/pacing.py), unusable: an object or
    an array, which cannot key the durations the pacer observes by class. None otherwise."""
    value = row.get("difficulty")
    if not (cfg.async_rl.enabled and cfg.async_rl.sampler.admission == "paced" and isinstance(value, (dict, list))):
        return None
    return (f"difficulty must be a string, a number, a boolean or null (async_rl.sampler.admission=paced classes "
            f"prompts by it), got {json.dumps(value)[:80]} ({_json_type(value)})")


_WIDEST = Coords(10**9, 10**9, 10**9, 10**9)
"""Coordinates at least as long as any the rollout manager sends (and a group attempt id longer
than its `grp-` + 12 hex digits, a task index longer than any seed or row index), for the size bound."""


def widest_request(row: dict, cfg: MinirlConfig) -> dict:
    """The `/run` body of a completed row with the bookkeeping the rollout manager adds, at its longest."""
    return run_body(cfg, row, _WIDEST, "grp-" + "f" * 32, task_index=2**40)


def agent_problem(row: dict, cfg: MinirlConfig) -> str | None:
    """What makes a completed row one that minirl's own agent pool cannot run, or None: its `/run`
    request (`widest_request`) over `agent.max_request_bytes`, or refused by the agent server's own
    check (`check_row`, `unknown_agent`): the server would answer every rollout of it with a 4xx; or
    its `agent_ref.name` is the compaction agent, which rewrites its history, where compaction is
    off (`MinirlConfig.uncompacted_rewrite`, the rule `agent.name` meets)."""
    body = widest_request(row, cfg)
    size = len(jsonio.dumps(body))
    if size > cfg.agent.max_request_bytes:
        return (f"its /run request is {size} bytes, over agent.max_request_bytes={cfg.agent.max_request_bytes} "
                "(minirl's agent server would refuse it with 413)")
    try:
        name, _ = check_row(body, cfg)
    except (BadRow, BadCoordinates) as exc:
        return f"minirl's agent server would refuse it (agent.external_url is unset): {exc}"
    problem = unknown_agent(name)
    if problem:
        return f"agent_ref.name: {problem} (minirl's own agent pool serves: agent.external_url is unset)"
    rewrite = cfg.uncompacted_rewrite(name, "agent_ref.name")
    return None if rewrite is None else f"context_compaction.enabled {rewrite}"


OUTCOME_FIELDS = ("response", "reward", "evidence", "_rowidx", "_minirl")
"""What a `/run` result adds to its row besides Gym's failure facts (`gym.failures.RESULT_FACTS`,
the `_ng_failure_*` stamps, `instance_config.mask_sample`): the outcome and minirl's bookkeeping."""


def result_fields(row: dict) -> list[str]:
    """The fields of a dataset row that only a rollout's result carries (a row copied from a rollout
    dump): `OUTCOME_FIELDS` and the failure facts `gym.failures.without_result_facts` leaves out."""
    found = [k for k in row if k in OUTCOME_FIELDS or k in RESULT_FACTS or k.startswith(NG_FAILURE_PREFIX)]
    legacy = row.get("instance_config")
    return found + ([f"instance_config.{MASK_SAMPLE}"] if isinstance(legacy, dict) and MASK_SAMPLE in legacy else [])


def without_results(row: dict) -> dict:
    """`row` without its `result_fields` (a copy)."""
    return without_result_facts({k: v for k, v in row.items() if k not in OUTCOME_FIELDS})


def _fill(cfg: MinirlConfig) -> tuple[str, float, float]:
    """What `_completed` fills in: `agent.name`, `policy.generation`'s temperature and top_p."""
    return cfg.agent.name, cfg.policy.generation.temperature, cfg.policy.generation.top_p


def _completed(row: dict, fill: tuple[str, float, float]) -> dict:
    """`row` with what Gym's collection or the trainer would set where the row leaves it out (`fill`),
    and without the fields only a rollout's result carries (`wire.result_fields`)."""
    row = without_results(row)
    name, temperature, top_p = fill
    params = dict(row["responses_create_params"])
    for key, value in (("temperature", temperature), ("top_p", top_p)):
        if params.get(key) is None:
            params[key] = value
    return {**row, "responses_create_params": params, "agent_ref": row.get("agent_ref") or {"name": name}}


def prepare(cfg: MinirlConfig) -> None:
    """Before a run starts: the dataset paths made absolute (the run's processes may have another
    working directory), every row read and checked (`check_rows`; one line printed when rows carry
    result fields, which are left out), and the rules that need the rows: a validation
    on JSONL training rows needs `data.validation_jsonl` with at least `grpo.val_num_prompts` rows,
    and `faults.rate_per_room` needs every training row to have a room count. ConfigError otherwise."""
    g = cfg.grpo
    validates = g.val_period > 0 or g.val_at_start
    for key in ("train_jsonl", "validation_jsonl"):
        if getattr(cfg.data, key) is not None:
            setattr(cfg.data, key, str(Path(getattr(cfg.data, key)).resolve()))
            note = check_rows(cfg, key)
            if note:
                print(note, flush=True)
    if validates and cfg.data.train_jsonl is not None and cfg.data.validation_jsonl is None:
        raise ConfigError("data.validation_jsonl", "must be set to validate a run on data.train_jsonl "
                          f"(grpo.val_period={g.val_period}, grpo.val_at_start={g.val_at_start}): "
                          "the doors task's held-out prompts are not that environment's")
    if validates and cfg.data.validation_jsonl is not None:
        n = len(dataset_rows(cfg, "validation_jsonl"))
        if n < g.val_num_prompts:
            raise ConfigError("data.validation_jsonl",
                              f"holds {n} rows, fewer than grpo.val_num_prompts={g.val_num_prompts}")
    if any(q > 0 for q in cfg.faults.rate_per_room.values()) and cfg.data.train_jsonl is not None:
        rows = dataset_rows(cfg, "train_jsonl")
        lacking = [i for i, row in enumerate(rows) if difficulty(row) is None]
        if lacking:
            raise ConfigError("faults.rate_per_room",
                              f"scales with a row's room count, and rows {lacking[:5]} (0-based) of "
                              f"data.train_jsonl have none (only doors rows do)")
