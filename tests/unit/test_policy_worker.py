"""The policy worker in-process: masked traces change nothing, and the optional k3 KL to the
initial policy is computed against a real reference model."""

import numpy as np
import pytest

from minirl.config import load_config
from minirl.trainer.policy_worker import PolicyWorker
from minirl.types import TrainBatch


def batch(rows=4, width=30, masked=()):
    rng = np.random.default_rng(0)
    b = TrainBatch(input_ids=rng.integers(3, 400, size=(rows, width)), loss_mask=np.zeros((rows, width), np.float32),
                   gen_logprobs=np.zeros((rows, width), np.float32), lengths=np.full(rows, width),
                   sample_mask=np.ones(rows, np.float32), advantages=np.linspace(-1, 1, rows).astype(np.float32))
    b.loss_mask[:, 15:] = 1
    for r in masked:
        b.sample_mask[r] = 0
    return b


def test_a_masked_trace_changes_nothing():
    cfg = load_config(None, ["policy.train_micro_batch_size=2"])
    with_masked = batch(rows=5, masked=(4,))
    with_masked.advantages[4] = 50.0  # would dominate the update if it were trained
    without = TrainBatch(**{k: (v[:4] if isinstance(v, np.ndarray) else v) for k, v in vars(with_masked).items()})
    a, b = PolicyWorker(cfg), PolicyWorker(cfg)
    sa, sb = a.train(with_masked), b.train(without)
    assert sa["train_tokens"] == sb["train_tokens"] == 4 * 15
    assert sa["loss"] == sb["loss"]
    wa, wb = dict(a.get_weights()), dict(b.get_weights())
    assert all(np.array_equal(wa[k], wb[k]) for k in wa)


def test_k3_kl_to_the_reference_policy():
    cfg = load_config(None, ["loss_fn.reference_policy_kl_penalty=0.01", "policy.optimizer.lr=1e-2"])
    worker = PolicyWorker(cfg)
    assert worker.reference is not None
    first = worker.train(batch())
    second = worker.train(batch())
    assert first["kl"] == 0.0  # the policy still equals its reference
    assert second["kl"] > 0.0  # one step later it does not


def test_a_non_finite_loss_skips_the_step_and_keeps_the_weights():
    import pytest

    from minirl.trainer.policy_worker import NonFiniteUpdate

    cfg = load_config(None, ["policy.train_micro_batch_size=2"])
    worker = PolicyWorker(cfg)
    before = {k: v.copy() for k, v in worker.get_weights()}  # get_weights' arrays share the live parameters' memory
    bad = batch()
    bad.advantages[1] = np.float32(np.inf)  # what a reward of 1e39 became as float32
    with pytest.raises(NonFiniteUpdate, match="the step was skipped and no weights were published"):
        worker.train(bad)
    after = dict(worker.get_weights())
    assert all(np.array_equal(before[k], after[k]) for k in before) and worker.steps_done == 0
    assert np.isfinite(worker.train(batch())["loss"])  # the next good batch trains
    assert all(np.isfinite(v).all() for _, v in worker.get_weights())
    assert not all(np.array_equal(before[k], v) for k, v in worker.get_weights()), "...and moves the weights"


def test_a_resume_takes_the_optimizer_settings_of_its_config_and_the_moments_of_the_checkpoint(tmp_path):
    """torch's load_state_dict restores the saved lr, betas, eps and weight_decay; a resume may
    change them (config.yaml and NonFiniteUpdate show the new ones), so they must be the ones that run."""
    import torch

    old = PolicyWorker(load_config(None, ["policy.optimizer.lr=1e-3", "policy.optimizer.weight_decay=0.1"]))
    old.train(batch())
    old.save(str(tmp_path))
    new_cfg = load_config(None, ["policy.optimizer.lr=1e-6", "policy.optimizer.weight_decay=0.0",
                                 "policy.optimizer.betas=[0.8,0.99]", "policy.optimizer.eps=1e-6"])
    new = PolicyWorker(new_cfg)
    new.load(str(tmp_path))
    for group in new.optimizer.param_groups:
        settings = (group["lr"], tuple(group["betas"]), group["eps"], group["weight_decay"])
        assert settings == (1e-6, (0.8, 0.99), 1e-6, 0.0)
    moments = [(old.optimizer.state[p], new.optimizer.state[q])
               for p, q in zip(old.model.parameters(), new.model.parameters())]
    assert moments and all(torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
                           and float(a["step"]) == float(b["step"]) == 1 for a, b in moments), "the moments carry over"
    assert new.steps_done == 1


