"""Typed configuration: a dataclass per section, a docstring per field, merged by OmegaConf
(`load_config`) and then checked (`validate`).

Names and defaults follow NeMo-RL (`grpo.*`, `policy.*`, `loss_fn.*`, `async_rl.rollout_failure.*`)
and Gym's `context_history` where they have the setting; where minirl's default differs, see
docs/deviations.md. Imports nothing of minirl's but the fault table, so checking loads no runtime code.

Invariant: `load_config` returns a config that passed every check here, or raises `ConfigError`
whose message starts with the offending dotted key; nothing downstream re-validates.
"""

from __future__ import annotations

import copy
import difflib
import functools
import importlib
import json
import math
import operator
import socket
import stat
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Iterator, Literal, Optional, Union, get_args, get_origin, get_type_hints
from urllib.parse import urlparse

import yaml
from omegaconf import II, MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from minirl.faults import AGENT_SIDE_KINDS, FAULT_KINDS

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_YAML = REPO_ROOT / "configs" / "default.yaml"
DEFAULT_MODEL = "models/tiny-doors"

if not OmegaConf.has_resolver("mul"):
    _register = getattr(OmegaConf, "register_resolver", None) or OmegaConf.register_new_resolver
    _register("mul", lambda a, b: int(a) * int(b))


class ConfigError(ValueError):
    """A bad config key or value; the message is one line and starts with the dotted key."""

    def __init__(self, key: str, problem: str):
        self.key, self.problem = key, " ".join(str(problem).split())
        super().__init__(f"{key}: {self.problem}")


def _require(ok: bool, key: str, problem: str) -> None:
    """In a section's `check()`, `key` is the field's name there; `validate` prefixes the section's key."""
    if not ok:
        raise ConfigError(key, problem)


def bounded(default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
            lt: float | None = None) -> Any:
    """A numeric field with its range (None passes where the field is Optional), checked by `validate`."""
    bounds = {name: v for name, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    return field(default=default, metadata=bounds)


ROUTER_MAX_BODY_BYTES = 64 * 2**20
"""The largest request body the generation router relays (a larger one it answers 413 itself, which an
agent reads as DATA). A worker's own limit (`policy.generation.vllm_cfg.max_request_bytes`) is bounded by it,
or the router would refuse a body its worker would serve."""

GREEDY_TEMPERATURE = 1e-5
"""vLLM's _SAMPLING_EPS: a temperature below it is greedy sampling."""


# --------------------------------------------------------------------------------------------- grpo
@dataclass
class GRPOConfig:
    num_prompts_per_step: int = bounded(8, ge=1)
    """Prompt groups per optimizer step (the step's target before any drop)."""
    num_generations_per_prompt: int = bounded(4, ge=1)
    """Rollouts per prompt group; at least 2 (`check`): a rollout's advantage is its reward against its
    group's, and a group with at most one valid rollout gets advantage 0 (upstream), so 1 trains nothing."""
    max_num_steps: int = bounded(40, ge=1)
    """Optimizer steps to run (a resumed run counts the steps already done)."""
    normalize_rewards: bool = True
    """Divide advantages by the group's leave-one-out std (where it is > 0)."""
    use_leave_one_out_baseline: bool = True
    """Baseline each rollout by the mean reward of the other rollouts of its group."""
    baseline_excludes_masked: bool = True
    """Baseline and std of a group run over its valid (unmasked) rollouts only, and a group with at
    most one valid rollout gets advantage 0 (minirl; RL #4061). False reproduces upstream, where a
    masked rollout's reward still counts in its siblings' baseline and std."""
    masked_sample_rewards_in_baseline: bool = False
    """NeMo-RL's third baseline policy (`single_controller_utils/sample_masks.py`): a rollout
    flagged incomplete (its verifier's `mask_sample`, a harness's `summary_failed`, truncation under
    `overlong_filtering`) gets no gradient but keeps its reward in its siblings' baseline and std,
    so a timeout still reads as a failure for the group; placeholders (`capture_failed`) and rows
    whose tokens or logprobs the ledger refused stay out of both. Needs
    `baseline_excludes_masked=true` (it reinstates rows that setting excludes; with `false` every
    masked row, placeholders included, is in the baseline already). docs/architecture.md's table."""
    segment_validity: Literal["all", "any"] = "all"
    """A rollout whose segments (physical traces) are not all valid: `all` (NeMo-RL #4124's amin,
    minirl's default) masks the whole rollout, out of training and out of the baseline; `any` (the
    segment-rows branch's amax) keeps it valid while any segment is, trains its valid segments with
    its advantage and masks only the masked ones. A rollout-level mask masks every segment in both."""
    summary_credit: Literal["rollout", "next_segment"] = "rollout"
    """The advantage a summary call's tokens train with (summarizing compaction). `rollout` (minirl's
    default, verl's one session-level advantage): its rollout's, as every segment. `next_segment`:
    its own, from the segment that follows it: the agent scores it (evidence `segment_rewards`, the
    verifier's mean per-room score over the rooms first tried after the summary and before the next
    one, agents/compaction/summarize.py), and a group's k-th summaries are compared with one another as
    rollouts are (`grpo.summary_advantages`: the same baseline, std and flags, over the valid
    rollouts whose k-th summary has a scored segment; the others' k-th summary gets 0). A rollout
    without that evidence (an external agent) keeps its rollout's advantage (`summary_credit_fallbacks`)."""
    overlong_filtering: bool = False
    """Mask (sample_mask=0) every rollout truncated at policy.max_total_sequence_length (a trace
    that reached it), as upstream marks truncation; a reply cut by the per-call cap is not."""
    seed: int = bounded(42, ge=0)
    """Seeds prompts, sampling and the policy's initial RNG."""
    val_period: int = bounded(0, ge=0)
    """Validate on the held-out prompts after every N-th optimizer step (0: never; NeMo-RL's name)."""
    val_at_start: bool = False
    """Validate the initial (or resumed) weights before the first step."""
    val_num_prompts: int = bounded(8, ge=1)
    """Held-out prompts per validation (minirl.validation: never a prompt of the run's training steps)."""
    val_num_generations: int = bounded(1, ge=1)
    """Rollouts per held-out prompt."""

    def check(self) -> None:
        _require(self.baseline_excludes_masked or not self.masked_sample_rewards_in_baseline,
                 "masked_sample_rewards_in_baseline",
                 "true needs grpo.baseline_excludes_masked=true: it reinstates the incomplete rows that setting "
                 "keeps out of the baseline, and keeps placeholders out, while baseline_excludes_masked=false puts "
                 "every masked row, placeholders included, in the baseline")
        n = self.num_generations_per_prompt
        _require(n >= 2, "num_generations_per_prompt",
                 f"must be >= 2, got {n}: GRPO's advantage is a rollout's reward against the rest of its group, "
                 "and a group with at most one valid rollout gets advantage 0 (as upstream), so every step would "
                 "train nothing")


# ------------------------------------------------------------------------------------------- policy
@dataclass
class OptimizerConfig:
    lr: float = bounded(2.0e-4, ge=0)
    """AdamW learning rate."""
    weight_decay: float = bounded(0.0, ge=0)
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    eps: float = bounded(1.0e-8, gt=0)
    """AdamW epsilon."""

    def check(self) -> None:
        _require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas",
                 f"must be two values in [0, 1), got {self.betas}")


@dataclass
class VllmConfig:
    max_model_len: int = bounded(1024, ge=1)
    """Context window of the engine; a longer prompt gets vLLM's HTTP 400 "maximum context length"."""
    tensor_parallel_size: int = bounded(1, ge=1)
    """vLLM tensor parallelism per generation worker (GPU only)."""
    gpu_memory_utilization: float = bounded(0.5, gt=0, le=1)
    """Fraction of GPU memory vLLM may take (GPU only)."""
    kv_cache_space_gb: int = bounded(1, ge=1)
    """VLLM_CPU_KVCACHE_SPACE on CPU, in GiB."""
    omp_threads: int = bounded(2, ge=1)
    """Torch threads of the engine on CPU."""
    enforce_eager: bool = True
    """Skip graph capture/compilation (start-up matters more than peak speed at this size)."""
    step_timeout_s: float = bounded(300.0, ge=0)
    """An engine step that has not returned after this many seconds is a dead engine: the generation
    worker ends and Ray restarts it (vLLM's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, 300, which vLLM
    applies only with tensor parallelism). 0: no limit."""
    max_request_bytes: int = bounded(16_000_000, ge=1, le=ROUTER_MAX_BODY_BYTES)
    """Largest request body the generation server accepts (aiohttp's client_max_size); a larger one gets 413.
    At most 67,108,864 (64 MiB), the generation router's own limit (`ROUTER_MAX_BODY_BYTES`)."""
    gather_gap_s: float = bounded(0.02, ge=0)
    """On a CPU engine: requests that reach an idle engine are gathered until none has come for this
    long (or `gather_max_s` has passed) before its first step, so a burst (a step's first turns)
    starts as one batch. Stepping at once, the engine's threads take the cores the agent and the front
    end need to deliver the rest of the burst, which then joins over several slow steps and finishes
    over as many (bench/README.md). A lone request waits only `gather_first_s`. 0: step at once,
    as vLLM does; a GPU engine always does (its steps leave the CPU to the front end)."""
    gather_first_s: float = bounded(0.01, ge=0)
    """The first window of that gather: an idle engine that one request reaches waits this long for a
    second before its first step; none comes (a lone call, e.g. a turn after a tool's reply): it steps;
    one comes (a burst): it gathers the rest with `gather_gap_s`. Inside a burst of 128 the second
    request followed the first within 0.8-9 ms with the 2-core build machine at load ~20, ~1 ms quiet
    (bench/README.md). At most `gather_gap_s`; set it to `gather_gap_s` for the old rule, where every
    lone call waited the whole gap."""
    gather_max_s: float = bounded(0.25, ge=0)
    """The longest an idle engine gathers a burst before its first step (see `gather_gap_s`)."""
    gather_rule: Literal["learned", "fixed"] = "fixed"
    """How long a gather waits for the next request of a clump. `learned`: until it holds
    `gather_burst_n` requests, 3x the 90th percentile of the gaps between recent gathers' requests, at
    least 5 ms, at most `gather_gap_s` (minirl.generation.engine.learned_gap); then `gather_gap_s`.
    Inside a clump of calls back from their tools the next followed within ~1 ms on a quiet machine,
    and the fixed gap held each clump ~20 ms past its last call; at load the learned gap grows back to
    `gather_gap_s`. `fixed` (the default: `learned` has not yet measured better, bench/README.md):
    every gather past its first request waits `gather_gap_s`."""
    gather_burst_n: int = bounded(8, ge=2)
    """Under `learned`: a gather holding this many requests is a burst (a step's first turns, P1's
    128) and waits `gather_gap_s` for the next, as the fixed rule does: a burst's delivery pauses for
    5-20 ms at times at load, and a step started mid-burst slows the rest of it."""


