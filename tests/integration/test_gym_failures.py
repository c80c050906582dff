"""Gym 0.7's failure facts drive minirl's lanes (minirl/gym/failures.py; issue 32): the mapping's
table, and the real rollout manager against a Gym-0.7-shaped agent on loopback (no Gym install, no
Ray, no vLLM). The shapes are Gym 0.7.0's, as its models write them (`EpisodeFailure.model_dump`
omits a None kind and stage; `judge_failsafe` writes `mask_sample` at the top level and under
`instance_config`); `make gym-check` checks them against the real package."""

from __future__ import annotations

import asyncio
import copy
import json

import numpy as np
from aiohttp import web

from helpers import serve_run
from minirl.controller import assemble
from minirl.data import prompt_row
from minirl.gym.failures import (
    FAILURE_KINDS,
    EpisodeFailed,
    EpisodeFailedTerminal,
    episode_failure,
    error_failure,
    failure_facts,
    kind_counts,
    known_kind,
    sample_mask,
)
from minirl.rollout.manager import RolloutManager
from minirl.wire import DATA, INFRA, GymTransportError, RolloutDataFailure, RolloutTimeout, classify, run_error_body

VOCAB = 512


def test_the_mapping_table():
    lost = {"failure_reason": "sandbox gone", "terminal": False, "failure_kind": "session_lost", "stage": "seed"}
    exc = episode_failure({"episode_id": {"id": "e"}, "task_id": {"id": "t"}, "failure": lost})
    assert isinstance(exc, EpisodeFailed) and classify(exc) == INFRA
    assert failure_facts(exc) == {"failure_kind": "session_lost", "stage": "seed", "terminal": False}
    exc = episode_failure({"episode_id": {}, "task_id": {},
                           "failure": {"failure_reason": "bad task", "terminal": True}})
    assert isinstance(exc, EpisodeFailedTerminal) and classify(exc) == DATA and "bad task" in str(exc)
    assert failure_facts(exc) == {"failure_kind": "agent_run_error", "stage": None, "terminal": True}
    stamped = episode_failure({"_ng_failure_class": "skipped", "_ng_failure_terminal": True,
                               "_ng_failure_message": "no"})
    # a class outside Gym's vocabulary (Stirrup's `skipped`) is the error type; the kind is a vocabulary one
    assert (classify(stamped) == DATA and stamped.terminal
            and failure_facts(stamped)["failure_kind"] == "agent_run_error")
    assert stamped.error_type == "skipped"
    assert classify(episode_failure({"_ng_failure_class": "timeout_exceeded"})) == INFRA  # unstamped: retried
    for plain in ({"response": {"output": []}, "reward": 0.0}, {"failure": "text"}, [1], None, {"failure": None}):
        assert episode_failure(plain) is None

    judge = {"reward": 0.0, "mask_sample": True, "failure_kind": "judge_failed", "failure_reason": "judge 503"}
    assert sample_mask(judge) == {"failure_kind": "judge_failed", "failure_reason": "judge 503"}
    assert sample_mask({"reward": 0.0, "instance_config": {"mask_sample": True}})["failure_kind"] == "verifier_error"
    # named, still measured
    assert sample_mask({"reward": 0.0, "mask_sample": False, "failure_kind": "judge_failed"}) is None
    assert sample_mask({"mask_sample": None}) is None and sample_mask(None) is None

    # error bodies: `terminal` decides where it is given, else the status does (as before)
    body = json.dumps({"error": "x", "failure_kind": "provider_oom_killed", "stage": "agent",
                       "terminal": False}).encode()
    exc = error_failure(400, body, "HTTP 400", None)
    assert (classify(exc) == INFRA
            and failure_facts(exc) == {"failure_kind": "provider_oom_killed", "stage": "agent", "terminal": False})
    exc = error_failure(500, b'{"error": "y", "terminal": true}', "HTTP 500", None)
    assert isinstance(exc, RolloutDataFailure) and exc.terminal is True
    assert classify(error_failure(500, b'"ValueError()"', "m", None)) == INFRA  # Gym's middleware body: a JSON string
    assert classify(error_failure(422, b"not json", "m", None)) == DATA
    assert failure_facts(error_failure(503, b"", "m", None))["failure_kind"] == "agent_request_failed"
    assert failure_facts(error_failure(500, b"", "m", None))["terminal"] is False

    # a kind for every failure, in Gym's vocabulary or namespaced
    transport = GymTransportError("failed in transport")
    transport.__cause__ = ConnectionResetError()
    for exc, kind in ((RolloutTimeout("t"), "agent_timeout"), (transport, "transport_peer_drop"),
                      (RolloutDataFailure("malformed /run result"), "minirl:bad_result"),
                      (TimeoutError(), "transport_timeout"),
                      (ConnectionRefusedError(), "transport_unreachable"), (KeyError("k"), "minirl:key_error")):
        assert failure_facts(exc)["failure_kind"] == kind and known_kind(kind), exc
    assert len(FAILURE_KINDS) == 22 and "session_lost" in FAILURE_KINDS and not known_kind("Bad Kind")

    assert run_error_body(ValueError("v")) == {"error": "ValueError('v')", "type": "ValueError",
                                               "failure_kind": "agent_run_error",
                                               "stage": "agent", "terminal": False}
    assert run_error_body(ValueError("row"), 400, stage="admission")["failure_kind"] == "minirl:bad_row"
    import minirl.agents.server as agent_server
    import minirl.gym.failures as gym_failures

    # one body, wire's, for both callers
    assert agent_server.run_error_body is run_error_body and not hasattr(gym_failures, "run_error_body")


