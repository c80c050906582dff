"""`context_compaction.call_selection` (NeMo-RL's selection policies) and forest training's two
invariants, against float64 references written here:

- split/merged equivalence: a rollout whose calls are trained as one physical trace per call gives
  the same token-level loss and gradient as the reconstruction that chains its append-compatible
  calls into one trace, since every sampled token keeps its context and is trained once (the loss
  and gradient computed here in float64 through the real tiny model, not minirl's trainer);
- trace count does not create extra reward observations: a group's advantages and its baseline's
  rows are the same however many traces each rollout splits into.
"""

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from minirl.algo.grpo import clipped_pg_loss
from minirl.config import REPO_ROOT, ConfigError, load_config
from minirl.controller import assemble
from minirl.rollout.evidence import split_traces
from minirl.rollout.selection import resolve_selection_policy, select_all_captured, select_calls
from minirl.types import Call, GroupOutcome, Rollout
from minirl.wire import Coords

P = [1, 5, 6, 7]  # the episode's opening prompt
C0 = Call(P, [20, 21, 22], [-0.5, -0.4, -0.3])
C1 = Call(P + [20, 21, 22, 8, 9], [23, 24], [-0.2, -0.6])  # extends C0 (a tool result between)
C2 = Call(P + [20, 21, 22, 8, 9, 23, 24, 10], [25, 26, 27, 28], [-0.1] * 4)  # extends C1
BRANCH = Call(P + [20, 21, 22, 11], [30, 31], [-0.7, -0.8])  # extends C0 only: a branch the agent did not return
REJECTED = Call(P + [20, 21, 22, 12], [40, 41, 42], [-0.9] * 3)  # a summary request the harness rejected


def record(call: Call, key: str, t: float, status: int = 200, coords=(0, 0, 0, 0)) -> dict:
    s, g, r, a = coords
    return {"key": f"s{s}.g{g}.r{r}.a{a}.{key}", "call": int(key[1:]) if key[0] == "c" else key, "status": status,
            "t_start": t, "step": s, "group": g, "rollout": r, "attempt": a, "prompt_token_ids": list(call.prompt),
            "generation_token_ids": list(call.gen) if status == 200 else None,
            "generation_log_probs": list(call.logprobs) if status == 200 else None}


def records() -> list[dict]:
    """The attempt's captured calls, listed out of start order: C0, a 503 try of C1, the rejected
    summary request, C1, C2, then the branch."""
    return [record(C1, "c1", 4.0), record(C0, "c0", 1.0), record(C1, "c1", 2.0, status=503),
            record(REJECTED, "s1a0", 3.0),
            record(BRANCH, "c9", 7.0), record(C2, "c2", 6.0)]


def rollout(calls, traces=None, reward=1.0, r=0, mask=None) -> Rollout:
    return Rollout(Coords(0, 0, r, 0), reward, list(calls), traces if traces is not None else split_traces(list(calls)),
                   False,
                   {}, mask)


# ------------------------------------------------------------------------------------ the policies
def test_builtins_and_a_custom_path_resolve_as_upstreams_resolve_selection_policy():
    assert resolve_selection_policy("all_captured") is resolve_selection_policy("select_all_captured") \
        is select_all_captured
    assert resolve_selection_policy("returned_history").__name__ == "returned_history"
    assert resolve_selection_policy("test_call_selection:last_call_only") is last_call_only
    for bad, why in (("nope", "must be returned_history, all_captured or an importable package.module:function"),
                     ("no_such_module_x:f", "cannot import 'no_such_module_x:f': ModuleNotFoundError"),
                     ("math:no_such_fn", "cannot import 'math:no_such_fn': AttributeError"),
                     ("math:pi", "'math:pi' is not callable")):
        with pytest.raises(ConfigError, match=r"^context_compaction\.call_selection: " + why):
            load_config(None, [f"context_compaction.call_selection={bad}"])