def test_a_sharded_checkpoint_loads_and_one_missing_a_weight_is_refused(tmp_path):
    """save_pretrained shards a large model (model-0000N-of-M.safetensors and an index): `load` read
    model.safetensors alone and failed on it. And with strict=False, a checkpoint missing a weight
    loaded silently, that weight left at the base model's; only the tied head may be absent."""
    import torch
    from safetensors.torch import load_file, save_file

    from minirl.trainer.checkpoint import CheckpointError

    old = PolicyWorker(load_config(None, ["policy.optimizer.lr=1e-2"]))
    old.train(batch())
    old.save(str(tmp_path))
    old.model.save_pretrained(tmp_path / "policy", safe_serialization=True, max_shard_size="200KB")
    (tmp_path / "policy" / "model.safetensors").unlink()
    assert (tmp_path / "policy" / "model.safetensors.index.json").exists()
    new = PolicyWorker(load_config())
    new.load(str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(old.model.state_dict().values(), new.model.state_dict().values()))

    shard = sorted((tmp_path / "policy").glob("model-*.safetensors"))[0]
    weights = load_file(str(shard))
    dropped = sorted(weights)[0]
    save_file({k: v for k, v in weights.items() if k != dropped}, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"does not hold .*tiny-doors's weights: missing \['{dropped}'\]"):
        PolicyWorker(load_config()).load(str(tmp_path))


def reference_top_p_logprob(logits_row, target, temperature, top_p):
    """float64, from the definition vLLM's processed logprobs use: probabilities of logits /
    temperature sorted ascending; a token is dropped when the cumulative probability of it and
    every smaller one is <= 1 - top_p (the most likely token always stays); the rest renormalised.
    Returns (logprob of `target` or None when it is dropped, the smallest distance of a cumulative
    sum from the boundary, to skip positions that float32 may decide the other way)."""
    z = np.asarray(logits_row, dtype=np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(p, kind="stable")
    cum = np.cumsum(p[order])
    keep = np.ones(len(p), dtype=bool)
    keep[order[cum <= 1 - top_p]] = False
    keep[order[-1]] = True
    margin = float(np.min(np.abs(cum - (1 - top_p))))
    if not keep[target]:
        return None, margin
    return float(np.log(p[target] / p[keep].sum())), margin


def test_top_p_filter_is_vllms():
    """The trainer's nucleus is exactly vLLM's (its own apply_top_k_top_p_pytorch, on the same float32 logits)."""
    import torch
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from minirl.trainer.policy_worker import top_p_filter

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 400, generator=g) * 3
    logits[0, :5] = 7.0  # ties at the top
    for p in (0.1, 0.5, 0.9, 0.99):
        ours = top_p_filter(logits.clone(), p)
        theirs = apply_top_k_top_p_pytorch(logits.clone(), None, torch.full((64,), p))
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), p
        assert torch.equal(ours[~torch.isinf(ours)], logits[~torch.isinf(ours)])


