"""GPU-only: one bf16 GRPO update on CUDA through the policy worker. Skipped without a GPU (CI)."""

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_bf16_policy_update_on_cuda():
    from minirl.config import load_config
    from minirl.trainer.policy_worker import PolicyWorker
    from minirl.types import TrainBatch

    cfg = load_config(None, ["policy.precision=bfloat16", "cluster.gpus_per_policy_worker=1"])
    worker = PolicyWorker(cfg)
    assert worker.device.type == "cuda" and next(worker.model.parameters()).dtype == torch.bfloat16
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 400, size=(8, 40))
    mask = np.zeros((8, 40), np.float32)
    mask[:, 20:] = 1
    batch = TrainBatch(input_ids=ids, loss_mask=mask, gen_logprobs=np.zeros((8, 40), np.float32),
                       lengths=np.full(8, 40), sample_mask=np.ones(8, np.float32),
                       advantages=np.array([1, -1] * 4, np.float32))
    before = {k: v.copy() for k, v in worker.get_weights()}
    stats = worker.train(batch)
    after = dict(worker.get_weights())
    assert np.isfinite(stats["loss"]) and stats["train_tokens"] == 160
    assert any(not np.array_equal(before[k], after[k]) for k in before)