def test_a_bad_policy_path_exits_2_before_ray_starts(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "minirl.train", "context_compaction.call_selection=no_such_module_x:f",
                           f"run_dir={tmp_path / 'run'}"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert proc.returncode == 2
    assert [x for x in proc.stderr.splitlines() if x.strip()] == [
        "ConfigError: context_compaction.call_selection: cannot import 'no_such_module_x:f': ModuleNotFoundError: "
        "No module named 'no_such_module_x'"]
    assert not (tmp_path / "run").exists()


def test_what_a_selection_needs_of_the_rest_of_the_config():
    with pytest.raises(ConfigError,
                       match=r"^context_compaction\.call_selection: all_captured needs minirl's own agents"):
        load_config(None, ["context_compaction.call_selection=all_captured", "agent.external_url=http://127.0.0.1:1"])
    with pytest.raises(ConfigError,
                       match=r"^context_compaction\.call_selection: all_captured needs context_compaction\.enabled"):
        load_config("configs/plain.yaml", ["context_compaction.call_selection=all_captured"])
    with pytest.raises(ConfigError, match=r"^loss_fn\.truncated_importance_sampling_type: seq-mask-tis with"):
        load_config(None,
                    ["context_compaction.call_selection=all_captured",
                     "loss_fn.use_importance_sampling_correction=true",
                           "loss_fn.truncated_importance_sampling_type=seq-mask-tis",
                           "loss_fn.truncated_importance_sampling_ratio=2",
                           "loss_fn.truncated_importance_sampling_ratio_min=0.5"])
    assert load_config(None).context_compaction.call_selection == "returned_history"  # upstream's default
    assert load_config("configs/upstream_pr4124.yaml").context_compaction.call_selection == "returned_history"


def test_all_captured_trains_every_usable_call_once_and_not_the_rejected_or_failed_ones():
    """The agent returned C0, C1, C2; the servers also captured a 503 try of C1, a rejected summary
    request and a branch off C0. `all_captured` trains C0, C1, C2 and the branch, each sampled token
    once, in two traces (the chain, then the branch with C0's tokens as its unmasked-off context)."""
    r = rollout([C0, C1, C2])
    assert select_calls("all_captured", [r], records(), max_len=1024) == 1
    # start order; the 503 and the rejected one out
    assert [c.gen for c in r.calls] == [C0.gen, C1.gen, C2.gen, BRANCH.gen]
    trained = [tok for t in r.traces for tok, m in zip(t.tokens, t.loss_mask) if m]
    assert trained == C0.gen + C1.gen + C2.gen + BRANCH.gen
    assert [len(t.tokens) for t in r.traces] == [len(C2.prompt) + 4, len(BRANCH.prompt) + 2]
    lps = [lp for t in r.traces for lp, m in zip(t.logprobs, t.loss_mask) if m]
    assert lps == C0.logprobs + C1.logprobs + C2.logprobs + BRANCH.logprobs  # the engine's record of each token
    # returned_history is today's path: nothing changes
    same = rollout([C0, C1, C2])
    assert select_calls("returned_history", [same], records(), max_len=1024) == 0 and same.calls == [C0, C1, C2]


def test_a_masked_rollout_keeps_its_returned_history():
    r = rollout([C0, C1, C2], mask="mask_sample")
    assert select_calls("all_captured", [r], records(), max_len=1024) == 0 and len(r.calls) == 3


def last_call_only(records, result):
    """A custom policy with upstream's signature: the last usable captured call alone."""
    usable = [rec for rec in records if rec["status"] == 200]
    return usable[-1:], usable[-1]["key"]


def stray_record(records, result):
    return [{**records[0], "key": "forged"}], None


def unselected_terminal(records, result):
    return records[:1], "s0.g0.r0.a0.c2"


def test_a_custom_policy_chooses_membership_and_minirl_checks_it():
    r = rollout([C0, C1, C2])
    assert select_calls("test_call_selection:last_call_only", [r], records(), max_len=1024) == 1
    # the last to start
    assert [c.gen for c in r.calls] == [BRANCH.gen] and sum(r.traces[0].loss_mask) == len(BRANCH.gen)
    with pytest.raises(RuntimeError, match="selected 1 record.* not usable captured calls of attempt s0.g0.r0.a0"):
        select_calls("test_call_selection:stray_record", [rollout([C0])], records(), max_len=1024)
    with pytest.raises(RuntimeError,
                       match="named terminal response 's0.g0.r0.a0.c2' of attempt s0.g0.r0.a0, "
                             "which it did not select"):
        select_calls("test_call_selection:unselected_terminal", [rollout([C0])], records(), max_len=1024)


def test_a_reconstruction_longer_than_the_trainer_holds_keeps_the_returned_history():
    r = rollout([C0, C1, C2])
    assert select_calls("all_captured", [r], records(), max_len=len(BRANCH.prompt)) == 0 and len(r.calls) == 3


# ------------------------------------------------------------------ forest training's invariants
def config(g=3):
    return load_config(None, [f"grpo.num_generations_per_prompt={g}", "grpo.num_prompts_per_step=1",
                              f"policy.train_global_batch_size={g}"])


def group(split: bool) -> GroupOutcome:
    """Rollout 0 (C0, C1, C2, BRANCH) as one trace per call (split) or chained where calls extend
    each other (merged); rollouts 1 and 2 of one trace each."""
    calls = [C0, C1, C2, BRANCH]
    traces = [t for c in calls for t in split_traces([c])] if split else split_traces(calls)
    r1, r2 = Call([2, 3], [50, 51, 52], [-0.3] * 3), Call([2, 4], [53], [-1.0])
    return GroupOutcome(0, "committed", {0: rollout(calls, traces, 1.0), 1: rollout([r1], reward=0.0, r=1),
                                         2: rollout([r2], reward=0.25, r=2)})


def test_trace_count_creates_no_extra_reward_observation():
    split, s_stats = assemble(config(), [group(True)], pad_id=0)
    merged, m_stats = assemble(config(), [group(False)], pad_id=0)
    assert (len(split.lengths), len(merged.lengths)) == (6, 4)
    # the reference: leave-one-out over the 3 rollouts' rewards, whatever their trace counts
    others = [[0.0, 0.25], [1.0, 0.25], [1.0, 0.0]]
    want = [(x - np.mean(o)) / (np.std(o, ddof=1) + 1e-6) for x, o in zip([1.0, 0.0, 0.25], others)]
    for batch in (split, merged):
        got = [batch.advantages[batch.rollout == r] for r in range(3)]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-6)
    for key in ("train/masking/rows", "train/masking/baseline_rows", "rollouts_trained", "tokens_trained"):
        assert s_stats[key] == m_stats[key], key
    assert s_stats["train/masking/rows"] == 3 and s_stats["tokens_trained"] == 3 + 2 + 4 + 2 + 3 + 1


