"""The sweep's grid: the policies, the fault modes and the cells, and the `minirl.train` overrides of
one cell. Invariant: a cell is named by `cell_id` alone, and within a seed every policy meets the same
prompts, the same held-out set and the same fault stream (a seed s sets `faults.seed=s`,
`grpo.seed=42+s` and `env.data_seed=1234+s`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

from minirl.config import REPO_ROOT as REPO

POLICIES = {
    "upstream": [],
    "+shrink": ["context_compaction.allow_step_shrink=true"],
    "+end_episode": ["agent.context_history.guards.on_reject=end_episode"],
    "+redispatch": ["context_compaction.redispatch_dropped_groups=true"],
    "all fixes": [
        "context_compaction.allow_step_shrink=true",
        "agent.context_history.guards.on_reject=end_episode",
        "context_compaction.redispatch_dropped_groups=true",
    ],
    "minirl defaults": [],
    "minirl defaults (masked in baseline)": ["grpo.baseline_excludes_masked=false"],
    "minirl defaults (masked rewards in baseline)": ["grpo.masked_sample_rewards_in_baseline=true"],
    # the segments experiment (minirl.experiments.segments): the shipped config, one segment switch moved
    "segments rollout_equal": ["loss_fn.segment_weighting=rollout_equal"],
    "segments length_ratio": ["loss_fn.segment_weighting=length_ratio"],
    "segments any": ["grpo.segment_validity=any"],
}
SEGMENT_POLICIES = ("segments rollout_equal", "segments length_ratio", "segments any")
DEFAULTS = "minirl defaults"  # no preset: `python -m minirl.train` as shipped (fixes on, its own budgets)
# the same, but upstream's baseline (masked rollouts in it: grpo.baseline_excludes_masked=false)
MASKED_IN_BASELINE = "minirl defaults (masked in baseline)"
MASKED_REWARDS = "minirl defaults (masked rewards in baseline)"  # the same, NeMo's third baseline policy
# built on the shipped config rather than the preset
ON_DEFAULTS = {DEFAULTS, MASKED_IN_BASELINE, MASKED_REWARDS, *SEGMENT_POLICIES}
# upstream forces the floor to 100% without fix 1 (context_compaction.allow_step_shrink)
SHRINKS = {"+shrink", "all fixes"} | ON_DEFAULTS

COLUMNS = [
    "cell", "kind", "rate", "policy", "budget", "fraction", "seed", "survived", "died_at_step", "died_reason",
    "steps_completed", "steps_target", "groups_dropped", "rollouts_masked", "groups_redispatched",
    "rollouts_generated", "rollouts_trained", "fraction_trained", "mean_groups_trained", "mean_rollouts_trained",
    "final_reward", "val_reward_start", "val_reward_final", "val_success_final", "val_final_by_rooms",
    "rooms_dispatched_mean", "rooms_trained_mean", "rooms_shift", "skew_tv", "wall_s", "run_dir",
]
FLOATS = ("rate", "fraction", "fraction_trained", "mean_groups_trained", "mean_rollouts_trained", "wall_s",
          "final_reward", "val_reward_start", "val_reward_final", "val_success_final", "rooms_dispatched_mean",
          "rooms_trained_mean", "rooms_shift", "skew_tv")
OVERFLOW_TOKENS = 270
"""Guard limit of the `overflow` mode. Measured on the initial tiny model under the upstream preset (with
default.yaml's compaction under it), 6 calls at most, 32 held-out prompts: the largest prompt of an episode
was 67-199 tokens with 1 room, 67-272 with 2 (3 of 10 above 268), 166-279 with 3 or 4 (11 of 17 above
268). 240 ended so many long episodes that whole groups were masked and every policy died at step 0."""


@dataclass(frozen=True)
class Grid:
    kinds: tuple
    rates: tuple
    policies: tuple
    budgets: tuple
    fractions: tuple
    seeds: tuple
    steps: int
    prompts: int
    generations: int
    mix: tuple = (1, 2, 3, 4)
    max_calls: int = 6
    val_period: int = 2
    val_prompts: int = 8

    def cells(self):
        seen = set()
        for seed, kind, rate, policy, budget, fraction in itertools.product(  # seed outermost: a sweep cut
            self.seeds, self.kinds, self.rates, self.policies, self.budgets, self.fractions  # short stays paired
        ):
            rate = 0.0 if kind == "overflow" else rate
            if policy in ON_DEFAULTS:  # the shipped budgets, whatever the grid's
                rf = _defaults().async_rl.rollout_failure
                budget, fraction = rf.max_consecutive_dropped_prompts, rf.min_step_batch_fraction
            frac = fraction if policy in SHRINKS else 1.0
            cell = {"kind": kind, "rate": rate, "policy": policy, "budget": budget, "fraction": frac, "seed": seed}
            if cell_id(cell) not in seen:
                seen.add(cell_id(cell))
                yield cell


def _defaults():
    from minirl.config import load_config

    return load_config()


# one correlated mode, the four policies that survive it, 2 seeds: 8 cells fit the 10-minute budget
QUICK = Grid(kinds=("guard_reject@room",), rates=(0.05,), policies=("+shrink", "+redispatch", "all fixes", DEFAULTS),
             budgets=(4,), fractions=(0.5,), seeds=(0, 1), steps=4, prompts=4, generations=2)
# The sweep's four questions (questions.py) on one correlated mode, 5 seeds (seeds, not cells, narrow the intervals):
# at a per-room hazard of 7% shrink drops about half the groups (a 4-room group of 4 rollouts fails
# with 1 - 0.93**16 = 69%, a 1-room one with 25%) and end_episode masks 16% of the rollouts; the
# floor of one group (0.125) and a budget of 16 keep +shrink alive, so its skew is measured, not its death.
# +shrink, +end_episode and +redispatch are the upstream preset plus one fix. The baseline flag: +end_episode
# (upstream's baseline_excludes_masked=false) and minirl defaults (true) differ in the flag, the budgets
# and fixes 1 and 3 (allow_step_shrink, redispatch_dropped_groups); in this mode nothing is dropped or
# re-sent under either (guard rejections are masks),
# so fixes 1 and 3 and the budgets never act and the pair isolates the flag (the report checks this per
# seed). The literal twin, MASKED_IN_BASELINE, measured the same run as +end_episode. Other modes:
# --kinds guard_reject,overflow,agent_exception@room,... (`timeout` fails like agent_exception, but each
# hit costs rollout_timeout_s of wall time).
DEFAULT = Grid(kinds=("guard_reject@room",), rates=(0.07,),
               policies=("+shrink", "+end_episode", "+redispatch", DEFAULTS), budgets=(16,), fractions=(0.125,),
               seeds=tuple(range(5)), steps=6, prompts=8, generations=4, val_period=3, val_prompts=24)


def kind_args(kind: str, rate: float) -> list[str]:
    """The overrides of a fault mode: `KIND`, a coin per rollout attempt at the rate
    (`faults.rate.KIND`); `KIND@room`, the rate as a per-room hazard q, so an n-room attempt fails
    with 1 - (1 - q)**n (`faults.rate_per_room`); `overflow`, no injected fault but a real context
    guard at OVERFLOW_TOKENS that long, many-room episodes cross and short ones rarely do."""
    if kind == "overflow":
        return [f"agent.context_history.guards.max_total_tokens={OVERFLOW_TOKENS}"]
    if kind.endswith("@room"):  # `a+b@room`: each kind with the same per-room hazard
        return [f"faults.rate_per_room.{k}={rate}" for k in kind[:-len('@room')].split("+")]
    return [f"faults.rate.{kind}={rate}"]


def cell_id(c: dict) -> str:
    policy = c["policy"].replace("+", "plus_").replace("(", "").replace(")", "").replace(" ", "_")
    return f"{c['kind']}-{c['rate']}-{policy}-b{c['budget']}-f{c['fraction']}-s{c['seed']}"


def cell_args(c: dict, grid: Grid, run_dir: Path, attach: list[str]) -> list[str]:
    if c["policy"] in ON_DEFAULTS:
        args = list(POLICIES[c["policy"]])
    else:
        args = [
            "--config", str(REPO / "configs" / "upstream_pr4124.yaml"), *POLICIES[c["policy"]],
            f"async_rl.rollout_failure.max_consecutive_dropped_prompts={c['budget']}",
            f"async_rl.rollout_failure.min_step_batch_fraction={c['fraction']}",
        ]
    args += [
        *kind_args(c["kind"], c["rate"]), f"faults.seed={c['seed']}", f"grpo.seed={42 + c['seed']}",
        f"env.data_seed={1234 + c['seed']}", f"env.num_rooms_choices=[{','.join(map(str, grid.mix))}]",
        f"agent.max_steps={grid.max_calls}", "grpo.val_at_start=true", f"grpo.val_period={grid.val_period}",
        f"grpo.val_num_prompts={grid.val_prompts}",
        f"grpo.max_num_steps={grid.steps}", f"grpo.num_prompts_per_step={grid.prompts}",
        f"grpo.num_generations_per_prompt={grid.generations}",
        "async_rl.rollout_failure.nemo_gym.rollout_timeout_s=8", "async_rl.rollout_failure.backoff_base_s=0.25",
        "async_rl.rollout_failure.max_backoff_s=2", "checkpoint.enabled=false", "logger.tensorboard=false",
        # a cell not in the results runs again whole
        "logger.progress=false", f"run_dir={run_dir}", "run_dir_exists=overwrite",
    ]
    return args + attach
