"""Data parallelism across two Ray "nodes" on this machine: `ray start --head` and a second
`ray start --address`, separate processes with their own resources. Two gloo policy workers
(one per node) run DDP over the same two GRPO batches as one worker; the updates must agree."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from minirl.config import load_config
from minirl.controller import assemble
from minirl.data import prompt_row
from minirl.wire import Coords
from minirl.rollout.evidence import parse_rollout
from minirl.types import GroupOutcome

pytestmark = pytest.mark.slow
# max |w_2workers - w_1worker| after two AdamW steps at lr 1e-3 (float32). Adam's step is lr * m / (sqrt(v) + eps),
# so at its default eps (1e-8) a gradient that is near zero (~1e-10) moves its weight by up to ~lr in the direction
# of its rounding, which two reduction orders may disagree on: 5.0e-6 here in 5 runs (quiet, loaded, the single
# worker on 1 thread), but once 1.2e-3 in a fresh clone's suite (2026-12-06, cause not found). The test's eps (1e-6)
# damps that to lr * |noise| / eps and leaves every real gradient's step near lr: 3.9e-7 in 5 such runs. A real
# difference between the ranks' gradients still moves weights by ~lr at either eps, and the losses must agree too.
WEIGHT_TOLERANCE = 1e-5
EPS = 1e-6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_nodes():
    """Two `ray start` nodes, stopped at the end by stopping only the processes they started (tagged
    in their environment), not with `ray stop`, which kills every Ray cluster on the machine, the
    session's shared engine included."""
    tag = f"test-ddp-{os.getpid()}"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "MINIRL_TEST_TAG": tag}
    ray_bin = str(Path(sys.executable).parent / "ray")
    port = free_port()
    try:
        subprocess.run([ray_bin, "start", "--head", f"--port={port}", "--num-cpus=1", '--resources={"node_a": 1}',
                        "--include-dashboard=false", "--disable-usage-stats"], check=True, capture_output=True, env=env)
        subprocess.run([ray_bin, "start", f"--address=127.0.0.1:{port}", "--num-cpus=2", '--resources={"node_b": 1}',
                        "--disable-usage-stats"], check=True, capture_output=True, env=env)
        yield f"127.0.0.1:{port}"
    finally:
        stop_tagged(tag)


def stop_tagged(tag: str) -> None:
    """SIGTERM, then SIGKILL after 10 s, every process with MINIRL_TEST_TAG=tag and its descendants."""
    import psutil

    procs = {}
    for p in psutil.process_iter():
        try:
            if p.environ().get("MINIRL_TEST_TAG") == tag:
                procs.update((q.pid, q) for q in [p, *p.children(recursive=True)])
        except psutil.Error:
            pass
    for p in procs.values():
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(list(procs.values()), timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass


def real_batches(cfg, tokenizer, steps=2, groups=4, gens=4):
    """GRPO batches of real token sequences: the doors prompts with right and wrong replies."""
    from minirl.agents.agent import chat_tools
    from minirl.agents.env import make_rooms
    from minirl.agents.items import items_to_messages

    batches = []
    for step in range(steps):
        outcomes = []
        for g in range(groups):
            row = prompt_row(cfg, step, g)
            params = row["responses_create_params"]
            prompt = tokenizer.apply_chat_template(items_to_messages(params["input"]),
                                                   tools=chat_tools(params["tools"]),
                                                   add_generation_prompt=True, tokenize=True, return_dict=False)
            code = make_rooms(row["task"]["seed"], row["task"]["num_rooms"])[0].code
            rollouts = {}
            for r in range(gens):
                guess = code if (r + g) % 3 == 0 else (code + r + 1) % 10
                reply = (f'<think>door{guess}</think><tool_call>{{"name": "open_door", "arguments": {{"code": '
                         f'{guess}}}}}'
                         "</tool_call><|im_end|>")
                gen = tokenizer(reply, add_special_tokens=False)["input_ids"]
                item = {"type": "function_call", "name": "open_door", "call_id": "c",
                        "arguments": f'{{"code": {guess}}}',
                        "prompt_token_ids": prompt, "generation_token_ids": gen,
                        "generation_log_probs": [-1.0] * len(gen)}
                result = {"response": {"output": [item]}, "reward": float(guess == code)}
                rollouts[r] = parse_rollout(result, Coords(step, g, r, 0), vocab_size=512, max_len=1024,
                                            overlong_filtering=False)
            outcomes.append(GroupOutcome(g, "committed", rollouts))
        batches.append(assemble(cfg, outcomes, pad_id=0)[0])
    return batches


def test_two_gloo_workers_on_two_nodes_match_one_worker(two_nodes):
    import ray
    from transformers import AutoTokenizer

    from minirl.trainer.policy_worker import PolicyWorker

    cfg = load_config(None, ["policy.train_micro_batch_size=4", "policy.optimizer.lr=1e-3",
                              f"policy.optimizer.eps={EPS}"])
    batches = real_batches(cfg, AutoTokenizer.from_pretrained(cfg.policy.model_name))
    ray.init(address=two_nodes, logging_level="error", log_to_driver=False,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}})
    try:
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        Worker = ray.remote(PolicyWorker)
        master = f"127.0.0.1:{free_port()}"
        pair = [Worker.options(num_cpus=1, resources={node: 0.5}).remote(cfg, rank, 2, master)
                for rank, node in enumerate(("node_a", "node_b"))]
        single = Worker.options(num_cpus=1, resources={"node_b": 0.5}).remote(cfg, 0, 1, None)
        hosts = ray.get([w.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()) for w in pair])
        assert len(set(hosts)) == 2, "the two ranks run on different nodes"
        for batch in batches:
            two = ray.get([w.train.remote(batch) for w in pair])
            one = ray.get(single.train.remote(batch))
            assert two[0]["loss"] == two[1]["loss"], "both ranks report the global loss"
            assert two[0]["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
            assert two[0]["train_tokens"] == one["train_tokens"] == batch.global_valid_tokens
        w2 = dict(ray.get(pair[0].get_weights.remote()))
        w1 = dict(ray.get(single.get_weights.remote()))
        w2b = dict(ray.get(pair[1].get_weights.remote()))
        worst = max(float(np.abs(w2[k] - w1[k]).max()) for k in w1)
        assert worst < WEIGHT_TOLERANCE, worst
        assert all(np.array_equal(w2[k], w2b[k]) for k in w2), "DDP keeps the ranks identical"
        moved = max(float(np.abs(w1[k] - v).max()) for k, v in
                    load_initial(cfg).items())
        assert moved > 50 * WEIGHT_TOLERANCE, "the steps really changed the weights"
    finally:
        ray.shutdown()


def load_initial(cfg) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.policy.model_name)
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}
