"""Typed configuration: dataclasses merged by OmegaConf, then validated.

Names and defaults mirror NeMo-RL (`grpo.*`, `policy.*`, `loss_fn.*`, `async_rl.rollout_failure.*`)
and Gym's `context_history` where the concept exists there. minirl's own switches for the review's
fixes default to the fix. Layering: dataclass defaults, then `configs/default.yaml` (the default
run: the tiny task and minirl's budgets), then the `--config` YAML, then `key=value` overrides.

Invariant: `load_config` returns a config that passed every check here, or raises `ConfigError`
whose message starts with the offending dotted key; nothing downstream re-validates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import II, MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_YAML = REPO_ROOT / "configs" / "default.yaml"
DEFAULT_MODEL = "models/tiny-doors"

if not OmegaConf.has_resolver("mul"):
    _register = getattr(OmegaConf, "register_resolver", None) or OmegaConf.register_new_resolver
    _register("mul", lambda a, b: int(a) * int(b))


class ConfigError(ValueError):
    """A bad config key or value; the message starts with the dotted key."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"{key}: {problem}")
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
    overlong_filtering: bool = False
    """Mask (sample_mask=0) every rollout with a reply truncated by the length cap."""
    seed: int = 42
    """Seeds prompts, sampling and the policy's initial RNG."""


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
    reference_policy_kl_penalty: float = 0.0
    """Weight of the k3 KL to the initial policy (0 disables the reference model)."""
    token_level_loss: bool = True
    """Sum over all valid tokens of the global batch, divided by their count (required under CC)."""


# ---------------------------------------------------------------------------------------- async_rl
@dataclass
class NemoGymConfig:
    rollout_timeout_s: Optional[float] = None
    """Deadline of one `/run` request; past it the attempt fails with RolloutTimeout (INFRA)."""
    max_row_attempts: int = 3
    """Attempts per row within one group attempt before the group attempt fails (row redispatch)."""


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
    """What a drop does to its step: `shrink` trains the step on the groups it has."""
    nemo_gym: NemoGymConfig = field(default_factory=NemoGymConfig)


@dataclass
class StallWatchdogConfig:
    stall_timeout_s: Optional[float] = 600.0
    """Seconds without any completed rollout before the watchdog acts (None disables)."""
    action: str = "raise"
    """`raise` RolloutStall with what is in flight, or `warn` and keep waiting."""


@dataclass
class AsyncRLConfig:
    rollout_failure: RolloutFailureConfig = field(default_factory=RolloutFailureConfig)
    stall_watchdog: StallWatchdogConfig = field(default_factory=StallWatchdogConfig)


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
    name: str = "doors"
    """The task environment (see minirl/agents/env.py)."""
    num_rooms: int = 2
    """Rooms per episode; each needs at least one model call."""
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
    "agent_kill",
)


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
        if isinstance(child, DictConfig) and isinstance(value, dict):
            _check_keys(value, child, full + ".")


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
    layers: list[tuple[str, dict]] = []
    for file in (base, path):
        if file is None:
            continue
        try:
            data = OmegaConf.to_container(OmegaConf.load(file)) or {}
        except (OSError, OmegaConfBaseException) as exc:
            raise ConfigError("--config", f"cannot read {file}: {exc}") from None
        layers.append(("", data))
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
    """Fewest groups a step may train: ceil(num_prompts_per_step * min_step_batch_fraction)."""
    rf = cfg.async_rl.rollout_failure
    return math.ceil(cfg.grpo.num_prompts_per_step * rf.min_step_batch_fraction - 1e-9)