def _item(base: int) -> dict:
    return {"type": "function_call", "name": "open_door", "arguments": "{}", "call_id": "c",
            "prompt_token_ids": [1, 2, 3], "generation_token_ids": [base, base + 1],
            "generation_log_probs": [-0.1, -0.2]}


def test_gym_facts_drive_the_rollout_managers_lanes(base_cfg):
    """A Gym-0.7-shaped agent server on loopback: group 0's rollout 0 comes back with its verifier's
    `mask_sample` (masked, out of the baseline, counted by kind, rollout 1 trains); group 1 answers
    a terminal EpisodeFailure (one send, never retried, skipped); group 2's rollout 0 answers a
    non-terminal one once (re-sent alone, INFRA, then committed); group 3 answers non-terminal ones
    on every send (retried within the INFRA budget, then dropped)."""
    sends: dict[tuple, int] = {}

    async def run_handler(request):
        row = await request.json()
        g, r = row["_minirl"]["group"], row["_minirl"]["rollout"]
        sends[g, r] = sends.get((g, r), 0) + 1
        ok = {**row, "response": {"output": [_item(10 + r)]}, "reward": float(r), "mask_sample": False}
        if g == 0 and r == 0:
            return web.json_response({**ok, "reward": 0.0, "mask_sample": True, "failure_kind": "session_lost",
                                      "failure_reason": "session expired before verify"})
        if g == 1:
            return web.json_response({"episode_id": {"id": "e"}, "task_id": {"id": "t"},
                                      "failure": {"failure_reason": "task has no answer key", "terminal": True}})
        if (g == 2 and r == 0 and sends[g, r] == 1) or g == 3:
            return web.json_response({"episode_id": {"id": "e"}, "task_id": {"id": "t"},
                                      "failure": {"failure_reason": "sandbox OOM", "terminal": False,
                                                  "failure_kind": "provider_oom_killed", "stage": "agent"}})
        return web.json_response(ok)

    cfg = copy.deepcopy(base_cfg)
    cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt = 4, 2
    rf = cfg.async_rl.rollout_failure
    rf.max_data_attempts_per_prompt, rf.max_skipped_prompts, rf.nemo_gym.max_row_attempts = 3, 1, 2
    rf.max_infra_attempts_per_prompt, rf.max_consecutive_dropped_prompts = 2, 1
    events: list[dict] = []

    async def go():
        runner, url = await serve_run(run_handler)
        m = RolloutManager(cfg, [url], events.append, VOCAB, sleep=lambda s: asyncio.sleep(0))
        try:
            return await m.run_step(0, [prompt_row(cfg, 0, g) for g in range(4)])
        finally:
            await m.session.close()
            await runner.cleanup()

    outcomes = asyncio.run(go())
    assert [o.status for o in outcomes] == ["committed", "skipped", "committed", "dropped"]
    masked = outcomes[0].rollouts[0]
    assert masked.mask_reason == "mask_sample" and masked.evidence["failure_kind"] == "session_lost"
    assert masked.evidence["failure_reason"] == "session expired before verify"
    assert sends[1, 0] == 1 and sends[1, 1] == 1, "a terminal EpisodeFailure is never retried"
    assert sends[2, 0] == 2 and sends[2, 1] == 1, "a non-terminal one is re-sent alone"
    assert sends[3, 0] == sends[3, 1] == 4, \
        "2 group attempts (max_infra_attempts_per_prompt) x 2 sends (max_row_attempts)"
    failures = [e for e in events if e["type"] == "failure"]
    assert {(e["group"], e["class"], e["decision"], e["failure_kind"], e["terminal"]) for e in failures} == {
        (1, "data", "skipped", "agent_run_error", True), (2, "infra", "retried", "provider_oom_killed", False),
        (3, "infra", "retried", "provider_oom_killed", False), (3, "infra", "dropped", "provider_oom_killed", False)}
    assert all(e["reason"] == "EpisodeFailedTerminal" for e in failures if e["group"] == 1)

    batch, stats = assemble(cfg, outcomes, pad_id=0)
    g0 = batch.group == 0
    assert (batch.sample_mask[g0 & (batch.rollout == 0)] == 0).all() \
        and (batch.sample_mask[g0 & (batch.rollout == 1)] == 1).all()
    # out of the baseline: the survivor is alone, so its advantage is 0 (with the masked reward 0.0 in it, it would be
    # 1.0)
    assert np.allclose(batch.advantages[g0], 0.0)
    assert stats["rollouts_masked"] == 1 and stats["rollouts_trained"] == 3
    kept = [r for o in outcomes if o.status == "committed" for r in o.rollouts.values()]
    assert kind_counts(outcomes, kept) == {"failures_by_kind": {"agent_run_error": 2, "provider_oom_killed": 1 + 8},
                                           "masked_by_kind": {"session_lost": 1}}
    assert [o.failures_by_kind
            for o in outcomes] == [{}, {"agent_run_error": 2}, {"provider_oom_killed": 1}, {"provider_oom_killed": 8}]
    assert kind_counts([], []) == {"failures_by_kind": {}, "masked_by_kind": {}}


