"""Datasets of Gym rows (`data.train_jsonl`, `data.validation_jsonl`, minirl/data.py): rows load
as written, pass through the rollout manager unchanged except the seed and minirl's bookkeeping,
a bad row is one ConfigError naming the key, the file and the line, and nothing above the dataset
reads an environment's fields (the per-room fault hazard keeps its stream on doors rows)."""

from __future__ import annotations

import asyncio
import copy
import json
import re
import sys
from pathlib import Path

import pytest
from aiohttp import web

from helpers import serve_run
from minirl import data
from minirl.config import ConfigError
from minirl.data import difficulty, prompt_key, prompt_row, task_seed
from minirl.faults import FAULT_KINDS, FaultPlan
from minirl.rollout.manager import RolloutManager
from minirl.validation import held_out_rows, summarize
from minirl.wire import Coords, extra_body

REPO = Path(__file__).resolve().parents[2]
TOOL = {"type": "function", "name": "get_weather", "strict": True, "description": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def foreign_rows(n: int) -> list[dict]:
    """Rows shaped like nemo-gym's example_tool_call_multireward/data/example.jsonl: no agent_ref,
    no sampling parameters, an environment field (`expected_call`) that only its server reads."""
    rows = []
    for i in range(n):
        params = {"input": [{"role": "developer", "content": "call get_weather"},
                            {"role": "user", "content": f"city {i}?"}],
                  "tools": [TOOL]}
        rows.append({"responses_create_params": params,
                     "expected_call": {"name": "get_weather", "arguments": {"city": f"c{i}"}}})
    if n > 1:
        rows[1]["agent_ref"] = {"name": "my_agent"}
        rows[1]["responses_create_params"]["metadata"] = {"extra_body": '{"top_k": 5}', "tag": "x"}
    return rows


def write(path: Path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def jsonl_cfg(base_cfg, tmp_path, rows, **data_fields):
    """A config training on `rows`, served by an external Gym agent (minirl's own pool runs only
    rows it can parse: tests/integration/test_data_checks.py)."""
    cfg = copy.deepcopy(base_cfg)
    cfg.agent.external_url = "http://127.0.0.1:9"
    cfg.data.train_jsonl = write(tmp_path / "train.jsonl", rows)
    for k, v in data_fields.items():
        setattr(cfg.data, k, v)
    return cfg


def test_rows_load_as_written_and_cycle_in_epochs(base_cfg, tmp_path):
    rows = foreign_rows(5)
    cfg = jsonl_cfg(base_cfg, tmp_path, rows, shuffle=False)
    cfg.grpo.num_prompts_per_step = 2
    data.prepare(cfg)
    gen = cfg.policy.generation
    for i, want in enumerate(rows):  # the row as written, plus only what Gym's collection / the trainer sets
        got = prompt_row(cfg, i // 2, i % 2)
        assert got["agent_ref"] == want.get("agent_ref", {"name": cfg.agent.name})
        params = dict(got["responses_create_params"])
        assert (params.pop("temperature"), params.pop("top_p")) == (gen.temperature, gen.top_p)
        assert params == want["responses_create_params"]
        assert {k: v for k, v in got.items() if k not in ("agent_ref", "responses_create_params")} == \
            {k: v for k, v in want.items() if k not in ("agent_ref", "responses_create_params")}
        assert prompt_key(cfg, i // 2, i % 2) == i
    assert prompt_key(cfg, 2, 1) == 0 and prompt_key(cfg, 3, 0) == 1  # index 5 = epoch 1, row 0
    prompt_row(cfg, 0, 0)["expected_call"]["name"] = "changed"  # a caller's copy: the dataset is untouched
    assert prompt_row(cfg, 0, 0)["expected_call"]["name"] == "get_weather"

    shuffled = jsonl_cfg(base_cfg, tmp_path, rows)
    shuffled.grpo.num_prompts_per_step = 5
    epochs = [[prompt_key(shuffled, step, g) for g in range(5)] for step in range(4)]
    assert all(sorted(e) == list(range(5)) for e in epochs)  # each epoch visits every row once
    assert len({tuple(e) for e in epochs}) > 1  # in its own order
    assert epochs == [[prompt_key(shuffled, step, g) for g in range(5)] for step in range(4)]  # reproducibly

    doors = copy.deepcopy(base_cfg)  # the default dataset: the key is the task seed, as prompt_seeds was
    assert [prompt_key(doors, 3, g) for g in range(4)] == [prompt_row(doors, 3, g)["task"]["seed"] for g in range(4)]
    assert [prompt_key(doors, 3, g) for g in range(4)] == [task_seed(doors, 3, g) for g in range(4)]


BAD_LINES = [
    ("{not json", r"Malformed JSON in '.*' at line 2: "),
    ("[1, 2]", r"line 2: a row must be a JSON object, got list"),
    ({"input": "hi"}, r"line 2: responses_create_params must be an object .* got nothing"),
    ({"responses_create_params": {"tools": []}}, r"line 2: responses_create_params.input must be"),
    ({"responses_create_params": {"input": "hi", "seed": 3}},
     r"line 2: responses_create_params.seed: Gym's request parameters forbid it"),
    ({"responses_create_params": {"input": "hi", "metadata": {"extra_body": "[1]"}}},
     r"line 2: .*metadata.extra_body must be a JSON object"),
    ({"responses_create_params": {"input": "hi", "temperature": 0.5}},
     r"line 2: responses_create_params.temperature=0.5 differs from policy.generation.temperature=1.0"),
    ({"responses_create_params": {"input": "hi"}, "agent_ref": "simple_agent"},
     r"line 2: agent_ref must be an object with a string name"),
    # what nemo-gym's own request model refuses (a Gym /run answers 422, and the prompt was lost mid-run)
    ({"responses_create_params": {"input": "hi", "max_tokens": 8}},
     r"line 2: responses_create_params.max_tokens: Extra inputs are not permitted, got 8 \(nemo-gym's request"),
    ({"responses_create_params": {"input": "hi", "metadata": {"k": 1}}},
     r"line 2: responses_create_params.metadata.k: Input should be a valid string"),
    ({"responses_create_params": {"input": "hi", "stream": True}}, r"line 2: responses_create_params.stream: "),
    ({"responses_create_params": {"input": "hi", "tools": "x"}}, r"line 2: responses_create_params.tools: "),
    # nested past json's recursion limit (msgspec refuses it, json.loads raised RecursionError); the limit is
    # the interpreter's when the test runs (torch's inductor lifts it to 2000 in a process that compiled)
    ("NESTED", r"Malformed JSON in '.*' at line 2: maximum recursion depth exceeded"),
]


def nested_past_the_recursion_limit() -> str:
    depth = sys.getrecursionlimit() + 200
    return '{"responses_create_params": {"input": "hi", "metadata": ' + "[" * depth + "]" * depth + "}}"


@pytest.mark.parametrize("bad,message", BAD_LINES)
def test_a_bad_row_names_the_key_the_file_and_the_line(base_cfg, tmp_path, bad, message):
    bad = nested_past_the_recursion_limit() if bad == "NESTED" else bad
    cfg = jsonl_cfg(base_cfg, tmp_path, [foreign_rows(1)[0], bad, foreign_rows(1)[0]])
    with pytest.raises(ConfigError, match=r"^data.train_jsonl: ") as err:
        data.prepare(cfg)
    assert re.search(message, str(err.value)) and str(tmp_path / "train.jsonl") in str(err.value)


def test_dataset_rules_that_need_the_rows(base_cfg, tmp_path):
    from minirl.train import main

    empty = jsonl_cfg(base_cfg, tmp_path, [])
    with pytest.raises(ConfigError, match="holds no rows"):
        data.prepare(empty)
    cfg = jsonl_cfg(base_cfg, tmp_path, foreign_rows(3))
    cfg.grpo.val_period = 2
    with pytest.raises(ConfigError, match=r"^data.validation_jsonl: must be set to validate a run on data.train_jsonl"):
        data.prepare(cfg)
    cfg.data.validation_jsonl = write(tmp_path / "val.jsonl", foreign_rows(2))
    with pytest.raises(ConfigError, match=r"^data.validation_jsonl: holds 2 rows, fewer than grpo.val_num_prompts=8"):
        data.prepare(cfg)
    cfg = jsonl_cfg(base_cfg, tmp_path, foreign_rows(3))
    cfg.faults.rate_per_room = {"agent_exception": 0.1}
    with pytest.raises(ConfigError, match=r"^faults.rate_per_room: .* rows \[0, 1, 2\]"):
        data.prepare(cfg)
    cfg.data.train_jsonl = write(tmp_path / "doors.jsonl", [prompt_row(base_cfg, 0, g) for g in range(3)])
    data.prepare(cfg)  # doors rows have a room count
    # from the command line: one line naming the key, exit 2, before Ray starts
    bad = write(tmp_path / "bad.jsonl", [foreign_rows(1)[0], "{oops"])
    assert main([f"data.train_jsonl={bad}", f"run_dir={tmp_path / 'run'}"]) == 2
    assert main([f"data.train_jsonl={tmp_path / 'missing.jsonl'}", f"run_dir={tmp_path / 'run'}"]) == 2


async def _run_step(cfg, rows, step=0):
    """`rows` through the real rollout manager to a stand-in agent on loopback that records every body."""
    seen, events = [], []

    async def run(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        item = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x"}],
                "prompt_token_ids": [1, 2], "generation_token_ids": [3], "generation_log_probs": [-0.5]}
        return web.json_response({**body, "response": {"output": [item]}, "reward": 1.0})

    runner, url = await serve_run(run)
    manager = RolloutManager(cfg, [url], events.append, vocab_size=100)
    try:
        outcomes = await manager.run_step(step, rows)
    finally:
        await manager.session.close()
        await runner.cleanup()
    return outcomes, seen, events


def test_the_manager_passes_rows_through_but_the_seed_and_its_bookkeeping(base_cfg, tmp_path):
    cfg = jsonl_cfg(base_cfg, tmp_path, foreign_rows(4), shuffle=False)
    cfg.grpo.num_generations_per_prompt, cfg.grpo.num_prompts_per_step = 3, 2
    cfg.faults.rate = {"agent_exception": 0.5}  # a rate needs no room count: foreign rows still plan faults
    rows = [prompt_row(cfg, 1, g) for g in range(2)]
    outcomes, seen, events = asyncio.run(_run_step(cfg, rows, step=1))
    assert [o.status for o in outcomes] == ["committed"] * 2 and [len(o.rollouts) for o in outcomes] == [3, 3]
    assert len(seen) == 6 and any(e["type"] == "fault" for e in events)
    for body in seen:
        g, r = body["_minirl"]["group"], body["_minirl"]["rollout"]
        assert body["_rowidx"] == r and body["_minirl"]["step"] == 1
        assert {k: body[k] for k in body if k.startswith("_ng_")} == {  # Gym's collector keys (minirl.wire)
            "_ng_task_index": data.prompt_key(cfg, 1, g), "_ng_rollout_index": r, "_ng_attempt_index": 0,
            "_ng_rollout_id": f"s1.g{g}.r{r}"}
        sent = {k: v for k, v in body.items() if k not in ("_rowidx", "_minirl") and not k.startswith("_ng_")}
        params = dict(sent.pop("responses_create_params"))
        extras = extra_body(params)
        assert extras.pop("seed") == data.sampling_seed(cfg, 1, g, r, 0)
        want = rows[g]["responses_create_params"]
        assert extras == extra_body(want)  # the row's own extras (top_k) kept beside the seed
        assert {k: v for k, v in params.items() if k != "metadata"} == \
            {k: v for k, v in want.items() if k != "metadata"}
        assert {k: v for k, v in (params.get("metadata") or {}).items() if k != "extra_body"} == \
            {k: v for k, v in (want.get("metadata") or {}).items() if k != "extra_body"}
        assert sent == {k: v for k, v in rows[g].items() if k != "responses_create_params"}
    seeds = {(b["_minirl"]["group"], extra_body(b["responses_create_params"])["seed"]) for b in seen}
    assert len(seeds) == 6  # G rollouts of a prompt, each with its own seed


def test_per_room_hazard_reads_the_row_count_through_the_dataset_accessor(base_cfg, tmp_path):
    """Doors rows, from the doors dataset or from a JSONL of the same rows, give the fault stream that
    `FaultPlan.call_of(kind, coords, task.num_rooms)` gives (the manager read task.num_rooms itself before)."""
    cfg = copy.deepcopy(base_cfg)
    cfg.grpo.num_generations_per_prompt, cfg.grpo.num_prompts_per_step = 4, 4
    cfg.env.num_rooms_choices = [1, 3, 6]
    cfg.faults.rate_per_room = {"agent_exception": 0.15}
    rows = [prompt_row(cfg, 0, g) for g in range(4)]
    assert sorted({difficulty(r) for r in rows}) != [None] and difficulty(foreign_rows(1)[0]) is None
    _, _, from_doors = asyncio.run(_run_step(cfg, rows))
    from_file = jsonl_cfg(cfg, tmp_path, rows, shuffle=False)
    data.prepare(from_file)
    _, _, from_jsonl = asyncio.run(_run_step(from_file, [prompt_row(from_file, 0, g) for g in range(4)]))
    plan = FaultPlan(cfg.faults)
    expected = [(kind, g, r) for g in range(4) for r in range(4) for kind in FAULT_KINDS
                if plan.call_of(kind, Coords(0, g, r, 0), rows[g]["task"]["num_rooms"]) is not None]

    def faults(evs):
        return sorted((e["kind"], e["group"], e["rollout"]) for e in evs if e["type"] == "fault")

    assert faults(from_doors) == faults(from_jsonl) == sorted(expected) and expected


def test_nothing_above_the_dataset_reads_environment_fields():
    for module in ("rollout/manager.py", "controller.py", "async_rl/pump.py", "async_rl/source.py",
                   "async_rl/pacing.py", "validation.py"):
        source = (REPO / "minirl" / module).read_text()
        assert '["task"]' not in source and '"num_rooms"' not in source and "['task']" not in source, module


def test_validation_rows_come_from_the_validation_jsonl(base_cfg, tmp_path):
    cfg = copy.deepcopy(base_cfg)
    cfg.grpo.val_num_prompts, cfg.grpo.val_num_generations = 3, 2
    cfg.data.validation_jsonl = write(tmp_path / "val.jsonl", foreign_rows(5))
    rows = held_out_rows(cfg)
    assert len(rows) == 6 and all("_minirl" not in r for r in rows)
    assert [r["responses_create_params"]["input"][1]["content"] for r in rows[::2]] == ["city 0?", "city 1?", "city 2?"]
    assert held_out_rows(cfg) == rows and len({extra_body(r["responses_create_params"])["seed"] for r in rows}) == 6
    metrics = summarize(rows, [{"reward": 1.0 * (i % 2)} for i in range(6)])
    assert metrics["val_reward_mean"] == 0.5 and not any("rooms" in k for k in metrics)
