"""The policy worker (a Ray actor): recompute logprobs, GRPO loss, one AdamW step per RL step; with N
workers, one torch.distributed group running DDP that computes the same update as one worker.

Invariant: one `train` call makes exactly one optimizer step over every trace with a non-zero
mask, or none at all: a non-finite loss, gradient norm, parameter or logits after the step raises
NonFiniteUpdate before anything is published, so the weights stay finite. The loss is
token-normalised over what is trained, whatever the step's size; the logprobs it trains against
are its own (the generator's only weight them, with use_importance_sampling_correction).
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from minirl.algo.grpo import clipped_pg_loss
from minirl.config import MinirlConfig
from minirl.types import TrainBatch

if TYPE_CHECKING:
    import torch


TOTALS = ("loss", "clip_fraction", "kl", "is_oob", "is_units", "abs_err", "mult_err", "tokens")
"""What `train` sums over micro-batches (and ranks) before it reports the step."""


class NonFiniteUpdate(RuntimeError):
    """The step's loss or gradient norm is not finite: the optimizer step was skipped."""


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """vLLM's nucleus filter (`apply_top_k_top_p`, its PyTorch path): sort each row's probabilities
    ascending, drop every token whose cumulative probability (itself and all smaller ones) is
    <= 1 - top_p, always keep the most likely one; dropped logits become -inf."""
    import torch

    ascending, order = logits.sort(dim=-1)
    drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
    drop[..., -1] = False
    return logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float,
                   top_p: float = 1.0, also_unfiltered: bool = False, first: int = 1):
    """[B, T] logprob of each token given its prefix (position 0 gets 0), from the distribution
    vLLM samples and reports as its processed logprobs: logits / temperature, then, with
    top_p < 1, nucleus-filtered (`top_p_filter`) and renormalised, as upstream filters the
    trainer's side so the two compare. A token outside the trainer's nucleus gets logprob 0 with
    no gradient (upstream's `mask_out_neg_inf_logprobs`). With `also_unfiltered`, returns
    (filtered, unfiltered): upstream's KL uses the unfiltered ones. Positions before `first` (no
    row trains a token there) get 0, and the LM head skips them where the model takes
    `logits_to_keep` (Hugging Face's, as TRL asks for its completions alone): on the ~12M / 32k-vocab
    model, whose prompts are most of each row, that took 38% off the update (bench/README.md, P2)."""
    import torch
    import torch.nn.functional as F

    first = max(1, min(first, input_ids.shape[1]))
    keep = input_ids.shape[1] - first + 1  # the logits at positions first-1 .. T-1
    if first > 1 and _keeps_logits(model):
        logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep).logits.float()
    else:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, first - 1 :].float()
    if temperature != 1.0:
        logits = logits / temperature
    logits, targets = logits[:, :-1], input_ids[:, first:, None]
    raw = F.pad(torch.log_softmax(logits, dim=-1).gather(-1, targets).squeeze(-1), (first, 0))
    if top_p >= 1.0:
        return (raw, raw) if also_unfiltered else raw
    lp = torch.log_softmax(top_p_filter(logits, top_p), dim=-1).gather(-1, targets).squeeze(-1)
    lp = F.pad(torch.where(torch.isneginf(lp), torch.zeros_like(lp), lp), (first, 0))
    return (lp, raw) if also_unfiltered else lp


def _keeps_logits(model) -> bool:
    """Does the model's forward take `logits_to_keep` (through a DDP wrapper too)?"""
    return _forward_keeps_logits(type(getattr(model, "module", model)))


@functools.cache
def _forward_keeps_logits(cls: type) -> bool:
    """`_keeps_logits` by the model's class: read once, not on every micro-batch."""
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


