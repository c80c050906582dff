"""P2: step time and reward, minirl vs TRL's GRPOTrainer, side by side on the same machine.

    pip install -e '.[bench]'          # trl + datasets (once)
    python bench/vs_trl.py --quick     # tiny model only
    python bench/vs_trl.py             # tiny model, then the ~12M / 32k-vocab variant
    python bench/vs_trl.py --quick --async-staleness 1   # minirl trains async (TRL's side unchanged)

A single-turn task both can run: the doors task with one room and one model call; the reward
is 1 when the call opens the door (minirl's verifier, called by TRL's reward function). Same
model directory, same prompts in the same order, group size, completion length (48), learning
rate, loss (token-level, no KL, clip 0.2, std-normalised group advantages) and number of steps.
TRL generates with Hugging Face `generate` (`use_vllm=False`, as on CPU); minirl with its vLLM
workers behind HTTP. Reported: median step time after the first (warm-up) step, their ratio
(minirl / TRL; target <= 0.7), and the mean reward of the last steps of each. P2's figure is minirl's
default, sync; `--async-staleness S` runs minirl's side async (its generation overlapping the update, at
most S versions stale), a second figure beside it, not the claim.

The 12M variant is built on first use into `.cache/models/small-doors-32k` by
`scripts/build_tiny_model.py --size small --pad-vocab-to 32768 --sft-steps 0`: untrained, because
its warm start would take over an hour here, so it measures step time, not learning.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SMALL_MODEL = REPO / ".cache" / "models" / "small-doors-32k"


def common(model: str, steps: int, prompts: int, gens: int, lr: float, threads: int = 2,
           staleness: int = 0) -> list[str]:
    """minirl's side: the config file, then its overrides; `threads`: the engine's and the trainer's
    torch threads (TRL's process gets as many); `staleness` > 0: minirl trains async at that staleness
    (as bench/async_speedup.py: importance weights truncated by `tis` at 2.0), 0: sync (the default)."""
    overlap = ["async_rl.enabled=true", f"async_rl.sampler.max_staleness_versions={staleness}",
               "loss_fn.use_importance_sampling_correction=true", "loss_fn.truncated_importance_sampling_type=tis",
               "loss_fn.truncated_importance_sampling_ratio=2.0"] if staleness > 0 else []
    return [
        "--config", str(REPO / "configs" / "plain.yaml"), f"policy.model_name={model}", "agent.max_steps=1",
        "env.num_rooms=1", f"grpo.num_prompts_per_step={prompts}", f"grpo.num_generations_per_prompt={gens}",
        f"grpo.max_num_steps={steps}", f"policy.optimizer.lr={lr}", "policy.generation.max_new_tokens=48",
        f"policy.train_micro_batch_size={prompts * gens}",  # one forward/backward per step, as TRL's batch here
        "checkpoint.enabled=false", "logger.tensorboard=false", "loss_fn.reference_policy_kl_penalty=0",
        f"policy.generation.vllm_cfg.omp_threads={threads}", f"policy.train_threads={threads}", *overlap,
    ]


def run_minirl(model: str, steps: int, prompts: int, gens: int, lr: float, threads: int, staleness: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        args = common(model, steps, prompts, gens, lr, threads, staleness)
        proc = subprocess.run([sys.executable, "-m", "minirl.train", *args, f"run_dir={tmp}"],
                              cwd=REPO, capture_output=True, text=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"minirl run failed: {proc.stderr[-2000:]}")
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    return {"step_times": [r["step_time_s"] for r in rows], "rewards": [r["reward_mean"] for r in rows], "wall_s": wall,
            "phases": {k: statistics.median(r.get(k) or 0.0 for r in rows[1:])
                       for k in ("rollout_time_s", "engine_busy_s", "train_time_s", "sync_time_s")}}


def run_trl(model: str, steps: int, prompts: int, gens: int, lr: float, threads: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from minirl.agents.agent import chat_tools
    from minirl.agents.env import verify
    from minirl.agents.items import items_to_messages
    from minirl.config import load_config
    from minirl.data import prompt_row
    from minirl.generation.chat_format import parse_reply

    torch.set_num_threads(threads)
    cfg = load_config(None, common(model, steps, prompts, gens, lr, threads)[2:])
    tok = AutoTokenizer.from_pretrained(cfg.policy.model_name)
    records = []
    for step in range(steps):  # the prompts minirl sees, in minirl's order
        for g in range(prompts):
            row = prompt_row(cfg, step, g)
            params = row["responses_create_params"]
            text = tok.apply_chat_template(items_to_messages(params["input"]), tools=chat_tools(params["tools"]),
                                           add_generation_prompt=True, tokenize=False)
            records.append({"prompt": text, "task": json.dumps(row["task"])})

    def reward(completions, task, **_):
        out = []
        for text, t in zip(completions, task):
            msg = parse_reply(text)
            items = [{"type": "function_call", "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in msg["tool_calls"]]
            out.append(verify(json.loads(t), items))
        return out

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], None

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)

    timer = Timer()
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp, max_steps=steps, learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0,
            per_device_train_batch_size=prompts * gens, num_generations=gens, gradient_accumulation_steps=1,
            max_completion_length=48, temperature=1.0, top_p=1.0, beta=0.0, epsilon=0.2, loss_type="dapo",
            scale_rewards="group", use_vllm=False, shuffle_dataset=False, logging_steps=1, report_to=[],
            save_strategy="no", bf16=False, use_cpu=True, seed=cfg.grpo.seed, max_grad_norm=1.0,
            adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0,
        )
        trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(cfg.policy.model_name, dtype=torch.float32),
                              reward_funcs=reward, args=args, train_dataset=Dataset.from_list(records),
                              processing_class=tok, callbacks=[timer])
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"step_times": timer.times, "rewards": rewards, "wall_s": wall}


def ensure_small_model() -> str:
    if not (SMALL_MODEL / "config.json").exists():
        print(f"building the 12M variant into {SMALL_MODEL} (first use) ...", flush=True)
        # no warm start: one SFT step of this size takes ~17 s on 2 CPU cores, so the 12M variant
        # compares step time only (an untrained model writes all 48 tokens; reward stays ~0)
        subprocess.run([sys.executable, "scripts/build_tiny_model.py", "--out", str(SMALL_MODEL), "--size", "small",
                        "--pad-vocab-to", "32768", "--sft-steps", "0", "--episodes", "200"], cwd=REPO, check=True)
    return str(SMALL_MODEL)


def compare(name: str, model: str, steps: int, prompts: int, gens: int, lr: float, threads: int,
            staleness: int = 0) -> dict:
    print(f"[{name}] minirl ...", flush=True)
    mine = run_minirl(model, steps, prompts, gens, lr, threads, staleness)
    print(f"[{name}] TRL GRPOTrainer ...", flush=True)
    trl = run_trl(model, steps, prompts, gens, lr, threads)
    tail = max(1, steps // 3)
    out = {
        "name": name, "steps": steps, "minirl_step_s": statistics.median(mine["step_times"][1:]),
        "trl_step_s": statistics.median(trl["step_times"][1:]),
        "minirl_reward": statistics.mean(mine["rewards"][-tail:]),
        "trl_reward": statistics.mean(trl["rewards"][-tail:]),
        "minirl_reward_first": mine["rewards"][0], "trl_reward_first": trl["rewards"][0], "phases": mine["phases"],
    }
    out["ratio"] = out["minirl_step_s"] / out["trl_step_s"]
    print(f"[{name}] minirl {out['minirl_step_s']:.2f}s/step (rollout {mine['phases']['rollout_time_s']:.2f} of which "
          f"vLLM stepping {mine['phases']['engine_busy_s']:.2f}, "
          f"train {mine['phases']['train_time_s']:.2f}, sync {mine['phases']['sync_time_s']:.2f}), "
          f"TRL {out['trl_step_s']:.2f}s/step, ratio {out['ratio']:.2f}; "
          f"reward minirl {out['minirl_reward_first']:.2f} -> "
          f"{out['minirl_reward']:.2f}, TRL {out['trl_reward_first']:.2f} -> {out['trl_reward']:.2f}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model only, 8 steps")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--threads", type=int, default=2,
                    help="torch threads on each side: minirl's engine and trainer, TRL's process (default 2)")
    ap.add_argument("--async-staleness", type=int, default=0, metavar="S",
                    help="minirl trains async (async_rl) at staleness S (default 0: sync, the P2 figure); "
                         "TRL's side is the same either way")
    ap.add_argument("--models", default=None,
                    help="comma-separated: tiny, small (default: tiny with --quick, else both)")
    args = ap.parse_args(argv)
    steps = args.steps or (8 if args.quick else 20)
    models = args.models.split(",") if args.models else (["tiny"] if args.quick else ["tiny", "small"])
    from minirl.config import load_config

    results, s = [], args.async_staleness
    mode = f", minirl async S={s}" if s else ""
    if "tiny" in models:
        results.append(compare(f"tiny 0.46M{mode}", load_config().policy.model_name, steps, 8, 4, args.lr,
                               args.threads, s))
    if "small" in models:
        results.append(compare(f"small 12M / 32k vocab{mode}", ensure_small_model(), max(6, steps // 2), 8, 4,
                               args.lr, args.threads, s))
    print()
    print("| benchmark | minirl s/step | TRL s/step | minirl / TRL | target "
          "| reward minirl (first -> last third) | reward TRL |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| P2 vs TRL, {r['name']}, 8 prompts x 4, {r['steps']} steps, {args.threads} threads "
              f"| {r['minirl_step_s']:.2f} | {r['trl_step_s']:.2f} | "
              f"{r['ratio']:.2f} | <= 0.7 | {r['minirl_reward_first']:.2f} -> {r['minirl_reward']:.2f} | "
              f"{r['trl_reward_first']:.2f} -> {r['trl_reward']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
