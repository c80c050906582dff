"""The generation side, hardening round 3 (issues 49 and 51), through real parts: the session's vLLM
engine behind minirl's model server, and the shared cluster's detached generation workers that CLI runs
attach to.

- a run whose `policy.model_name` is not the attached workers' model is a ConfigError naming both,
  before any publish, and weights of another model are refused before vLLM's reload: the shared worker
  serves its last good weights on (issue 49 HIGH 2);
- an external agent that sends one seed on every call of a rollout (Gym's `vllm_model`) gets a
  distinct, reproducible seed per call, recorded in the call log and the ledger; minirl's own agents'
  seeds are used as sent (issue 51 item 1);
- the server answers to `policy.model_name` as the user wrote it and to its basename, and its 404
  names the served path (issue 51 item 4, issue 49 LOW).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from helpers import connect, last_line, run_cli, serve_run_in_thread
from test_bad_input import CHAT, GOOD_CHAT, post

from minirl.config import REPO_ROOT

SUMMARIZE = REPO_ROOT / "models" / "tiny-summarize"


def summarize_weights() -> list:
    from safetensors.numpy import load_file

    return list(load_file(str(SUMMARIZE / "model.safetensors")).items())


def served_ok(url: str) -> tuple[int, dict, int]:
    """(/health status, its body, a chat request's status) of the model server at `url`."""
    async def go():
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/health") as r:
                health = (r.status, await r.json())
            status, _ = await post(http, url + CHAT, {**GOOD_CHAT, "seed": 1})
            return (*health, status)

    return asyncio.run(go())


# ------------------------------------------------------------------ issue 49 HIGH 2: another model
def test_check_weights_names_the_tensor_that_does_not_fit(base_cfg):
    from minirl.generation.engine import check_weights, checkpoint_shapes

    served = base_cfg.policy.model_name
    expected = checkpoint_shapes(served)
    shapes, optional = expected
    assert shapes["lm_head.weight"] == shapes["model.embed_tokens.weight"] == (512, 128)  # tied: vLLM skips it
    assert optional == {"lm_head.weight"}
    good = [(k, np.zeros(v, np.float32)) for k, v in shapes.items()]
    check_weights([kv for kv in good if kv[0] != "lm_head.weight"], expected, served)  # tied: may be left out
    check_weights(good, expected, served)  # the policy's own state_dict (lm_head included) fits
    with pytest.raises(ValueError, match=r"'model.embed_tokens.weight' has shape \(576, 128\), but the served model "
                                         r".*tiny-doors has \(512, 128\)"):
        check_weights(summarize_weights(), expected, served)
    with pytest.raises(ValueError, match="'model.extra.weight' is not a tensor of the served model"):
        check_weights(good + [("model.extra.weight", np.zeros(3, np.float32))], expected, served)
    with pytest.raises(ValueError, match="'model.norm.weight' is int64, not floating point"):
        check_weights([(k, np.zeros(v, np.int64 if k == "model.norm.weight" else np.float32))
                       for k, v in shapes.items()], expected, served)
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\) of the served model .*'model.norm.weight'"):
        check_weights([kv for kv in good if kv[0] != "model.norm.weight"], expected, served)


def test_an_untied_models_update_must_carry_its_lm_head(tmp_path):
    """Only a tied lm_head (the embedding's own tensor) may be left out of an update: an untied model's
    is a tensor of its checkpoint, and an update without it would leave the engine's head unchanged."""
    import json

    from safetensors.numpy import save_file

    from minirl.generation.engine import check_weights, checkpoint_shapes

    tensors = {"model.embed_tokens.weight": np.zeros((8, 4), np.float32), "lm_head.weight": np.ones((8, 4), np.float32)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    expected = checkpoint_shapes(str(tmp_path))
    assert expected == ({"model.embed_tokens.weight": (8, 4), "lm_head.weight": (8, 4)}, set())
    check_weights(list(tensors.items()), expected, str(tmp_path))
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\) of the served model .*'lm_head.weight'"):
        check_weights([("model.embed_tokens.weight", tensors["model.embed_tokens.weight"])], expected, str(tmp_path))