def test_top_p_logprobs_match_a_float64_reference():
    import torch

    from minirl.trainer.policy_worker import token_logprobs

    cfg = load_config(None, [])
    worker = PolicyWorker(cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.as_tensor(batch(rows=6, width=24).input_ids)
    with torch.no_grad():  # tokens 8.. sampled from the model itself (most inside a nucleus, some not)
        for t in range(8, ids.shape[1]):
            probs = worker.model(input_ids=ids[:, :t]).logits[:, -1].float().softmax(-1)
            ids[:, t] = torch.multinomial(probs, 1, generator=g)[:, 0]
        attn = torch.ones_like(ids)
        logits = worker.model(input_ids=ids, attention_mask=attn).logits.double()
    for temperature, top_p in ((1.0, 0.9), (0.7, 0.5), (1.0, 0.2)):
        with torch.no_grad():
            got = token_logprobs(worker.model, ids, attn, temperature, top_p)
            plain = token_logprobs(worker.model, ids, attn, temperature)
        dropped = checked = 0
        for i in range(ids.shape[0]):
            for t in range(1, ids.shape[1]):
                want, margin = reference_top_p_logprob(logits[i, t - 1].numpy(), int(ids[i, t]), temperature, top_p)
                if margin < 1e-5:
                    continue  # at the boundary float32 may round either way
                checked += 1
                if want is None:
                    dropped += 1
                    assert got[i, t] == 0.0  # outside the nucleus: 0, as upstream's mask_out_neg_inf_logprobs
                else:
                    assert float(got[i, t]) == pytest.approx(want, abs=2e-5)
                    assert float(got[i, t]) >= float(plain[i, t]) - 1e-6  # renormalised over fewer tokens
        assert checked > 80 and 0 < dropped < checked
    # top_p = 1: the unfiltered log-softmax, exactly as before
    with torch.no_grad():
        want = torch.log_softmax(worker.model(input_ids=ids, attention_mask=attn).logits.float()[:, :-1], dim=-1)
        assert torch.equal(token_logprobs(worker.model, ids, attn, 1.0)[:, 1:],
                           want.gather(-1, ids[:, 1:, None]).squeeze(-1))


def test_logprobs_from_the_first_trained_position_skip_the_lm_head_before_it():
    """`first`: the same logprobs from there on, bit for bit, 0 before it, and the LM head computes
    only the positions from first - 1 on (Hugging Face's `logits_to_keep`); a model whose forward
    takes no `logits_to_keep` gets the same numbers from its full logits."""
    import torch

    from minirl.trainer.policy_worker import token_logprobs

    worker = PolicyWorker(load_config(None, []))
    ids = torch.as_tensor(batch(rows=3, width=40).input_ids)
    attn = torch.ones_like(ids)
    attn[1, 33:] = 0
    seen = []
    hook = worker.model.lm_head.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[1]))

    class Plain(torch.nn.Module):  # a forward without logits_to_keep
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask)

    with torch.no_grad():
        for top_p in (1.0, 0.5):
            full = token_logprobs(worker.model, ids, attn, 0.7, top_p)
            assert seen[-1] == 40
            part = token_logprobs(worker.model, ids, attn, 0.7, top_p, first=25)
            assert seen[-1] == 16  # positions 24 .. 39
            assert torch.equal(part[:, 25:], full[:, 25:]) and bool((part[:, :25] == 0).all())
            assert torch.equal(token_logprobs(Plain(worker.model), ids, attn, 0.7, top_p, first=25), part)
            assert torch.equal(token_logprobs(worker.model, ids, attn, 0.7, top_p, first=0), full)
    hook.remove()


def test_top_p_training_step_and_kl_on_unfiltered_logprobs():
    """With top_p < 1 the worker trains against filtered logprobs (a token outside the nucleus has
    no gradient) and the KL compares unfiltered ones with the unfiltered reference: 0 at step 0."""
    cfg = load_config(None, ["policy.generation.top_p=0.5", "loss_fn.reference_policy_kl_penalty=0.01",
                             "policy.optimizer.lr=1e-2"])
    import torch

    worker = PolicyWorker(cfg)
    b = batch()
    with torch.no_grad():  # the trained tokens sampled from the model itself, as the engine would
        ids = torch.as_tensor(b.input_ids)
        for t in range(15, ids.shape[1]):
            ids[:, t] = torch.multinomial(worker.model(input_ids=ids[:, :t]).logits[:, -1].float().softmax(-1), 1,
                                          generator=torch.Generator().manual_seed(t))[:, 0]
    b.input_ids = ids.numpy()
    lp = worker.logprobs(b)[:, 15:]
    assert (lp <= 0).all() and (lp == 0).any() and (lp < 0).any()  # some sampled tokens fall outside a 0.5 nucleus
    first = worker.train(b)
    second = worker.train(b)
    assert np.isfinite(first["loss"]) and np.isfinite(second["loss"])
    assert first["kl"] == 0.0 and second["kl"] > 0.0


def test_sequence_level_loss_is_normalised_by_the_valid_rows():
    """token_level_loss=false: upstream's masked_mean(masked_mean(loss, token_mask, -1), sample_mask,
    global_valid_seqs), global_valid_seqs being the sample-mask sum over the batch's rows. At
    ratio 1 each row's token mean is -A, so the loss is -(sum of A over the valid rows) / rows."""
    cfg = load_config(None, ["policy.train_micro_batch_size=2", "context_compaction.enabled=false",
                             "agent.name=simple_agent", "loss_fn.token_level_loss=false"])
    b = batch(rows=5, masked=(1,))
    b.advantages = np.array([0.5, 9.0, -0.25, 1.0, 0.75], np.float32)
    b.loss_mask[3, :25] = 0  # rows of different lengths: each still counts once
    stats = PolicyWorker(cfg).train(b)
    valid = [0, 2, 3, 4]
    assert stats["loss"] == pytest.approx(-float(b.advantages[valid].sum()) / len(valid), rel=1e-6)