def f64_loss_and_grad(model, batch) -> tuple[float, list[torch.Tensor]]:
    """Upstream's token-level clipped loss of `batch` in float64 through `model`: each token's
    logprob given its prefix, prev = curr - 0.3 sin(1.7 x position + rollout) (ratios past both
    clips), summed over the valid tokens and divided by their count."""
    model.zero_grad()
    ids = torch.as_tensor(batch.input_ids)
    attn = (torch.arange(ids.shape[1])[None] < torch.as_tensor(batch.lengths)[:, None]).long()
    logits = model(input_ids=ids, attention_mask=attn).logits.double()
    lp = torch.nn.functional.pad(torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0))
    pos = torch.arange(ids.shape[1], dtype=torch.float64)[None]
    prev = lp.detach() - 0.3 * torch.sin(1.7 * pos + torch.as_tensor(batch.rollout, dtype=torch.float64)[:, None])
    mask = torch.as_tensor(batch.valid_mask(), dtype=torch.float64)
    loss, _ = clipped_pg_loss(lp, prev, torch.as_tensor(batch.advantages, dtype=torch.float64), mask,
                              batch.global_valid_tokens)
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters()]


def f64_rms_norm(self, x):
    """Qwen2's RMSNorm without its float32 round trip (its backward would be float32 too)."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def test_split_and_merged_traces_train_the_same_loss_and_gradient(monkeypatch):
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen2 import modeling_qwen2

    monkeypatch.setattr(modeling_qwen2.Qwen2RMSNorm, "forward", f64_rms_norm)
    model = AutoModelForCausalLM.from_pretrained(REPO_ROOT / "models" / "tiny-doors", dtype=torch.float64)
    split, _ = assemble(config(), [group(True)], pad_id=0)
    merged, _ = assemble(config(), [group(False)], pad_id=0)
    loss_s, grad_s = f64_loss_and_grad(model, split)
    loss_m, grad_m = f64_loss_and_grad(model, merged)
    assert abs(loss_s) > 1e-3 and loss_s == pytest.approx(loss_m, rel=1e-12, abs=1e-14)
    norm = math.sqrt(sum(float((g ** 2).sum()) for g in grad_m))
    assert norm > 1e-3
    assert max(float((a - b).abs().max()) for a, b in zip(grad_s, grad_m)) <= 1e-12 * max(norm, 1.0)
    # the check can fail: a reconstruction that trains C0's tokens a second time (in C1's row) does not match
    twice = split
    row = int(np.flatnonzero((split.rollout == 0))[1])  # C1's own row: C0's tokens are its context
    twice.loss_mask[row, len(P):len(P) + len(C0.gen)] = 1
    loss_t, grad_t = f64_loss_and_grad(model, twice.count_valid())
    assert abs(loss_t - loss_m) > 1e-4 and max(float((a - b).abs().max()) for a, b in zip(grad_t, grad_m)) > 1e-4


# ------------------------------------------------------------------------------ a real stack's records
def every_usable_record(records, result):
    """A custom policy that would train the harness's rejected summary requests too."""
    kept = [rec for rec in records if rec["status"] == 200 and rec.get("generation_token_ids")]
    return kept, kept[-1]["key"] if kept else None