def test_another_models_weights_are_refused_and_the_shared_worker_serves_on(shared_engine):
    """Before: vLLM's loader asserted midway, the worker held meta tensors while /health said ok, and
    the next chat request killed its engine. Now the publish is refused before the reload starts."""
    ray = connect(shared_engine)
    try:
        worker = ray.get_actor("shared-gen-1")  # runs attach to shared-gen-0; this one serves the fleet-health test
        url = ray.get(worker.start.remote())
        _, before, _ = served_ok(url)
        with pytest.raises(Exception) as refused:
            ray.get(worker.update_weights.remote(summarize_weights(), 10_000))
        message = str(refused.value)
        assert "ValueError: weights of version 10000 refused, the engine keeps serving version" in message, \
            message[-800:]
        assert "'model.embed_tokens.weight' has shape (576, 128)" in message and "has (512, 128)" in message, \
            message[-800:]
        assert served_ok(url) == (200, before, 200)  # the same version, healthy, and it answers
        assert ray.get(worker.weights_finite.remote())
    finally:
        ray.shutdown()


def test_an_update_failing_inside_vllms_reload_marks_the_engine_dead_and_the_next_reset_restarts_it(
    shared_engine, base_cfg):
    """The fallback behind the check: weights that pass it but fail inside vLLM's reload (here a float
    dtype torch cannot hold) leave no engine serving from half-loaded layers: /health is 503 and a chat
    request is refused, the process lives on (Ray would re-run the same update on a restarted worker),
    and the next run's `reset` restarts the worker, which then serves."""
    from safetensors.numpy import load_file

    odd = [(k, a.astype(np.longdouble))
           for k, a in load_file(f"{base_cfg.policy.model_name}/model.safetensors").items()]
    ray = connect(shared_engine)
    try:
        worker = ray.get_actor("shared-gen-1")
        url, pid = ray.get(worker.start.remote()), ray.get(worker.pid.remote())
        with pytest.raises(Exception) as failed:
            ray.get(worker.update_weights.remote(odd, 10_001))
        assert "failed inside vLLM's reload" in str(failed.value), str(failed.value)[-800:]
        status, body, chat = served_ok(url)
        assert status == 503 and "vLLM engine is dead" in body["error"] and chat >= 500, (status, body, chat)
        assert ray.get(worker.pid.remote()) == pid
        assert ray.get(worker.reset.remote(base_cfg)) == url  # the worker restarted at the same port
        assert ray.get(worker.pid.remote()) != pid
        status, body, chat = served_ok(url)
        assert (status, body["status"], chat) == (200, "ok", 200)
        assert ray.get(worker.weights_finite.remote())
    finally:
        ray.shutdown()


def test_a_run_of_another_model_attached_is_a_config_error_before_any_publish(tmp_path, shared_engine, base_cfg):
    proc = run_cli("--config", "configs/summarize.yaml", "grpo.max_num_steps=1", "grpo.num_prompts_per_step=2",
                   "grpo.num_generations_per_prompt=2", f"run_dir={tmp_path}", *shared_engine)
    line = last_line(proc.stderr)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert line.startswith(f"ConfigError: policy.model_name: {SUMMARIZE} is not the model that the generation workers "
                           "cluster.attach_generation_workers=shared-gen serve"), line
    assert str(REPO_ROOT / "models" / "tiny-doors") in line, line
    ray = connect(shared_engine)
    try:  # the worker the run attached to still serves the next run, which resets it as it attaches (an earlier
        worker = ray.get_actor("shared-gen-0")  # test of the session, the fleet-health one, may have left it hung)
        url = ray.get(worker.start.remote())
        assert ray.get(worker.reset.remote(base_cfg)) == url
        status, body, chat = served_ok(url)
        assert (status, body["status"], chat) == (200, "ok", 200)
        assert ray.get(worker.weights_finite.remote())
    finally:
        ray.shutdown()