class PolicyWorker:
    """One rank of the policy. With N workers they form one torch.distributed group (gloo on CPU, NCCL
    on GPU) and run DDP: each rank takes every N-th trace, the loss is divided by the *global*
    valid-token count (summed across ranks with an all-reduce), and DDP's gradient average is undone
    by scaling the loss by N, so N workers compute the same update as one.

    torch is imported inside the functions: the driver imports this module only to hand the class to
    `ray.remote`, and a top-level import would cost every run ~2 s before its first actor starts."""

    def __init__(self, cfg: MinirlConfig, rank: int = 0, world_size: int = 1, master: str | None = None):
        import torch
        from transformers import AutoModelForCausalLM

        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        torch.set_num_threads(cfg.policy.train_threads)  # Ray pins OMP threads to num_cpus otherwise
        torch.manual_seed(cfg.grpo.seed)
        gpu = torch.cuda.is_available() and cfg.cluster.gpus_per_policy_worker > 0
        self.device = torch.device("cuda" if gpu else "cpu")
        dtype = torch.bfloat16 if cfg.policy.precision == "bfloat16" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(cfg.policy.model_name, dtype=dtype).to(self.device)
        self.model.config.use_cache = False
        self.reference = None
        if cfg.loss_fn.reference_policy_kl_penalty > 0:
            reference = AutoModelForCausalLM.from_pretrained(cfg.policy.model_name, dtype=dtype)
            self.reference = reference.to(self.device).eval()
        opt = cfg.policy.optimizer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay
        )
        self.net = self.model
        if world_size > 1:
            import torch.distributed as dist

            addr, port = master.split(":")
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, port
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, rank=rank, world_size=world_size)
            self.net = torch.nn.parallel.DistributedDataParallel(self.model)
        self.steps_done = 0

    def _global(self, value: float) -> float:
        if self.world_size == 1:
            return value
        import torch
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item())

    def train(self, batch: TrainBatch) -> dict:
        """One optimizer step over the batch: this rank's micro-batches -> loss -> summed totals."""
        started = time.perf_counter()
        valid = batch.valid_mask()
        rows = np.flatnonzero(valid.sum(-1) > 0)
        mine = rows[self.rank :: self.world_size]
        token_level = self.cfg.loss_fn.token_level_loss
        normalizer = max(self._global(float(valid[mine].sum()) if token_level else float(len(mine))), 1.0)
        micro = self.cfg.policy.train_micro_batch_size
        # the same on every rank (DDP needs it)
        n_micro = max(1, math.ceil(math.ceil(len(rows) / self.world_size) / micro))
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals = dict.fromkeys(TOTALS, 0.0)
        for k in range(n_micro):
            idx = mine[k * micro : (k + 1) * micro]
            with self.net.no_sync() if (self.world_size > 1 and k < n_micro - 1) else nullcontext():
                self._micro_step(batch, valid, idx, normalizer, totals)
        loss, grad_norm = self._optimizer_step(totals)
        self._check_update(batch, rows)
        self.steps_done += 1
        return {**self._report(totals, loss, grad_norm), "timing/train/policy_compute": time.perf_counter() - started}

    def _micro_step(self, batch: TrainBatch, valid: np.ndarray, idx: np.ndarray, normalizer: float,
                    totals: dict) -> None:
        """Forward and backward over one micro-batch's rows, adding its sums to `totals`. An empty
        one still runs a zero backward: DDP needs the same collective count on every rank."""
        import torch

        if len(idx) == 0:
            out = self.net(input_ids=torch.zeros((1, 2), dtype=torch.long, device=self.device)).logits
            (out.sum() * 0.0).backward()
            return
        width = int(batch.lengths[idx].max())
        ids = torch.as_tensor(batch.input_ids[idx, :width], device=self.device)
        attn = (torch.arange(width)[None, :] < torch.as_tensor(batch.lengths[idx])[:, None]).long().to(self.device)
        mask = torch.as_tensor(valid[idx, :width], device=self.device)
        gen_lp = torch.as_tensor(batch.gen_logprobs[idx, :width], device=self.device)
        adv = torch.as_tensor(batch.advantages[idx], device=self.device)
        weights = None if batch.loss_weight is None else torch.as_tensor(batch.loss_weight[idx], device=self.device)
        loss, m, prev = self._loss(ids, attn, adv, mask, gen_lp, normalizer, weights)
        (loss * self.world_size).backward()  # DDP averages gradients over ranks
        with torch.no_grad():
            n = float(mask.sum())
            diff = (prev - gen_lp) * mask
            totals["loss"] += float(loss)
            totals["clip_fraction"] += m["clip_fraction"] * n
            totals["kl"] += m["kl"] * n
            totals["is_oob"] += m["is_oob"]
            totals["is_units"] += m["is_units"]
            totals["abs_err"] += float(diff.abs().sum())
            totals["mult_err"] += float((torch.exp(diff.abs()) * mask).sum())
            totals["tokens"] += n

    def _loss(self, ids, attn, adv, mask, gen_lp, normalizer: float, weights=None):
        """The micro-batch's clipped policy-gradient loss, its metrics and the pre-update logprobs;
        `weights`: the rows' segment weights (None: every token counts once)."""
        import torch

        temperature, top_p = self.cfg.policy.generation.temperature, self.cfg.policy.generation.top_p
        lf = self.cfg.loss_fn
        first = int(mask.any(0).float().argmax())  # the micro-batch's first trained position: none before it
        curr, curr_unfiltered = token_logprobs(self.net, ids, attn, temperature, top_p, also_unfiltered=True,
                                               first=first)
        prev = curr.detach()  # one optimizer step per batch: the pre-update policy is this one
        ref = None
        if self.reference is not None:  # unfiltered, as upstream's reference logprobs
            with torch.no_grad():
                ref = token_logprobs(self.reference, ids, attn, temperature, first=first)
        loss, m = clipped_pg_loss(
            curr, prev, adv, mask, normalizer, lf.ratio_clip_min, lf.ratio_clip_max,
            ref, lf.reference_policy_kl_penalty, lf.token_level_loss,
            gen_lp if lf.use_importance_sampling_correction else None, lf.truncated_importance_sampling_type,
            lf.truncated_importance_sampling_ratio, lf.truncated_importance_sampling_ratio_min,
            curr_unfiltered if top_p < 1.0 else None, weights,
        )
        return loss, m, prev

    def _optimizer_step(self, totals: dict) -> tuple[float, float]:
        """Clip, then step, unless the global loss or the gradient norm is not finite (NonFiniteUpdate)."""
        import torch

        clip = self.cfg.policy.max_grad_norm
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf")))
        loss = self._global(totals["loss"])
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteUpdate(
                f"loss={loss} grad_norm={grad_norm} at optimizer step {self.steps_done}: the step was skipped "
                "and no weights were published"
            )
        self.optimizer.step()
        return loss, grad_norm

    def _report(self, totals: dict, loss: float, grad_norm: float) -> dict:
        """The step's metrics: the global totals, per trained token where they are sums over tokens."""
        tokens = self._global(totals["tokens"])
        return {
            "loss": loss,
            "grad_norm": grad_norm,
            "clip_fraction": self._global(totals["clip_fraction"]) / max(tokens, 1),
            "kl": self._global(totals["kl"]) / max(tokens, 1),
            "is_oob_ratio": self._global(totals["is_oob"]) / max(self._global(totals["is_units"]), 1),
            "logprob_abs_error": self._global(totals["abs_err"]) / max(tokens, 1),
            "token_mult_prob_error": self._global(totals["mult_err"]) / max(tokens, 1),
            "train_tokens": tokens,
        }

    def _check_update(self, batch: TrainBatch, rows: np.ndarray) -> None:
        """The weights the step left are finite, and so are the logits of a forward pass on one of the
        step's sequences; else NonFiniteUpdate naming the step, the lr and what is not finite (a huge
        learning rate leaves finite weights whose activations overflow)."""
        import torch

        with torch.no_grad():
            params = list(self.model.named_parameters())
            what = next((f"parameter {name}" for name, p in params if not torch.isfinite(p).all()), None)
            if what is None:
                n = int(batch.lengths[rows[0]]) if len(rows) else 2
                ids = batch.input_ids[rows[:1], :n] if len(rows) else np.zeros((1, 2), dtype=np.int64)
                self.model.eval()
                logits = self.model(input_ids=torch.as_tensor(ids, device=self.device)).logits
                self.model.train()
                bad = int((~torch.isfinite(logits)).sum())
                what = (f"the logits of a forward pass on a trained sequence ({bad} of {logits.numel()})"
                        if bad else None)
            if what is None:
                return
            largest = float(max(p.detach().abs().max().float() for _, p in params))
        raise NonFiniteUpdate(
            f"after optimizer step {self.steps_done} (policy.optimizer.lr={self.cfg.policy.optimizer.lr:g}) "
            f"{what} not finite "
            f"(largest |weight| {largest:.3g}): the update diverged, and no weights were published"
        )

    def get_weights(self) -> list[tuple[str, np.ndarray]]:
        """Hugging Face names -> float32 numpy arrays (cheap to send through Ray)."""
        import torch

        return [(k, v.detach().to("cpu", torch.float32).numpy()) for k, v in self.model.state_dict().items()]

    def logprobs(self, batch: TrainBatch) -> np.ndarray:
        """Re-score a batch's tokens (for tests and the engine-contract check)."""
        import torch

        self.model.eval()
        with torch.no_grad():
            width = int(batch.lengths.max())
            ids = torch.as_tensor(batch.input_ids[:, :width], device=self.device)
            attn = (torch.arange(width)[None, :] < torch.as_tensor(batch.lengths)[:, None]).long().to(self.device)
            gen = self.cfg.policy.generation
            return token_logprobs(self.model, ids, attn, gen.temperature, gen.top_p).float().cpu().numpy()

    def save(self, directory: str) -> None:
        import torch

        path = Path(directory)
        if self.rank == 0:
            self.model.save_pretrained(path / "policy", safe_serialization=True)
            torch.save(
                {"optimizer": self.optimizer.state_dict(), "torch_rng": torch.get_rng_state(),
                 "steps_done": self.steps_done},
                path / "trainer_state.pt",
            )

    def load(self, directory: str) -> None:
        """The checkpoint's weights (one safetensors file, or the shards its index names, as
        save_pretrained writes a large model), optimizer moments, RNG and step count; the optimizer's
        settings (policy.optimizer.*) are this run's config, which a resume may change. Every weight
        of the model must be in it but the tied ones (the head that shares the embedding), and
        nothing else: CheckpointError names the keys. The trainer state loads onto the CPU (a GPU
        run's checkpoint resumes on a machine without one; the optimizer moves its moments to the
        parameters' device)."""
        import json

        import torch
        from safetensors.torch import load_file

        from minirl.trainer.checkpoint import CheckpointError

        path = Path(directory)
        index = path / "policy" / "model.safetensors.index.json"
        files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
                 else ["model.safetensors"])
        state = {}
        for name in files:
            state.update(load_file(str(path / "policy" / name)))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = set(getattr(self.model, "_tied_weights_keys", None) or ()) if self.model.config.tie_word_embeddings \
            else set()
        missing = [k for k in missing if k not in tied]
        if missing or unexpected:
            raise CheckpointError(f"{path / 'policy'} does not hold {self.cfg.policy.model_name}'s weights: "
                                  f"missing {missing[:5]}, unexpected {unexpected[:5]}")
        if self.model.config.tie_word_embeddings:
            self.model.tie_weights()
        extra = torch.load(path / "trainer_state.pt", weights_only=False, map_location="cpu")
        self.optimizer.load_state_dict(extra["optimizer"])
        # torch restores the saved lr, betas, eps and weight_decay; a resume may change them (only the
        # moments and step counts carry over), and config.yaml and NonFiniteUpdate name the config's
        opt = self.cfg.policy.optimizer
        for group in self.optimizer.param_groups:
            group.update(lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay)
        torch.set_rng_state(extra["torch_rng"])
        self.steps_done = extra["steps_done"]
