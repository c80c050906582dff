"""Typed configuration: dataclasses merged by OmegaConf, then validated.

Names and defaults mirror NeMo-RL (`grpo.*`, `policy.*`, `loss_fn.*`, `async_rl.rollout_failure.*`)
and Gym's `context_history` where the concept exists there. minirl's own switches for the review's
fixes default to the fix. Layering: dataclass defaults, then `configs/default.yaml` (the default
run: the tiny task and minirl's budgets), then the `--config` YAML, then `key=value` overrides.

Invariant: `load_config` returns a config that passed every check here, or raises `ConfigError`
whose message starts with the offending dotted key; nothing downstream re-validates.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

import yaml
from omegaconf import II, MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_YAML = REPO_ROOT / "configs" / "default.yaml"
DEFAULT_MODEL = "models/tiny-doors"

if not OmegaConf.has_resolver("mul"):
    _register = getattr(OmegaConf, "register_resolver", None) or OmegaConf.register_new_resolver
    _register("mul", lambda a, b: int(a) * int(b))


class ConfigError(ValueError):
    """A bad config key or value; the message is one line and starts with the dotted key."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"{key}: {' '.join(str(problem).split())}")
        self.key = key


# --------------------------------------------------------------------------------------------- grpo
@dataclass
class GRPOConfig:
    num_prompts_per_step: int = 8
    """Prompt groups per optimizer step (the step's target before any drop)."""
    num_generations_per_prompt: int = 4
    """Rollouts per prompt group."""
    max_num_steps: int = 40
    """Optimizer steps to run (a resumed run counts the steps already done)."""
    normalize_rewards: bool = True
    """Divide advantages by the group's leave-one-out std (where it is > 0)."""
    use_leave_one_out_baseline: bool = True
    """Baseline each rollout by the mean reward of the other rollouts of its group."""
    baseline_excludes_masked: bool = True
    """Baseline and std of a group run over its valid (unmasked) rollouts only, and a group with at
    most one valid rollout gets advantage 0 (minirl; RL #4061). False reproduces upstream, where a
    masked rollout's reward still counts in its siblings' baseline and std."""
    overlong_filtering: bool = False
    """Mask (sample_mask=0) every rollout truncated at policy.max_total_sequence_length (a trace
    that reached it), as upstream marks truncation; a reply cut by the per-call cap is not."""
    seed: int = 42
    """Seeds prompts, sampling and the policy's initial RNG."""
    val_period: int = 0
    """Validate on the held-out prompts after every N-th optimizer step (0: never; NeMo-RL's name)."""
    val_at_start: bool = False
    """Validate the initial (or resumed) weights before the first step."""
    val_num_prompts: int = 8
    """Held-out prompts per validation (minirl.validation: never a prompt of the run's training steps)."""
    val_num_generations: int = 1
    """Rollouts per held-out prompt."""


# ------------------------------------------------------------------------------------------- policy
@dataclass
class OptimizerConfig:
    lr: float = 2.0e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    eps: float = 1.0e-8
    """AdamW epsilon."""


@dataclass
class VllmConfig:
    max_model_len: int = 1024
    """Context window of the engine; a longer prompt gets vLLM's HTTP 400 "maximum context length"."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallelism per generation worker (GPU only)."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take (GPU only)."""
    kv_cache_space_gb: int = 1
    """VLLM_CPU_KVCACHE_SPACE on CPU, in GiB."""
    omp_threads: int = 2
    """Torch threads of the engine on CPU."""
    enforce_eager: bool = True
    """Skip graph capture/compilation (start-up matters more than peak speed at this size)."""
    step_timeout_s: float = 300.0
    """An engine step that has not returned after this many seconds is a dead engine: the generation
    worker ends and Ray restarts it (vLLM's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, 300, which vLLM
    applies only with tensor parallelism). 0: no limit."""
    max_request_bytes: int = 16_000_000
    """Largest request body the generation server accepts (aiohttp's client_max_size); a larger one gets 413."""


@dataclass
class GenerationConfig:
    temperature: float = 1.0
    """Sampling temperature for rollouts."""
    top_p: float = 1.0
    """Nucleus sampling for rollouts."""
    max_new_tokens: int = 48
    """Cap on each model call's reply (also capped by the room left in `max_model_len`)."""
    reasoning_parser: Optional[str] = "think"
    """As `vllm serve --reasoning-parser`: `think` splits a leading `<think>…</think>` off a reply into
    `reasoning`; null leaves it in `content` (for a Gym `vllm_model` with `uses_reasoning_parser: false`)."""
    vllm_cfg: VllmConfig = field(default_factory=VllmConfig)


