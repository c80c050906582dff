"""What an optimizer step is made of (prime-rl's `orchestrator/types.py` is the model): a model
`Call`, the physical `Trace`s it builds, a validated `Rollout`, a prompt group's `GroupOutcome`, the
`StepTake` a `StepSource` hands the controller, and the `TrainBatch` the controller hands the
policy workers.

Invariant: these are plain carriers; they check nothing and import nothing of minirl's but
`wire.Coords`. A `GroupOutcome`'s counters count that group's sends and failures only, so a step's
counters are sums over the outcomes it took; a `TrainBatch` holds numpy arrays only (cheap to
pickle through Ray), one row per trace, and its `global_valid_*` totals are those of `valid_mask()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol

import numpy as np

from minirl.wire import Coords

GroupStatus = Literal["committed", "dropped", "skipped", "replaced"]
"""committed: trained (its masked rollouts too); dropped: an INFRA budget ran out, the step goes on
without it; skipped: a DATA failure under `on_rollout_data_error=skip`; replaced: async
`on_dropped_prompt=replace`, a lost prompt whose place a spare filled (counted, never a group)."""


@dataclass
class Call:
    """One model call of a rollout: its prompt, generated tokens and their logprobs."""

    prompt: list[int]
    gen: list[int]
    logprobs: list[float]
    kind: str = "turns"
    """`turns` (an ordinary call) or `compaction_summary` (a summarizing compaction's accepted summary)."""
    compaction: dict | None = None
    """A summary call's compaction record: outcome, tokens_before, tokens_after, model_calls."""


@dataclass
class Trace:
    """One training sequence: calls that extend each other, loss mask on generated tokens only."""

    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]  # the generator's logprob per token (0 where loss_mask is 0)
    calls: int = 1
    compaction: dict | None = None
    """A `compaction_summary` trace's record, as Gym's ContextCompactionObservation: outcome,
    tokens_before, tokens_after, model_calls (the attempts it used, rejected ones included)."""
    kind: str = "turns"
    """What made the trace: "turns" (the ordinary chain of calls) or "compaction_summary" (the
    summary call of a summarizing compaction, as upstream's segment branch names it)."""
    mask_reason: str | None = None
    """Why this one segment may not be trained (None: it may). Whether it also takes its rollout
    out of the baseline is `grpo.segment_validity`'s choice (controller.assemble)."""


@dataclass
class Rollout:
    """One committed rollout attempt: what the trainer needs, plus what the metrics report."""

    coords: Coords
    reward: float
    calls: list[Call]
    traces: list[Trace]
    capture_failed: bool
    evidence: dict = field(default_factory=dict)
    mask_reason: str | None = None

    @property
    def sample_mask(self) -> int:
        return 0 if self.mask_reason else 1


@dataclass
class GroupOutcome:
    """What became of one prompt group in one step, with its failure-policy counters."""

    group: int
    status: GroupStatus
    rollouts: dict[int, Rollout] = field(default_factory=dict)
    reason: str | None = None
    group_attempts: int = 0
    row_sends: int = 0  # /run requests (rollout attempts)
    rows_returned: int = 0  # /run results that came back valid (rollouts generated), kept or not
    row_retries: int = 0
    backoff_s: float = 0.0
    step: int = 0
    guard_rejections: int = 0  # guard rejections: failed sends (on_reject=raise), returned rows' records (end_episode)
    summaries_failed: int = 0  # failed sends answered SummaryFailed (raise), returned rows' failed summaries (the rest)
    deterministic_failures: int = 0  # rows whose failure was found deterministic (max_identical_failures)
    failures_by_kind: dict[str, int] = field(default_factory=dict)  # its `failure` events by Gym's failure_kind

    @property
    def redispatched(self) -> bool:
        return self.group_attempts > 1 or self.row_retries > 0


SOURCE_COUNTS = ("stale_groups_evicted", "promoted_prompt_groups", "replaced_prompt_groups")
"""The per-step counters a step source keeps of its own (the async buffer's; zero in a sync run)."""


class StepTake(NamedTuple):
    """What a step source hands the controller for one optimizer step."""

    outcomes: list[GroupOutcome]  # the groups the step trains or lost (replaced prompts too)
    start_weights: list[int]  # per outcome: the oldest policy version its kept rows' attempts started under
    calls: list[dict]  # the generation servers' call records of these groups (async: and orphans)
    since: float  # perf_counter when the step's generation began (async: the previous hand-over)
    counts: dict  # the source's own per-step counters, keyed by SOURCE_COUNTS
    evicted: tuple[GroupOutcome, ...] = ()  # async: groups this step's wait evicted as stale (their cost is the step's)

    def oldest(self, version: int, window: int) -> int:
        """The oldest weights a trained call may have run under: the window's, or an older kept
        group's start (ready_first evicts nothing)."""
        kept = [w for o, w in zip(self.outcomes, self.start_weights) if o.status == "committed"]
        return min([version - window] + kept)


