"""Dataset rows and settings refused before Ray starts (issue 49 AA items 4, 5 data side, 7 and the
data-file LOWs; issue 50 X item 10): a row minirl's own agents cannot run is refused by the agent
server's own check (`agents.server.check_row`) with the file, the line and the field; a row over
`agent.max_request_bytes` likewise; result fields copied from a rollout dump are left out with one
line; a summarizing threshold that can never fire is a ConfigError; a directory, a FIFO, a string
temperature are named as what they are; a BOM and blank lines are accepted; a process holds no
parsed rows and finds a prompt's row without rebuilding the epoch's order; the summarizing
threshold is drawn per prompt for dataset rows too."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import signal
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
from aiohttp import web

from helpers import serve_run
from minirl import data
from minirl.agents.agent import start_episode
from minirl.agents.env import SYSTEM_PROMPT
from minirl.config import ConfigError, load_config
from minirl.data import prompt_key, prompt_row
from minirl.rollout.manager import RolloutManager
from minirl.validation import held_out_rows

REPO = Path(__file__).resolve().parents[2]
SUMMARIZE_YAML = str(REPO / "configs" / "summarize.yaml")


def write(path: Path, rows, tail: str = "") -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows) + tail)
    return str(path)


def doors_rows(cfg, n: int) -> list[dict]:
    return [prompt_row(cfg, 0, g) for g in range(n)]


def own_pool_cfg(base_cfg, tmp_path, rows, **agent):
    """Training on `rows` with minirl's own agent pool serving (no agent.external_url)."""
    cfg = copy.deepcopy(base_cfg)
    cfg.data.train_jsonl = write(tmp_path / "train.jsonl", rows)
    for key, value in agent.items():
        setattr(cfg.agent, key, value)
    return cfg


def changed(row: dict, path: str, value) -> dict:
    """`row` with the dotted `path` set to `value` (DELETE: removed)."""
    row = copy.deepcopy(row)
    *parents, last = path.split(".")
    node = row
    for key in parents:
        node = node[key]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return row


DELETE = object()
UNRUNNABLE = [  # (path, value, what the message names): AA item 4's cases as the review tried them
    ("responses_create_params.input", [5], r"responses_create_params\.input\[0\] must be an object, got 5"),
    ("responses_create_params.input", "open the door",
     r"responses_create_params\.input must be a list of items, got str"),
    ("responses_create_params.input", [], r"responses_create_params\.input must hold at least one item, got \[\]"),
    ("responses_create_params.tools", "x", r"responses_create_params\.tools must be a list of objects, got 'x'"),
    ("responses_create_params.max_output_tokens", -1,
     r"responses_create_params\.max_output_tokens must be an integer >= 1"),
    ("task.num_rooms", 0, r"task\.num_rooms must be in \[1, 16\] \(env\.max_num_rooms\), got 0"),
    ("task", DELETE, r"task must be an object, got None"),  # a Gym row: its resources server's fields, no doors task
    ("agent_ref", {"name": "my_agent"},
     r"agent_ref\.name: unknown agent_ref name 'my_agent'; known: \['simple_agent', 'compaction_agent'\]"),
]


@pytest.mark.parametrize("path,value,message", UNRUNNABLE,
                         ids=[f"{p}={'(deleted)' if v is DELETE else repr(v)}"[:40] for p, v, _ in UNRUNNABLE])
def test_a_row_minirls_agents_cannot_run_is_refused_before_ray(base_cfg, tmp_path, path, value, message):
    good = doors_rows(base_cfg, 2)
    cfg = own_pool_cfg(base_cfg, tmp_path, [good[0], changed(good[1], path, value), good[0]])
    with pytest.raises(ConfigError, match=r"^data\.train_jsonl: ") as err:
        data.prepare(cfg)
    assert f"'{tmp_path / 'train.jsonl'}' line 2: " in str(err.value) and re.search(message, str(err.value)), err.value
    # the same row is for an external Gym agent to judge (a string input is valid for Gym), unless nemo-gym's own
    # request model refuses it: a Gym /run would answer 422 and the prompt be lost mid-run
    external = own_pool_cfg(base_cfg, tmp_path, [good[0], changed(good[1], path, value)],
                            external_url="http://127.0.0.1:9")
    if path == "responses_create_params.tools":
        with pytest.raises(ConfigError, match=r"line 2: responses_create_params\.tools: Input should be a valid list, "
                                              r"got \"x\" \(nemo-gym's request model refuses it"):
            data.prepare(external)
    else:
        data.prepare(external)


