"""P1's floor: what minirl's two HTTP hops cost a burst before any handler does real work.

    python bench/hop_floor.py [--quick] [--prompts 128] [--rounds 9] [--hold 0.5] [--small]

P1 (bench/engine_overhead.py) sends one `/run` per prompt, all at once, from a client through the
agent server to the generation worker's front end. This bench keeps that chain's processes,
servers and bodies and takes out everything else: no engine, no agent loop, no verifier, no
protocol classes, no call log. Three processes on uvloop, each as minirl runs it:
- the client posts the doors task's real `/run` rows (one aiohttp session, as the bench's);
- "agent" (an `HttpThread` app, as the agent server's) parses the row, posts the chat request
  minirl's model client sends to "front end", parses its reply and answers with it;
- "front end" (an `HttpThread` app) parses the request; in `template` rounds it also renders and
  tokenizes it with the model's real chat template (`apply_chat_template(tokenize=True)`, the one
  piece of work the front end cannot skip and raw vLLM's side does before its timer starts). It
  stamps the arrival, holds the reply `--hold` s from then (generation), and answers with a body
  shaped as the front end's (48 tokens with logprobs and ids, the prompt's ids).

Raw vLLM rounds (bench/engine_overhead.py's raw side: `LLM.generate` on the same prompts, the
same sampling) alternate with a template round and a bare one. Per chain round: when the last
request reached the front end, and the round's overhead, its wall time minus the hold: the arrival
spread plus the replies' way back. The ceiling these hops alone put on P1 follows, per round, from
raw vLLM's round before it: raw's wall / (raw's wall - raw's time until its last prompt is in + the
chain's overhead). It is generous to minirl: it charges no handler work and no competition with an
engine for the cores, and lets the last request's generation take no longer than raw's. Each
process's CPU per request (engine_overhead's `_cpu_s`) is printed too, to set against P1's own line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="3 rounds of each kind")
    ap.add_argument("--rounds", type=int, default=None,
                    help="rounds of each kind (raw, template, bare), alternated; 9 by default")
    ap.add_argument("--hold", type=float, default=0.5,
                    help="seconds the front end holds each reply, as generation would")
    ap.add_argument("--small", action="store_true",
                    help="the ~12M / 32k-vocab variant, as bench/engine_overhead.py --small")
    args = ap.parse_args(argv)
    args.rounds = args.rounds or (3 if args.quick else 9)

    from minirl.agents.agent import chat_tools
    from minirl.agents.items import items_to_messages
    from minirl.agents.model_client import chat_body
    from minirl.config import load_config
    from minirl.data import prompt_row
    from minirl.runtime.http_thread import new_event_loop

    from engine_overhead import RawVllm, _cpu_s  # bench/ is this script's directory, so on sys.path
    from vs_trl import ensure_small_model

    overrides = [f"policy.model_name={ensure_small_model()}"] if args.small else []
    cfg = load_config(None, ["agent.name=simple_agent", "agent.max_steps=1", *overrides])
    rows, chats = [], []
    for i in range(args.prompts):
        row = prompt_row(cfg, 0, i)
        params = row["responses_create_params"]
        rows.append(row)
        chats.append(chat_body(cfg.policy.model_name, items_to_messages(params["input"]), chat_tools(params["tools"]),
                               {**params, "seed": i}))

    ctx = mp.get_context("spawn")
    arrivals, ready = ctx.Queue(), ctx.Barrier(3)
    front = ctx.Process(target=_front_end,
                        args=(cfg.policy.model_name, cfg.policy.generation.max_new_tokens, args.hold, arrivals, ready),
                        daemon=True)
    front.start()
    front_url = arrivals.get(timeout=120)
    agent = ctx.Process(target=_agent, args=(front_url, chats, arrivals, ready), daemon=True)
    agent.start()
    agent_url = arrivals.get(timeout=120)
    ready.wait(timeout=120)
    raw = RawVllm(cfg, rows)

    pids = {"front end": front.pid, "agent": agent.pid, "client": os.getpid()}
    loop = new_event_loop()

    async def rounds():
        import aiohttp

        results = {"bare": [], "template": []}
        raw_wall = raw_in = 0.0
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            async def one(i: int, mode: str):
                async with http.post(agent_url + "/run", json={**rows[i], "_i": i, "_mode": mode}) as r:
                    body = await r.json()
                assert r.status == 200 and len(body["choices"][0]["token_ids"]) > 0, body

            for k in range(3 * args.rounds + 3):  # the first three warm up
                mode = ("raw", "template", "bare")[k % 3]
                await asyncio.sleep(0.3)  # the engine's OMP threads stop spinning
                if mode == "raw":
                    tokens, raw_wall, raw_in, _, _ = raw.round()
                    print(f"round {k + 1}: raw vLLM {tokens} tokens in {1000 * raw_wall:.0f} ms, "
                          f"last prompt in at {1000 * raw_in:.0f} ms", flush=True)
                    continue
                t0, c0 = time.time(), {name: _cpu_s(pid) for name, pid in pids.items()}
                await asyncio.gather(*(one(i, mode) for i in range(args.prompts)))
                wall = time.time() - t0
                cpu = {name: (_cpu_s(pid) - c0[name]) / args.prompts for name, pid in pids.items()}
                stamps = [arrivals.get(timeout=10) for _ in range(args.prompts)]
                last_in, overhead = max(stamps) - t0, wall - args.hold
                ceiling = raw_wall / (raw_wall - raw_in + overhead)
                if k >= 3:
                    results[mode].append((last_in, overhead, ceiling, cpu))
                print(f"round {k + 1}: {mode:8s} last request at the front end {1000 * last_in:4.0f} ms, "
                      f"overhead (wall - hold) {1000 * overhead:4.0f} ms, P1 ceiling {ceiling:.3f}"
                      + ("   (warm-up)" if k < 3 else ""), flush=True)
        return results

    results = loop.run_until_complete(rounds())
    front.terminate()
    agent.terminate()
    print()
    print("| benchmark | front end's work | last request at the front end (median) "
          "| round overhead, wall - hold (median) | P1 ceiling (median) |")
    print("|---|---|---|---|---|")
    for mode, what in (("bare", "parse only"), ("template", "parse + chat template + tokenizer")):
        ins, overs, ceilings, _ = zip(*results[mode])
        print(f"| hop_floor ({args.prompts} prompts x {args.rounds} rounds, {Path(cfg.policy.model_name).name}) "
              f"| {what} | {1000 * statistics.median(ins):.0f} ms | {1000 * statistics.median(overs):.0f} ms "
              f"| {statistics.median(ceilings):.3f} |")
    print()
    for mode in ("bare", "template"):
        cpus = [c for *_, c in results[mode]]
        print(f"CPU per request, {mode} rounds (median): "
              + ", ".join(f"{name} {1000 * statistics.median(c[name] for c in cpus):.2f} ms" for name in pids)
              + f"; the machine has {os.cpu_count()} cores")
    return 0


def _front_end(model: str, max_new: int, hold: float, arrivals, ready) -> None:
    from aiohttp import web
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    prompts: dict[int, list[int]] = {}  # seed -> prompt ids

    async def chat(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        if request.headers.get("x-mode") == "template":
            prompt_ids = prompts[body["seed"]] = tok.apply_chat_template(
                body["messages"], tools=body["tools"], add_generation_prompt=True, tokenize=True, return_dict=False)
        else:  # the same reply, from the ids a template round (the first warm-up round) rendered
            prompt_ids = prompts[body["seed"]]
        arrivals.put(time.time())
        await asyncio.sleep(hold)
        ids = [(body["seed"] + j) % 200 + 3 for j in range(max_new)]
        reply = {"id": "chatcmpl-floor", "object": "chat.completion", "model": body["model"],
                 "prompt_token_ids": prompt_ids,
                 "choices": [{"index": 0, "finish_reason": "length", "token_ids": ids,
                              "message": {"role": "assistant", "content": " ".join(map(str, ids))},
                              "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": -1.234567, "bytes": [t],
                                                        "top_logprobs": []}
                                                       for t in ids]}}],
                 "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": max_new,
                           "total_tokens": len(prompt_ids) + max_new}}
        return web.Response(body=json.dumps(reply).encode(), content_type="application/json")

    async def handler():
        return chat

    _serve("/v1/chat/completions", handler, "front-end", arrivals, ready)


def _agent(front_url: str, chats: list[dict], out, ready) -> None:
    import aiohttp
    from aiohttp import web

    async def handler():  # on the server's loop, which the client session must share
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

        async def run(request: web.Request) -> web.Response:
            row = json.loads(await request.read())
            async with session.post(front_url + "/v1/chat/completions", json=chats[row["_i"]],
                                    headers={"x-mode": row["_mode"]}) as r:
                reply = json.loads(await r.text())
            return web.Response(body=json.dumps(reply).encode(), content_type="application/json")

        return run

    _serve("/run", handler, "agent", out, ready)


def _serve(route: str, make_handler, name: str, out, ready) -> None:
    """Serve `route` with the handler `make_handler()` builds on the server's loop, from an
    `HttpThread` as minirl's servers are; put the URL on `out`, then serve until terminated."""
    from aiohttp import web

    from minirl.runtime.http_thread import HttpThread

    async def setup() -> web.Application:
        app = web.Application()
        app.router.add_post(route, await make_handler())
        return app

    server = HttpThread(setup, "127.0.0.1", 0, name)
    out.put(server.url)
    ready.wait()
    server._thread.join()


if __name__ == "__main__":
    sys.exit(main())