@dataclass
class PolicyConfig:
    model_name: str = DEFAULT_MODEL
    """Local Hugging Face model directory, loaded with `from_pretrained` (no hub access); a relative
    path that does not exist from the working directory is taken from the repository root."""
    train_global_batch_size: int = II("mul:${grpo.num_prompts_per_step},${grpo.num_generations_per_prompt}")
    """Logical rollouts per optimizer step; must equal prompts x generations (one step per RL step)."""
    train_micro_batch_size: int = 16
    """Traces per forward/backward pass (gradient accumulation inside the step)."""
    max_total_sequence_length: int = 1024
    """Longest trace the trainer accepts; a longer one is a data failure."""
    precision: str = "float32"
    """Trainer dtype: float32 or bfloat16 (bf16 is meant for GPUs)."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm (0 disables)."""
    train_threads: int = 2
    """torch threads of the policy worker on CPU (Ray sets OMP threads to num_cpus otherwise)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)


@dataclass
class LossConfig:
    ratio_clip_min: float = 0.2
    """Lower PPO clip: ratio >= 1 - ratio_clip_min."""
    ratio_clip_max: float = 0.2
    """Upper PPO clip: ratio <= 1 + ratio_clip_max."""
    reference_policy_kl_penalty: float = 0.01
    """Weight of the k3 KL to the initial policy (0 disables the reference model). Upstream's
    default (ClippedPGLossConfig, grpo_math_1B.yaml); configs/default.yaml sets 0."""
    token_level_loss: bool = True
    """Sum over all valid tokens of the global batch, divided by their count (required under CC)."""
    use_importance_sampling_correction: bool = False
    """Weight each token's clipped loss by exp(prev - generation): the trainer's logprob at the
    step's start over the engine's, detached (non-finite -> 0). For rollouts from older weights."""
    truncated_importance_sampling_type: Optional[str] = None
    """Truncation of those weights: null, `tis` (clamp to [ratio_min or 0, ratio]), `icepop` (zero
    the tokens outside [ratio_min, ratio]) or `seq-mask-tis` (zero every token of a sequence whose
    geometric-mean weight falls outside [ratio_min, ratio]; the others keep theirs untruncated)."""
    truncated_importance_sampling_ratio: Optional[float] = None
    """Upper bound of the truncated weights (required with a truncation type)."""
    truncated_importance_sampling_ratio_min: Optional[float] = None
    """Lower bound of the truncated weights (required for `icepop` and `seq-mask-tis`)."""


# ---------------------------------------------------------------------------------------- async_rl
@dataclass
class NemoGymConfig:
    rollout_timeout_s: Optional[float] = None
    """One deadline around a whole prompt group attempt (all its rows' `/run` requests, row re-sends
    included); past it the attempt fails with RolloutTimeout("NeMo-Gym prompt group exceeded {s}s"),
    INFRA. None: no deadline."""
    max_row_attempts: int = 3
    """Attempts per row within one group attempt before the group attempt fails (row redispatch)."""
    keep_returned_rows: bool = True
    """A group retry re-sends only the rows that did not come back; their siblings keep their
    validated results (minirl, fix 3's design). `false`: upstream's retry, every row of the group
    re-run under the fresh group id."""


@dataclass
class RolloutFailureConfig:
    max_infra_attempts_per_prompt: int = 5
    """INFRA attempts per prompt group before it is dropped."""
    max_data_attempts_per_prompt: int = 2
    """DATA attempts per prompt group (no backoff) before it is skipped or the error re-raised."""
    backoff_base_s: float = 1.0
    """Backoff before INFRA retry k: min(backoff_base_s * 2**(k-1), max_backoff_s)."""
    max_backoff_s: float = 30.0
    """Backoff ceiling; must be >= backoff_base_s."""
    max_skipped_prompts: int = 0
    """Run-wide budget of prompts skipped after DATA failures (0: re-raise the DATA error)."""
    max_consecutive_dropped_prompts: int = 0
    """Drops allowed with no committed group in between (0: the first drop raises)."""
    min_step_batch_fraction: float = 0.9
    """Floor: a step needs ceil(fraction x num_prompts_per_step) groups, in (0, 1]."""
    on_dropped_prompt: str = "shrink"
    """What a lost prompt (an INFRA drop or a DATA skip) does to its step: `shrink` trains the step on
    the groups it has; `replace` (async, a sampler that stamps target steps: in_order) gives its
    place a spare prompt: the furthest later step's finished group is promoted into the step and the
    spare repays that step, or the spare fills the step itself."""
    max_replacement_attempts: int = 1
    """`replace`: spare prompts one lost place may take (its spare may be lost too); beyond, the step shrinks."""
    replacement_reserve_prompts: int = 1
    """`replace`: low-water mark of the spare-prompt pool: below it, a whole batch of spare prompts
    (num_prompts_per_step) is added at the next batch boundary. An empty pool means shrink."""
    replacement_prompt_source: str = "spare_groups"
    """`replace`: where a refill's batch comes from. `spare_groups`: batch b is the groups N..2N-1 of
    prompt step b, prompts no step trains, so a step's prompts never depend on drops. `stream`
    (upstream): the next batch of the training stream is diverted, and every later step trains the
    batch after the one it would have (which batch depends on when the pool ran low)."""
    nemo_gym: NemoGymConfig = field(default_factory=NemoGymConfig)


@dataclass
class StallWatchdogConfig:
    stall_timeout_s: Optional[float] = 600.0
    """Seconds without any completed rollout before the watchdog acts (None disables)."""
    action: str = "raise"
    """`raise` RolloutStall with what is in flight, or `warn` and keep waiting."""


GYM_RETRIED_STATUSES = (429, 500, 502, 503, 504, 520)
"""HTTP statuses Gym's model client retries (nemo_gym.openai_utils.RETRY_ERROR_CODES)."""


@dataclass
class GenerationRouterConfig:
    enabled: bool = True
    """Put a router at a fixed port in front of the generation workers (its URL goes to endpoints.json)."""
    port_range_low: int = 6000
    """The router binds the first free port from here..."""
    port_range_high: int = 6099
    """...to here (inclusive)."""
    backend_timeout_s: float = 600.0
    """A forwarded request that takes longer gets HTTP 504."""
    connect_timeout_s: float = 5.0
    """A worker that does not accept the connection within this is skipped, and ineligible this long."""
    no_healthy_backend_status: int = 409
    """The status answered when no worker is eligible; never one Gym retries (429, 500, 502, 503, 504, 520)."""


@dataclass
class GenerationFleetHealthConfig:
    enabled: bool = False
    """Probe every generation worker from the router, quarantine the sick ones, and send minirl's own
    agents through the router. Off by default: the default run has one worker, where a quarantine
    cannot route around anything but only end the run (a worker Ray restarts after `worker_kill` is
    down for its engine start-up, 15 s or more: three failed probes), and the agents keep their rollout-sticky routing (prefix
    cache), so the default run's rewards stay as they were. Turn it on with two or more workers."""
    probe_interval_s: float = 5.0
    """Seconds between two probes (`GET /health`) of one worker."""
    probe_timeout_s: float = 2.0
    """A probe not answered 200 within this fails; must be less than probe_interval_s."""
    unhealthy_threshold: int = 3
    """Consecutive failed probes that quarantine a worker: it gets no new request, and the requests in
    flight on it fail at once with HTTP 503 (INFRA: their rollouts are redispatched)."""
    healthy_threshold: int = 2
    """Consecutive passed probes that re-admit a quarantined worker (e.g. one Ray restarted)."""
    min_healthy_shards: int = 1
    """Fewer workers out of quarantine than this end the run (GenerationFleetUnhealthy, naming the
    quarantined workers and their failed probes); at most cluster.num_generation_workers."""


@dataclass
class SamplerConfig:
    name: str = "in_order"
    """`in_order` (each step trains its own prompt groups), `windowed` (any ready group in the
    window), `weight_fifo` (one weight's groups per step, oldest first) or `ready_first` (the first
    ready groups, of any age); see minirl/async_rl/samplers.py."""
    max_staleness_versions: int = 1
    """S: a group dispatched under weights v may train at versions v..v+S, older ones are evicted;
    the gated samplers (in_order, weight_fifo, ready_first) dispatch prompt batch k only while
    k <= version + S."""
    max_lookahead_versions: Optional[int] = None
    """Upstream's name of in_order's gate: when set (in_order only), it is S, and max_staleness_versions
    takes its value (one resolved value, in config.yaml too)."""


@dataclass
class AsyncRLConfig:
    enabled: bool = False
    """Overlap generation and training (NeMo-RL's Single-Controller path): a rollout pump runs ahead
    of the optimizer under the staleness sampler. False: generate a step, train it, sync, repeat."""
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    max_inflight_prompts: int = 32
    """Prompt groups the rollout pump keeps in flight at most."""
    max_buffered_rollouts: int = 64
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


# ------------------------------------------------------------------------------- context compaction
@dataclass
class ContextCompactionConfig:
    enabled: bool = True
    """Train rollouts as physical traces of a compacting agent (CC GRPO)."""
    allow_step_shrink: bool = True
    """Fix 1: a CC step trains on the groups it kept. False reproduces upstream (full count or raise)."""
    redispatch_dropped_groups: bool = True
    """Fix 3: re-run CC groups that failed with INFRA errors. False reproduces upstream (drop at once)."""


@dataclass
class ImagesPolicyConfig:
    enabled: bool = True
    """Drop old pictures."""
    protect_initial_context: bool = True
    """Never drop pictures of the episode's initial input."""
    keep_last_groups: int = 3
    """Keep the pictures of the last N items that carry any."""
    omission_marker: str = "[Earlier image omitted]"
    """Text that replaces a dropped picture."""


@dataclass
class ReasoningPolicyConfig:
    enabled: bool = True
    """Drop old reasoning blocks."""
    keep_first_block: bool = False
    """Always keep the first reasoning block."""
    keep_last_blocks: int = 3
    """Keep the last N reasoning blocks."""


@dataclass
class CompactionPolicyOptions:
    images: ImagesPolicyConfig = field(default_factory=ImagesPolicyConfig)
    reasoning: ReasoningPolicyConfig = field(default_factory=ReasoningPolicyConfig)


@dataclass
class CompactionPolicyConfig:
    type: str = "recency"
    """`recency` (drop old media and reasoning) or `identity` (never rewrite)."""
    config: CompactionPolicyOptions = field(default_factory=CompactionPolicyOptions)


@dataclass
class ScheduleConfig:
    type: str = "rolling_recency"
    """`rolling_recency` compacts before every call; `turn_chunked_recency` every N actions."""
    actions_per_chunk: int = 1
    """Actions per chunk for `turn_chunked_recency`; must be 1 for `rolling_recency`."""


@dataclass
class GuardsConfig:
    max_total_tokens: Optional[int] = None
    """Context guard: refuse a call whose prompt + reserved tokens exceed this (None: no guard)."""
    reserved_generation_tokens: int = 0
    """Tokens the guard reserves for the reply."""
    on_reject: str = "end_episode"
    """Fix 2 `end_episode`: stop, verify, return (rollout masked). `raise` reproduces upstream (HTTP 500)."""


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
    """`compaction_agent` or `simple_agent`; sent as the row's `agent_ref.name`."""
    max_steps: int = 4
    """Model calls per episode at most."""
    external_url: Optional[str] = None
    """Base URL of an external Gym-style agent server; minirl then starts no agent pool."""
    max_request_bytes: int = 8_000_000
    """Largest `/run` request body the agent server accepts."""
    context_history: ContextHistoryConfig = field(default_factory=ContextHistoryConfig)


@dataclass
class EnvConfig:
    num_rooms: int = 2
    """Rooms per episode; each needs at least one model call."""
    tool_latency_s: float = 0.0
    """Seconds each tool call of the doors environment sleeps (a stand-in for real tools and
    sandboxes, which spend seconds outside the model)."""
    num_rooms_choices: Optional[list[int]] = None
    """A task mix: each prompt's room count is drawn from this list by the prompt's own seed (None:
    every prompt has `num_rooms`). More rooms make a longer, harder episode."""
    max_num_rooms: int = 16
    """Largest `num_rooms` a `/run` row may ask for; the agent server refuses larger."""
    data_seed: int = 1234
    """Seeds the prompt stream: the prompt of (step, group) depends on this and nothing else."""
    max_num_rooms: int = 16
    """Largest num_rooms a /run row may ask for; the agent server refuses larger."""


# -------------------------------------------------------------------------------------- placement
@dataclass
class ClusterConfig:
    ray_address: Optional[str] = None
    """Connect to this Ray cluster (`auto` for a running one); None starts a local one."""
    num_cpus: Optional[int] = None
    """CPUs a locally started Ray advertises (None: all)."""
    num_gpus: Optional[int] = None
    """GPUs a locally started Ray advertises (None: detect; >0 on a CPU box fakes them for tests)."""
    num_generation_workers: int = 1
    """vLLM engines, each behind its own HTTP endpoint."""
    attach_generation_workers: Optional[str] = None
    """Reuse running detached generation workers named `<this>-<rank>` (namespace `minirl`): they
    are reset to this run's faults and initial weights. For sweeps of short runs, which then skip
    engine start-up (see scripts/compare_drop_budgets.py). None starts new ones."""
    num_policy_workers: int = 1
    """Data-parallel torch policy workers (one torch.distributed group)."""
    num_agent_servers: int = 1
    """Agent-pool HTTP servers."""
    gpus_per_generation_worker: float = 0.0
    """GPUs per generation worker (0: CPU)."""
    gpus_per_policy_worker: float = 0.0
    """GPUs per policy worker (0: CPU)."""
    cpus_per_generation_worker: float = 1.0
    """CPUs Ray reserves per generation worker."""
    cpus_per_policy_worker: float = 1.0
    """CPUs Ray reserves per policy worker."""
    host: str = "127.0.0.1"
    """Address HTTP servers bind; `auto` picks the node's IP when the cluster has several nodes."""


@dataclass
class CheckpointConfig:
    enabled: bool = True
    """Write checkpoints at all."""
    save_period: int = 10
    """Save every N steps, and at the end."""
    keep_last_k: int = 2
    """Keep this many newest checkpoints (0 keeps all)."""
    resume: str = "none"
    """`none`, `auto` (newest complete checkpoint in run_dir) or a checkpoint directory."""


@dataclass
class LoggerConfig:
    tensorboard: bool = True
    """Write TensorBoard scalars under run_dir/tensorboard."""
    progress: bool = True
    """Print one progress line per step."""


# ------------------------------------------------------------------------------------------- faults
FAULT_KINDS = (
    "context_overflow",
    "model_error",
    "guard_reject",
    "agent_exception",
    "timeout",
    "transport",
    "bad_output",
    "worker_kill",
    "worker_hang",
    "engine_hang",
    "engine_crash",
    "agent_kill",
)
AGENT_SIDE_KINDS = ("guard_reject", "agent_exception", "timeout", "transport", "bad_output", "agent_kill")
"""Kinds that fire in the agent pool, where the row (and so its task's room count) is known."""


@dataclass
class FaultSpec:
    kind: str = MISSING
    """One of FAULT_KINDS."""
    step: Optional[int] = None
    """Step (from 0); None matches every step."""
    group: Optional[int] = None
    """Group in dispatch order (from 0); None matches every group."""
    rollout: Optional[int] = None
    """Rollout within the group (from 0); None matches every rollout."""
    attempt: Optional[int] = None
    """Attempt of that rollout (from 0); None matches every attempt."""
    call: int = 0
    """Model call of the episode at which per-call kinds fire."""


@dataclass
class FaultsConfig:
    seed: int = 0
    """Seeds the per-rollout draws of `rate`: the same seed gives the same fault stream under every policy."""
    inject: list[FaultSpec] = field(default_factory=list)
    """Exact faults at given coordinates."""
    rate: dict[str, float] = field(default_factory=dict)
    """Independent per-rollout-attempt probability of each kind."""
    rate_per_room: dict[str, float] = field(default_factory=dict)
    """Correlated with difficulty: per-room hazard q of each agent-side kind; a rollout attempt of an
    n-room episode fails with p = 1 - (1 - q)**n (see minirl/faults.py)."""
    hang_s: float = 3600.0
    """How long a `timeout` fault keeps `/run` from answering."""


# ------------------------------------------------------------------------------------------- root
@dataclass
class MinirlConfig:
    run_dir: Optional[str] = None
    """Output directory (default runs/<UTC timestamp>)."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    loss_fn: LossConfig = field(default_factory=LossConfig)
    async_rl: AsyncRLConfig = field(default_factory=AsyncRLConfig)
    context_compaction: ContextCompactionConfig = field(default_factory=ContextCompactionConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)


# ------------------------------------------------------------------------------------------ loading
def _check_keys(node: Any, schema: Any, prefix: str) -> None:
    """Refuse keys the schema does not have, naming the unknown key in full."""
    if not isinstance(node, dict) or not isinstance(schema, DictConfig):
        return
    if OmegaConf.get_type(schema) is dict:  # free-form mapping (faults.rate)
        return
    for key, value in node.items():
        full = f"{prefix}{key}"
        if key not in schema:
            while isinstance(value, dict) and len(value) == 1:  # name the leaf of `a.b.c=1`
                key, value = next(iter(value.items()))
                full += f".{key}"
            raise ConfigError(full, "unknown config key")
        child = schema._get_node(key)
        if isinstance(child, DictConfig):
            if not isinstance(value, dict):
                raise ConfigError(full, f"is a section: give it a mapping of keys, got {value!r}")
            _check_keys(value, child, full + ".")


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
    """`a.b=v` strings -> (key, nested dict) layers, values parsed as YAML (flow style allowed)."""
    out = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, "an override must look like dotted.key=value")
        key, raw = item.split("=", 1)
        try:
            value = OmegaConf.from_dotlist([f"v={raw}"])["v"]
        except OmegaConfBaseException as exc:
            raise ConfigError(key, f"cannot parse value {raw!r}: {exc}") from None
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value)
        node: dict = {}
        cursor = node
        parts = key.split(".")
        for part in parts[:-1]:
            cursor = cursor.setdefault(part, {})
        cursor[parts[-1]] = value
        out.append((key, node))
    return out


def load_config(path: str | None = None, overrides: list[str] = (), base: Path | None = DEFAULT_YAML) -> MinirlConfig:
    """Dataclass defaults <- configs/default.yaml <- `path` <- dotted overrides, then `validate`.

    Raises ConfigError naming the offending key.
    """
    merged = OmegaConf.structured(MinirlConfig)
    layers = [("", _read_yaml(file)) for file in (base, path) if file is not None]
    layers += _parse_overrides(list(overrides))
    for key, data in layers:
        _check_keys(data, merged, "")
        try:
            merged = OmegaConf.merge(merged, data)
        except OmegaConfBaseException as exc:
            raise ConfigError(getattr(exc, "full_key", None) or key or "config", str(exc).splitlines()[0]) from None
    try:
        OmegaConf.resolve(merged)
        cfg: MinirlConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise ConfigError(getattr(exc, "full_key", None) or "config", str(exc).splitlines()[0]) from None
    model = Path(cfg.policy.model_name)
    if not model.is_absolute():  # actors run elsewhere: always hand them an absolute path
        cfg.policy.model_name = str(model.resolve() if model.exists() else REPO_ROOT / model)
    validate(cfg)
    return cfg


def _require(ok: bool, key: str, problem: str) -> None:
    if not ok:
        raise ConfigError(key, problem)


def step_floor(cfg: MinirlConfig) -> int:
    """Fewest groups a step may train: ceil(num_prompts_per_step * min_step_batch_fraction), the
    float product exactly as upstream computes it, with no fudge (N=100, f=0.55 gives 56; N=10,
    f=0.9 gives 9, where the exact rational value of the float 0.9 would give 10)."""
    rf = cfg.async_rl.rollout_failure
    return math.ceil(cfg.grpo.num_prompts_per_step * rf.min_step_batch_fraction)


# Range checks by dotted key (None passes where the field is Optional); the rules below are the rest.
AT_LEAST_1 = (
    "grpo.num_prompts_per_step", "grpo.num_generations_per_prompt", "grpo.max_num_steps",
    "policy.train_micro_batch_size", "policy.max_total_sequence_length", "policy.train_threads",
    "policy.generation.max_new_tokens", "policy.generation.vllm_cfg.max_model_len",
    "policy.generation.vllm_cfg.tensor_parallel_size", "policy.generation.vllm_cfg.kv_cache_space_gb",
    "policy.generation.vllm_cfg.omp_threads",
    "async_rl.rollout_failure.max_infra_attempts_per_prompt", "async_rl.rollout_failure.max_data_attempts_per_prompt",
    "async_rl.rollout_failure.nemo_gym.max_row_attempts", "async_rl.max_inflight_prompts", "async_rl.max_buffered_rollouts",
    "agent.max_steps", "agent.max_request_bytes", "agent.context_history.schedule.actions_per_chunk",
    "env.num_rooms", "env.max_num_rooms", "grpo.val_num_prompts", "grpo.val_num_generations",
    "cluster.num_cpus", "cluster.num_generation_workers", "cluster.num_policy_workers", "cluster.num_agent_servers",
    "checkpoint.save_period", "async_rl.generation_fleet_health.unhealthy_threshold",
    "async_rl.generation_fleet_health.healthy_threshold", "async_rl.generation_fleet_health.min_healthy_shards",
)
AT_LEAST_0 = (
    "grpo.seed", "grpo.val_period", "env.data_seed", "faults.seed", "faults.hang_s",
    "policy.max_grad_norm", "policy.optimizer.lr", "policy.optimizer.weight_decay",
    "loss_fn.ratio_clip_min", "loss_fn.ratio_clip_max", "loss_fn.reference_policy_kl_penalty",
    "async_rl.rollout_failure.max_skipped_prompts", "async_rl.rollout_failure.max_consecutive_dropped_prompts",
    "async_rl.rollout_failure.backoff_base_s", "async_rl.sampler.max_staleness_versions",
    "async_rl.sampler.max_lookahead_versions", "env.tool_latency_s",
    "agent.context_history.guards.reserved_generation_tokens",
    "agent.context_history.policy.config.images.keep_last_groups",
    "agent.context_history.policy.config.reasoning.keep_last_blocks",
    "cluster.num_gpus", "cluster.gpus_per_generation_worker", "cluster.gpus_per_policy_worker",
    "cluster.cpus_per_generation_worker", "cluster.cpus_per_policy_worker",
    "checkpoint.keep_last_k",
)
ABOVE_0 = (
    "policy.generation.temperature", "policy.optimizer.eps",
    "async_rl.rollout_failure.nemo_gym.rollout_timeout_s", "async_rl.stall_watchdog.stall_timeout_s",
    "agent.context_history.guards.max_total_tokens", "async_rl.generation_fleet_health.probe_interval_s",
    "async_rl.generation_fleet_health.probe_timeout_s",
)
UNIT_INTERVAL = (  # (0, 1]
    "policy.generation.top_p", "policy.generation.vllm_cfg.gpu_memory_utilization",
    "async_rl.rollout_failure.min_step_batch_fraction",
)


def _get(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _check_finite(node: Any, key: str) -> None:
    """Every float anywhere in the config is a finite number (NaN passes no range check unnoticed)."""
    if is_dataclass(node):
        for f in fields(node):
            _check_finite(getattr(node, f.name), f"{key}.{f.name}" if key else f.name)
    elif isinstance(node, (list, dict)):
        for k, v in (node.items() if isinstance(node, dict) else enumerate(node)):
            _check_finite(v, f"{key}.{k}" if isinstance(node, dict) else f"{key}[{k}]")
    elif isinstance(node, float):
        _require(math.isfinite(node), key, f"must be a finite number, got {node}")


GREEDY_TEMPERATURE = 1e-5
"""vLLM's _SAMPLING_EPS: a temperature below it is greedy sampling."""


def _check_resources(cfg: MinirlConfig) -> None:
    """A locally started Ray advertises cluster.num_cpus / num_gpus: the workers' bundles must fit, or
    the placement group would wait forever (Ray's GetTimeoutError after 120 s, naming nothing). Where
    they are unset (Ray detects the machine's) or a cluster is joined by address, `Cluster` checks
    against what Ray offers once it is up, before anything is placed."""
    cl = cfg.cluster
    for res, key in (("CPU", "cpus"), ("GPU", "gpus")):
        have = getattr(cl, f"num_{key}")
        if cl.ray_address is None and have is not None:
            problem = resource_shortfall(cfg, res, have, f"cluster.num_{key}={have}")
            _require(problem is None, f"cluster.num_{key}", problem or "")


def resource_shortfall(cfg: MinirlConfig, res: str, have: float | None, where: str) -> str | None:
    """None when the workers' `res` (CPU or GPU) fits in `have` (None: not known, not checked); else the sum, named."""
    cl, key = cfg.cluster, res.lower() + "s"
    gen = 0 if cl.attach_generation_workers else cl.num_generation_workers
    per_gen, per_pol = getattr(cl, f"{key}_per_generation_worker"), getattr(cl, f"{key}_per_policy_worker")
    need = gen * per_gen + cl.num_policy_workers * per_pol
    if have is None or need <= have + 1e-9:
        return None
    return (f"the workers need {need:g} {res}s (cluster.num_generation_workers={gen} x cluster.{key}_per_generation_worker="
            f"{per_gen:g} + cluster.num_policy_workers={cl.num_policy_workers} x cluster.{key}_per_policy_worker={per_pol:g}), "
            f"more than Ray offers ({where})")


def validate(cfg: MinirlConfig) -> None:
    """Every range and cross-field rule, then the paths and the URL; each failure names its key."""
    g, rf, cc, ch = cfg.grpo, cfg.async_rl.rollout_failure, cfg.context_compaction, cfg.agent.context_history
    _check_finite(cfg, "")
    for keys, ok, problem in (
        (AT_LEAST_1, lambda v: v >= 1, "must be >= 1"),
        (AT_LEAST_0, lambda v: v >= 0, "must be >= 0"),
        (ABOVE_0, lambda v: v > 0, "must be > 0"),
        (UNIT_INTERVAL, lambda v: 0 < v <= 1, "must be in (0, 1]"),
    ):
        for key in keys:
            value = _get(cfg, key)
            _require(value is None or ok(value), key, f"{problem}, got {value}")
    temp = cfg.policy.generation.temperature
    _require(temp >= GREEDY_TEMPERATURE, "policy.generation.temperature",
             f"must be >= {GREEDY_TEMPERATURE} (below it vLLM samples greedily, and a group's identical rollouts "
             f"train nothing), got {temp}")
    _check_resources(cfg)
    clip = cfg.loss_fn.ratio_clip_min
    _require(clip < 1, "loss_fn.ratio_clip_min", f"must be < 1 (the lower clip is 1 - ratio_clip_min), got {clip}")
    betas = cfg.policy.optimizer.betas
    _require(len(betas) == 2 and all(0 <= b < 1 for b in betas), "policy.optimizer.betas",
             f"must be two values in [0, 1), got {betas}")
    _require(
        cfg.env.num_rooms <= cfg.env.max_num_rooms,
        "env.num_rooms",
        f"must be <= env.max_num_rooms ({cfg.env.max_num_rooms}), got {cfg.env.num_rooms}",
    )
    for i, n in enumerate(cfg.env.num_rooms_choices or []):
        _require(1 <= n <= cfg.env.max_num_rooms, f"env.num_rooms_choices[{i}]",
                 f"must be in [1, env.max_num_rooms={cfg.env.max_num_rooms}], got {n}")
    _require(cfg.env.num_rooms_choices != [], "env.num_rooms_choices", "must be null or a non-empty list")
    want = g.num_prompts_per_step * g.num_generations_per_prompt
    _require(
        cfg.policy.train_global_batch_size == want,
        "policy.train_global_batch_size",
        f"must equal grpo.num_prompts_per_step * grpo.num_generations_per_prompt = {want} "
        f"(one optimizer step per RL step), got {cfg.policy.train_global_batch_size}",
    )
    _require(
        rf.max_backoff_s >= rf.backoff_base_s,
        "async_rl.rollout_failure.max_backoff_s",
        f"must be >= backoff_base_s ({rf.backoff_base_s}), got {rf.max_backoff_s}",
    )
    _require(rf.on_dropped_prompt in ("shrink", "replace"), "async_rl.rollout_failure.on_dropped_prompt",
             f"must be shrink or replace, got {rf.on_dropped_prompt!r}")
    if rf.on_dropped_prompt == "replace":
        _require(cfg.async_rl.enabled, "async_rl.rollout_failure.on_dropped_prompt",
                 "replace needs async_rl.enabled=true with a sampler that stamps target steps (async_rl.sampler.name=in_order)")
        for key in ("max_replacement_attempts", "replacement_reserve_prompts"):
            _require(getattr(rf, key) >= 1, f"async_rl.rollout_failure.{key}", f"must be >= 1 with replace, got {getattr(rf, key)}")
    _require(rf.replacement_prompt_source in ("spare_groups", "stream"), "async_rl.rollout_failure.replacement_prompt_source",
             f"must be spare_groups or stream, got {rf.replacement_prompt_source!r}")
    timeout = rf.nemo_gym.rollout_timeout_s
    wd = cfg.async_rl.stall_watchdog
    _require(wd.action in ("raise", "warn"), "async_rl.stall_watchdog.action", f"must be raise or warn, got {wd.action!r}")
    _require(cfg.policy.precision in ("float32", "bfloat16"), "policy.precision", "must be float32 or bfloat16")
    _require(
        cfg.agent.name in ("simple_agent", "compaction_agent"),
        "agent.name",
        f"must be simple_agent or compaction_agent, got {cfg.agent.name!r}",
    )
    _require(ch.policy.type in ("identity", "recency"), "agent.context_history.policy.type", "must be identity or recency")
    _require(
        ch.schedule.type in ("rolling_recency", "turn_chunked_recency"),
        "agent.context_history.schedule.type",
        "must be rolling_recency or turn_chunked_recency",
    )
    _require(
        ch.schedule.type != "rolling_recency" or ch.schedule.actions_per_chunk == 1,
        "agent.context_history.schedule.actions_per_chunk",
        "must be 1 for rolling_recency",
    )
    _require(ch.guards.on_reject in ("raise", "end_episode"), "agent.context_history.guards.on_reject", "must be raise or end_episode")
    _require(
        cc.enabled or cfg.agent.external_url is not None or not (cfg.agent.name == "compaction_agent" and ch.enabled),
        "context_compaction.enabled",
        "is false, but agent.name=compaction_agent with agent.context_history.enabled=true rewrites its history; "
        "without compaction every call must extend the previous one (use agent.name=simple_agent, see configs/plain.yaml)",
    )
    if cc.enabled:
        # upstream: validate_cc_objective
        _require(cfg.loss_fn.token_level_loss, "loss_fn.token_level_loss", "context compaction requires token_level_loss=true")
        if not cc.allow_step_shrink:
            _require(
                rf.min_step_batch_fraction == 1,
                "async_rl.rollout_failure.min_step_batch_fraction",
                "context compaction requires min_step_batch_fraction=1",
            )
    lf = cfg.loss_fn
    _require(lf.truncated_importance_sampling_type in (None, "tis", "icepop", "seq-mask-tis"),
             "loss_fn.truncated_importance_sampling_type",
             f"must be null, tis, icepop or seq-mask-tis, got {lf.truncated_importance_sampling_type!r}")
    if lf.truncated_importance_sampling_type is not None:
        _require(lf.use_importance_sampling_correction, "loss_fn.truncated_importance_sampling_type",
                 "needs loss_fn.use_importance_sampling_correction=true")
        ratio, lo = lf.truncated_importance_sampling_ratio, lf.truncated_importance_sampling_ratio_min
        _require(ratio is not None and ratio > 0, "loss_fn.truncated_importance_sampling_ratio", f"must be > 0, got {ratio}")
        _require(lo is not None or lf.truncated_importance_sampling_type == "tis",
                 "loss_fn.truncated_importance_sampling_ratio_min", "is required for icepop and seq-mask-tis")
        _require(lo is None or 0 <= lo <= ratio, "loss_fn.truncated_importance_sampling_ratio_min",
                 f"must be in [0, truncated_importance_sampling_ratio], got {lo}")
    for i, spec in enumerate(cfg.faults.inject):
        _require(spec.kind in FAULT_KINDS, f"faults.inject[{i}].kind", f"must be one of {', '.join(FAULT_KINDS)}")
        for name in ("step", "group", "rollout", "attempt", "call"):
            value = getattr(spec, name)
            _require(value is None or value >= 0, f"faults.inject[{i}].{name}", f"must be >= 0, got {value}")
    for kind, p in cfg.faults.rate.items():
        _require(kind in FAULT_KINDS, f"faults.rate.{kind}", f"unknown fault kind; one of {', '.join(FAULT_KINDS)}")
        _require(0 <= p <= 1, f"faults.rate.{kind}", f"must be a probability in [0, 1], got {p}")
    for kind, q in cfg.faults.rate_per_room.items():
        _require(kind in AGENT_SIDE_KINDS, f"faults.rate_per_room.{kind}",
                 f"needs the row's room count, which only agent-side kinds see; one of {', '.join(AGENT_SIDE_KINDS)}")
        _require(0 <= q <= 1, f"faults.rate_per_room.{kind}", f"must be a probability in [0, 1], got {q}")
    uses_timeout = any(s.kind == "timeout" for s in cfg.faults.inject) or any(
        rates.get("timeout", 0) > 0 for rates in (cfg.faults.rate, cfg.faults.rate_per_room))
    _require(
        not uses_timeout or timeout is not None,
        "async_rl.rollout_failure.nemo_gym.rollout_timeout_s",
        "a `timeout` fault needs a rollout timeout, or /run would hang",
    )
    ar = cfg.async_rl
    from minirl.async_rl.samplers import SAMPLERS  # checked with async off too: a typo must not wait for the day it is on

    _require(ar.sampler.name in SAMPLERS, "async_rl.sampler.name", f"must be one of {', '.join(SAMPLERS)}, got {ar.sampler.name!r}")
    look = ar.sampler.max_lookahead_versions
    if look is not None:  # upstream's name of in_order's gate: one resolved value
        _require(ar.sampler.name == "in_order", "async_rl.sampler.max_lookahead_versions",
                 f"is in_order's gate; {ar.sampler.name} reads async_rl.sampler.max_staleness_versions")
        ar.sampler.max_staleness_versions = look
    if ar.enabled:
        sampler = SAMPLERS[ar.sampler.name]
        window = sampler.capacity(g.num_prompts_per_step, ar.sampler.max_staleness_versions)
        _require(ar.max_buffered_rollouts >= window, "async_rl.max_buffered_rollouts",
                 f"must hold the sampler's window of {window} prompt groups, got {ar.max_buffered_rollouts}")
        _require(ar.sampler.max_staleness_versions == 0 or cfg.loss_fn.use_importance_sampling_correction,
                 "loss_fn.use_importance_sampling_correction",
                 "must be true when async_rl.sampler.max_staleness_versions > 0: rollouts come from older weights")
        _require(not sampler.needs_is_correction or cfg.loss_fn.use_importance_sampling_correction,
                 "loss_fn.use_importance_sampling_correction",
                 f"must be true with async_rl.sampler.name={ar.sampler.name}: it trains groups of any age")
        _require(sampler.stamps_target_steps or not (rf.max_skipped_prompts or rf.max_consecutive_dropped_prompts),
                 "async_rl.sampler.name",
                 f"{ar.sampler.name!r} stamps no target step, so the drop budget (max_skipped_prompts={rf.max_skipped_prompts}, "
                 f"max_consecutive_dropped_prompts={rf.max_consecutive_dropped_prompts}) cannot be honoured: a prompt that is "
                 "given up on is never subtracted from the step waiting for it. Set async_rl.sampler.name=in_order to get the "
                 "tolerance these budgets promise, or set both budgets to 0 to end the run on the first dropped prompt instead")
        _require(sampler.stamps_target_steps or rf.on_dropped_prompt == "shrink", "async_rl.rollout_failure.on_dropped_prompt",
                 f"replace needs a sampler that stamps target steps (in_order); {ar.sampler.name} stamps none")
    # serving for external (Gym) servers
    _require(cfg.policy.generation.reasoning_parser in (None, "think"), "policy.generation.reasoning_parser", "must be think or null")
    gr = cfg.async_rl.generation_router
    _require(1 <= gr.port_range_low <= 65535, "async_rl.generation_router.port_range_low", "must be a port (1-65535)")
    _require(gr.port_range_low <= gr.port_range_high <= 65535, "async_rl.generation_router.port_range_high",
             f"must be a port >= port_range_low ({gr.port_range_low})")
    for key in ("backend_timeout_s", "connect_timeout_s"):
        _require(getattr(gr, key) > 0, f"async_rl.generation_router.{key}", "must be > 0")
    _require(400 <= gr.no_healthy_backend_status <= 599 and gr.no_healthy_backend_status not in GYM_RETRIED_STATUSES,
             "async_rl.generation_router.no_healthy_backend_status",
             f"must be an HTTP error status that Gym does not retry (not {', '.join(map(str, GYM_RETRIED_STATUSES))}), "
             f"got {gr.no_healthy_backend_status}")
    fh = cfg.async_rl.generation_fleet_health
    _require(fh.probe_timeout_s < fh.probe_interval_s, "async_rl.generation_fleet_health.probe_timeout_s",
             f"must be less than probe_interval_s ({fh.probe_interval_s}), got {fh.probe_timeout_s}")
    _require(fh.min_healthy_shards <= cfg.cluster.num_generation_workers, "async_rl.generation_fleet_health.min_healthy_shards",
             f"must be at most cluster.num_generation_workers ({cfg.cluster.num_generation_workers}), got {fh.min_healthy_shards}")
    _require(gr.enabled or not fh.enabled, "async_rl.generation_fleet_health.enabled",
             "needs async_rl.generation_router.enabled=true: the router probes the workers and routes around the sick")
    # the servers' own limits on what a request may cost them
    vllm = cfg.policy.generation.vllm_cfg
    _require(vllm.max_request_bytes >= 1, "policy.generation.vllm_cfg.max_request_bytes", f"must be >= 1, got {vllm.max_request_bytes}")
    _check_outside(cfg)


def _check_outside(cfg: MinirlConfig) -> None:
    """What the config points at: the model directory loads, the resume path exists, the URL parses."""
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
    _require(resume in ("none", "auto") or Path(resume).is_dir(), "checkpoint.resume",
             f"must be none, auto or an existing checkpoint directory; {resume!r} is not a directory")
    url = cfg.agent.external_url
    if url is not None:
        try:
            parts = urlparse(url)
            parts.port  # raises ValueError on a bad port
        except ValueError as exc:
            raise ConfigError("agent.external_url", f"{url!r} is not a URL: {exc}") from None
        _require(parts.scheme in ("http", "https") and bool(parts.hostname), "agent.external_url",
                 f"must be an http(s) URL with a host, got {url!r}")


def to_yaml(cfg: MinirlConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
