"""P1: generation tokens/s through minirl's pipeline vs raw vLLM, side by side.

    python bench/engine_overhead.py --quick

Same tiny model, same prompts (the doors task's first-call prompts, rendered with the chat
template), same sampling (temperature 1, max 48 new tokens, one seed per prompt, so both paths
generate the same tokens). Raw: `LLM.generate` on token ids, in this process. minirl: one `/run`
per prompt (single-call episodes) sent concurrently to the agent-pool actor, which calls the
generation-worker actor's HTTP endpoint, as in training. The two alternate `--rounds` times; the
result is the median of per-round ratios (minirl tokens/s / raw tokens/s). Target >= 0.9.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 rounds of 64 prompts")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("overrides", nargs="*", help="minirl config overrides for the pipeline, e.g. policy.generation.vllm_cfg.omp_threads=1")
    args = ap.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 7)
    n = args.prompts or (64 if args.quick else 128)

    import aiohttp
    import ray

    from minirl.agents.agent import chat_tools
    from minirl.agents.items import items_to_messages
    from minirl.cluster import ACTOR_ENV, free_port, start_generation_workers
    from minirl.config import load_config
    from minirl.data import prompt_row
    from minirl.gym.rows import with_extra_body
    from minirl.agents.server import AgentServer
    from minirl.generation.engine import configure_cpu_env

    cfg = load_config(None, ["agent.name=simple_agent", "agent.max_steps=1", *args.overrides])
    max_new = cfg.policy.generation.max_new_tokens
    rows = []
    for i in range(n):
        row = prompt_row(cfg, 0, i)
        row["responses_create_params"] = with_extra_body(row["responses_create_params"], seed=i)
        rows.append({**row, "_rowidx": i})

    # raw vLLM, in this process
    configure_cpu_env(cfg.policy.generation.vllm_cfg.kv_cache_space_gb, cfg.policy.generation.vllm_cfg.omp_threads)
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(cfg.policy.model_name)
    prompts = [
        {"prompt_token_ids": tok.apply_chat_template(items_to_messages(r["responses_create_params"]["input"]),
                                                     tools=chat_tools(r["responses_create_params"]["tools"]),
                                                     add_generation_prompt=True, tokenize=True, return_dict=False)}
        for r in rows
    ]
    params = [SamplingParams(temperature=1.0, max_tokens=max_new, seed=i, logprobs=0) for i in range(n)]
    llm = LLM(model=cfg.policy.model_name, dtype="float32", max_model_len=cfg.policy.generation.vllm_cfg.max_model_len,
              enforce_eager=True, seed=0, logprobs_mode="processed_logprobs", enable_chunked_prefill=False)

    raw_steps = [0]
    engine_step = llm.llm_engine.step

    def counted_step():  # count raw vLLM's engine steps too, for the side-by-side line
        raw_steps[0] += 1
        return engine_step()

    llm.llm_engine.step = counted_step

    def raw_round() -> tuple[int, float]:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t0

    # minirl's path: the same actors as training
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="error", log_to_driver=False,
             runtime_env={"env_vars": {**ACTOR_ENV, "RAY_AUTH_MODE": "disabled"}})
    (gen,) = start_generation_workers(cfg, "127.0.0.1")  # as training starts it
    model_url = ray.get(gen.start.remote())
    agent = ray.remote(AgentServer).options(num_cpus=0).remote(cfg, [model_url], "127.0.0.1", free_port("127.0.0.1"))
    agent_url = ray.get(agent.start.remote())

    async def pipeline_round() -> tuple[int, float]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            async def one(row):
                async with http.post(agent_url + "/run", json=row) as r:
                    body = await r.json()
                return sum(len(it.get("generation_token_ids", [])) for it in body["response"]["output"])

            t0 = time.perf_counter()
            tokens = await asyncio.gather(*(one(r) for r in rows))
            return sum(tokens), time.perf_counter() - t0

    raw_round()  # warm both paths up
    asyncio.run(pipeline_round())
    results = []
    for k in range(rounds):
        raw_steps[0] = 0
        rt, rs = raw_round()
        before = ray.get(gen.stats.remote())
        pt, ps = asyncio.run(pipeline_round())
        after = ray.get(gen.stats.remote())
        busy, steps = after["busy_s"] - before["busy_s"], after["steps"] - before["steps"]
        results.append((rt / rs, pt / ps, rt, pt))
        print(f"round {k + 1}/{rounds}: raw {rt / rs:8.0f} tok/s ({rt} tokens, {rs:.2f} s in {raw_steps[0]} steps)   minirl {pt / ps:8.0f} tok/s "
              f"({pt} tokens, {ps:.2f} s, engine stepping {busy:.2f} s in {steps} steps)   ratio {pt / ps / (rt / rs):.3f}", flush=True)
    ratios = [p / r for r, p, _, _ in results]
    ray.shutdown()
    print()
    print("| benchmark | raw vLLM tok/s (median) | minirl tok/s (median) | ratio (median) | target |")
    print("|---|---|---|---|---|")
    print(f"| P1 engine_overhead ({n} prompts x {rounds} rounds) | {statistics.median(r for r, _, _, _ in results):.0f} | "
          f"{statistics.median(p for _, p, _, _ in results):.0f} | {statistics.median(ratios):.3f} | >= 0.9 |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
