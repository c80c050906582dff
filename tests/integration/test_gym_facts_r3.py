"""How minirl reads Gym's failure facts in a `/run` result, round 3 (issues 49 AA-3/5, 50 X-2..4, 51 Y-7):
a fact of the wrong type is a DATA failure naming the field; Gym 0.7's `judge_failsafe` result is a
masked rollout that trains on; a terminal row decides its group over a sibling's INFRA failure;
`_ng_failure_class: null` is success; minirl's own agent echoes no result fact from its request; a
failure's kind is bounded and from Gym's vocabulary, its text one level escaped with control bytes
written out, and each row's event carries its own class and a `terminal` that is never true on a retry.

The real rollout manager against Gym-0.7-shaped agent servers on loopback (tests/helpers.serve_run),
and minirl's own agent server over the real engine (the `stack` fixture)."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
from aiohttp import web

from helpers import serve_run
from minirl.data import prompt_row
from minirl.gym.failures import KIND_LIMIT, episode_failure, failure_facts, known_kind, sample_mask
from minirl.rollout.evidence import parse_rollout
from minirl.rollout.manager import RolloutManager
from minirl.wire import INFRA, Coords, RolloutDataFailure, RolloutRedispatchExhausted, classify, parse_error_body

VOCAB = 512
KW = dict(vocab_size=VOCAB, max_len=4096, overlong_filtering=False)


def _item(base: int) -> dict:
    return {"type": "function_call", "name": "open_door", "arguments": "{}", "call_id": "c",
            "prompt_token_ids": [1, 2, 3], "generation_token_ids": [base, base + 1],
            "generation_log_probs": [-0.1, -0.2]}


def _ok(row: dict, r: int) -> dict:
    return {**row, "response": {"output": [_item(10 + r)]}, "reward": float(r), "mask_sample": False}


def _run(cfg, handler, groups: int, events: list) -> list:
    """One step of `groups` groups through the real RolloutManager against `handler` on loopback."""

    async def go():
        runner, url = await serve_run(handler)
        m = RolloutManager(cfg, [url], events.append, VOCAB, sleep=lambda s: asyncio.sleep(0))
        try:
            return await m.run_step(0, [prompt_row(cfg, 0, g) for g in range(groups)])
        finally:
            await m.session.close()
            await runner.cleanup()

    return asyncio.run(go())


def _cfg(base_cfg, G: int = 2):
    cfg = copy.deepcopy(base_cfg)
    cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt = 1, G
    return cfg


# ------------------------------------------------------------------------ AA-3: facts of the wrong type
WRONG = [({"mask_sample": "true"}, "mask_sample"), ({"mask_sample": 1}, "mask_sample"),
         ({"instance_config": {"mask_sample": "true"}}, "instance_config.mask_sample"),
         ({"failure": {"failure_reason": "x", "terminal": "true"}}, "failure.terminal"),
         ({"failure": {"failure_reason": "x", "terminal": 1}}, "failure.terminal"),
         ({"_ng_failure_class": "Timeout", "_ng_failure_terminal": "true"}, "_ng_failure_terminal"),
         ({"_ng_failure_class": 5}, "_ng_failure_class")]


@pytest.mark.parametrize("facts,field", WRONG, ids=[f"{f}={json.dumps(v)}" for v, f in WRONG])
def test_a_fact_of_the_wrong_type_is_a_data_failure_naming_the_field(facts, field):
    """Never coerced (Gym's pydantic would read "true" and 1 as true) and never ignored (the old code
    trained such a rollout as a measurement): a malformed result, DATA, naming the field."""
    result = {**_ok({}, 0), **facts}
    with pytest.raises(RolloutDataFailure) as err:
        parse_rollout(result, Coords(0, 0, 0, 0), **KW)
    assert f"malformed /run result: {field} must be a boolean" in str(err.value) or \
        f"malformed /run result: {field} must be a string" in str(err.value)
    assert type(err.value) is RolloutDataFailure and failure_facts(err.value)["terminal"] is False


def test_a_wrong_typed_terminal_stamp_is_not_sent_fifteen_times(base_cfg):
    """`_ng_failure_terminal: "true"` was read as non-terminal and re-sent within the INFRA budget
    (15 sends); now a malformed result: DATA, retried without backoff within its budget, then skipped."""
    sends: dict = {}

    async def handler(request):
        row = await request.json()
        r = row["_minirl"]["rollout"]
        sends[r] = sends.get(r, 0) + 1
        return web.json_response({**_ok(row, r), "_ng_failure_class": "Timeout",
                                  "_ng_failure_terminal": "true"} if r == 0
                                 else _ok(row, r))

    cfg = _cfg(base_cfg)
    rf = cfg.async_rl.rollout_failure
    rf.max_data_attempts_per_prompt, rf.max_infra_attempts_per_prompt, rf.nemo_gym.max_row_attempts = 2, 3, 5
    events: list = []
    [out] = _run(cfg, handler, 1, events)
    assert out.status == "skipped" and sends[0] == 2 and "_ng_failure_terminal must be a boolean" in out.reason
    assert {(e["class"], e["decision"]) for e in events if e["type"] == "failure" and e["rollout"] == 0} == {
        ("data", "retried"), ("data", "skipped")}


# ------------------------------------------------------------------------ X-2: judge_failsafe
def judge_failsafe(row: dict, r: int, error: str = "judge endpoint answered 503") -> dict:
    """What Gym 0.7's `nemo_gym/judge.py::judge_failsafe` answers for a failed judge call: the verify
    request's dump (the row and its response) with these keys merged over it."""
    data = _ok(row, r)
    instance_config = data.get("instance_config")
    return data | {"reward": 0.0, "mask_sample": True, "failure_kind": "judge_failed", "failure_reason": error,
                   "instance_config": {**(instance_config if isinstance(instance_config, dict) else {}),
                                       "mask_sample": True},
                   "_ng_failure_class": "judge_failed", "_ng_failure_judge_error": error}