def test_minirls_agent_server_speaks_gyms_failure_shapes(stack, base_cfg):
    """minirl's own agent pool: a refused row and an unknown agent carry Gym's facts (terminal: the
    answer will not change), a finished episode carries the verify fields, and the `session_lost`
    fault makes its verifier report `mask_sample`: one classifier reads both pools."""
    import aiohttp

    from minirl.config import FaultSpec
    from minirl.rollout.evidence import parse_rollout
    from minirl.wire import Coords

    cfg = copy.deepcopy(base_cfg)
    cfg.env.num_rooms = 1
    cfg.faults.inject = [FaultSpec(kind="session_lost", step=0, group=0, rollout=1)]

    async def go():
        async with stack(cfg) as s, aiohttp.ClientSession() as http:
            out = {}
            for name, body in (("bad", {"agent_ref": {"name": "simple_agent"}}),
                               ("unknown", {**prompt_row(cfg, 0, 0), "agent_ref": {"name": "nope"}}),
                               *((f"r{r}", {**prompt_row(cfg, 0, 0), "_rowidx": r,
                                            "_minirl": {"step": 0, "group": 0, "rollout": r, "attempt": 0}})
                                 for r in (0, 1))):
                async with http.post(s.agent_url + "/run", json=body) as resp:
                    out[name] = (resp.status, await resp.read())
            return out

    out = asyncio.run(go())
    for name, status, kind in (("bad", 400, "minirl:bad_row"), ("unknown", 404, "minirl:unknown_agent")):
        body = json.loads(out[name][1])
        assert (out[name][0] == status
                and (body["failure_kind"], body["stage"], body["terminal"]) == (kind, "admission", True))
        exc = error_failure(status, out[name][1], "m", body["type"])
        assert classify(exc) == DATA and exc.terminal is True
    plain, lost = (json.loads(out[f"r{r}"][1]) for r in (0, 1))
    assert out["r0"][0] == out["r1"][0] == 200
    assert (plain["mask_sample"], plain["failure_kind"], plain["failure_reason"]) == (False, None, None)
    assert (lost["mask_sample"] is True and lost["failure_kind"] == "session_lost"
            and "session_lost" in lost["failure_reason"])
    assert lost["reward"] == 0.0, "a lost session's score is no measurement: 0.0, as Gym's failsafes report it"
    kw = dict(vocab_size=10**6,
              max_len=cfg.policy.max_total_sequence_length, overlong_filtering=False)
    assert parse_rollout(plain, Coords(0, 0, 0, 0), **kw).mask_reason is None
    masked = parse_rollout(lost, Coords(0, 0, 1, 0), **kw)
    assert masked.mask_reason == "mask_sample" and masked.evidence["failure_kind"] == "session_lost" and masked.calls


