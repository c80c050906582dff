"""Held-out evaluation of the summarizing experiment's policies without Ray or vLLM (issue 30,
experiment 1): more held-out episodes than a training run's validation affords, on a shared machine
whose Ray/vLLM lock is busy.

    python scripts/summarize_offline_eval.py [--model models/tiny-summarize | --model RUN/checkpoints/step_N/policy]
        --policy summarize|recency [--prompts 100] [--seeds 0 1 2]

`--model` may hold `{seed}` (e.g. `RUNS/summarize-s{seed}/checkpoints/step_200/policy`): each seed's
held-out prompts are then played by the policy that seed's run trained.

The episodes run through minirl's own agent loop (`run_episode`: the real summarizing or recency
policy and guard of configs/summarize.yaml), on minirl.validation's held-out prompts (the same rows a
run's validation sends: disjoint from training, a fixed sampling seed per rollout). The model is the
real policy's weights, sampled at temperature 1 by Hugging Face `generate` in this process instead
of the vLLM engine behind the generation server (a deviation stated in the report: the rendering is
the same chat template and tokenizer, the sampler a different implementation). Prints one JSON line:
success (every room on its first try), reward, last-room success, summary recall. An episode whose
summary attempts all fail (SummaryFailed) scores 0, as minirl.validation scores it.

Invariant: reads the model and the config only; writes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from minirl.agents.agent import ModelReply, run_episode  # noqa: E402
from minirl.agents.env import make_rooms  # noqa: E402
from minirl.config import load_config  # noqa: E402
from minirl.generation.chat_format import parse_reply  # noqa: E402
from minirl.validation import POLICY_ENDS, held_out_rows  # noqa: E402
from minirl.wire import SummaryFailed  # noqa: E402


class LocalModel:
    """A ModelClient over a local Hugging Face model: the chat template renders, `generate` samples."""

    def __init__(self, model_dir: str, tokenizer_dir: str, max_new_tokens: int, temperature: float):
        self.tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.max_new, self.temperature = max_new_tokens, temperature

    def _ids(self, messages, tools) -> list[int]:
        text = self.tok.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True)
        return self.tok(text, add_special_tokens=False)["input_ids"]

    async def chat(self, messages, tools, params, key, required_prefix):
        ids = self._ids(messages, tools)
        torch.manual_seed(params.get("seed", zlib.crc32(key.encode())) % 2**31)  # the row's sampling seed, per call
        with torch.no_grad():
            out = self.model.generate(torch.tensor([ids]), max_new_tokens=self.max_new, do_sample=True, top_k=0,
                                      temperature=self.temperature, eos_token_id=self.tok.eos_token_id,
                                      pad_token_id=self.tok.pad_token_id)
        gen = out[0, len(ids):].tolist()
        finish = "stop" if gen and gen[-1] == self.tok.eos_token_id else "length"
        text = self.tok.decode(gen, skip_special_tokens=True)
        evidence = {"prompt_token_ids": ids, "generation_token_ids": gen, "generation_log_probs": [0.0] * len(gen)}
        return ModelReply(parse_reply(text), finish, evidence)

    async def count_tokens(self, messages, tools, key, required_prefix):
        return len(self._ids(messages, tools))


def evaluate(model_dir: str, policy: str, prompts: int, seed: int) -> dict:
    overrides = [f"grpo.val_num_prompts={prompts}", f"grpo.seed={42 + seed}", f"env.data_seed={1234 + seed}"]
    if policy == "recency":
        overrides += ["agent.context_history.policy.type=recency",
                      "agent.context_history.policy.config.images.keep_last_groups=2"]
    cfg = load_config(str(REPO / "configs" / "summarize.yaml"), overrides)
    client = LocalModel(model_dir, cfg.policy.model_name, cfg.policy.generation.max_new_tokens,
                        cfg.policy.generation.temperature)
    results = []
    for i, row in enumerate(held_out_rows(cfg)):
        row = {**row, "_minirl": {"step": 0, "group": i, "rollout": 0, "attempt": 0}}
        try:
            results.append(asyncio.run(run_episode(row, cfg.agent, client)))
        except SummaryFailed:  # no usable summary: 0, as a validation scores it
            results.append({"reward": 0.0, "task": row["task"], "response": {"output": []},
                            "evidence": {"end_reason": POLICY_ENDS["SummaryFailed"]}})
    last = []
    for res in results:
        rooms = res["task"]["num_rooms"]
        calls = [json.loads(it["arguments"]).get("code") if it["arguments"].strip().startswith("{") else None
                 for it in res["response"]["output"] if it.get("type") == "function_call"]
        last.append(len(calls) == rooms and calls[-1] == make_rooms(res["task"]["seed"], rooms)[-1].code)
    ev = [r["evidence"] for r in results]
    needed = sum(e.get("summary_facts_needed", 0) for e in ev)
    return {"model": model_dir, "policy": policy, "seed": seed, "episodes": len(results),
            "success": sum(r["reward"] == 1.0 for r in results) / len(results),
            "reward": sum(r["reward"] for r in results) / len(results),
            "last_room": sum(last) / len(results),
            "summary_recall": sum(e.get("summary_facts_recalled", 0) for e in ev) / needed if needed else None,
            "summaries": sum(e.get("summaries", 0) for e in ev) / len(results),
            "guard_rejects": sum(e.get("end_reason") == "guard_reject" for e in ev),
            "summary_failed": sum(e.get("end_reason") == POLICY_ENDS["SummaryFailed"] for e in ev)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "models" / "tiny-summarize"))
    ap.add_argument("--policy", choices=["summarize", "recency"], required=True)
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    for seed in args.seeds:
        print(json.dumps(evaluate(args.model.format(seed=seed), args.policy, args.prompts, seed)), flush=True)


if __name__ == "__main__":
    main()