# ------------------------------------------------------------------ issue 51 item 4: the model's names
def test_the_model_is_served_by_the_name_as_written_and_its_basename(stack, base_cfg):
    from minirl.generation.server import served_as

    served = base_cfg.policy.model_name
    assert all(served_as(n, served) for n in (served, "models/tiny-doors", "tiny-doors", "./models/tiny-doors/",
                                              str(Path(served).parent / "." / "tiny-doors")))
    assert not any(served_as(n, served)
                   for n in ("doors", "tiny", "other/tiny-doors", "../tiny-doors", "/models/tiny-doors", ""))

    async def go():
        async with stack() as s, aiohttp.ClientSession() as http:
            ok = [await post(http, s.model_url + CHAT, {**GOOD_CHAT, "model": n})
                  for n in ("models/tiny-doors", "tiny-doors")]
            tok = await post(http, s.model_url + "/tokenize", {"model": "tiny-doors", "prompt": "door 7"})
            wrong = await post(http, s.model_url + CHAT, {**GOOD_CHAT, "model": "models/tiny-summarize"})
            return ok, tok, wrong

    ok, tok, wrong = asyncio.run(go())
    assert [s for s, _ in ok] == [200, 200] and tok[0] == 200, (ok, tok)
    assert [b["model"] for _, b in ok] == ["models/tiny-doors", "tiny-doors"]  # echoed as asked, as vLLM does
    assert wrong[0] == 404 and wrong[1]["error"]["message"] == (
        f"The model `models/tiny-summarize` does not exist. Valid aliases: {served}, or a trailing part of that path "
        "(models/tiny-doors, tiny-doors).")


# ------------------------------------------------------------------ issue 51 item 1: a seed per call
def test_a_headerless_call_samples_with_a_seed_of_its_own_and_a_keyed_one_as_sent(stack):
    """Three turns of one external rollout, all sent with seed 7 and no rollout header: each samples
    with call_seed(7, its prompt); the same turn again gives the same seed and the same reply. A call
    with minirl's rollout header keeps its seed (minirl's agents send seed + call themselves), and so
    does a headerless one marked `X-Minirl-Seed: per-call` (minirl's agent in a held-out validation)."""
    from minirl.generation.server import call_seed
    from minirl.wire import ROLLOUT_HEADER, SEED_AS_SENT, SEED_HEADER

    async def go():
        async with stack() as s, aiohttp.ClientSession() as http:
            messages, replies = list(GOOD_CHAT["messages"]), []
            for _ in range(3):
                body = {**GOOD_CHAT, "messages": messages, "seed": 7, "max_completion_tokens": 8,
                        "return_token_ids": True}
                status, out = await post(http, s.model_url + CHAT, body)
                assert status == 200, out
                replies.append(out)
                messages = messages + [{"role": "assistant",
                                        "content": out["choices"][0]["message"].get("content") or "?"},
                                       {"role": "user", "content": "Try another door."}]
            again = await post(http, s.model_url + CHAT,
                               {**GOOD_CHAT, "seed": 7, "max_completion_tokens": 8, "return_token_ids": True})
            keyed = await post(http, s.model_url + CHAT, {**GOOD_CHAT, "seed": 7, "max_completion_tokens": 8},
                               headers={ROLLOUT_HEADER: "s0.g0.r0.a0.c0"})
            marked = await post(http, s.model_url + CHAT, {**GOOD_CHAT, "seed": 7, "max_completion_tokens": 8},
                                headers={SEED_HEADER: SEED_AS_SENT})
            return replies, again, keyed, marked, s.model.take_calls(None), s.model.take_calls(0)

    replies, again, keyed, marked, unkeyed, calls = asyncio.run(go())
    assert marked[0] == 200 and unkeyed[-1]["seed"] == 7
    seeds = [rec["seed"] for rec in unkeyed[:-1]]
    assert len(seeds) == 4 and len(set(seeds[:3])) == 3, seeds
    assert seeds == [call_seed(7, r["prompt_token_ids"]) for r in [*replies, again[1]]]
    assert seeds[3] == seeds[0] and again[1]["choices"][0]["token_ids"] == replies[0]["choices"][0]["token_ids"]
    assert keyed[0] == 200 and [rec["seed"] for rec in calls] == [7]