@pytest.mark.parametrize("preset", ["default", "upstream"])
def test_judge_failsafe_is_a_masked_rollout_that_trains_on(base_cfg, preset):
    """`mask_sample` wins over a non-terminal `_ng_failure_class` (as NeMo-RL reads it): one send, the
    group commits with that rollout masked (reason `mask_sample`, kind `judge_failed`), no failure
    event. The old code made it INFRA: re-sent, then dropped (upstream preset: the run ended)."""
    from minirl.config import REPO_ROOT, load_config

    sends: dict = {}

    async def handler(request):
        row = await request.json()
        r = row["_minirl"]["rollout"]
        sends[r] = sends.get(r, 0) + 1
        return web.json_response(judge_failsafe(row, r) if r == 0 else _ok(row, r))

    cfg = _cfg(base_cfg if preset == "default" else load_config(str(REPO_ROOT / "configs/upstream_pr4124.yaml")))
    events: list = []
    [out] = _run(cfg, handler, 1, events)
    assert out.status == "committed" and sends == {0: 1, 1: 1}
    masked = out.rollouts[0]
    assert masked.mask_reason == "mask_sample" and masked.sample_mask == 0 and out.rollouts[1].sample_mask == 1
    assert (masked.evidence["failure_kind"] == "judge_failed"
            and masked.evidence["failure_reason"] == "judge endpoint answered 503")
    assert not [e for e in events if e["type"] == "failure"]


def test_which_fact_wins():
    """The gym.md table's order: a terminal stamp beats `mask_sample`; `mask_sample` beats a
    non-terminal `_ng_failure_class`; an EpisodeFailure object decides as it says."""
    judge = judge_failsafe({}, 0)
    assert episode_failure(judge) is None and sample_mask(judge)["failure_kind"] == "judge_failed"
    terminal = episode_failure({**judge, "_ng_failure_terminal": True})
    assert (terminal is not None and terminal.terminal is True
            and failure_facts(terminal)["failure_kind"] == "judge_failed")
    legacy_only = {**_ok({}, 0), "instance_config": {"mask_sample": True}, "_ng_failure_class": "judge_failed"}
    assert episode_failure(legacy_only) is None
    assert parse_rollout(legacy_only, Coords(0, 0, 0, 0), **KW).mask_reason == "mask_sample"
    assert classify(episode_failure({"_ng_failure_class": "judge_failed"})) == INFRA  # no mask: still a failure