@dataclass
class GenerationConfig:
    temperature: float = bounded(1.0, gt=0)
    """Sampling temperature for rollouts."""
    top_p: float = bounded(1.0, gt=0, le=1)
    """Nucleus sampling for rollouts."""
    max_new_tokens: int = bounded(48, ge=1)
    """Cap on each model call's reply (also capped by the room left in `max_model_len`)."""
    reasoning_parser: Optional[Literal["think"]] = "think"
    """As `vllm serve --reasoning-parser`: `think` splits a leading `<think>…</think>` off a reply into
    `reasoning`; null leaves it in `content` (for a Gym `vllm_model` with `uses_reasoning_parser: false`)."""
    vllm_cfg: VllmConfig = field(default_factory=VllmConfig)

    def check(self) -> None:
        _require(self.temperature >= GREEDY_TEMPERATURE, "temperature",
                 f"must be >= {GREEDY_TEMPERATURE} (below it vLLM samples greedily, and a group's identical rollouts "
                 f"train nothing), got {self.temperature}")


@dataclass
class PolicyConfig:
    model_name: str = DEFAULT_MODEL
    """Local Hugging Face model directory, loaded with `from_pretrained` (no hub access); a relative
    path that does not exist from the working directory is taken from the repository root."""
    train_global_batch_size: int = II("mul:${grpo.num_prompts_per_step},${grpo.num_generations_per_prompt}")
    """Logical rollouts per optimizer step; must equal prompts x generations (one step per RL step).
    Derived from the two `grpo` keys; a config file's value equal to its own prompts x generations
    (a run's saved config.yaml holds it resolved) stays derived, so a later override of either key
    moves it along (`load_config`). Set on the command line, it is checked as given."""
    train_micro_batch_size: int = bounded(16, ge=1)
    """Traces per forward/backward pass (gradient accumulation inside the step)."""
    max_total_sequence_length: int = bounded(1024, ge=1)
    """Longest trace the trainer accepts; a longer one is a data failure."""
    precision: Literal["float32", "bfloat16"] = "float32"
    """Trainer dtype: float32 or bfloat16 (bf16 is meant for GPUs)."""
    max_grad_norm: float = bounded(1.0, ge=0)
    """Gradient clipping norm (0 disables)."""
    train_threads: int = bounded(2, ge=1)
    """torch threads of the policy worker on CPU (Ray sets OMP threads to num_cpus otherwise)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)


@dataclass
class LossConfig:
    ratio_clip_min: float = bounded(0.2, ge=0)
    """Lower PPO clip: ratio >= 1 - ratio_clip_min."""
    ratio_clip_max: float = bounded(0.2, ge=0)
    """Upper PPO clip: ratio <= 1 + ratio_clip_max."""
    reference_policy_kl_penalty: float = bounded(0.01, ge=0)
    """Weight of the k3 KL to the initial policy (0 disables the reference model). Upstream's
    default (ClippedPGLossConfig, grpo_math_1B.yaml); configs/default.yaml sets 0."""
    token_level_loss: bool = True
    """Sum over all valid tokens of the global batch, divided by their count (required under CC)."""
    segment_weighting: Literal["token_mean", "rollout_equal", "length_ratio"] = "token_mean"
    """Weight of a rollout's segments (physical traces) in the loss: `token_mean` (upstream: every
    valid token counts once), `rollout_equal` (verl #7580: each of a rollout's N trained segments
    gets 1/N) or `length_ratio` (a segment's trained tokens over its rollout's mean). Weights are
    scaled to mean 1 over the step's trained segments and multiply every term. Under the token-level
    loss (which CC requires) a row's mass is weight x tokens, so `rollout_equal` does not count each
    rollout once (a rollout's mass is its mean segment length) and `length_ratio` does not preserve a
    rollout's mass when it splits (sum T_i^2 / mean T, not sum T_i); #7580's claims hold for a
    per-segment token mean."""
    use_importance_sampling_correction: bool = False
    """Weight each token's clipped loss by exp(prev - generation): the trainer's logprob at the
    step's start over the engine's, detached (non-finite -> 0). For rollouts from older weights."""
    truncated_importance_sampling_type: Optional[Literal["tis", "icepop", "seq-mask-tis"]] = None
    """Truncation of those weights: null, `tis` (clamp to [ratio_min or 0, ratio]), `icepop` (zero
    the tokens outside [ratio_min, ratio]) or `seq-mask-tis` (zero every token of a sequence whose
    geometric-mean weight falls outside [ratio_min, ratio]; the others keep theirs untruncated; refused
    under context compaction, as upstream's multi-trace guide refuses it: a sequence is a physical trace)."""
    truncated_importance_sampling_ratio: Optional[float] = None
    """Upper bound of the truncated weights (required with a truncation type)."""
    truncated_importance_sampling_ratio_min: Optional[float] = None
    """Lower bound of the truncated weights (required for `icepop` and `seq-mask-tis`)."""

    def check(self) -> None:
        _require(self.ratio_clip_min < 1, "ratio_clip_min",
                 f"must be < 1 (the lower clip is 1 - ratio_clip_min), got {self.ratio_clip_min}")
        kind, ratio, lo = (self.truncated_importance_sampling_type, self.truncated_importance_sampling_ratio,
                           self.truncated_importance_sampling_ratio_min)
        if kind is None:
            return
        _require(self.use_importance_sampling_correction, "truncated_importance_sampling_type",
                 "needs loss_fn.use_importance_sampling_correction=true")
        _require(ratio is not None and ratio > 0, "truncated_importance_sampling_ratio", f"must be > 0, got {ratio}")
        _require(lo is not None or kind == "tis", "truncated_importance_sampling_ratio_min",
                 "is required for icepop and seq-mask-tis")
        _require(lo is None or 0 <= lo <= ratio, "truncated_importance_sampling_ratio_min",
                 f"must be in [0, truncated_importance_sampling_ratio], got {lo}")


# ---------------------------------------------------------------------------------------- async_rl
@dataclass
class NemoGymConfig:
    rollout_timeout_s: Optional[float] = bounded(None, gt=0)
    """One deadline around a whole prompt group attempt (all its rows' `/run` requests, row re-sends
    included); past it the attempt fails with RolloutTimeout("NeMo-Gym prompt group exceeded {s}s"),
    INFRA. None: no deadline."""
    max_row_attempts: int = bounded(3, ge=1)
    """Attempts per row within one group attempt before the group attempt fails (row redispatch)."""
    keep_returned_rows: bool = True
    """A group retry re-sends only the rows that did not come back; their siblings keep their
    validated results (minirl, as fix 3, `context_compaction.redispatch_dropped_groups`, re-sends
    only the missing rows). `false`: upstream's retry, every row of the group
    re-run under the fresh group id."""


@dataclass
class RolloutFailureConfig:
    max_infra_attempts_per_prompt: int = bounded(5, ge=1)
    """INFRA attempts per prompt group before it is dropped."""
    max_data_attempts_per_prompt: int = bounded(2, ge=1)
    """DATA attempts per prompt group (no backoff) before it is skipped or the error re-raised."""
    backoff_base_s: float = bounded(1.0, ge=0)
    """Backoff before INFRA retry k: min(backoff_base_s * 2**(k-1), max_backoff_s)."""
    max_backoff_s: float = 30.0
    """Backoff ceiling; must be >= backoff_base_s."""
    agent_restart_window_s: float = bounded(60.0, ge=0)
    """A group whose `/run` cannot reach any agent server (connection refused or reset: a server down or
    restarting) keeps retrying with the backoff above (at least 1 s a wait), past
    `max_infra_attempts_per_prompt`, until its backoff adds up to this many seconds (minirl; 0: upstream,
    the attempts alone, ~7.5 s with configs/default.yaml's backoff)."""
    generation_restart_window_s: float = bounded(120.0, ge=0)
    """A group whose every failed row is minirl's agent finding no model server (GenerationUnavailable:
    a generation worker down, or restarting at its port as Ray restarts it after its engine died) keeps
    retrying with the backoff above, past `max_infra_attempts_per_prompt`, until its backoff adds up to
    this many seconds (minirl; 0: upstream, the attempts alone). A worker's restart is its engine's
    start-up: 20-40 s for the tiny model on 2 CPU cores, minutes for a large one."""
    max_identical_failures: int = bounded(3, ge=0)
    """A row whose `/run` is answered with the same 5xx status and the same error text on this many
    sends in a row has a deterministic failure (minirl): it is not retried again, and its group is
    skipped as DATA within `max_skipped_prompts`, or ends the run naming the failure. 502, 503, 504
    and an unreachable model server never count. 0: never (upstream: retried to the INFRA budget)."""
    max_skipped_prompts: int = bounded(0, ge=0)
    """Run-wide budget of prompts skipped after DATA failures (0: re-raise the DATA error)."""
    max_consecutive_dropped_prompts: int = bounded(0, ge=0)
    """Drops allowed with no committed group in between (0: the first drop raises)."""
    min_step_batch_fraction: float = bounded(0.9, gt=0, le=1)
    """Floor: a step needs ceil(fraction x num_prompts_per_step) groups, in (0, 1]."""
    on_dropped_prompt: Literal["shrink", "replace"] = "shrink"
    """What a lost prompt (an INFRA drop or a DATA skip) does to its step: `shrink` trains the step on
    the groups it has; `replace` (async, a sampler that stamps target steps: in_order) gives its
    place a spare prompt: the furthest later step's finished group is promoted into the step and the
    spare repays that step, or the spare fills the step itself."""
    max_replacement_attempts: int = 1
    """`replace`: spare prompts one lost place may take (its spare may be lost too); beyond, the step shrinks."""
    replacement_reserve_prompts: int = 1
    """`replace`: low-water mark of the spare-prompt pool: below it, a whole batch of spare prompts
    (num_prompts_per_step) is added at the next batch boundary. An empty pool means shrink."""
    replacement_prompt_source: Literal["spare_groups", "stream"] = "spare_groups"
    """`replace`: where a refill's batch comes from. `spare_groups`: batch b is the groups N..2N-1 of
    prompt step b, prompts no step trains, so a step's prompts never depend on drops (the doors task:
    with `data.train_jsonl`, whose rows are all in the stream, it is a ConfigError). `stream`
    (upstream): the next batch of the training stream is diverted, and every later step trains the
    batch after the one it would have (which batch depends on when the pool ran low)."""
    nemo_gym: NemoGymConfig = field(default_factory=NemoGymConfig)

    def check(self) -> None:
        _require(self.max_backoff_s >= self.backoff_base_s, "max_backoff_s",
                 f"must be >= backoff_base_s ({self.backoff_base_s}), got {self.max_backoff_s}")
        for key in ("max_replacement_attempts", "replacement_reserve_prompts"):
            value = getattr(self, key)
            _require(self.on_dropped_prompt != "replace" or value >= 1, key, f"must be >= 1 with replace, got {value}")


@dataclass
class StallWatchdogConfig:
    stall_timeout_s: Optional[float] = bounded(600.0, gt=0)
    """Seconds without any completed rollout before the watchdog acts (None disables)."""
    action: Literal["raise", "warn"] = "raise"
    """`raise` RolloutStall with what is in flight, or `warn` and keep waiting."""


GYM_RETRIED_STATUSES = (429, 500, 502, 503, 504, 520)
"""HTTP statuses Gym's model client retries (nemo_gym.openai_utils.RETRY_ERROR_CODES)."""


@dataclass
class GenerationRouterConfig:
    enabled: bool = True
    """Put a router at a fixed port in front of the generation workers (its URL goes to endpoints.json)."""
    port_range_low: int = bounded(6000, ge=1, le=65535)
    """The router binds the first free port from here..."""
    port_range_high: int = 6099
    """...to here (inclusive)."""
    backend_timeout_s: float = bounded(600.0, gt=0)
    """A forwarded request that takes longer gets HTTP 504."""
    connect_timeout_s: float = bounded(5.0, gt=0)
    """A worker that does not accept the connection within this is skipped, and ineligible this long."""
    no_healthy_backend_status: int = 409
    """The status answered when no worker is eligible; never one Gym retries (429, 500, 502, 503, 504, 520)."""

    def check(self) -> None:
        _require(self.port_range_low <= self.port_range_high <= 65535, "port_range_high",
                 f"must be a port >= port_range_low ({self.port_range_low})")
        status = self.no_healthy_backend_status
        _require(400 <= status <= 599 and status not in GYM_RETRIED_STATUSES, "no_healthy_backend_status",
                 "must be an HTTP error status that Gym does not retry "
                 f"(not {', '.join(map(str, GYM_RETRIED_STATUSES))}), got {status}")


@dataclass
class GenerationFleetHealthConfig:
    enabled: bool = False
    """Probe every generation worker from the router, quarantine the sick ones, and send minirl's own
    agents through the router. Off by default: the default run has one worker, where a quarantine
    cannot route around anything but only end the run (a worker Ray restarts after `worker_kill` is
    down for its engine start-up, 15 s or more: three failed probes), and the agents keep their
    rollout-sticky routing (prefix cache), so the default run's rewards stay as they were. Turn it on
    with two or more workers."""
    probe_interval_s: float = bounded(5.0, gt=0)
    """Seconds between two probes (`GET /health`) of one worker."""
    probe_timeout_s: float = bounded(2.0, gt=0)
    """A probe not answered 200 within this fails; must be less than probe_interval_s."""
    unhealthy_threshold: int = bounded(3, ge=1)
    """Consecutive failed probes that quarantine a worker: it gets no new request, and the requests in
    flight on it fail at once with HTTP 503 (INFRA: their rollouts are redispatched)."""
    healthy_threshold: int = bounded(2, ge=1)
    """Consecutive passed probes that re-admit a quarantined worker (e.g. one Ray restarted)."""
    min_healthy_shards: int = bounded(1, ge=1)
    """Fewer workers out of quarantine than this end the run (GenerationFleetUnhealthy, naming the
    quarantined workers and their failed probes); at most cluster.num_generation_workers."""

    def check(self) -> None:
        _require(self.probe_timeout_s < self.probe_interval_s, "probe_timeout_s",
                 f"must be less than probe_interval_s ({self.probe_interval_s}), got {self.probe_timeout_s}")


@dataclass(frozen=True)
class SamplerTraits:
    """What the config asks of a staleness sampler; minirl/async_rl/samplers.py copies each row onto its class."""

    gated: bool = False
    """Dispatches prompt batch k only while k <= version + S."""
    stamps_target_steps: bool = False
    """Stamps a batch's groups for one optimizer step, so a lost group is credited to it (drop budgets, replace)."""
    needs_is_correction: bool = False
    """Selects groups of any age: requires loss_fn.use_importance_sampling_correction."""

    def capacity(self, num_prompts_per_step: int, s: int) -> int:
        """Buffer places the sampler needs: the live batch plus one per lookahead version if gated."""
        return num_prompts_per_step * (s + 1) if self.gated else num_prompts_per_step


SAMPLER_TRAITS = {
    "in_order": SamplerTraits(gated=True, stamps_target_steps=True),
    "windowed": SamplerTraits(),
    "weight_fifo": SamplerTraits(gated=True),
    "ready_first": SamplerTraits(gated=True, needs_is_correction=True),
}
"""Every sampler by name; tests/unit/test_config.py checks it against minirl.async_rl.samplers.SAMPLERS."""
SamplerName = Literal["in_order", "windowed", "weight_fifo", "ready_first"]


@dataclass
class SamplerConfig:
    name: SamplerName = "in_order"
    """`in_order` (each step trains its own prompt groups), `windowed` (any ready group in the
    window), `weight_fifo` (one weight's groups per step, oldest first) or `ready_first` (the first
    ready groups, of any age); see minirl/async_rl/samplers.py."""
    max_staleness_versions: int = bounded(1, ge=0)
    """S: a group dispatched under weights v may train at versions v..v+S, older ones are evicted;
    the gated samplers (in_order, weight_fifo, ready_first) dispatch prompt batch k only while
    k <= version + S."""
    max_lookahead_versions: Optional[int] = bounded(None, ge=0)
    """Upstream's name of in_order's gate: when set (in_order only), it is S, and max_staleness_versions
    takes its value (one resolved value, in config.yaml too)."""
    admission: Literal["eager", "paced"] = "eager"
    """`eager` (upstream): dispatch whatever the sampler's gate admits. `paced` (minirl): also hold a
    prompt group whose expected duration (observed by prompt class) would end after the window
    closes, S step periods after the current version's publish, so it is not generated to be
    evicted; see minirl/async_rl/pacing.py. Not with ready_first, which evicts nothing."""
    pacing_bound_s: Optional[float] = bounded(None, gt=0)
    """`paced`: the duration assumed for a prompt class not observed yet (None: admit it, and learn)."""
    pacing_quantile: float = bounded(0.9, gt=0, le=1)
    """`paced`: a class's expected duration is this quantile of its last observed group durations."""

    def check(self) -> None:
        """Also resolves the gate's two names into max_staleness_versions, before the rules that read it."""
        if self.max_lookahead_versions is not None:
            _require(self.name == "in_order", "max_lookahead_versions",
                     f"is in_order's gate; {self.name} reads async_rl.sampler.max_staleness_versions")
            self.max_staleness_versions = self.max_lookahead_versions
        _require(self.admission == "eager" or self.name != "ready_first", "admission",
                 "paced holds groups that would be evicted; ready_first evicts nothing (use eager)")


@dataclass
class AsyncRLConfig:
    enabled: bool = False
    """Overlap generation and training (NeMo-RL's Single-Controller path): a rollout pump runs ahead
    of the optimizer under the staleness sampler. False: generate a step, train it, sync, repeat."""
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    max_inflight_prompts: int = bounded(32, ge=1)
    """Prompt groups the rollout pump keeps in flight at most."""
    max_buffered_rollouts: int = bounded(64, ge=1)
    """Unconsumed prompt groups the buffer holds (finished or reserved by one in flight); must hold
    the sampler's window, or the pumps would deadlock."""
    in_flight_weight_updates: bool = False
    """New weights reach the engine between its steps, without draining: a call in flight may span
    two versions (recorded, and checked against the window). False: the engine drains first.
    Upstream's Single-Controller path always updates in flight (the upstream preset sets true)."""
    rollout_failure: RolloutFailureConfig = field(default_factory=RolloutFailureConfig)
    stall_watchdog: StallWatchdogConfig = field(default_factory=StallWatchdogConfig)
    generation_router: GenerationRouterConfig = field(default_factory=GenerationRouterConfig)
    generation_fleet_health: GenerationFleetHealthConfig = field(default_factory=GenerationFleetHealthConfig)

    def check(self) -> None:
        _require(self.rollout_failure.on_dropped_prompt != "replace" or self.enabled,
                 "rollout_failure.on_dropped_prompt",
                 "replace needs async_rl.enabled=true with a sampler that stamps target steps "
                 "(async_rl.sampler.name=in_order)")
        _require(self.generation_router.enabled or not self.generation_fleet_health.enabled,
                 "generation_fleet_health.enabled",
                 "needs async_rl.generation_router.enabled=true: the router probes the workers and routes around "
                 "the sick")


# ------------------------------------------------------------------------------- context compaction
SELECTION_BUILTINS = ("returned_history", "all_captured", "select_all_captured")
"""`context_compaction.call_selection`'s built-in policies (upstream's names, and minirl's short one)."""


def load_callable(path: str, key: str):
    """`package.module:function` -> the function, as upstream's `resolve_selection_policy` imports a
    custom policy; a path that does not import, or names no callable, is a ConfigError naming `key`."""
    module, sep, name = path.partition(":")
    _require(bool(sep and module and name), key,
             f"must be returned_history, all_captured or an importable package.module:function, got {path!r}")
    try:
        fn = functools.reduce(getattr, name.split("."), importlib.import_module(module))
    except Exception as exc:  # ImportError, AttributeError, or whatever the module raises when imported
        raise ConfigError(key, f"cannot import {path!r}: {type(exc).__name__}: {exc}") from None
    _require(callable(fn), key, f"{path!r} is not callable")
    return fn


@dataclass
class ContextCompactionConfig:
    enabled: bool = True
    """Train rollouts as physical traces of a compacting agent (CC GRPO)."""
    allow_step_shrink: bool = True
    """Fix 1: a CC step trains on the groups it kept. False reproduces upstream (full count or raise)."""
    redispatch_dropped_groups: bool = True
    """Fix 3: re-run CC groups that failed with INFRA errors. False reproduces upstream (drop at once)."""
    call_selection: str = "returned_history"
    """Which captured model calls of a rollout train (NeMo-RL's `nemo_rl.environments.call_selection`):
    `returned_history` (upstream's default: the calls of the history the agent returned),
    `all_captured` (upstream's `select_all_captured`, also accepted: every usable captured call of
    the committed attempt, the summary requests the harness rejected excepted; each sampled token
    trained once, one reward and advantage per rollout), or a custom `package.module:function` with
    upstream's signature `(records, result) -> (selected_records, terminal_response_id)`
    (minirl/rollout/selection.py). Anything but `returned_history` needs minirl's own agents."""

    def check(self) -> None:
        if self.call_selection not in SELECTION_BUILTINS:
            load_callable(self.call_selection, "call_selection")


@dataclass
class ImagesPolicyConfig:
    enabled: bool = True
    """Drop old pictures."""
    protect_initial_context: bool = True
    """Never drop pictures of the episode's initial input."""
    keep_last_groups: int = bounded(3, ge=0)
    """Keep the pictures of the last N items that carry any."""
    omission_marker: str = "[Earlier image omitted]"
    """Text that replaces a dropped picture."""


@dataclass
class ReasoningPolicyConfig:
    enabled: bool = True
    """Drop old reasoning blocks."""
    keep_first_block: bool = False
    """Always keep the first reasoning block."""
    keep_last_blocks: int = bounded(3, ge=0)
    """Keep the last N reasoning blocks."""


@dataclass
class CompactionPolicyOptions:
    images: ImagesPolicyConfig = field(default_factory=ImagesPolicyConfig)
    reasoning: ReasoningPolicyConfig = field(default_factory=ReasoningPolicyConfig)


@dataclass
class SummarizeConfig:
    """`policy.type=summarize` (agents/compaction/summarize.py): the model writes a summary of its history when the
    context fills, and the episode continues from the system prompt, the task, the summary and the
    current observation. No upstream NeMo-RL/Gym summarizer exists; the knobs follow prime-rl/verifiers
    and verl's recipe."""

    threshold_tokens: list[int] = field(default_factory=lambda: [256, 384])
    """[lo, hi]: summarize before a call whose prompt tokens + guards.reserved_generation_tokens exceed a
    threshold drawn uniformly from [lo, hi] per prompt (seeded by the prompt's identity: a doors task's seed, a
    dataset row's input and task; so a group shares it)."""
    max_compactions: int = bounded(4, ge=1)
    """Summaries per rollout at most (verl's max_context_compressions=4); the next trigger ends the
    rollout as truncated (end_reason max_compactions)."""
    max_summary_attempts: int = bounded(3, ge=1)
    """Sampled summary calls per compaction; a rejected one (empty, a tool call, no closed block, over
    max_summary_tokens) is resampled, never trained, and retired by the ledger (prime-rl: 5)."""
    max_summary_tokens: int = bounded(32, ge=1)
    """Longest accepted summary reply, in generated tokens."""
    require_stop: bool = False
    """Accept a summary only when its reply ended by itself (`finish_reason == "stop"`), as nano-rlm
    (#178) / prime-rl do: a reply cut by the generation cap (`length`) is rejected as `not_stop` and
    resampled, even when it holds a closed block. False (minirl's default): the block decides."""
    on_summary_failure: Literal["raise", "end_episode", "end_episode_scored", "recency_fallback"] = "raise"
    """Attempts exhausted: `raise` (the upstream-like choice, as prime-rl/verifiers: a typed
    SummaryFailed, HTTP 500, which the rollout manager retries as an INFRA harness failure: row
    redispatch under fix 3, `context_compaction.redispatch_dropped_groups`, the drop budget
    otherwise; never a reward of 0); `end_episode` (stop,
    verify, return the rollout masked as summary_failed); `end_episode_scored` (stop, verify, return
    the rollout valid, scored on the rooms it reached, with the newest rejected reply trained as the
    summary call: a policy failure that costs reward, where the others leave a malformed summary
    unpunished; under `grpo.summary_credit=next_segment` its segment scores 0; end reason
    `summary_failed_scored`); `recency_fallback` (apply the recency rewrite of policy.config
    instead and go on)."""

    def check(self) -> None:
        t = self.threshold_tokens
        _require(len(t) == 2, "threshold_tokens", f"must be [lo, hi], got {list(t)}")
        _require(1 <= t[0] <= t[1], "threshold_tokens", f"must be [lo, hi] with 1 <= lo <= hi, got {list(t)}")


@dataclass
class CompactionPolicyConfig:
    type: Literal["identity", "recency", "summarize"] = "recency"
    """`recency` (drop old media and reasoning), `identity` (never rewrite) or `summarize` (the model
    summarizes its history when the context fills; see `summarize`)."""
    config: CompactionPolicyOptions = field(default_factory=CompactionPolicyOptions)
    summarize: SummarizeConfig = field(default_factory=SummarizeConfig)


@dataclass
class ScheduleConfig:
    type: Literal["rolling_recency", "turn_chunked_recency"] = "rolling_recency"
    """`rolling_recency` compacts before every call; `turn_chunked_recency` every N actions."""
    actions_per_chunk: int = bounded(1, ge=1)
    """Actions per chunk for `turn_chunked_recency`; must be 1 for `rolling_recency`."""

    def check(self) -> None:
        _require(self.type != "rolling_recency" or self.actions_per_chunk == 1, "actions_per_chunk",
                 "must be 1 for rolling_recency")


@dataclass
class GuardsConfig:
    max_total_tokens: Optional[int] = bounded(None, gt=0)
    """Context guard: refuse a call whose prompt + reserved tokens exceed this (None: no guard)."""
    reserved_generation_tokens: int = bounded(0, ge=0)
    """Tokens the guard reserves for the reply."""
    on_reject: Literal["raise", "end_episode"] = "end_episode"
    """Fix 2 `end_episode`: stop, verify, return (rollout masked). `raise` reproduces upstream (HTTP 500)."""

    def check(self) -> None:
        _require(self.max_total_tokens is None or self.reserved_generation_tokens < self.max_total_tokens,
                 "reserved_generation_tokens", f"must be < max_total_tokens ({self.max_total_tokens}): the guard "
                 f"would refuse every call, got {self.reserved_generation_tokens}")


@dataclass
class ContextHistoryConfig:
    enabled: bool = True
    """Rewrite the agent's history before model calls (the compaction agent)."""
    policy: CompactionPolicyConfig = field(default_factory=CompactionPolicyConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    guards: GuardsConfig = field(default_factory=GuardsConfig)


@dataclass
class AgentConfig:
    name: str = "compaction_agent"
    """minirl's own agent: `compaction_agent` or `simple_agent`. With `external_url`, the name of any
    Gym agent instance (Gym's `+agent_name`). Sent as `agent_ref.name` on a row that has no `agent_ref`
    (a row's own wins); Gym 0.7's `single_agent_turn_legacy` requires its configured agent's name."""
    max_steps: int = bounded(4, ge=1)
    """Model calls per episode at most."""
    external_url: Optional[Union[str, list[str]]] = None
    """Base URL of an external Gym-style agent server, or a list of them (several agent servers of one
    Gym deployment); minirl then starts no agent pool. See `selection`."""
    selection: Literal["least_busy", "round_robin"] = "least_busy"
    """Which agent server (external, or `cluster.num_agent_servers` of minirl's pool) a `/run` goes
    to: `least_busy` (fewest of this run's `/run` requests in flight, ties in turn) or `round_robin`.
    One that is down (see `down_retry_s`) is passed over while others are up, and the row is re-sent
    at once on another (rollout/agent_pool.py)."""
    down_retry_s: float = bounded(2.0, gt=0)
    """Seconds an agent server marked down (it refused or reset a connection, or failed
    `max_server_failures` sends in a row) is passed over before the rollout manager probes it
    (`GET /health`, any answer below 500 within 5 s brings it up; so does any `/run` it answers).
    Doubled with each mark that follows no `/run` answer, up to `down_retry_max_s`."""
    down_retry_max_s: float = bounded(30.0, gt=0)
    """The longest wait before a down agent server is probed again; must be >= down_retry_s."""
    max_server_failures: int = bounded(2, ge=1)
    """Failures of an agent server's own in a row that mark it down: a 200 whose body is not JSON (a
    proxy's error page), or a send still unanswered at its group's deadline while the server answered
    nothing else. A refused or reset connection marks it down at once."""
    uses_reasoning_parser: bool = True
    """Gym's `vllm_model` flag of the same name, for minirl's own agent: `false` expects replies with
    the reasoning left in the content (a model server without a reasoning parser), and fails the call
    with Gym's AssertionError when one carries a separate `reasoning` field, as Gym's server does."""
    max_request_bytes: int = bounded(8_000_000, ge=1)
    """Largest `/run` request body the agent server accepts."""
    context_history: ContextHistoryConfig = field(default_factory=ContextHistoryConfig)

    def check(self) -> None:
        own = ("simple_agent", "compaction_agent")
        _require(self.name in own or (self.external_url is not None and self.name.strip() != ""), "name",
                 f"must be simple_agent or compaction_agent, got {self.name!r}" if self.external_url is None
                 else f"must name a Gym agent instance, got {self.name!r}")
        _require(self.down_retry_max_s >= self.down_retry_s, "down_retry_max_s",
                 f"must be >= down_retry_s ({self.down_retry_s}), got {self.down_retry_max_s}")

    def external_urls(self) -> list[str]:
        """`external_url` as a list of base URLs (none: minirl's own pool serves)."""
        url = self.external_url
        return [u.rstrip("/") for u in ([url] if isinstance(url, str) else url or [])]


TASK_MIN_ROOMS = {"doors": 1, "doors_memory": 3, "doors_notes": 7}
"""The fewest rooms each `env.task` allows (agents/env.py: where its notes and hidden doors lie)."""


@dataclass
class EnvConfig:
    num_rooms: int = bounded(2, ge=1)
    """Rooms per episode; each needs at least one model call."""
    tool_latency_s: float = bounded(0.0, ge=0)
    """Seconds each tool call of the doors environment sleeps (a stand-in for real tools and
    sandboxes, which spend seconds outside the model)."""
    tool_latency_per_room_s: float = bounded(0.0, ge=0)
    """More seconds each tool call sleeps per room of its episode: tool time that grows with the
    task, so many-room episodes form a long tail (the async pacing experiment, docs/async.md)."""
    num_rooms_choices: Optional[list[int]] = None
    """A task mix: each prompt's room count is drawn from this list by the prompt's own seed (None:
    every prompt has `num_rooms`). More rooms make a longer, harder episode."""
    max_num_rooms: int = bounded(16, ge=1)
    """Largest `num_rooms` a `/run` row may ask for; the agent server refuses larger."""
    data_seed: int = bounded(1234, ge=0)
    """Seeds the prompt stream: the prompt of (step, group) depends on this and nothing else."""
    task: Literal["doors", "doors_memory", "doors_notes"] = "doors"
    """`doors`, or `doors_memory`: the last room hides its door, whose code a note in the second
    room's picture (a tool reply) showed, so recency compaction can drop what the end needs
    (agents/env.py); needs every room count >= 3. `doors_notes`: two needed notes and a distractor
    in rooms drawn per prompt, needed by the last two rooms; needs every room count >= 7."""

    def check(self) -> None:
        least = TASK_MIN_ROOMS[self.task]
        if least > 1:
            counts = [(f"num_rooms_choices[{i}]", n) for i, n in enumerate(self.num_rooms_choices or [])]
            for key, n in counts or [("num_rooms", self.num_rooms)]:
                _require(n >= least, key, f"must be >= {least} for env.task={self.task}, got {n}")
        _require(self.num_rooms_choices is not None or self.num_rooms <= self.max_num_rooms, "num_rooms",
                 f"must be <= env.max_num_rooms ({self.max_num_rooms}), got {self.num_rooms}")
        for i, n in enumerate(self.num_rooms_choices or []):
            _require(1 <= n <= self.max_num_rooms, f"num_rooms_choices[{i}]",
                     f"must be in [1, env.max_num_rooms={self.max_num_rooms}], got {n}")
        _require(self.num_rooms_choices != [], "num_rooms_choices", "must be null or a non-empty list")


@dataclass
class DataConfig:
    """Where the prompts come from (minirl/data.py): the doors task built from `env.*` (the default),
    or JSONL files of NeMo Gym rows."""

    train_jsonl: Optional[str] = None
    """A JSONL file of Gym `/run` rows, one a line, as Gym's rollout collection takes them
    (`responses_create_params`, `agent_ref`, any environment fields), to train on instead of the doors
    task (`env.*` then only serves minirl's own agent). Prompt group (step, group) is row
    step * grpo.num_prompts_per_step + group of the epoch's order, cycling over the file."""
    validation_jsonl: Optional[str] = None
    """A JSONL file of held-out Gym rows: a validation runs its first `grpo.val_num_prompts` rows. None:
    the doors task's held-out seeds (so a run with `data.train_jsonl` that validates must set it)."""
    shuffle: bool = True
    """Visit `train_jsonl`'s rows in a fresh order each epoch, a permutation drawn from `env.data_seed`
    and the epoch alone (false: file order)."""

    def check(self) -> None:
        for key in ("train_jsonl", "validation_jsonl"):
            path = getattr(self, key)
            _require(path != "", key, "must be a file's path or null, got ''")
            if path is not None and not Path(path).is_file():
                raise ConfigError(key, f"{path}: {_not_a_file(Path(path))}")


_ABSENT = object()
"""`OmegaConf.select`'s default where a key names nothing."""


def _not_a_file(path: Path) -> str:
    """What `path`, which is not a regular file, is instead: for a message that says so."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        return "no such file" if isinstance(exc, FileNotFoundError) else f"cannot be read ({exc.strerror or exc})"
    except ValueError as exc:  # a NUL byte in the path
        return f"cannot be read ({exc})"
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return f"is {next((name for test, name in kinds if test(mode)), 'a special file')}, not a file of rows"


# -------------------------------------------------------------------------------------- placement
@dataclass
class ClusterConfig:
    ray_address: Optional[str] = None
    """Connect to this Ray cluster: `host:port` of its head (GCS), `ray://host:port` (Ray client) or
    `auto` (the one running on this machine); None starts a local one. `host:port` is probed (a TCP
    connect, `RAY_PROBE_TIMEOUT_S`) before Ray starts: one that does not answer is a ConfigError."""
    num_cpus: Optional[int] = bounded(None, ge=1)
    """CPUs a locally started Ray advertises (None: all)."""
    num_gpus: Optional[int] = bounded(None, ge=0)
    """GPUs a locally started Ray advertises (None: detect; >0 on a CPU box fakes them for tests)."""
    num_generation_workers: int = bounded(1, ge=1)
    """vLLM engines, each behind its own HTTP endpoint."""
    attach_generation_workers: Optional[str] = None
    """Reuse running detached generation workers named `<this>-<rank>` (namespace `minirl`): they
    are reset to this run's faults and initial weights, and their router `<this>-router`, when there is
    one, forwards to them alone under this run's fleet health. For sweeps of short runs, which then skip
    engine start-up (see minirl/experiments/sweep.py). Needs `cluster.ray_address` (the cluster that
    runs them). None starts new ones."""
    num_policy_workers: int = bounded(1, ge=1)
    """Data-parallel torch policy workers (one torch.distributed group)."""
    num_agent_servers: int = bounded(1, ge=1)
    """Agent-pool HTTP servers."""
    gpus_per_generation_worker: float = bounded(0.0, ge=0)
    """GPUs per generation worker (0: CPU)."""
    gpus_per_policy_worker: float = bounded(0.0, ge=0)
    """GPUs per policy worker (0: CPU)."""
    cpus_per_generation_worker: float = bounded(1.0, ge=0)
    """CPUs Ray reserves per generation worker."""
    generation_worker_max_restarts: int = bounded(10, ge=-1)
    """How many times Ray restarts a generation worker whose process died (its engine died, `worker_kill`,
    an OOM kill), as Ray's `max_restarts` counts them: over the worker's life, not in a row; -1 without
    limit, as before, when a worker that died at every start was restarted forever and every call on it
    waited for good. Past it the worker stays dead, and the next call on it fails with Ray's
    ActorDiedError naming the worker (`generation-worker-<rank>-job-<id>`, an attached one `<name>-<rank>`)
    and why its process died."""
    cpus_per_policy_worker: float = bounded(1.0, ge=0)
    """CPUs Ray reserves per policy worker."""
    host: str = "127.0.0.1"
    """Address HTTP servers bind; `auto` picks the node's IP when the cluster has several nodes. Checked
    before start: it resolves, and on a local Ray (no `ray_address`) this machine can bind it."""

    def check(self) -> None:
        _require(self.attach_generation_workers is None or self.ray_address is not None, "attach_generation_workers",
                 f"needs cluster.ray_address, the cluster whose workers are named {self.attach_generation_workers!r}: "
                 "without it a new local Ray starts, which runs no such workers")
        if self.ray_address not in (None, "auto", "local"):
            _require(ray_endpoint(self.ray_address) is not None, "ray_address",
                     f"must be auto, host:port or ray://host:port, got {self.ray_address!r}")


@dataclass
class CheckpointConfig:
    enabled: bool = True
    """Write checkpoints at all."""
    save_period: int = bounded(10, ge=1)
    """Save every N steps, and at the end."""
    keep_last_k: int = bounded(2, ge=0)
    """Keep this many newest checkpoints (0 keeps all)."""
    resume: str = "none"
    """`none`, `auto` (newest checkpoint in run_dir that verifies; step 0 when there is none, a CheckpointError
    when there are some and none verifies) or a checkpoint directory."""


@dataclass
class LoggerConfig:
    tensorboard: bool = True
    """Write TensorBoard scalars under run_dir/tensorboard."""
    progress: bool = True
    """Print one progress line per step."""


# ------------------------------------------------------------------------------------------- faults
@dataclass
class FaultSpec:
    kind: str = MISSING
    """One of minirl.faults.FAULT_KINDS (a `str` checked here: OmegaConf would name a bad kind in a
    list without its index)."""
    step: Optional[int] = bounded(None, ge=0)
    """Step (from 0); None matches every step."""
    group: Optional[int] = bounded(None, ge=0)
    """Group in dispatch order (from 0); None matches every group."""
    rollout: Optional[int] = bounded(None, ge=0)
    """Rollout within the group (from 0); None matches every rollout."""
    attempt: Optional[int] = bounded(None, ge=0)
    """Attempt of that rollout (from 0); None matches every attempt."""
    call: int = bounded(0, ge=0)
    """Model call of the episode at which per-call kinds fire (from 0)."""

    def check(self) -> None:
        _require(self.kind in FAULT_KINDS, "kind", f"must be one of {', '.join(FAULT_KINDS)}")


@dataclass
class FaultsConfig:
    seed: int = bounded(0, ge=0)
    """Seeds the per-rollout draws of `rate`: the same seed gives the same fault stream under every policy."""
    inject: list[FaultSpec] = field(default_factory=list)
    """Exact faults at given coordinates."""
    rate: dict[str, float] = field(default_factory=dict)
    """Independent per-rollout-attempt probability of each kind. A mapping given whole (`faults.rate={...}`,
    or `rate:` in a later config file) replaces the earlier layers' (`{}` clears it); a dotted
    `faults.rate.KIND=p` sets that kind alone (`load_config`)."""
    rate_per_room: dict[str, float] = field(default_factory=dict)
    """Correlated with difficulty: per-room hazard q of each agent-side kind; a rollout attempt of an
    n-room episode fails with p = 1 - (1 - q)**n (see minirl/faults.py). Layered as `rate`: a
    mapping given whole replaces the earlier one, a dotted `faults.rate_per_room.KIND=q` sets one kind."""
    hang_s: float = bounded(3600.0, ge=0)
    """How long a `timeout` fault keeps `/run` from answering."""

    def check(self) -> None:
        coords = ("step", "group", "rollout", "attempt")
        for j, b in enumerate(self.inject):  # one planned call per kind and attempt (FaultPlan.call_of)
            for i, a in enumerate(self.inject[:j]):
                both = a.kind == b.kind and all(getattr(a, k) is None or getattr(b, k) is None
                                                or getattr(a, k) == getattr(b, k) for k in coords)
                _require(not both, f"inject[{j}]",
                         f"matches a rollout attempt that inject[{i}] matches too (both {a.kind}); a kind fires at "
                         "one call of an attempt, the first matching spec's, so this one would be ignored there: "
                         "give the two specs coordinates that no attempt shares")
        for kind, p in self.rate.items():
            _require(kind in FAULT_KINDS, f"rate.{kind}", f"unknown fault kind; one of {', '.join(FAULT_KINDS)}")
            _require(0 <= p <= 1, f"rate.{kind}", f"must be a probability in [0, 1], got {p}")
        for kind, q in self.rate_per_room.items():
            _require(kind in AGENT_SIDE_KINDS, f"rate_per_room.{kind}",
                     "needs the row's room count, which only agent-side kinds see; "
                     f"one of {', '.join(AGENT_SIDE_KINDS)}")
            _require(0 <= q <= 1, f"rate_per_room.{kind}", f"must be a probability in [0, 1], got {q}")

    def uses(self, kind: str) -> bool:
        """Whether any fault of `kind` may fire (an injected one, or a rate above 0)."""
        return (any(s.kind == kind for s in self.inject)
                or any(r.get(kind, 0) > 0 for r in (self.rate, self.rate_per_room)))


# ------------------------------------------------------------------------------------------- root
@dataclass
class MinirlConfig:
    run_dir: Optional[str] = None
    """Output directory (default runs/<UTC timestamp>)."""
    run_dir_exists: Literal["error", "overwrite"] = "error"
    """A fresh run (`checkpoint.resume=none`) into a run_dir that holds an earlier run's records
    (metrics, events, ledger, validation, checkpoints): `error` refuses it before Ray starts (exit 2,
    naming the folder); `overwrite` first removes every file a run writes there, so the two runs never
    mix. A resume (`checkpoint.resume=auto` or a path) continues the earlier run and removes nothing."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    loss_fn: LossConfig = field(default_factory=LossConfig)
    async_rl: AsyncRLConfig = field(default_factory=AsyncRLConfig)
    context_compaction: ContextCompactionConfig = field(default_factory=ContextCompactionConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)

    def check(self) -> None:
        """The rules across sections (full dotted keys); each section's own ran before."""
        g, rf, cc = self.grpo, self.async_rl.rollout_failure, self.context_compaction
        _require(self.run_dir is None or self.run_dir.strip() != "", "run_dir",
                 f"must name a folder (null: runs/<UTC timestamp>), got {self.run_dir!r}")
        _require(self.run_dir is None or "\0" not in self.run_dir, "run_dir",
                 f"a path cannot hold a NUL byte, got {self.run_dir!r}")
        # vLLM seeds its generator with numpy (below 2**32), each generation worker with grpo.seed + its rank
        top = g.seed + self.cluster.num_generation_workers - 1
        _require(top < 2**32, "grpo.seed", f"must leave grpo.seed + cluster.num_generation_workers - 1 below 2**32 "
                                           f"(numpy's and vLLM's seed range), got {top}")
        self._check_resources()
        want = g.num_prompts_per_step * g.num_generations_per_prompt
        _require(self.policy.train_global_batch_size == want, "policy.train_global_batch_size",
                 f"must equal grpo.num_prompts_per_step * grpo.num_generations_per_prompt = {want} "
                 f"(one optimizer step per RL step), got {self.policy.train_global_batch_size}")
        problem = self.uncompacted_rewrite(self.agent.name, "agent.name")
        _require(problem is None, "context_compaction.enabled", problem or "")
        if self.agent.context_history.policy.type == "summarize":
            rewrites = self.agent.name == "compaction_agent" and self.agent.context_history.enabled
            _require(rewrites, "agent.context_history.policy.type",
                     "summarize needs agent.name=compaction_agent with agent.context_history.enabled=true")
            self._check_summary_reachable()
        if cc.call_selection != "returned_history":
            _require(cc.enabled, "context_compaction.call_selection",
                     f"{cc.call_selection} needs context_compaction.enabled=true: captured calls outside the returned "
                     "history need not extend each other")
            _require(self.agent.external_url is None, "context_compaction.call_selection",
                     f"{cc.call_selection} needs minirl's own agents: an external agent's calls carry no rollout "
                     "header, so no captured call can be told apart as its rollout's")
        if cc.enabled:  # upstream: validate_cc_objective
            _require(self.loss_fn.token_level_loss, "loss_fn.token_level_loss",
                     "context compaction requires token_level_loss=true")
            # upstream's multi-trace guide: every CC rollout is rebuilt from its captured calls (returned_history
            # is one selection policy) and a compaction rewrite starts a new trace
            _require(self.loss_fn.truncated_importance_sampling_type != "seq-mask-tis",
                     "loss_fn.truncated_importance_sampling_type",
                     "seq-mask-tis with context_compaction.enabled=true: sequence-level correction masks depend on "
                     "physical trace boundaries and cannot preserve split/merged equivalence")
            _require(cc.allow_step_shrink or rf.min_step_batch_fraction == 1,
                     "async_rl.rollout_failure.min_step_batch_fraction",
                     "context compaction requires min_step_batch_fraction=1")
        _require(not self.faults.uses("timeout") or rf.nemo_gym.rollout_timeout_s is not None,
                 "async_rl.rollout_failure.nemo_gym.rollout_timeout_s",
                 "a `timeout` fault needs a rollout timeout, or /run would hang")
        if self.async_rl.enabled:
            self._check_sampler()
        _require(rf.on_dropped_prompt != "replace" or rf.replacement_prompt_source != "spare_groups"
                 or self.data.train_jsonl is None, "async_rl.rollout_failure.replacement_prompt_source",
                 "spare_groups draws spares from prompts no step trains, which data.train_jsonl has none of (every "
                 "row is in the stream): spare group N + g of prompt step b would be the row step b + 1 trains as "
                 "its group g, trained twice; set async_rl.rollout_failure.replacement_prompt_source=stream")
        fh, workers = self.async_rl.generation_fleet_health, self.cluster.num_generation_workers
        _require(fh.min_healthy_shards <= workers, "async_rl.generation_fleet_health.min_healthy_shards",
                 f"must be at most cluster.num_generation_workers ({workers}), got {fh.min_healthy_shards}")

    def uncompacted_rewrite(self, agent: str, named: str) -> str | None:
        """Why minirl's agent `agent` (named by `named`: `agent.name`, or a dataset row's `agent_ref.name`,
        which wins over it; data.agent_problem) cannot run here, worded to follow the key
        `context_compaction.enabled`; or None. The compaction agent with agent.context_history.enabled=true
        rewrites its history, and without compaction every call must extend the previous one."""
        rewrites = agent == "compaction_agent" and self.agent.context_history.enabled
        if self.context_compaction.enabled or self.agent.external_url is not None or not rewrites:
            return None
        return (f"is false, but {named}=compaction_agent with agent.context_history.enabled=true rewrites its "
                f"history; without compaction every call must extend the previous one (use {named}=simple_agent, "
                "see configs/plain.yaml)")

    def _check_summary_reachable(self) -> None:
        """Every threshold `summarize.threshold_tokens` may draw can fire: a summary triggers when a
        prompt's tokens + `reserved_generation_tokens` pass the threshold, but the guard rejects a call
        past `max_total_tokens` (the summary comes first only at or below it), and the model server
        refuses a prompt of `max_model_len` tokens or more."""
        ch = self.agent.context_history
        lo, hi = ch.policy.summarize.threshold_tokens
        key, guard = "agent.context_history.policy.summarize.threshold_tokens", ch.guards.max_total_tokens
        _require(guard is None or hi <= guard, key,
                 f"[{lo}, {hi}] can draw a threshold above the context guard's "
                 f"agent.context_history.guards.max_total_tokens={guard}: "
                 "the guard rejects a call before its prompt passes such a threshold, so the summary never "
                 f"fires there (set threshold_tokens at most {guard})")
        max_len, reserved = self.policy.generation.vllm_cfg.max_model_len, ch.guards.reserved_generation_tokens
        # the longest prompt the model server takes (max_model_len - 1) + reserved, less 1
        reach = max_len - 2 + reserved
        _require(hi <= reach, key,
                 f"[{lo}, {hi}] can draw a threshold no prompt reaches: the model's max length "
                 f"policy.generation.vllm_cfg.max_model_len={max_len} admits prompts of at most {max_len - 1} tokens, "
                 f"which with reserved_generation_tokens={reserved} pass thresholds up to {reach} only")

    def _check_sampler(self) -> None:
        """What the async sampler needs of the buffer, the loss and the drop policy."""
        ar, rf, lf = self.async_rl, self.async_rl.rollout_failure, self.loss_fn
        name, s = ar.sampler.name, ar.sampler.max_staleness_versions
        traits = SAMPLER_TRAITS[name]
        window = traits.capacity(self.grpo.num_prompts_per_step, s)
        _require(ar.max_buffered_rollouts >= window, "async_rl.max_buffered_rollouts",
                 f"must hold the sampler's window of {window} prompt groups, got {ar.max_buffered_rollouts}")
        _require(s == 0 or lf.use_importance_sampling_correction, "loss_fn.use_importance_sampling_correction",
                 "must be true when async_rl.sampler.max_staleness_versions > 0: rollouts come from older weights")
        _require(not traits.needs_is_correction or lf.use_importance_sampling_correction,
                 "loss_fn.use_importance_sampling_correction",
                 f"must be true with async_rl.sampler.name={name}: it trains groups of any age")
        budgets = (f"max_skipped_prompts={rf.max_skipped_prompts}, "
                   f"max_consecutive_dropped_prompts={rf.max_consecutive_dropped_prompts}")
        _require(traits.stamps_target_steps or not (rf.max_skipped_prompts or rf.max_consecutive_dropped_prompts),
                 "async_rl.sampler.name",
                 f"{name!r} stamps no target step, so the drop budget ({budgets}) cannot be honoured: a prompt "
                 "that is given up on is never subtracted from the step waiting for it. Set "
                 "async_rl.sampler.name=in_order to get the tolerance these budgets promise, or set both budgets "
                 "to 0 to end the run on the first dropped prompt instead")
        _require(traits.stamps_target_steps or rf.on_dropped_prompt == "shrink",
                 "async_rl.rollout_failure.on_dropped_prompt",
                 f"replace needs a sampler that stamps target steps (in_order); {name} stamps none")

    def _check_resources(self) -> None:
        """A locally started Ray advertises cluster.num_cpus / num_gpus: the workers' bundles must fit, or
        the placement group would wait forever (Ray's GetTimeoutError after 120 s, naming nothing). Where
        they are unset (Ray detects the machine's) or a cluster is joined by address, `Cluster` checks
        against what Ray offers once it is up, before anything is placed."""
        for res, key in (("CPU", "cpus"), ("GPU", "gpus")):
            have = getattr(self.cluster, f"num_{key}")
            if self.cluster.ray_address is None and have is not None:
                problem = resource_shortfall(self, res, have, f"cluster.num_{key}={have}")
                _require(problem is None, f"cluster.num_{key}", problem or "")


# ------------------------------------------------------------------------------------------ loading
def _check_keys(node: Any, schema: Any, prefix: str) -> None:
    """Refuse keys the schema does not have, naming the unknown key in full, and anything but a list
    (or null) for a list; in a list of structured items (faults.inject) each item's keys and values
    too, named with the item's index."""
    if not isinstance(node, dict) or not isinstance(schema, DictConfig):
        return
    if OmegaConf.get_type(schema) is dict:  # free-form mapping (faults.rate)
        return
    for key, value in node.items():
        full = f"{prefix}{key}"
        if key not in schema.keys():  # `in schema` is False for a field still MISSING (FaultSpec.kind)
            if isinstance(key, str) and "." in key and OmegaConf.select(schema, key, default=_ABSENT) is not _ABSENT:
                head, _, rest = key.partition(".")
                raise ConfigError(full, f"a dotted key is for the command line; in a YAML file write it nested "
                                        f"({head}: {{{rest}: ...}})")
            close = difflib.get_close_matches(str(key), [str(k) for k in schema.keys()], n=1, cutoff=0.8)
            raise ConfigError(_leaf(full, value), "unknown config key"
                              + (f" (did you mean {prefix}{close[0]}?)" if close else ""))
        child = schema._get_node(key)
        if isinstance(child, DictConfig):
            if not isinstance(value, dict):
                raise ConfigError(full, f"is a section: give it a mapping of keys, got {value!r}")
            _check_keys(value, child, full + ".")
        elif isinstance(child, ListConfig) and isinstance(value, list):
            _check_items(value, child, full)
        elif isinstance(child, ListConfig) and value is not None:  # OmegaConf's merge raises a bare TypeError
            leaf = _leaf(full, value)
            raise ConfigError(leaf, f"is a list: give it [...], got {value!r}" if leaf == full else
                              f"{full} is a list: give it whole, as {full}=[...], not an item by its index or key")


def _leaf(full: str, value: Any) -> str:
    """The dotted key an override typed: `a.b.c` for `a.b.c=1`, whose parsed value under `a.b` is {c: 1}."""
    while isinstance(value, dict) and len(value) == 1:
        key, value = next(iter(value.items()))
        full += f".{key}"
    return full


def _whole_mappings(node: dict, schema: DictConfig, prefix: str, typed: str) -> Iterator[str]:
    """The dotted keys of the free-form mappings (faults.rate) that a layer gives whole, which replace
    the earlier layers' rather than merge into them: any in a file (`typed` ""), and an override's own
    or one inside it (`faults.rate={}`, `faults={rate: {}}`), but not one an override goes inside
    (`faults.rate.timeout=0.1` sets one kind). Run on a layer `_check_keys` passed."""
    for key, value in node.items():
        full, child = f"{prefix}{key}", schema._get_node(key)
        if not (isinstance(child, DictConfig) and isinstance(value, dict)):
            continue
        if OmegaConf.get_type(child) is dict:
            if not typed.startswith(full + "."):
                yield full
        else:
            yield from _whole_mappings(value, child, full + ".", typed)


def _check_items(items: list, schema: ListConfig, full: str) -> None:
    """Each item of a list of structured items, as `faults.inject[1].group` (OmegaConf's own errors
    there name the item's field alone: `group`)."""
    element = schema._metadata.element_type
    if not (isinstance(element, type) and is_dataclass(element)):
        return
    for i, item in enumerate(items):
        where = f"{full}[{i}]"
        if not isinstance(item, dict):
            raise ConfigError(where, f"must be a mapping of {element.__name__} keys, got {item!r}")
        item_schema = OmegaConf.structured(element)
        _check_keys(item, item_schema, where + ".")
        try:
            OmegaConf.merge(item_schema, item)
        except (OmegaConfBaseException, TypeError) as exc:
            raise _merge_error(exc, where, inside=True) from None


def _read_yaml(file: str | Path) -> dict:
    """A YAML file's top-level mapping; a file that cannot be read, is not YAML or is not a mapping
    is one ConfigError naming the file (and, for a syntax error, the line)."""
    try:
        top = yaml.compose(Path(file).read_text(), Loader=yaml.SafeLoader)
        if top is not None and not isinstance(top, yaml.MappingNode):
            kind = "list" if isinstance(top, yaml.SequenceNode) else "scalar"
            raise ConfigError("--config", f"{file}: must be a mapping of config keys (key: value), got a YAML {kind}")
        return OmegaConf.to_container(OmegaConf.load(file)) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError("--config", f"{file}{where}: YAML error: {getattr(exc, 'problem', None) or exc}") from None
    except (OSError, UnicodeDecodeError, OmegaConfBaseException) as exc:
        raise ConfigError("--config", f"cannot read {file}: {exc}") from None


def _parse_overrides(overrides: list[str]) -> list[tuple[str, dict]]:
    """`a.b=v` strings -> (key, nested dict) layers, values parsed as YAML (flow style allowed). A text
    field's value that YAML reads as a number or a boolean keeps its text (YAML 1.1 read `run_dir=0755` as
    493 and `12:30` as 750); a `${...}` interpolation stays one, resolved with the merged config's keys."""
    out = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, "an override must look like dotted.key=value")
        key, raw = item.split("=", 1)
        if not key:
            raise ConfigError(item, "an override must look like dotted.key=value (no key before the '=')")
        try:
            value = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={raw}"]), resolve=False)["v"]
        except (OmegaConfBaseException, yaml.YAMLError) as exc:  # OmegaConf's own, or YAML's ('[2,3')
            if not _text_field(key):  # a text field keeps it as typed: `cluster.ray_address=[::1]:6379`
                why = str(exc).replace("\n", " ")
                raise ConfigError(key, f"cannot parse value {raw!r}: {why}") from None
            value = raw
        if isinstance(value, (bool, int, float)) and _text_field(key):
            value = raw
        node: dict = {}
        cursor = node
        parts = key.split(".")
        for part in parts[:-1]:
            cursor = cursor.setdefault(part, {})
        cursor[parts[-1]] = value
        out.append((key, node))
    return out


def _text_field(key: str) -> bool:
    """Is dotted `key` a field of MinirlConfig typed str (or Optional[str])?"""
    node: Any = MinirlConfig
    for name in key.split("."):
        if not is_dataclass(node) or name not in {f.name for f in fields(node)}:
            return False
        node = get_type_hints(node)[name]
    return node is str or node == Optional[str]


def load_config(path: str | None = None, overrides: list[str] = (), base: Path | None = DEFAULT_YAML) -> MinirlConfig:
    """Dataclass defaults <- configs/default.yaml <- `path` <- dotted overrides, then `validate`.

    Each layer merges into the ones before it, but for a free-form mapping it gives whole
    (`_whole_mappings`: `faults.rate={}` clears the rates), which replaces theirs. A file's
    `policy.train_global_batch_size` equal to prompts x generations stays derived from them.
    Raises ConfigError naming the offending key.
    """
    merged = _base_config(base)  # a copy of its own: each layer below merges into it in place
    layers = [("", _read_yaml(path))] if path is not None else []
    for key, data in layers + _parse_overrides(list(overrides)):
        _merge_layer(merged, key, data)
    try:
        OmegaConf.resolve(merged)
        cfg: MinirlConfig = OmegaConf.to_object(merged)
    except (OmegaConfBaseException, TypeError) as exc:
        raise _merge_error(exc, "") from None
    model = Path(cfg.policy.model_name)
    if not model.is_absolute():  # actors run elsewhere: always hand them an absolute path
        cfg.policy.model_name = str(model.resolve() if model.exists() else REPO_ROOT / model)
    validate(cfg)
    return cfg


def _merge_layer(merged: DictConfig, key: str, data: dict) -> None:
    """One layer (a file's mapping, key "", or a dotted override's) merged into `merged` in place, as
    OmegaConf.merge merges into its copy of the first config: unknown keys and a free-form mapping given
    whole first (`_whole_mappings`). Raises ConfigError naming the key."""
    _check_keys(data, merged, "")
    for whole in _whole_mappings(data, merged, "", key):
        OmegaConf.update(merged, whole, {}, merge=False)
    try:
        merged.merge_with(data)
        if not key and "train_global_batch_size" in (data.get("policy") or {}):
            _keep_batch_derived(merged)
    except (OmegaConfBaseException, TypeError) as exc:
        raise _merge_error(exc, key) from None


_BASES: dict[tuple, DictConfig] = {}
"""`_base_config`'s merges, by the base file and its version (size, modification time)."""


def _base_config(base: Path | None) -> DictConfig:
    """A copy of the dataclass defaults <- `base`, merged once per process and version of the file: the
    structured config and the YAML cost ~0.13 s a load, a copy ~0.01 s."""
    version = None
    if base is not None:
        try:
            st = Path(base).stat()
        except OSError as exc:  # as `_read_yaml` names a file it cannot read
            raise ConfigError("--config", f"cannot read {base}: {exc}") from None
        version = (str(Path(base).resolve()), st.st_size, st.st_mtime_ns)
    if version not in _BASES:
        merged = OmegaConf.structured(MinirlConfig)
        if base is not None:
            _merge_layer(merged, "", _read_yaml(base))
        _BASES[version] = merged
    return copy.deepcopy(_BASES[version])


def _keep_batch_derived(merged: DictConfig) -> None:
    """A config file's `policy.train_global_batch_size` (a run's config.yaml holds every value resolved)
    that equals prompts x generations as merged so far is put back to the interpolation it came
    from, so that a later override of either `grpo` key moves it too; any other value stays, for
    `MinirlConfig.check` to refuse."""
    g = merged.grpo
    if merged.policy.train_global_batch_size == g.num_prompts_per_step * g.num_generations_per_prompt:
        merged.policy.train_global_batch_size = PolicyConfig.train_global_batch_size  # the default, ${mul:...}


def step_floor(cfg: MinirlConfig) -> int:
    """Fewest groups a step may train: ceil(num_prompts_per_step * min_step_batch_fraction), the
    float product exactly as upstream computes it, with no fudge (N=100, f=0.55 gives 56; N=10,
    f=0.9 gives 9, where the exact rational value of the float 0.9 would give 10)."""
    rf = cfg.async_rl.rollout_failure
    return math.ceil(cfg.grpo.num_prompts_per_step * rf.min_step_batch_fraction)


def validate(cfg: MinirlConfig) -> None:
    """Every field's type, finiteness and bounds, then each section's `check()` (innermost first,
    the root's cross-section rules last), then what the config points at; each failure names its key.

    Each rule sits on what it checks: a choice is a `Literal` field type, a range is the field's
    `bounded(...)` metadata, a rule between fields of one section is that section's `check()`, and a
    rule across sections is `MinirlConfig.check()`."""
    _check_tree(cfg, "")
    _check_outside(cfg)


def _check_tree(node: Any, key: str) -> None:
    """`validate`'s rules on one tree (the whole config at key "", or a section at its dotted key)."""
    _check_fields(node, key, Any, {})
    for k, section in _sections(node, key):
        try:
            section.check()
        except ConfigError as err:
            raise ConfigError(f"{k}.{err.key}" if k else err.key, err.problem) from None


def faults_section(data: Any) -> FaultsConfig:
    """`faults.*` from plain JSON (a Gym-side server's copy of the run's fault plan, minirl/gym_servers/
    doors_v07.py), checked as `load_config` checks the run's: unknown keys, types, bounds and
    FaultsConfig's rules, each ConfigError naming `faults.<key>` (a misspelt key would otherwise match
    every rollout, an unknown kind never fire)."""
    if not isinstance(data, dict):
        raise ConfigError("faults", f"is a section: give it a mapping of keys, got a {type(data).__name__}")
    node = OmegaConf.structured(FaultsConfig)
    _check_keys(data, node, "faults.")
    try:
        faults: FaultsConfig = OmegaConf.to_object(OmegaConf.merge(node, data))
    except (OmegaConfBaseException, TypeError) as exc:
        raise _merge_error(exc, "faults", inside=True) from None
    _check_tree(faults, "faults")
    return faults


def _sections(node: Any, key: str) -> Iterator[tuple[str, Any]]:
    """(dotted key, section) for every dataclass with a `check()` in the config, children before parents."""
    children = ([(f"{key}.{f.name}" if key else f.name, getattr(node, f.name)) for f in fields(node)]
                if is_dataclass(node)
                else [(f"{key}[{i}]", v) for i, v in enumerate(node)] if isinstance(node, list) else [])
    for child_key, child in children:
        yield from _sections(child, child_key)
    if is_dataclass(node) and hasattr(node, "check"):
        yield key, node


def _check_fields(node: Any, key: str, hint: Any, meta: Any) -> None:
    """One walk over every value: a Literal field holds one of its choices, a number, string or
    boolean field (a typed list's item, a `dict[str, float]`'s value) no list or mapping, which
    OmegaConf lets through there, a float is finite, a `bounded` field lies within its bounds (None
    passes where the field is Optional)."""
    if is_dataclass(node):
        hints = _hints(type(node))
        for f in fields(node):
            _check_fields(getattr(node, f.name), f"{key}.{f.name}" if key else f.name, hints[f.name], f.metadata)
    elif isinstance(node, (list, dict)) and (word := _scalar_word(hint)):
        raise ConfigError(key, f"must be {word}, got {'a list' if isinstance(node, list) else 'a mapping'} {node!r}")
    elif isinstance(node, (list, dict)):
        item = _item_hint(hint, type(node))
        for k, v in (node.items() if isinstance(node, dict) else enumerate(node)):
            _check_fields(v, f"{key}.{k}" if isinstance(node, dict) else f"{key}[{k}]", item, {})
    elif isinstance(node, float) and not math.isfinite(node):
        raise ConfigError(key, f"must be a finite number, got {node}")
    elif (choices := _choices(hint)) is not None and node not in choices:
        raise ConfigError(key, _choice_problem(choices, node))
    elif node is not None and not all(_BOUNDS[op][0](node, b) for op, b in meta.items() if op in _BOUNDS):
        raise ConfigError(key, _bounds_problem(meta, node))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A section's field types, resolved (this module postpones annotations)."""
    return get_type_hints(cls)


def _union(hint: Any) -> list:
    """The types a field may hold: `Optional[Union[str, list[str]]]` -> [str, list[str]] (None left out)."""
    return [a for a in (get_args(hint) if get_origin(hint) is Union else (hint,)) if a is not type(None)]


_SCALAR_WORDS = {float: "a number", int: "an integer", str: "a string", bool: "true or false"}


def _scalar_word(hint: Any) -> str | None:
    """What a field of scalar types holds, in words (`a number`); None where it may hold a container."""
    types = _union(hint)
    return " or ".join(_SCALAR_WORDS[t] for t in types) if types and all(t in _SCALAR_WORDS for t in types) else None


def _item_hint(hint: Any, container: type) -> Any:
    """The type of an item of a `container` (list or dict) a field holds: `list[int]` -> int,
    `dict[str, float]` -> float, `Optional[Union[str, list[str]]]` with a list -> str; else Any."""
    typed = [get_args(t) for t in _union(hint) if get_origin(t) is container]
    return typed[0][-1] if typed and typed[0] else Any


def _choices(hint: Any) -> tuple | None:
    """The values a `Literal[...]` (or `Optional[Literal[...]]`) field allows, None first; None for other types."""
    if get_origin(hint) is Literal:
        return get_args(hint)
    if get_origin(hint) is Union:
        literal = [get_args(a) for a in get_args(hint) if get_origin(a) is Literal]
        return (None, *literal[0]) if literal and type(None) in get_args(hint) else None
    return None


def _choice_problem(choices: tuple, value: Any) -> str:
    *rest, last = ["null" if c is None else str(c) for c in choices]
    return f"must be {', '.join(rest) + ' or ' if rest else ''}{last}, got {value!r}"


_BOUNDS = {"ge": (operator.ge, ">=", "["), "gt": (operator.gt, ">", "("),
           "le": (operator.le, "<=", "]"), "lt": (operator.lt, "<", ")")}


def _bounds_problem(meta: Any, value: Any) -> str:
    """`must be >= 1, got 0` for one bound, `must be in (0, 1], got 0` for two."""
    bounds = [(op, b) for op, b in meta.items() if op in _BOUNDS]
    if len(bounds) == 1:
        (op, b), = bounds
        return f"must be {_BOUNDS[op][1]} {b}, got {value}"
    (lo_op, lo), (hi_op, hi) = sorted(bounds, key=lambda ob: ob[0] in ("le", "lt"))
    return f"must be in {_BOUNDS[lo_op][2]}{lo}, {hi}{_BOUNDS[hi_op][2]}, got {value}"


_ROOT_KEYS = frozenset(f.name for f in fields(MinirlConfig))
"""The top-level sections and keys: the first part of every full key."""


def _merge_error(exc: Exception, key: str, inside: bool = False) -> ConfigError:
    """OmegaConf's error (or the bare TypeError its merge raises for containers it cannot combine)
    as one line naming the key; a value outside a Literal's choices reads as `validate` words it.
    OmegaConf names a field of a structured list item without its path (`step` for
    `faults.inject[0].step`): `key` (the override's, or with `inside` the item's) goes before a
    name that is not a top-level section."""
    where = getattr(exc, "full_key", None) or ""
    if key and where and (inside or where.split(".")[0].split("[")[0] not in _ROOT_KEYS):
        where = f"{key}.{where}"
    where = where or key or "config"
    owner, name = getattr(exc, "object_type", None), getattr(exc, "key", None)
    choices = _choices(_hints(owner).get(name)) if isinstance(owner, type) and is_dataclass(owner) else None
    if isinstance(exc, ValidationError) and choices is not None:
        return ConfigError(where, _choice_problem(choices, getattr(exc, "value", None)))
    return ConfigError(where, str(exc).splitlines()[0])


def resource_shortfall(cfg: MinirlConfig, res: str, have: float | None, where: str) -> str | None:
    """None when the workers' `res` (CPU or GPU) fits in `have` (None: not known, not checked); else the sum, named."""
    cl, key = cfg.cluster, res.lower() + "s"
    gen = 0 if cl.attach_generation_workers else cl.num_generation_workers
    per_gen, per_pol = getattr(cl, f"{key}_per_generation_worker"), getattr(cl, f"{key}_per_policy_worker")
    need = gen * per_gen + cl.num_policy_workers * per_pol
    if have is None or need <= have + 1e-9:
        return None
    return (f"the workers need {need:g} {res}s (cluster.num_generation_workers={gen} "
            f"x cluster.{key}_per_generation_worker={per_gen:g} + cluster.num_policy_workers={cl.num_policy_workers} "
            f"x cluster.{key}_per_policy_worker={per_pol:g}), more than Ray offers ({where})")


def _check_host(host: str, local: bool) -> None:
    """`cluster.host` resolves, and on a local Ray (every server on this machine) this machine can bind it;
    otherwise the first server's bind failed after Ray had started, naming no key."""
    if host == "auto":
        return
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError, ValueError) as exc:
        raise ConfigError("cluster.host", f"{host!r} does not resolve ({exc})") from None
    if local:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind(addr)
        except OSError as exc:
            raise ConfigError("cluster.host", f"{host!r}: this machine cannot bind it ({exc.strerror or exc}); "
                              "use an address of its own, or auto") from None


def _check_outside(cfg: MinirlConfig) -> None:
    """What the config points at: the model directory loads, the resume path exists, the URL parses, the
    servers' address resolves (and, on a local Ray, binds here)."""
    _check_host(cfg.cluster.host, local=cfg.cluster.ray_address is None)
    model = Path(cfg.policy.model_name)
    try:
        model_cfg = json.loads((model / "config.json").read_text())
    except (OSError, ValueError) as exc:
        problem = "no such directory" if not model.is_dir() else f"config.json does not load ({exc})"
        raise ConfigError("policy.model_name", f"{model}: {problem}") from None
    _require(isinstance(model_cfg, dict) and "model_type" in model_cfg, "policy.model_name",
             f"{model / 'config.json'}: not a Hugging Face model config (no model_type)")
    positions = model_cfg.get("max_position_embeddings")
    max_len = cfg.policy.generation.vllm_cfg.max_model_len
    _require(not isinstance(positions, int) or max_len <= positions, "policy.generation.vllm_cfg.max_model_len",
             f"must be <= the model's max_position_embeddings ({positions}, {model / 'config.json'}), got {max_len}")
    resume = cfg.checkpoint.resume
    _require(resume in ("none", "auto") or (resume != "" and Path(resume).is_dir()), "checkpoint.resume",
             f"must be none, auto or an existing checkpoint directory; {resume!r} is not a directory")
    url = cfg.agent.external_url
    urls = [url] if isinstance(url, str) else list(url or [])
    _require(url is None or bool(urls), "agent.external_url", "must be a URL or a non-empty list of URLs, got []")
    for i, one in enumerate(urls):
        key = "agent.external_url" if isinstance(url, str) else f"agent.external_url[{i}]"
        try:
            parts = urlparse(one)
            parts.port  # raises ValueError on a bad port
        except ValueError as exc:
            raise ConfigError(key, f"{one!r} is not a URL: {exc}") from None
        _require(parts.scheme in ("http", "https") and bool(parts.hostname), key,
                 f"must be an http(s) URL with a host, got {one!r}")
    seen: dict[tuple, str] = {}
    for one in urls:
        first = seen.setdefault(same_server(one), one)
        _require(first is one, "agent.external_url", f"lists one agent server twice: {first!r} and {one!r}")


def same_server(url: str) -> tuple:
    """What makes two agent URLs one server: scheme, host (`localhost` read as 127.0.0.1, any case),
    port (the scheme's default when none is given) and path without a trailing slash."""
    parts = urlparse(url)
    host = (parts.hostname or "").lower()
    host = "127.0.0.1" if host == "localhost" else host
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower())
    return parts.scheme.lower(), host, port, parts.path.rstrip("/")


