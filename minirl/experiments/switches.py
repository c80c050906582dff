"""The switch matrix's table: every supported switch, its values and the overrides each value sets, and
the combinations minirl refuses before start-up, each with its reason.

Invariant: where the config has a closed set of values (a `Literal` field), a switch's values are read
from that field, so this table cannot offer a value the config refuses nor miss one it gains; and every
refusal here is checked against the config's own validation (`refusal_examples` must each end with exit
2, and a cell the table lets through must load), so the table and the config cannot drift apart.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Callable

from minirl.config import REPO_ROOT, MinirlConfig, _choices

UPSTREAM = str(REPO_ROOT / "configs" / "upstream_pr4124.yaml")
ASYNC = ("in_order", "windowed", "weight_fifo", "ready_first")


def choices(key: str) -> tuple:
    """The values the config's `Literal` field at dotted `key` allows (None first when it is optional)."""
    cls: Any = MinirlConfig
    *path, last = key.split(".")
    for name in path:
        cls = typing.get_type_hints(cls)[name]
    hint = typing.get_type_hints(cls)[last]
    values = _choices(hint)
    if values is None:
        raise TypeError(f"{key} is not a Literal field")
    return values


def has_field(key: str) -> bool:
    cls: Any = MinirlConfig
    for name in key.split("."):
        if not is_dataclass(cls) or name not in {f.name for f in fields(cls)}:
            return False
        cls = typing.get_type_hints(cls)[name]
    return True


@dataclass(frozen=True)
class Switch:
    name: str
    values: tuple
    overrides: Callable[[Any], list[str]]
    doc: str


def _is(v: Any) -> list[str]:
    if v is None:
        return ["loss_fn.use_importance_sampling_correction=false"]
    bounds = {"tis": [], "icepop": ["loss_fn.truncated_importance_sampling_ratio_min=0.5"],
              "seq-mask-tis": ["loss_fn.truncated_importance_sampling_ratio_min=0.5"]}[v]
    return ["loss_fn.use_importance_sampling_correction=true", f"loss_fn.truncated_importance_sampling_type={v}",
            "loss_fn.truncated_importance_sampling_ratio=2.0", *bounds]


def _baselines() -> tuple:
    """`grpo.baseline_excludes_masked` true / false, and the third policy where the config has it."""
    third = ("masked_sample_rewards",) if has_field("grpo.masked_sample_rewards_in_baseline") else ()
    return ("excludes_masked", "includes_masked", *third)


def _baseline(v: str) -> list[str]:
    third = has_field("grpo.masked_sample_rewards_in_baseline")
    out = [f"grpo.baseline_excludes_masked={'false' if v == 'includes_masked' else 'true'}"]
    return out + ([f"grpo.masked_sample_rewards_in_baseline={'true' if v == 'masked_sample_rewards' else 'false'}"]
                  if third else [])


def _mode(v: str) -> list[str]:
    return ["async_rl.enabled=false"] if v == "sync" else ["async_rl.enabled=true", f"async_rl.sampler.name={v}"]


def _drop(v: str) -> list[str]:
    if v == "shrink":
        return ["async_rl.rollout_failure.on_dropped_prompt=shrink"]
    return ["async_rl.rollout_failure.on_dropped_prompt=replace",
            f"async_rl.rollout_failure.replacement_prompt_source={v.split(':')[1]}"]


def _cc(v: bool) -> list[str]:
    return ["context_compaction.enabled=true", "agent.name=compaction_agent"] if v else [
        "context_compaction.enabled=false", "agent.name=simple_agent"]


def _flag(key: str) -> Callable[[Any], list[str]]:
    return lambda v: [f"{key}={str(v).lower()}"]


def _fix1(v: bool) -> list[str]:
    """Fix 1, `context_compaction.allow_step_shrink`: upstream forces the floor to 100% without it (the
    preset's comment)."""
    if v:
        return ["context_compaction.allow_step_shrink=true", "async_rl.rollout_failure.min_step_batch_fraction=0.75"]
    return ["context_compaction.allow_step_shrink=false", "async_rl.rollout_failure.min_step_batch_fraction=1.0"]


def switches() -> list[Switch]:
    """The table, in the order a cell's overrides are applied (the preset first: its `--config` comes
    before every key=value, so a switch set in a cell wins over the preset's value)."""
    return [
        Switch("preset", ("default", "upstream"), lambda v: ["--config", UPSTREAM] if v == "upstream" else [],
               "configs/default.yaml alone, or configs/upstream_pr4124.yaml over it"),
        Switch("mode", ("sync", *choices("async_rl.sampler.name")), _mode, "synchronous, or async with this sampler"),
        Switch("admission", choices("async_rl.sampler.admission"), lambda v: [f"async_rl.sampler.admission={v}"],
               "async admission (inert in sync)"),
        Switch("staleness", (0, 1, 2), lambda v: [f"async_rl.sampler.max_staleness_versions={v}"],
               "S, the staleness window (inert in sync)"),
        Switch("in_flight", (False, True), _flag("async_rl.in_flight_weight_updates"), "weights into a busy engine"),
        Switch("is_correction", choices("loss_fn.truncated_importance_sampling_type"), _is,
               "IS correction off (None), or on with this truncation"),
        Switch("cc", (True, False), _cc, "context compaction (compaction_agent), or plain (simple_agent)"),
        Switch("fix1", (True, False), _fix1, "context_compaction.allow_step_shrink, with its floor"),
        Switch("fix2", choices("agent.context_history.guards.on_reject"),
               lambda v: [f"agent.context_history.guards.on_reject={v}"], "what a guard rejection does"),
        Switch("fix3", (True, False), _flag("context_compaction.redispatch_dropped_groups"), "redispatch CC groups"),
        Switch("on_dropped", ("shrink", *(f"replace:{s}" for s in choices(
            "async_rl.rollout_failure.replacement_prompt_source"))), _drop, "shrink, or replace from this source"),
        Switch("keep_returned_rows", (True, False), _flag("async_rl.rollout_failure.nemo_gym.keep_returned_rows"),
               "a group retry keeps the rows that came back"),
        Switch("baseline", _baselines(), _baseline, "which masked rewards stay in the baseline"),
        Switch("segment_validity", choices("grpo.segment_validity"), lambda v: [f"grpo.segment_validity={v}"],
               "does one masked segment mask its rollout"),
        Switch("segment_weighting", choices("loss_fn.segment_weighting"),
               lambda v: [f"loss_fn.segment_weighting={v}"], "weights of a rollout's segments"),
        Switch("compaction", choices("agent.context_history.policy.type"),
               lambda v: [f"agent.context_history.policy.type={v}"], "compaction policy"),
        Switch("on_summary_failure", choices("agent.context_history.policy.summarize.on_summary_failure"),
               lambda v: [f"agent.context_history.policy.summarize.on_summary_failure={v}"],
               "attempts exhausted (inert unless summarize)"),
    ]