def validate(cfg: MinirlConfig) -> None:
    """Every cross-field rule; each failure names its key."""
    g, rf, cc, ch = cfg.grpo, cfg.async_rl.rollout_failure, cfg.context_compaction, cfg.agent.context_history
    for key, value in (
        ("grpo.num_prompts_per_step", g.num_prompts_per_step),
        ("grpo.num_generations_per_prompt", g.num_generations_per_prompt),
        ("grpo.max_num_steps", g.max_num_steps),
        ("agent.max_steps", cfg.agent.max_steps),
        ("env.num_rooms", cfg.env.num_rooms),
        ("async_rl.rollout_failure.max_infra_attempts_per_prompt", rf.max_infra_attempts_per_prompt),
        ("async_rl.rollout_failure.max_data_attempts_per_prompt", rf.max_data_attempts_per_prompt),
        ("async_rl.rollout_failure.nemo_gym.max_row_attempts", rf.nemo_gym.max_row_attempts),
        ("policy.generation.max_new_tokens", cfg.policy.generation.max_new_tokens),
        ("policy.train_micro_batch_size", cfg.policy.train_micro_batch_size),
        ("cluster.num_generation_workers", cfg.cluster.num_generation_workers),
        ("cluster.num_policy_workers", cfg.cluster.num_policy_workers),
        ("cluster.num_agent_servers", cfg.cluster.num_agent_servers),
    ):
        _require(value >= 1, key, f"must be >= 1, got {value}")
    for key, value in (
        ("async_rl.rollout_failure.max_skipped_prompts", rf.max_skipped_prompts),
        ("async_rl.rollout_failure.max_consecutive_dropped_prompts", rf.max_consecutive_dropped_prompts),
        ("async_rl.rollout_failure.backoff_base_s", rf.backoff_base_s),
        ("checkpoint.keep_last_k", cfg.checkpoint.keep_last_k),
        ("loss_fn.reference_policy_kl_penalty", cfg.loss_fn.reference_policy_kl_penalty),
    ):
        _require(value >= 0, key, f"must be >= 0, got {value}")
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
    _require(
        0 < rf.min_step_batch_fraction <= 1,
        "async_rl.rollout_failure.min_step_batch_fraction",
        f"must be in (0, 1], got {rf.min_step_batch_fraction}",
    )
    _require(
        rf.on_dropped_prompt == "shrink",
        "async_rl.rollout_failure.on_dropped_prompt",
        f"only `shrink` is implemented in minirl, got {rf.on_dropped_prompt!r}",
    )
    timeout = rf.nemo_gym.rollout_timeout_s
    _require(timeout is None or timeout > 0, "async_rl.rollout_failure.nemo_gym.rollout_timeout_s", "must be > 0 or null")
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
    _require(ch.schedule.actions_per_chunk >= 1, "agent.context_history.schedule.actions_per_chunk", "must be >= 1")
    _require(
        ch.schedule.type != "rolling_recency" or ch.schedule.actions_per_chunk == 1,
        "agent.context_history.schedule.actions_per_chunk",
        "must be 1 for rolling_recency",
    )
    _require(ch.guards.on_reject in ("raise", "end_episode"), "agent.context_history.guards.on_reject", "must be raise or end_episode")
    _require(
        ch.guards.max_total_tokens is None or ch.guards.max_total_tokens > 0,
        "agent.context_history.guards.max_total_tokens",
        "must be > 0 or null",
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
    _require(cfg.checkpoint.save_period >= 1, "checkpoint.save_period", "must be >= 1")
    for i, spec in enumerate(cfg.faults.inject):
        _require(spec.kind in FAULT_KINDS, f"faults.inject[{i}].kind", f"must be one of {', '.join(FAULT_KINDS)}")
    for kind, p in cfg.faults.rate.items():
        _require(kind in FAULT_KINDS, f"faults.rate.{kind}", f"unknown fault kind; one of {', '.join(FAULT_KINDS)}")
        _require(0 <= p <= 1, f"faults.rate.{kind}", f"must be a probability in [0, 1], got {p}")
    uses_timeout = any(s.kind == "timeout" for s in cfg.faults.inject) or cfg.faults.rate.get("timeout", 0) > 0
    _require(
        not uses_timeout or timeout is not None,
        "async_rl.rollout_failure.nemo_gym.rollout_timeout_s",
        "a `timeout` fault needs a rollout timeout, or /run would hang",
    )
    # the servers' own limits on what a request may cost them
    vllm = cfg.policy.generation.vllm_cfg
    _require(vllm.max_request_bytes >= 1, "policy.generation.vllm_cfg.max_request_bytes", f"must be >= 1, got {vllm.max_request_bytes}")


def to_yaml(cfg: MinirlConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