# ------------------------------------------------------------------------ X-4: `_ng_failure_class: null`
def test_a_null_failure_class_is_success():
    """Gym's collector: `result.get("_ng_failure_class") is None` is success."""
    for stamps in ({"_ng_failure_class": None}, {"_ng_failure_class": None, "_ng_failure_terminal": False},
                   {"_ng_failure_class": None, "_ng_failure_terminal": None, "_ng_failure_message": None}):
        result = {**_ok({}, 1), **stamps}
        assert episode_failure(result) is None
        rollout = parse_rollout(result, Coords(0, 0, 1, 0), **KW)
        assert rollout.reward == 1.0 and rollout.mask_reason is None
    # a terminal stamp still fails, class or not (Gym stamps both together)
    assert episode_failure({"_ng_failure_class": None, "_ng_failure_terminal": True}).terminal is True


# ------------------------------------------------------------------------ X-3: a terminal row beside an INFRA row
@pytest.mark.parametrize("infra", ["503", "timeout"])
def test_a_terminal_row_decides_its_group_over_an_infra_sibling(base_cfg, infra):
    """Row 0 fails INFRA (a 503 on every send, or a hang past the group deadline); row 1 reports a
    terminal EpisodeFailure. Gym never re-attempts a terminal row: row 1 is sent once and the group
    is skipped (DATA), each row's events with its own class. The old code retried the group as
    INFRA (row 1 sent once per group attempt, called infra/retried) and ended it `dropped`."""
    sends: dict = {}

    async def handler(request):
        row = await request.json()
        r = row["_minirl"]["rollout"]
        sends[r] = sends.get(r, 0) + 1
        if r == 1:
            return web.json_response({"episode_id": {"id": "e"}, "task_id": {"id": "t"},
                                      "failure": {"failure_reason": "no answer key", "terminal": True,
                                                  "failure_kind": "verifier_error", "stage": "admission"}})
        if infra == "timeout":  # past the deadline by a margin a loaded machine keeps (the deadline first)
            await asyncio.sleep(4)
        return web.json_response({"error": "upstream unavailable"}, status=503)

    cfg = _cfg(base_cfg)
    rf = cfg.async_rl.rollout_failure
    rf.max_infra_attempts_per_prompt, rf.nemo_gym.max_row_attempts, rf.max_consecutive_dropped_prompts = 5, 2, 0
    # row 1's terminal answer must come back before the deadline: loopback, but on a loaded machine not within 0.5 s
    rf.nemo_gym.rollout_timeout_s = 1.5 if infra == "timeout" else 120.0
    events: list = []
    [out] = _run(cfg, handler, 1, events)
    assert out.status == "skipped" and out.group_attempts == 1 and sends[1] == 1, (out.status, sends)
    assert "EpisodeFailedTerminal" in out.reason
    group_level = {(e["rollout"], e["class"], e["decision"], e["terminal"]) for e in events
                   if e["type"] == "failure" and "scope" not in e}
    assert group_level == {(0, "infra", "skipped", False), (1, "data", "skipped", True)}
    assert not [e for e in events if e["type"] == "drop"]


# ------------------------------------------------------------------------ Y-7: each row's own class
def test_a_siblings_deterministic_failure_logs_each_rows_own_class(base_cfg):
    """Row 0 answers the same 500 on every send (deterministic at max_identical_failures), row 1 a
    gateway 503: the deterministic failure skips the group, and row 1's event says infra (the old
    code logged it data/skipped)."""

    async def handler(request):
        row = await request.json()
        if row["_minirl"]["rollout"] == 0:
            return web.json_response({"error": "ValueError('the same bug')", "type": "ValueError"}, status=500)
        return web.json_response({"error": "gateway"}, status=503)

    cfg = _cfg(base_cfg)
    rf = cfg.async_rl.rollout_failure
    rf.max_identical_failures, rf.nemo_gym.max_row_attempts = 2, 2
    events: list = []
    [out] = _run(cfg, handler, 1, events)
    assert out.status == "skipped" and "DeterministicFailure" in out.reason
    group_level = {(e["rollout"], e["reason"], e["class"], e["decision"], e["terminal"]) for e in events
                   if e["type"] == "failure" and "scope" not in e}
    assert group_level == {(0, "DeterministicFailure", "data", "skipped", True),
                           (1, "GymTransportError", "infra", "skipped", False)}
    # the repeated answer's own kind: an agent's 500 (it was filed `minirl:bad_result`, a result that does not parse)
    assert {e["failure_kind"] for e in events if e["type"] == "failure" and e["rollout"] == 0} == {"agent_run_error"}
    assert out.failures_by_kind == {"agent_run_error": 2, "agent_request_failed": 2}, out.failures_by_kind


