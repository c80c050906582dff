"""The GPU check behind bench/gpu_check.sh (see there). Real parts only: the committed tiny model
and a ~150M-parameter Qwen2 built in place (random weights, real shapes), minirl's PolicyWorker
doing GRPO updates in bf16 on CUDA on rollouts of the doors task."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # gpu_check.sh may run it with a python where minirl is not installed


def rollouts(model_dir: str, cfg, prompts: int, gens: int, use_vllm: bool):
    """One group of single-call doors episodes per prompt; returns (token rows, prompt lens, rewards, gen tok/s)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from minirl.agents.agent import chat_tools
    from minirl.agents.env import verify
    from minirl.agents.items import items_to_messages
    from minirl.data import prompt_row
    from minirl.generation.chat_format import parse_reply

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [prompt_row(cfg, 0, g) for g in range(prompts)]
    ids = [tok.apply_chat_template(items_to_messages(r["responses_create_params"]["input"]),
                                   tools=chat_tools(r["responses_create_params"]["tools"]), add_generation_prompt=True,
                                   tokenize=True, return_dict=False) for r in rows]
    t0 = time.perf_counter()
    outs = []
    if use_vllm:
        from vllm import LLM, SamplingParams

        llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.3,
                  enforce_eager=False)
        t0 = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": p} for p in ids for _ in range(gens)],
                           SamplingParams(temperature=1.0, max_tokens=48), use_tqdm=False)
        outs = [list(r.outputs[0].token_ids) for r in res]
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
        for p in ids:
            x = torch.tensor([p] * gens, device="cuda")
            with torch.no_grad():
                y = model.generate(x, max_new_tokens=48, do_sample=True, temperature=1.0, top_k=0,
                                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            for row in y[:, len(p):].tolist():
                outs.append(row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row)
    gen_s = time.perf_counter() - t0
    seqs, plens, rewards = [], [], []
    for k, out in enumerate(outs):
        g = k // gens
        msg = parse_reply(tok.decode(out, skip_special_tokens=True))
        items = [{"type": "function_call", "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                 for c in msg["tool_calls"]]
        seqs.append(ids[g] + out)
        plens.append(len(ids[g]))
        rewards.append(verify(rows[g]["task"], items))
    return seqs, plens, rewards, sum(len(o) for o in outs) / gen_s


def batch_of(seqs, plens, rewards, gens):

    from minirl.algo.grpo import group_advantages
    from minirl.types import TrainBatch

    b = TrainBatch.zeros(len(seqs), max(len(s) for s in seqs))
    b.lengths[:] = [len(s) for s in seqs]
    b.sample_mask[:] = 1
    for i, (s, p) in enumerate(zip(seqs, plens)):
        b.input_ids[i, : len(s)] = s
        b.loss_mask[i, p : len(s)] = 1
    for g in range(0, len(seqs), gens):
        b.advantages[g : g + gens] = group_advantages(rewards[g : g + gens])
    return b.count_valid()


def check(name: str, model_dir: str, steps: int, prompts: int, gens: int, use_vllm: bool) -> dict:
    import torch

    from minirl.config import load_config
    from minirl.trainer.policy_worker import PolicyWorker

    cfg = load_config(None, [f"policy.model_name={model_dir}", "policy.precision=bfloat16",
                             "cluster.gpus_per_policy_worker=1", "env.num_rooms=1", "policy.train_micro_batch_size=32"])
    worker = PolicyWorker(cfg)
    assert worker.device.type == "cuda"
    times, gen_rates, train_tokens = [], [], []
    for step in range(steps):
        seqs, plens, rewards, gen_rate = rollouts(model_dir, cfg, prompts, gens, use_vllm)
        batch = batch_of(seqs, plens, rewards, gens)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        stats = worker.train(batch)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        gen_rates.append(gen_rate)
        train_tokens.append(int(batch.lengths.sum()))
        print(f"  [{name}] step {step}: update {times[-1]:.3f}s ({train_tokens[-1] / times[-1]:.0f} tok/s), "
              f"generation {gen_rate:.0f} tok/s, reward {sum(rewards) / len(rewards):.3f}, loss {stats['loss']:+.4f}",
              flush=True)
    return {"name": name, "update_s": statistics.median(times[1:]),
            "update_tok_s": statistics.median(t / s for t, s in zip(train_tokens[1:], times[1:])),
            "gen_tok_s": statistics.median(gen_rates[1:]),
            "generator": "vLLM" if use_vllm else "HF generate (vLLM not installed)"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here; nothing to check")
        return 0
    try:
        import vllm  # noqa: F401

        use_vllm = True
    except ImportError:
        use_vllm = False
    print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"vLLM {'yes' if use_vllm else 'not installed'}")
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from minirl.config import load_config

    tiny = load_config().policy.model_name
    results = [check("tiny 0.46M", tiny, args.steps, 16, 8, use_vllm)]
    with tempfile.TemporaryDirectory() as tmp:  # ~150M params, real shapes, random weights
        big = Qwen2Config(vocab_size=32768, hidden_size=768, intermediate_size=2688, num_hidden_layers=12,
                          num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048,
                          tie_word_embeddings=True, torch_dtype="bfloat16",
                          **{k: v for k, v in json.loads((Path(tiny) / "config.json").read_text()).items()
                             if k in ("bos_token_id", "eos_token_id", "pad_token_id")})
        Qwen2ForCausalLM(big).save_pretrained(tmp)
        AutoTokenizer.from_pretrained(tiny).save_pretrained(tmp)
        results.append(check("qwen2 150M (random init)", tmp, args.steps, 16, 8, use_vllm))
    print()
    print("| GPU check | bf16 update s/step | update tokens/s | generation tokens/s | generator |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['name']}, 16 prompts x 8 | {r['update_s']:.3f} | {r['update_tok_s']:.0f} | "
              f"{r['gen_tok_s']:.0f} | {r['generator']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