def test_selection_over_a_real_stacks_call_records(stack, base_cfg, tokenizer):
    """Two summarizing episodes through the real agent server and model server (the tiny model
    never writes a summary block, so each compaction's 3 requests are rejected, then recency takes
    over): the servers' records pass the ledger; `all_captured` changes nothing (minirl's agents
    return every call, the rejected requests stay out); a custom policy that selects a rejected
    request (which the ledger retired) ends the run naming it; one that picks a subset trains it,
    each sampled token once."""
    import asyncio

    from test_summarize import SUMMARY, post, row_of, stack_cfg

    from minirl.rollout.evidence import Ledger, parse_rollout
    from minirl.wire import is_summary_call

    cfg = stack_cfg(base_cfg, (f"{SUMMARY}.on_summary_failure", "recency_fallback"))
    max_len = cfg.policy.max_total_sequence_length

    async def go():
        async with stack(cfg) as s:
            results = await asyncio.gather(*(post(s.agent_url, row_of(cfg, rollout=r, seed=3)) for r in range(2)))
            return results, s.model.take_calls(0)

    results, calls = asyncio.run(go())

    def parsed():
        return [parse_rollout(body, Coords(0, 0, r, 0), vocab_size=len(tokenizer), max_len=max_len,
                              overlong_filtering=True)
                for r, (_, body) in enumerate(results)]

    rollouts = parsed()
    assert Ledger(None).close_step(0, calls, rollouts, version=0)["calls_unrecorded"] == 0
    returned = [[c.gen for c in r.calls] for r in rollouts]
    assert (select_calls("all_captured", rollouts, calls, max_len) == 0
            and [[c.gen for c in r.calls] for r in rollouts] == returned)
    rejected = [c for c in calls if is_summary_call(c["call"])]
    assert len(rejected) == 6
    with pytest.raises(RuntimeError,
                       match=r"every_usable_record selected 3 record\(s\) that are not usable captured calls"):
        select_calls("test_call_selection:every_usable_record", parsed(), calls, max_len)
    last = parsed()
    assert select_calls("test_call_selection:last_call_only", last, calls, max_len) == 2
    for r, gens in zip(last, returned):  # the last call alone, each of its sampled tokens once
        assert [c.gen for c in r.calls] == [gens[-1]] and sum(sum(t.loss_mask) for t in r.traces) == len(gens[-1])