@pytest.mark.parametrize("task", [{"num_rooms": 3}, {"env": "doors_memory", "num_rooms": 3, "seed": "7"},
                                  {"env": "doors_memory", "num_rooms": 3, "seed": True}])
def test_an_external_agents_held_out_row_without_an_integer_seed_has_no_fact_rooms(base_cfg, tmp_path, task):
    """A doors-shaped task without an integer `seed` is the external agent's to judge (`prepare` accepts
    it, as above); validation reads its result without replaying its rooms (`fact_rooms` None, so no
    `val_fact_success_rate`), where it died with a bare KeyError 'seed' after the row's /run succeeded."""
    row = {"responses_create_params": {"input": "How many rooms?"}, "task": task}
    cfg = own_pool_cfg(base_cfg, tmp_path, [row], external_url="http://127.0.0.1:9")
    cfg.data.validation_jsonl, cfg.grpo.val_num_prompts, cfg.grpo.val_at_start = cfg.data.train_jsonl, 1, True
    data.prepare(cfg)
    (held,) = held_out_rows(cfg)
    opened = {"type": "function_call", "name": "open_door", "arguments": json.dumps({"door": "red"}), "call_id": "c"}
    result = {**held, "response": {"status": "completed", "output": [opened]}, "reward": 1.0}
    assert data.fact_rooms(held, result) is None and data.fact_rooms(held, {}) is None


def test_a_rows_agent_ref_meets_the_compaction_rule_that_agent_name_meets(base_cfg, tmp_path):
    """`context_compaction.enabled=false` is refused with agent.name=compaction_agent (its history
    rewrites would break every trace); a row's own `agent_ref.name`, which wins over agent.name, got
    around it: those rollouts failed at run time with "Non-contiguous messages found!"."""
    cfg = copy.deepcopy(base_cfg)
    cfg.agent.name, cfg.context_compaction.enabled = "simple_agent", False
    good = doors_rows(cfg, 2)
    rows = [good[0], changed(good[1], "agent_ref", {"name": "compaction_agent"})]
    cfg.data.train_jsonl = write(tmp_path / "train.jsonl", rows)
    with pytest.raises(ConfigError) as err:
        data.prepare(cfg)
    assert str(err.value) == (
        f"data.train_jsonl: '{tmp_path / 'train.jsonl'}' line 2: context_compaction.enabled is false, but "
        "agent_ref.name=compaction_agent with agent.context_history.enabled=true rewrites its history; without "
        "compaction every call must extend the previous one (use agent_ref.name=simple_agent, see configs/plain.yaml)")
    history_kept, compacting = copy.deepcopy(cfg), copy.deepcopy(cfg)  # either lifts the rule, as for agent.name
    history_kept.agent.context_history.enabled = False
    compacting.context_compaction.enabled = True
    for ok in (history_kept, compacting):
        data.prepare(ok)


def test_the_validation_rows_are_checked_too(base_cfg, tmp_path):
    cfg = copy.deepcopy(base_cfg)
    cfg.grpo.val_num_prompts = 2
    cfg.data.validation_jsonl = write(tmp_path / "val.jsonl",
                                      [*doors_rows(base_cfg, 1), changed(doors_rows(base_cfg, 1)[0], "task", DELETE)])
    with pytest.raises(ConfigError, match=r"^data\.validation_jsonl: '.*val\.jsonl' line 2: .*task must be an object"):
        data.prepare(cfg)