def test_the_router_forwards_the_seed_mark_so_a_validation_through_it_samples_as_before(stack):
    """With fleet health on, minirl's agents call through the generation router: it forwards
    `X-Minirl-Seed` as it forwards the rollout header, or a held-out validation's seeds would change."""
    from minirl.config import GenerationRouterConfig
    from minirl.generation.router import GenerationRouter
    from minirl.wire import SEED_AS_SENT, SEED_HEADER

    async def go():
        loop = asyncio.get_running_loop()
        async with stack() as s, aiohttp.ClientSession() as http:
            cfg = GenerationRouterConfig(port_range_low=6000, port_range_high=6099)
            router = await loop.run_in_executor(None, GenerationRouter, cfg, [s.model_url])
            try:
                body = {**GOOD_CHAT, "seed": 11, "max_completion_tokens": 4}
                marked = await post(http, router.url + CHAT, body, headers={SEED_HEADER: SEED_AS_SENT})
                plain = await post(http, router.url + CHAT, body)
            finally:
                await loop.run_in_executor(None, router.stop)
            return marked, plain, s.model.take_calls(None)

    marked, plain, calls = asyncio.run(go())
    assert marked[0] == plain[0] == 200
    assert [rec["seed"] for rec in calls][0] == 11 and calls[1]["seed"] != 11, calls


def gym_like_agent(model_url: str, turns: int = 3):
    """An external agent as Gym's simple_agent + vllm_model behave: the row's extra_body seed merged
    into every chat call of the episode, no rollout header; an aiohttp `/run` served on its own loop."""
    from aiohttp import web

    from minirl.agents.items import items_to_messages

    async def run(request):
        row = await request.json()
        params = row["responses_create_params"]
        seed = json.loads(params["metadata"]["extra_body"])["seed"]
        messages, output = items_to_messages(params["input"]), []
        async with aiohttp.ClientSession() as http:
            for _ in range(turns):
                body = {"messages": messages, "seed": seed, "max_completion_tokens": 12, "logprobs": True,
                        "return_token_ids": True}
                status, out = await post(http, model_url + CHAT, body)
                if status != 200:
                    return web.json_response({"error": out}, status=500)
                choice = out["choices"][0]
                text = choice["message"].get("content") or ""
                output.append({"type": "message", "role": "assistant", "content": text,
                               "prompt_token_ids": out["prompt_token_ids"],
                               "generation_token_ids": choice["token_ids"],
                               "generation_log_probs": [c["logprob"] for c in choice["logprobs"]["content"]]})
                messages = messages + [{"role": "assistant", "content": text},
                                       {"role": "user", "content": "Try another door."}]
        # distinct replies: a reward that varies
        reward = float(len({tuple(o["generation_token_ids"]) for o in output})) / turns
        return web.json_response({**row, "response": {"output": output}, "reward": reward})

    return serve_run_in_thread(run)


def test_an_external_agent_sending_one_seed_gets_a_seed_per_call_and_reruns_identically(tmp_path, shared_engine):
    """Issue 51's acceptance: no two calls of one rollout share a seed (the ledger says which each
    sampled with), and the same run twice gives identical metrics and ledgers."""
    ray = connect(shared_engine)
    try:
        model_url = ray.get(ray.get_actor("shared-gen-0").start.remote())
    finally:
        ray.shutdown()
    agent_url, loop = gym_like_agent(model_url)
    keys = ("reward_mean", "loss", "tokens_trained", "rollouts_trained", "calls_matched", "calls_unrecorded")
    runs = []
    try:
        for n in range(2):
            run_dir = tmp_path / f"run{n}"
            proc = run_cli("grpo.max_num_steps=2", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
                           "checkpoint.enabled=false", "logger.tensorboard=false", f"agent.external_url={agent_url}",
                           f"run_dir={run_dir}", *shared_engine)
            assert proc.returncode == 0, proc.stderr[-3000:]
            metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
            ledger = [json.loads(x) for s in (0, 1)
                      for x in (run_dir / "ledger" / f"step_{s}.jsonl").read_text().splitlines()]
            runs.append(([{k: m[k] for k in keys} for m in metrics], ledger))
    finally:
        loop.call_soon_threadsafe(loop.stop)
    (metrics, ledger), (metrics2, ledger2) = runs
    assert metrics == metrics2 and ledger == ledger2
    assert all(m["calls_matched"] == 2 * 2 * 3 and m["calls_unrecorded"] == 0 for m in metrics), metrics
    by_rollout: dict = {}
    for line in ledger:
        by_rollout.setdefault((line["step"], line["group"], line["rollout"], line["attempt"]), []).append(line["seed"])
    assert len(by_rollout) == 8 and all(len(s) == 3 for s in by_rollout.values()), by_rollout
    assert all(None not in s and len(set(s)) == 3 for s in by_rollout.values()), by_rollout