def test_a_run_longer_than_aiohttps_default_timeout_is_waited_for(base_cfg, monkeypatch):
    """aiohttp's session default is a 300 s total timeout: a longer `/run` (rollout_timeout_s None, upstream's
    default, or above 300) raised a bare TimeoutError that escaped the failure policy and ended the run, with
    no failure event. The sessions of the rollout manager and of validation set no total timeout: a `/run` is
    bounded by rollout_timeout_s alone. aiohttp's default is scaled to 1 s here, and the `/run` takes 2 s."""
    import aiohttp.client

    from minirl.rollout.manager import run_session

    monkeypatch.setattr(aiohttp.client, "DEFAULT_TIMEOUT", aiohttp.ClientTimeout(total=1, sock_connect=30))

    async def run_handler(request):
        row = await request.json()
        await asyncio.sleep(2)
        return web.json_response({**row, "response": {"output": [_item(10)]}, "reward": 1.0})

    cfg = copy.deepcopy(base_cfg)
    cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt = 1, 2
    cfg.async_rl.rollout_failure.nemo_gym.rollout_timeout_s = None
    events: list[dict] = []

    async def go():
        runner, url = await serve_run(run_handler)
        m = RolloutManager(cfg, [url], events.append, VOCAB, sleep=lambda s: asyncio.sleep(0))
        try:
            async with run_session() as validation:
                assert validation.timeout.total is None
            m.open()
            return await m.run_group(0, 0, prompt_row(cfg, 0, 0))
        finally:
            await m.session.close()
            await runner.cleanup()

    out = asyncio.run(go())
    assert out.status == "committed" and len(out.rollouts) == 2 and events == []


def test_a_group_whose_rows_fail_data_and_infra_meets_the_same_fate_whatever_their_order(base_cfg):
    """One row answers a 400 (DATA, non-terminal), its sibling a 500 (INFRA). Before, the failures were
    sorted by `will_not_pass` alone and the first row's class decided: DATA on row 0 skipped the group
    after 2 attempts, DATA on row 1 retried it as INFRA with backoff and dropped it after 5. A DATA failure
    now decides over an INFRA one, whichever row had it."""
    cfg = copy.deepcopy(base_cfg)
    cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt = 1, 2
    rf = cfg.async_rl.rollout_failure
    rf.max_identical_failures, rf.max_skipped_prompts, rf.nemo_gym.max_row_attempts = 0, 1, 1

    def fate(data_row: int):
        events: list[dict] = []

        async def run_handler(request):
            row = await request.json()
            if row["_minirl"]["rollout"] == data_row:
                return web.json_response({"error": "bad row"}, status=400)
            return web.json_response({"error": "agent crashed"}, status=500)

        async def go():
            runner, url = await serve_run(run_handler)
            m = RolloutManager(cfg, [url], events.append, VOCAB, sleep=lambda s: asyncio.sleep(0))
            m.open()
            try:
                out = await m.run_group(0, 0, prompt_row(cfg, 0, 0))
            finally:
                await m.session.close()
                await runner.cleanup()
            return out.status, out.group_attempts, sorted({(e["class"], e["decision"]) for e in events
                                                           if e["type"] == "failure"})

        return asyncio.run(go())

    decisions = [("data", "retried"), ("data", "skipped"), ("infra", "retried"), ("infra", "skipped")]
    assert fate(0) == fate(1) == ("skipped", rf.max_data_attempts_per_prompt, decisions)