# ------------------------------------------------------------------------ AA LOW: `terminal` on retries
def test_terminal_is_never_true_on_a_retried_failure(base_cfg):
    """A result that does not parse is DATA and retried: its events say `terminal: false` (the old
    code said true, read from the class, on every retry)."""

    async def handler(request):
        row = await request.json()
        r = row["_minirl"]["rollout"]
        return web.json_response({**_ok(row, r), "reward": "high"} if r == 0 else _ok(row, r))

    cfg = _cfg(base_cfg)
    cfg.async_rl.rollout_failure.max_data_attempts_per_prompt = 3
    events: list = []
    [out] = _run(cfg, handler, 1, events)
    failures = [e for e in events if e["type"] == "failure"]
    assert out.status == "skipped" and [e["decision"] for e in failures] == ["retried", "retried", "skipped"]
    assert all(e["terminal"] is False for e in failures)


# ------------------------------------------------------------------------ AA LOW: a kind's size
def test_a_huge_failure_kind_is_cut_with_a_marker(base_cfg):
    """A 1 MB `failure_kind` (and `_ng_failure_class`) made events.jsonl 15.7 MB from one row; now each
    is cut at KIND_LIMIT characters with a marker, and the whole step's events stay small."""
    huge = "k" * 1_000_000

    async def handler(request):
        row = await request.json()
        r = row["_minirl"]["rollout"]
        if r == 0:
            failure = {"failure_reason": "x" * 5000, "terminal": False, "failure_kind": huge}
            return web.json_response({"episode_id": {}, "task_id": {}, "failure": failure})
        return web.json_response({"_ng_failure_class": huge, "_ng_failure_message": "y" * 5000})

    cfg = _cfg(base_cfg)
    rf = cfg.async_rl.rollout_failure
    rf.max_infra_attempts_per_prompt, rf.nemo_gym.max_row_attempts, rf.max_consecutive_dropped_prompts = 3, 5, 4
    events: list = []
    [out] = _run(cfg, handler, 1, events)
    failures = [e for e in events if e["type"] == "failure"]
    assert out.status == "dropped" and len(failures) == 2 * 3 * 5
    kinds = {e["failure_kind"] for e in failures}
    assert kinds == {f"{'k' * KIND_LIMIT}...(cut from 1000000 chars)", "agent_run_error"}
    assert max(len(e["error_type"] or "") for e in failures) < 100
    assert len(json.dumps(events)) < 300_000, len(json.dumps(events))


# ------------------------------------------------------------------------ AA LOW, Y-7: the error's text
def test_an_agents_error_text_is_one_level_escaped_and_its_control_bytes_written_out(base_cfg):
    """Gym's error middleware answers `repr(e)` as a JSON string: minirl reads it once (the old code
    kept its JSON escaping, a second level of backslashes), and ESC, BEL, CR from the body reach
    neither the events nor the run-ending line raw."""
    exc = ValueError('the judge said "no"\x1b[31m red\x07\r')
    body = json.dumps(repr(exc)).encode()
    text, kind = parse_error_body(body)
    assert kind is None and text == repr(exc)  # read once: repr's own escapes, no JSON's
    raw = parse_error_body(json.dumps({"error": "bad \x1b[2J\x1b[H screen\x00", "type": "T"}).encode())[0]
    assert raw == "bad \\x1b[2J\\x1b[H screen\\x00" and "\x1b" not in raw

    async def handler(request):
        return web.Response(text='"ValueError(\'he said \\\\"hi\\\\"\')" \x1b[31mboom\x07', status=500)

    cfg = _cfg(base_cfg)
    rf = cfg.async_rl.rollout_failure
    rf.max_infra_attempts_per_prompt, rf.nemo_gym.max_row_attempts, rf.max_consecutive_dropped_prompts = 1, 1, 0
    events: list = []
    with pytest.raises(RolloutRedispatchExhausted) as err:
        _run(cfg, handler, 1, events)
    last_line = f"{type(err.value).__name__}: {err.value}"
    assert "\x1b" not in last_line and "\x07" not in last_line and "\\x1b[31mboom\\x07" in last_line
    assert all("\x1b" not in e.get("error", "") for e in events if e["type"] == "failure")

    async def gym_handler(request):
        return web.Response(body=body, status=500, content_type="application/json")

    events = []
    with pytest.raises(RolloutRedispatchExhausted):
        _run(cfg, gym_handler, 1, events)
    [error] = {e["error"] for e in events if e["type"] == "failure"}
    assert error == f"NeMo-Gym /run failed with HTTP 500: {repr(exc)}"  # one level: repr's own escapes, no JSON's