def test_a_row_over_the_agent_servers_size_bound_is_refused(base_cfg, tmp_path):
    row = doors_rows(base_cfg, 1)[0]
    cfg = own_pool_cfg(base_cfg, tmp_path, [row])
    size = len(json.dumps(data.widest_request(data.dataset_rows(cfg, "train_jsonl")[0], cfg), separators=(",", ":")))
    cfg.agent.max_request_bytes = size  # at the bound: accepted
    data.prepare(cfg)
    cfg.agent.max_request_bytes = size - 1
    with pytest.raises(ConfigError, match=rf"^data\.train_jsonl: '.*' line 1: its /run request is {size} bytes, "
                                          rf"over agent\.max_request_bytes={size - 1}"):
        data.prepare(cfg)


def test_the_size_bound_covers_what_the_rollout_manager_sends(base_cfg, tmp_path):
    """The bound is taken on the widest body: every body the real manager sends is no longer."""
    cfg = own_pool_cfg(base_cfg, tmp_path, doors_rows(base_cfg, 2))
    cfg.grpo.num_generations_per_prompt, cfg.grpo.num_prompts_per_step = 3, 2
    data.prepare(cfg)
    sizes = []

    async def run(request: web.Request) -> web.Response:
        raw = await request.read()
        sizes.append((json.loads(raw)["_minirl"]["group"], len(raw)))
        body = json.loads(raw)
        item = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x"}],
                "prompt_token_ids": [1, 2], "generation_token_ids": [3], "generation_log_probs": [-0.5]}
        return web.json_response({**body, "response": {"output": [item]}, "reward": 1.0})

    async def main():
        runner, url = await serve_run(run)
        manager = RolloutManager(cfg, [url], lambda e: None, vocab_size=100)
        try:
            return await manager.run_step(7, [prompt_row(cfg, 7, g) for g in range(2)])
        finally:
            await manager.session.close()
            await runner.cleanup()

    assert [o.status for o in asyncio.run(main())] == ["committed"] * 2 and len(sizes) == 6
    for group, size in sizes:
        assert size <= len(json.dumps(data.widest_request(prompt_row(cfg, 7, group), cfg), separators=(",", ":")))