@dataclass(frozen=True)
class Refusal:
    when: dict
    """switch name -> the values for which the rule holds; a cell is refused when every one matches."""
    key: str
    """The dotted key the ConfigError names."""
    reason: str


def _async_except(*names: str) -> tuple:
    return tuple(n for n in ASYNC if n not in names)


REFUSED = [
    Refusal({"mode": ("sync",), "on_dropped": ("replace:spare_groups", "replace:stream")},
            "async_rl.rollout_failure.on_dropped_prompt", "replace needs the async pump, which stamps target steps"),
    Refusal({"mode": ("windowed", "weight_fifo", "ready_first"),
             "on_dropped": ("replace:spare_groups", "replace:stream")},
            "async_rl.rollout_failure.on_dropped_prompt",
            "replace needs a sampler that stamps target steps (in_order)"),
    Refusal({"mode": ("ready_first",), "admission": ("paced",)}, "async_rl.sampler.admission",
            "paced holds groups that would be evicted; ready_first evicts nothing"),
    Refusal({"mode": ("ready_first",), "is_correction": (None,)}, "loss_fn.use_importance_sampling_correction",
            "ready_first trains groups of any age"),
    Refusal({"mode": ASYNC, "staleness": (1, 2), "is_correction": (None,)},
            "loss_fn.use_importance_sampling_correction",
            "a staleness window above 0 trains rollouts of older weights"),
    Refusal({"cc": (False,), "compaction": ("summarize",)}, "agent.context_history.policy.type",
            "summarize needs the compaction agent"),
    Refusal({"cc": (True,), "is_correction": ("seq-mask-tis",)}, "loss_fn.truncated_importance_sampling_type",
            "sequence-level masks depend on trace boundaries (upstream's multi-trace guide)"),
    Refusal({"is_correction": ("seq-mask-tis",), "compaction": ("summarize",)},
            "loss_fn.truncated_importance_sampling_type",
            "implied by the two rules above: seq-mask-tis needs CC off, summarize needs it on"),
]
"""Combinations of switch values that minirl refuses with a ConfigError (exit 2) before Ray starts."""

RAW_REFUSALS = [
    (["async_rl.enabled=true", "async_rl.sampler.name=windowed", "async_rl.sampler.max_staleness_versions=0",
      "async_rl.rollout_failure.max_consecutive_dropped_prompts=4"],
     "async_rl.sampler.name", "a drop budget under a sampler that stamps no target step (upstream refuses it too)"),
    (["context_compaction.allow_step_shrink=false", "async_rl.rollout_failure.min_step_batch_fraction=0.75"],
     "async_rl.rollout_failure.min_step_batch_fraction",
     "CC without fix 1 requires a floor of 1 (upstream's config check)"),
    (["context_compaction.enabled=false", "agent.name=compaction_agent"], "context_compaction.enabled",
     "a history rewrite without compaction"),
]
"""Refusals of settings the matrix does not vary (each cell sets them consistently, see `cell_overrides`)."""


def refused(cell: dict) -> Refusal | None:
    """The first rule that refuses `cell` (a mapping switch name -> value; missing switches match nothing)."""
    for rule in REFUSED:
        if all(name in cell and cell[name] in values for name, values in rule.when.items()):
            return rule
    return None


def budget_overrides(cell: dict) -> list[str]:
    """A sampler that stamps no target step takes no drop budget (RAW_REFUSALS' first row): its cells
    run with both budgets at 0, so a drop ends the run, as the config requires."""
    if cell.get("mode") in ("windowed", "weight_fifo", "ready_first"):
        return ["async_rl.rollout_failure.max_consecutive_dropped_prompts=0",
                "async_rl.rollout_failure.max_skipped_prompts=0"]
    return []


def cell_overrides(cell: dict) -> list[str]:
    """Every override of a cell: each switch's, in the table's order, then the budgets the cell needs."""
    out: list[str] = []
    for sw in switches():
        if sw.name in cell:
            out += sw.overrides(cell[sw.name])
    return out + budget_overrides(cell)


def refusal_examples() -> list[tuple[list[str], str, str]]:
    """One cell's overrides per refusal (rules and raw), with the key and reason: each must exit 2."""
    out = []
    for rule in REFUSED:
        example = {name: values[0] for name, values in rule.when.items()}
        if example.get("mode", "sync") != "sync":  # keep the staleness and IS rules out of another rule's example
            example.setdefault("staleness", 0)
            example.setdefault("is_correction", "tis")
        out.append((cell_overrides(example), rule.key, rule.reason))
    return out + RAW_REFUSALS