RAY_PROBE_TIMEOUT_S = 5.0
"""How long `probe_ray_address` waits for a TCP connection to `cluster.ray_address`."""


def ray_endpoint(address: str) -> tuple[str, int] | None:
    """(host, port) of `host:port` or `ray://host:port` (`[v6]:port` too); None when it is neither."""
    try:
        parts = urlparse(address if "://" in address else f"tcp://{address}")
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    if parts.scheme not in ("tcp", "ray") or not host or port is None or parts.path not in ("", "/"):
        return None
    return host, port


def probe_ray_address(cfg: MinirlConfig, timeout_s: float = RAY_PROBE_TIMEOUT_S) -> None:
    """Before Ray starts (a network check, so not part of `validate`, which reads saved configs too):
    `cluster.ray_address` accepts a TCP connection within `timeout_s`, else one ConfigError naming the
    address as typed. Ray itself keeps retrying one that does not answer (831 s and 61 warnings for
    `127.0.0.1:1`, the last naming a rewritten host)."""
    address = cfg.cluster.ray_address
    endpoint = ray_endpoint(address) if address not in (None, "auto", "local") else None
    if endpoint is None:
        return
    try:
        socket.create_connection(endpoint, timeout=timeout_s).close()
    except OSError as exc:
        why = f"no answer within {timeout_s:g} s" if isinstance(exc, TimeoutError) else exc.strerror or str(exc)
        raise ConfigError("cluster.ray_address", f"nothing answers at {address!r} ({why}): start that cluster "
                          "(`ray start --head`) or fix the address; null starts a local Ray") from None


def to_yaml(cfg: MinirlConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
