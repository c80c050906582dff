"""The policy worker in-process: masked traces change nothing, and the optional k3 KL to the
initial policy is computed against a real reference model."""

import numpy as np

from minirl.config import load_config
from minirl.trainer.policy_worker import PolicyWorker


def batch(rows=4, width=30, masked=()):
    rng = np.random.default_rng(0)
    b = {"input_ids": rng.integers(3, 400, size=(rows, width)), "loss_mask": np.zeros((rows, width), np.float32),
         "gen_logprobs": np.zeros((rows, width), np.float32), "lengths": np.full(rows, width),
         "sample_mask": np.ones(rows, np.float32), "advantages": np.linspace(-1, 1, rows).astype(np.float32)}
    b["loss_mask"][:, 15:] = 1
    for r in masked:
        b["sample_mask"][r] = 0
    return b


def test_a_masked_trace_changes_nothing():
    cfg = load_config(None, ["policy.train_micro_batch_size=2"])
    with_masked = batch(rows=5, masked=(4,))
    with_masked["advantages"][4] = 50.0  # would dominate the update if it were trained
    without = {k: (v[:4] if isinstance(v, np.ndarray) else v) for k, v in with_masked.items()}
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
    before = dict(worker.get_weights())
    bad = batch()
    bad["advantages"][1] = np.float32(np.inf)  # what a reward of 1e39 became as float32
    with pytest.raises(NonFiniteUpdate, match="the step was skipped and no weights were published"):
        worker.train(bad)
    after = dict(worker.get_weights())
    assert all(np.array_equal(before[k], after[k]) for k in before) and worker.steps_done == 0
    assert np.isfinite(worker.train(batch())["loss"])  # the next good batch trains
    assert all(np.isfinite(v).all() for _, v in worker.get_weights())
