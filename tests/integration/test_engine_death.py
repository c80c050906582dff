"""An engine whose thread fails outside a step dies loudly: a real vLLM engine (its own, in a child
process, since this one dies) behind minirl's model server, the failure injected with the seeded
`engine_loop_crash` fault. Before, the exception ended the engine thread alone: `/health` stayed 200
and every request in flight, queued, held behind a draining update or sent later waited for good."""

from __future__ import annotations

from helpers import child_result

LOOP_CRASH_CHILD = """
import asyncio, json, sys, time
sys.path[:0] = ["tests"]  # conftest.py
import aiohttp
from conftest import Stack
from safetensors.numpy import load_file
from transformers import AutoTokenizer
from vllm import SamplingParams
from minirl.config import load_config
from minirl.generation.engine import VllmEngine, configure_cpu_env
from minirl.wire import ROLLOUT_HEADER

cfg = load_config(None, ["faults.inject=[{kind: engine_hang, step: 0, group: 0, rollout: 0, attempt: 0},"
                         " {kind: engine_loop_crash, step: 1, group: 0, rollout: 0, attempt: 0}]"])
configure_cpu_env(1, 2)
engine = VllmEngine(cfg.policy.model_name, max_model_len=cfg.policy.generation.vllm_cfg.max_model_len, seed=0)
tokenizer = AutoTokenizer.from_pretrained(cfg.policy.model_name)
weights = list(load_file(f"{cfg.policy.model_name}/model.safetensors").items())

async def chat(http, url, key, **extra):
    body = {"messages": [{"role": "user", "content": "open door 3"}], "max_completion_tokens": 8, "seed": 1, **extra}
    try:
        async with http.post(url + "/v1/chat/completions", json=body, headers={ROLLOUT_HEADER: key} if key else {},
                             timeout=aiohttp.ClientTimeout(total=30)) as r:
            return r.status, (await r.json())["error"]["message"] if r.status != 200 else "ok"
    except asyncio.TimeoutError:
        return 0, "no answer within 30 s"

def outcome(fut):
    try:
        fut.result(timeout=5)
        return "ok"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"

async def until(cond):
    while not cond():
        await asyncio.sleep(0.01)

async def go():
    async with Stack(cfg, engine, tokenizer) as s, aiohttp.ClientSession() as http:
        # engine_hang: the step of this request (4 tokens at least) waits; what comes next queues behind it
        first = asyncio.ensure_future(chat(http, s.model_url, "s0.g0.r0.a0.c0", min_tokens=4))
        await until(lambda: engine._step_t0 is not None)
        update = engine.update_weights(weights, 1, drain=True)  # held until the first request finishes
        direct = engine.generate([1, 2, 3], SamplingParams(max_tokens=4))  # deferred behind the update
        crash = asyncio.ensure_future(chat(http, s.model_url, "s1.g0.r0.a0.c0"))  # engine_loop_crash, deferred
        await until(lambda: engine._inbox.qsize() == 3)
        engine.unhang()  # (as a new run's reset does): the loop takes them all, then fails resolving the first
        answers = await asyncio.gather(first, crash)
        async with http.get(s.model_url + "/health") as r:
            health = r.status, (await r.json()).get("error")
        t0 = time.monotonic()
        later_direct = engine.generate([1, 2, 3], SamplingParams(max_tokens=4))
        later_jobs = [engine.run(lambda llm: None), engine.update_weights(weights, 2)]
        return {"later_jobs": [(f.done(), outcome(f)) for f in later_jobs],
                "answers": answers, "update": outcome(update), "direct": outcome(direct), "health": health,
                "later_done_at_once": later_direct.done(), "later_direct": outcome(later_direct),
                "later": await chat(http, s.model_url, None), "later_s": time.monotonic() - t0,
                "dead": repr(engine.dead), "steps": engine.steps}

json.dump(asyncio.run(go()), open(sys.argv[1], "w"))
"""


def test_an_engine_loop_failure_outside_a_step_kills_the_engine_loudly(tmp_path):
    """`engine_loop_crash` makes the engine thread raise while it resolves a finished request: the
    request in flight, the drain update held for it, the requests deferred behind that update (the one
    that fired the fault among them) all fail at once naming the cause; `/health` is 503 naming it;
    a later request, job or weight update is refused at once."""
    out = child_result(LOOP_CRASH_CHILD, tmp_path, timeout=300, env={"VLLM_LOGGING_LEVEL": "ERROR"})
    cause = "vLLM engine loop failed outside a step: RuntimeError('injected engine_loop_crash')"
    assert cause in out["dead"], out
    assert out["steps"] >= 4, out  # the first request ran on (min_tokens): the loop took the queue into held/deferred
    for status, message in out["answers"]:  # the request in flight, and the one deferred that fired the fault
        assert status == 500 and "vLLM engine is dead" in message and cause in message, out
    for failed in (out["update"], out["direct"], out["later_direct"]):
        assert failed.startswith("RuntimeError: vLLM engine is dead") and cause in failed, out
    assert out["health"][0] == 503 and cause in out["health"][1], out
    assert out["later_done_at_once"] and out["later"][0] == 500 and cause in out["later"][1], out
    for done_at_once, failed in out["later_jobs"]:  # a job for the engine thread, and a weight update, sent later
        assert done_at_once and failed.startswith("RuntimeError: vLLM engine is dead") and cause in failed, out