class StepSource(Protocol):
    """Where a step's prompt groups come from: `SyncSource` (minirl/rollout/source.py: dispatched
    and awaited per step) or `BufferSource` (minirl/async_rl/source.py: selected from the buffer
    the rollout pump fills). `window` is how many versions older than the step's a trained call
    may be (0 in sync)."""

    window: int

    async def take(self, step: int, version: int) -> StepTake:
        """The groups of optimizer step `step`, trained at policy `version`."""
        ...

    def published(self, version: int) -> None:
        """The generation workers now serve `version`."""
        ...

    def syncing(self) -> None:
        """A weight sync begins."""
        ...

    def snapshot(self) -> bytes | None:
        """What a checkpoint keeps of the source (None: nothing)."""
        ...

    def restore(self, buffer: bytes | None) -> None:
        """Resume from a checkpoint's `snapshot`."""
        ...

    def ledgered(self) -> None:
        """The last take's call records are in its step's ledger. Until then the source keeps them, so a
        step that fails after its take (its checks, its ledger, the fleet watch's last poll) leaves them
        to `close`."""
        ...

    async def close(self) -> tuple[dict, list[dict]]:
        """The run ends: stop generating. Returns the prompt groups left unfinished (`buffered`: finished,
        taken by no step; `in_flight`: cancelled here), each as [step, group], and the call records
        the source holds that no step's ledger took (the last take's too, unless `ledgered`)."""
        ...


@dataclass
class TrainBatch:
    """One optimizer step's padded training arrays, one row per trace ([T, width] or [T])."""

    input_ids: np.ndarray  # int64 [T, W], padded with the tokenizer's pad id
    loss_mask: np.ndarray  # float32 [T, W], 1 on generated tokens
    gen_logprobs: np.ndarray  # float32 [T, W], the generator's logprobs (0 off the loss mask)
    lengths: np.ndarray  # int64 [T]
    advantages: np.ndarray  # float32 [T], the trace's rollout's advantage
    sample_mask: np.ndarray  # float32 [T], 0 for a masked rollout's traces and for a masked segment
    group: np.ndarray | None = None  # int64 [T], the rollout's group (for tests and metrics)
    rollout: np.ndarray | None = None  # int64 [T], the rollout's index in its group
    slot: np.ndarray | None = None
    """int64 [T], the index of the row's group among the step's group outcomes (its `prompt_seeds` entry):
    unlike `group`, unique to one prompt group even when an async step takes groups of several prompt steps."""
    loss_weight: np.ndarray | None = None
    """float32 [T], each row's segment weight (`loss_fn.segment_weighting`, mean 1 over the trained
    rows); None: every trained token counts once (token_mean, the default arithmetic)."""
    global_valid_tokens: float = 0.0
    global_valid_samples: float = 0.0

    @classmethod
    def zeros(cls, rows: int, width: int, pad_id: int = 0) -> "TrainBatch":
        """An empty batch of `rows` x `width` (every row masked out until filled in)."""
        return cls(
            input_ids=np.full((rows, width), pad_id, dtype=np.int64),
            loss_mask=np.zeros((rows, width), dtype=np.float32),
            gen_logprobs=np.zeros((rows, width), dtype=np.float32),
            lengths=np.zeros(rows, dtype=np.int64),
            advantages=np.zeros(rows, dtype=np.float32),
            sample_mask=np.zeros(rows, dtype=np.float32),
            group=np.zeros(rows, dtype=np.int64),
            rollout=np.zeros(rows, dtype=np.int64),
            slot=np.zeros(rows, dtype=np.int64),
        )

    def valid_mask(self) -> np.ndarray:
        """[T, W] 1 where a token is trained: on the loss mask of an unmasked rollout."""
        return self.loss_mask * self.sample_mask[:, None]

    def count_valid(self) -> "TrainBatch":
        """Fill in `global_valid_tokens` / `global_valid_samples` from `valid_mask()`; returns self."""
        valid = self.valid_mask()
        self.global_valid_tokens = float(valid.sum())
        self.global_valid_samples = float((valid.sum(-1) > 0).sum())
        return self