def test_the_cli_refuses_an_unrunnable_row_with_exit_2_before_ray(base_cfg, tmp_path):
    rows = [doors_rows(base_cfg, 1)[0], changed(doors_rows(base_cfg, 1)[0], "responses_create_params.input", "hi")]
    path = write(tmp_path / "rows.jsonl", rows)
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen([sys.executable, "-m", "minirl.train", f"data.train_jsonl={path}",
                             f"run_dir={tmp_path / 'run'}"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # it went on to start Ray: end it and everything it started
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the run started instead of refusing the row")
    last = stderr.strip().splitlines()[-1]
    assert proc.returncode == 2, stderr
    assert last.startswith(f"ConfigError: data.train_jsonl: '{path}' line 2: minirl's agent server would refuse it")
    assert "responses_create_params.input must be a list of items, got str" in last
    assert not (tmp_path / "run").exists() and "Ray" not in stdout + stderr


# ------------------------------------------------------------------------ result fields (AA item 5)
def test_result_fields_of_a_dumped_row_are_left_out_with_one_line(base_cfg, tmp_path, capsys):
    row = doors_rows(base_cfg, 1)[0]
    dumped = {**row, "response": {"output": []}, "reward": 0.0, "evidence": {"calls": 1}, "mask_sample": True,
              "failure_kind": "agent_timeout", "failure_reason": "x",
              "failure": {"terminal": True, "failure_reason": "x"},
              "_ng_failure_class": "Timeout", "_ng_failure_terminal": True,
              "instance_config": {"mask_sample": True, "level": 3},
              "_rowidx": 4, "_minirl": {"step": 9, "group": 1, "rollout": 4, "attempt": 2}}
    cfg = own_pool_cfg(base_cfg, tmp_path, [row, dumped])
    cfg.grpo.val_num_prompts, cfg.grpo.val_num_generations = 2, 1
    cfg.data.validation_jsonl = cfg.data.train_jsonl
    data.prepare(cfg)
    printed = [line for line in capsys.readouterr().out.splitlines() if "result fields" in line]
    assert len(printed) == 2  # one line per file
    assert printed[0] == ("minirl: data.train_jsonl: left out the result fields of 1 of 2 rows of "
                          f"'{cfg.data.train_jsonl}' "
                          "(response, reward, evidence, mask_sample, failure_kind, failure_reason, failure, "
                          "_ng_failure_class, "
                          "_ng_failure_terminal, _rowidx, _minirl, instance_config.mask_sample): a row is sent as its "
                          "prompt, "
                          "never with a rollout's outcome")
    cfg.data.shuffle = False
    sent = prompt_row(cfg, 0, 1)
    assert sent == {**row, "instance_config": {"level": 3}}  # the prompt, and the environment's own fields
    assert all("_minirl" not in r and "reward" not in r for r in held_out_rows(cfg))


# ----------------------------------------------------------------------- summarizer threshold (AA 7)
@pytest.mark.parametrize("overrides,names", [
    (["agent.context_history.policy.summarize.threshold_tokens=[300,400]"],
     r"\[300, 400\] can draw a threshold above the context guard's "
     r"agent\.context_history\.guards\.max_total_tokens=256"),
    (["agent.context_history.policy.summarize.threshold_tokens=[1000000000,1000000000]",
      "agent.context_history.guards.max_total_tokens=null"],
     r"no prompt reaches: the model's max length policy\.generation\.vllm_cfg\.max_model_len=1024"),
    (["agent.context_history.policy.summarize.threshold_tokens=[200,1023]",
      "agent.context_history.guards.max_total_tokens=null"],
     r"pass thresholds up to 1022 only"),
])
def test_a_summarizing_threshold_that_can_never_fire_is_refused(overrides, names):
    with pytest.raises(ConfigError, match=r"^agent\.context_history\.policy\.summarize\.threshold_tokens: .*" + names):
        load_config(SUMMARIZE_YAML, overrides)


def test_a_reachable_summarizing_threshold_passes():
    load_config(SUMMARIZE_YAML, ["agent.context_history.policy.summarize.threshold_tokens=[210,256]"])  # at the guard
    load_config(SUMMARIZE_YAML, ["agent.context_history.policy.summarize.threshold_tokens=[200,1022]",
                                 # a 1023-token prompt passes 1022
                                 "agent.context_history.guards.max_total_tokens=null"])
    load_config(SUMMARIZE_YAML, ["agent.context_history.policy.summarize.threshold_tokens=[200,1030]",
                                 "agent.context_history.guards.max_total_tokens=null",
                                 "agent.context_history.guards.reserved_generation_tokens=8"])


# -------------------------------------------------------------------------------- data-file LOWs
def test_a_directory_or_a_fifo_is_named_as_what_it_is(tmp_path):
    fifo = tmp_path / "rows.fifo"
    os.mkfifo(fifo)
    for path, what in ((tmp_path, "is a directory"), (fifo, r"is a FIFO \(named pipe\)"),
                       (tmp_path / "none.jsonl", "no such file")):
        with pytest.raises(ConfigError, match=rf"^data\.train_jsonl: {re.escape(str(path))}: {what}"):
            load_config(overrides=[f"data.train_jsonl={path}"])


@pytest.mark.parametrize("value,shown", [("1.0", r'got "1\.0" \(a string\)'), (True, r"got true \(a boolean\)")])
def test_a_temperature_of_another_type_says_its_type(base_cfg, tmp_path, value, shown):
    row = changed(doors_rows(base_cfg, 1)[0], "responses_create_params.temperature", value)
    cfg = own_pool_cfg(base_cfg, tmp_path, [row])
    with pytest.raises(ConfigError, match=r"line 1: responses_create_params\.temperature must be a number, " + shown):
        data.prepare(cfg)


def test_a_bom_and_blank_lines_are_accepted(base_cfg, tmp_path):
    rows = doors_rows(base_cfg, 3)
    path = tmp_path / "train.jsonl"
    text = json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n" + json.dumps(rows[2]) + "\n\n \n"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    cfg = copy.deepcopy(base_cfg)
    cfg.data.train_jsonl, cfg.data.shuffle = str(path), False
    cfg.grpo.num_prompts_per_step = 3
    data.prepare(cfg)
    assert len(data.dataset_rows(cfg, "train_jsonl")) == 3 and [prompt_row(cfg, 0, g) for g in range(3)] == rows
    assert [prompt_key(cfg, 1, g) for g in range(3)] == [0, 1, 2]  # a row's index counts rows, not lines
    path.write_bytes(path.read_bytes() + b"{oops\n")
    with pytest.raises(ConfigError, match=r"Malformed JSON in '.*' at line 7: "):  # line numbers are the file's
        data.prepare(cfg)


def test_a_process_holds_no_parsed_rows_and_a_lookup_does_not_rebuild_the_order(base_cfg, tmp_path):
    """The review's 100k rows cost +631 MB a process and 20 ms a lookup (the epoch's permutation
    rebuilt each time); here 5000 rows: what prepare and the lookups leave held, and a lookup's peak."""
    line = json.dumps(doors_rows(base_cfg, 1)[0]) + "\n"
    path = tmp_path / "big.jsonl"
    path.write_text(line * 5000)
    cfg = copy.deepcopy(base_cfg)
    cfg.data.train_jsonl = str(path)
    cfg.agent.external_url = "http://127.0.0.1:9"  # the row checks are not what is measured
    data._CACHE.clear()
    tracemalloc.start()
    try:
        data.prepare(cfg)
        prompt_row(cfg, 0, 0)
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        for step in range(1, 20):
            prompt_row(cfg, step, 1)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert held < 1_000_000, held  # parsed, 5000 doors rows held ~30 MB
    assert peak < 100_000, peak  # rebuilding the order allocated ~200 kB a lookup


# ------------------------------------------------------------------ per-prompt threshold (X item 10)
def test_dataset_rows_draw_their_own_summarizing_threshold_and_a_group_shares_it():
    """Rows of one doors task with different inputs (a dataset's prompts) each draw a threshold: with
    two calls and prompts of one length, some summarize before the second and some do not (the initial
    context alone, before the first, is never summarized); every rollout and attempt of one row decides
    alike. A doors prompt still draws by its task seed."""
    from test_summarize import Scripted, enc, play, row_of, summarize_cfg

    base = row_of(summarize_cfg("agent.max_steps=2"))
    probe = Scripted()
    play(summarize_cfg("agent.max_steps=2", lo=1000, hi=1000), probe)  # no summary: the second call as it goes
    tokens = len(enc([text for summary, text in probe.prompts if not summary][1]))
    cfg = summarize_cfg("agent.max_steps=2", lo=tokens - 150, hi=tokens + 150)  # the second call's prompt: mid-range

    def variant(i: int, rollout: int = 0, attempt: int = 0, seed: int = 7) -> dict:
        row = row_of(cfg, rollout=rollout, attempt=attempt, seed=seed)
        items = copy.deepcopy(row["responses_create_params"]["input"])
        items[0]["content"] = f"{SYSTEM_PROMPT} v{i:03d}"  # one length for every variant
        row["responses_create_params"] = {**row["responses_create_params"], "input": items}
        return row

    summarized = [play(cfg, Scripted(), variant(i))["evidence"]["summaries"] for i in range(24)]
    assert 0 < sum(summarized) < len(summarized), summarized  # one threshold for all: all or none
    for i in range(4):
        group = {play(cfg, Scripted(), variant(i, r, a, seed=100 + r))["evidence"]["summaries"] for r in range(3)
                 for a in range(2)}
        assert group == {summarized[i]}
    ids = {start_episode(variant(0, r, a, seed=r)).prompt for r in range(3) for a in range(2)}
    assert len(ids) == 1 and len({start_episode(variant(i)).prompt for i in range(24)}) == 24
    assert start_episode(base).prompt == base["task"]["seed"]  # doors prompts: the draws they had