# ------------------------------------------------------------------------ Y-7: the legacy Environment Server's class
def test_an_environment_server_failure_gets_a_kind_from_gyms_vocabulary():
    """Gym 0.7's `single_agent_turn_legacy` answers a failed episode with `_ng_failure_class:
    environment_server_failed` (a collector class, not a kind) and no `failure_kind`: the kind is
    `agent_run_error`, the class stays the error type."""
    legacy = {"_ng_failure_class": "environment_server_failed", "_ng_failure_terminal": False,
              "_ng_failure_message": "the sandbox provider did not answer", "_ng_failure_stage": "seed",
              "agent_ref": {"name": "simple_agent"}}
    exc = episode_failure(legacy)
    facts = failure_facts(exc)
    assert classify(exc) == INFRA and facts == {"failure_kind": "agent_run_error", "stage": "seed", "terminal": False}
    assert known_kind(facts["failure_kind"]) and exc.error_type == "environment_server_failed"
    assert failure_facts(episode_failure({"_ng_failure_class": "timeout_exceeded"}))["failure_kind"] == "agent_timeout"
    assert failure_facts(episode_failure({"_ng_failure_class": "gdpval:reference_missing"}))["failure_kind"] == \
        "gdpval:reference_missing"


# ------------------------------------------------------------------------ AA-5: minirl's agent echoes no result fact
def test_minirls_agent_does_not_echo_result_facts_from_its_request(stack, base_cfg):
    """A row copied from a rollout dump carries `_ng_failure_*`, `failure`, `mask_sample` and
    `instance_config.mask_sample`: minirl's own agent server runs it and answers a result without
    them, which parses as a plain, trained rollout (the old code echoed them: step 0 failed with
    `EpisodeFailedTerminal … _ng_failure_class='Timeout'`)."""
    import aiohttp

    cfg = copy.deepcopy(base_cfg)
    cfg.env.num_rooms = 1
    dumped = {"_ng_failure_class": "Timeout", "_ng_failure_terminal": True, "_ng_failure_message": "old run's timeout",
              "failure": {"failure_reason": "old", "terminal": True}, "mask_sample": True,
              "failure_kind": "judge_failed",
              "failure_reason": "old judge", "instance_config": {"mask_sample": True, "keep": 1}}

    async def go():
        async with stack(cfg) as s, aiohttp.ClientSession() as http:
            row = {**prompt_row(cfg, 0, 0), **dumped, "_rowidx": 0,
                   "_minirl": {"step": 0, "group": 0, "rollout": 0, "attempt": 0}}
            async with http.post(s.agent_url + "/run", json=row) as resp:
                return resp.status, await resp.json()

    status, result = asyncio.run(go())
    assert status == 200
    assert not [k for k in result if k.startswith("_ng_failure_") or k == "failure"], sorted(result)
    assert (result["mask_sample"], result["failure_kind"], result["failure_reason"]) == (False, None, None)
    assert result["instance_config"] == {"keep": 1}
    rollout = parse_rollout(result, Coords(0, 0, 0, 0), vocab_size=10**6, max_len=cfg.policy.max_total_sequence_length,
                            overlong_filtering=False)
    assert rollout.mask_reason is None and rollout.calls
