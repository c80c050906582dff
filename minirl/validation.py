"""Validation: the policy's reward on held-out prompts, without fault injection (NeMo-RL's
`grpo.val_period`, `grpo.val_at_start`; metrics `val_reward_mean`, `val_success_rate`). Held-out
prompts are doors tasks from a seed stream of their own that no training prompt uses, or the first
rows of `data.validation_jsonl`, sampled with the training generation config and a fixed seed.

Invariant: a validation's metrics cover exactly `val_num_prompts` x `val_num_generations` rollouts
of held-out prompts, each the answer of a fault-free `/run`: `val_num_rollouts` scored ones and
`val_num_masked` whose verifier measured nothing. A result is read as training reads it (Gym's
failure facts first, `gym.failures.episode_failure`), so a failed episode is never scored. Each send
goes to the agent server training's pool picks (`rollout.agent_pool`: another than the one the row
last failed on, a refused one marked down); an INFRA failure is re-sent after training's backoff. A
failure of the fleet ends it (`ValidationFailed`); a row is never dropped, since dropping would skew
the very mix this measures.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import aiohttp

from minirl.config import MinirlConfig
from minirl.data import _seed, dataset_rows, describe, difficulty, fact_rooms, task_row, task_seed
from minirl.gym.failures import episode_failure
from minirl.rollout.agent_pool import AgentPool
from minirl.rollout.evidence import parse_scored, reward_bound
from minirl.rollout.manager import backoff, post_run, run_session
from minirl.rollout.masking import PASS_REWARD
from minirl.runtime.files import naming
from minirl.trainer import checkpoint
from minirl.wire import (ATTEMPT_INDEX, INFRA, ROLLOUT_ID, ROLLOUT_INDEX, SUMMARY_FAILED_SCORED, TASK_INDEX,
                         AgentUnreachable, RolloutFailure, RolloutTimeout, classify, with_extra_body)


POLICY_ENDS = {"ContextGuardRejected": "guard_reject", "SummaryFailed": "summary_failed"}
"""A failed held-out `/run` that scores its episode 0 instead of ending the validation: the error
body's `type` -> the episode's end reason, as the episode reports it when it ends by itself
(`end_episode`).

The task's own limits stay on in a validation (the engine's `max_model_len`, the context guard):
they are the environment's, not injected faults. A held-out episode that the guard ends scores 0,
whether the guard ends it (`on_reject=end_episode`, a 200 with partial credit) or fails it (`raise`,
a 500 `ContextGuardRejected`), so a validation scores the same weights the same way under every
failure policy and compares policies on their learning alone. A summarizing episode whose summary
attempts all failed scores 0 the same way (`SummaryFailed`, or the episode ended as
`summary_failed`; `val_summary_failed_rate`): the policy wrote no usable summary, and the row's
fixed sampling seed would draw the very same attempts again, so a re-send cannot pass."""

SCORED_ZERO = {*POLICY_ENDS.values(), SUMMARY_FAILED_SCORED}
"""The end reasons a held-out episode scores 0 with: those of `POLICY_ENDS`, and `end_episode_scored`'s
(a summary failure scores 0 in a validation under every `on_summary_failure`)."""


class ValidationFailed(RuntimeError):
    """A held-out rollout failed without an injected fault: the fleet, not the policy, is broken."""


def training_seeds(cfg: MinirlConfig) -> set[int]:
    """The task seeds of every training prompt group of the run."""
    g = cfg.grpo
    return {task_seed(cfg, step, group) for step in range(g.max_num_steps) for group in range(g.num_prompts_per_step)}


def held_out_seeds(cfg: MinirlConfig) -> list[int]:
    """The first `val_num_prompts` seeds of the held-out stream, `(env.data_seed, "val", i)` for
    i = 0, 1, ..., that no training prompt of the run (`training_seeds`) uses. An episode is a pure
    function of its seed and room count, and a task's rooms are drawn from its seed alone, so no
    held-out episode shares a room sequence with a trained one; room counts follow the training mix
    (`env.num_rooms_choices`), so the held-out set has the training distribution of difficulty."""
    trained, out, i = training_seeds(cfg), [], 0
    while len(out) < cfg.grpo.val_num_prompts:
        seed = _seed(cfg.env.data_seed, "val", i)
        if seed not in trained and seed not in out:
            out.append(seed)
        i += 1
    return out


def held_out_prompts(cfg: MinirlConfig) -> list[dict]:
    """The held-out prompts: the first `val_num_prompts` rows of `data.validation_jsonl` (Gym rows,
    kept apart from `data.train_jsonl`'s by whoever wrote the two files), or the doors task's
    held-out seeds."""
    if cfg.data.validation_jsonl is not None:
        return dataset_rows(cfg, "validation_jsonl")[: cfg.grpo.val_num_prompts]
    return [task_row(cfg, seed) for seed in held_out_seeds(cfg)]


def held_out_rows(cfg: MinirlConfig, version: int = 0) -> list[dict]:
    """The `/run` rows of one validation (of policy `version`): no `_minirl` block, a fixed sampling
    seed per rollout, and Gym's collector keys with a rollout id of the version's (`val.v3.i0.r1`), so
    that no two validations share a Gym episode (`_send` adds each send's attempt index, as training's
    `wire.collector_keys` does).

    Without a `_minirl` coordinates block the row's model calls carry no rollout header, and every
    fault site (minirl.faults) is keyed by those coordinates, so none fires, whatever `faults.*` says.
    Sampling uses the training generation config (temperature, top_p, reply cap), as NeMo-RL
    validates: the reward at the sampling temperature is what GRPO optimises, while greedy decoding
    can hide or overstate a change of the sampled policy. The fixed seed is the same at every
    validation (common random numbers), so the difference between two is the policy's, not the
    sampler's."""
    rows = []
    for i, row in enumerate(held_out_prompts(cfg)):
        for r in range(cfg.grpo.val_num_generations):
            params = with_extra_body(row["responses_create_params"],
                                     seed=_seed(cfg.grpo.seed, "val", i, r) % 2**31)
            # Gym's collector keys (minirl.wire)
            keys = {TASK_INDEX: i, ROLLOUT_INDEX: r, ROLLOUT_ID: f"val.v{version}.i{i}.r{r}"}
            rows.append({**row, "responses_create_params": params, "_rowidx": len(rows), **keys})
    return rows


async def _send(cfg: MinirlConfig, session: aiohttp.ClientSession, pool: AgentPool, row: dict) -> dict:
    """One held-out row's scored result. A failure is the fleet's (no fault fires here): an INFRA one
    (Gym's non-terminal EpisodeFailure or `_ng_failure_*` stamp included) is sent again, after
    training's backoff (`rollout_failure.backoff_base_s`, `max_backoff_s`) and to the server the pool
    picks, up to `nemo_gym.max_row_attempts` sends, and any other ends the validation with
    ValidationFailed naming it, except the policy's own episode ends of `POLICY_ENDS`, which score 0.
    A verifier's `mask_sample` (the reward is not a measurement, e.g. a judge that failed) is transient
    as an INFRA failure is: the row is sent again, and a result still masked after the last send is
    returned as it is (`summarize` counts it in `val_num_masked`)."""
    rf = cfg.async_rl.rollout_failure
    ng = rf.nemo_gym
    send, url = 0, None
    while True:
        send += 1
        url = pool.pick(avoid=url)
        sent_at = pool.clock()
        pool.acquire(url)
        try:
            async with asyncio.timeout(ng.rollout_timeout_s):
                result = await post_run(session, url, {**row, ATTEMPT_INDEX: send - 1})
            pool.answered(url)
            failed = episode_failure(result)  # Gym's failure facts, as training's parse_rollout reads them first
            if failed is not None:
                raise failed
            scored = parse_scored(result, reward_bound(cfg.grpo.normalize_rewards))  # the training path's checks
            scored["fact_rooms"] = fact_rooms(row, result)
            if scored["mask"] is None or send >= ng.max_row_attempts:
                return scored
            continue  # the verifier's mask_sample: no measurement yet, send the row again
        except TimeoutError:
            pool.failed(url, "timeout", sent_at)
            exc: BaseException = RolloutTimeout(f"held-out /run exceeded {ng.rollout_timeout_s}s")
        except AgentUnreachable as e:
            pool.failed(url, "refused", sent_at)  # marked down: the pool passes it over while another is up
            exc = e
        except RolloutFailure as e:
            ended = POLICY_ENDS.get(getattr(e, "error_type", None))
            if ended is not None:  # the policy's own episode ended: scored 0 (POLICY_ENDS)
                return {"reward": 0.0, "response": {"status": "incomplete"}, "evidence": {"end_reason": ended},
                        "fact_rooms": fact_rooms(row, {})}
            exc = e
        finally:
            pool.release(url)
        if classify(exc) != INFRA or send >= ng.max_row_attempts:
            raise ValidationFailed(f"held-out row {row['_rowidx']}{describe(row)} "
                                   f"failed after {send} send(s): {type(exc).__name__}: {exc}") from exc
        await asyncio.sleep(backoff(rf, send))  # training's, before INFRA retry k


def summarize(rows: list[dict], results: list[dict]) -> dict:
    """val_* metrics of the held-out results; per room count too when the mix has several. A result
    whose verifier still set `mask_sample` after every send is no measurement: it is left out of the
    means and counted in `val_num_masked`."""
    masked = sum(res.get("mask") is not None for res in results)
    if masked == len(results):
        raise ValidationFailed(f"every one of the {len(results)} held-out rollouts still had mask_sample after its "
                               "last send (nemo_gym.max_row_attempts): the verifier measured none")
    rows, results = zip(*[(row, res) for row, res in zip(rows, results) if res.get("mask") is None])
    ends = [(res.get("evidence") or {}).get("end_reason") for res in results]
    rewards = [0.0 if end in SCORED_ZERO else float(res["reward"]) for res, end in zip(results, ends)]
    by_rooms: dict[int, list[float]] = defaultdict(list)
    for row, reward in zip(rows, rewards):
        if difficulty(row) is not None:
            by_rooms[difficulty(row)].append(reward)
    out = {
        "val_reward_mean": sum(rewards) / len(rewards),
        "val_success_rate": sum(r >= PASS_REWARD for r in rewards) / len(rewards),  # training's pass
        "val_truncated_rate": sum((res.get("response") or {}).get("status") == "incomplete" for res in results)
        / len(results),
        "val_guard_ended_rate": ends.count("guard_reject") / len(results),
        "val_summary_failed_rate": sum(end in ("summary_failed", SUMMARY_FAILED_SCORED) for end in ends) / len(results),
        "val_num_rollouts": len(results),
        "val_num_masked": masked,
    }
    facts = [(0 if end in SCORED_ZERO else res["fact_rooms"][0], res["fact_rooms"][1])
             for res, end in zip(results, ends) if res.get("fact_rooms")]  # a policy-ended episode opened none
    if facts:
        out["val_fact_success_rate"] = sum(a for a, _ in facts) / sum(n for _, n in facts)
    if len(by_rooms) > 1:
        for k, rs in sorted(by_rooms.items()):
            out[f"val_reward_mean_rooms_{k}"] = sum(rs) / len(rs)
            out[f"val_success_rate_rooms_{k}"] = sum(r >= PASS_REWARD for r in rs) / len(rs)
    return out


async def validate(cfg: MinirlConfig, agent_urls: list[str], version: int) -> dict:
    """One validation of the weights the generation workers serve now (`version`, for the record)."""
    t0 = time.perf_counter()
    rows = held_out_rows(cfg, version)
    pool = AgentPool.of(agent_urls, cfg.agent)
    async with run_session() as session:
        sends = [asyncio.ensure_future(_send(cfg, session, pool, row)) for row in rows]
        try:
            results = await asyncio.gather(*sends)
        except BaseException:  # one row ended the validation: the others' /run calls and backoffs end with it
            for send in sends:
                send.cancel()
            await asyncio.gather(*sends, return_exceptions=True)
            raise
    return {**summarize(rows, results), "val_policy_version": version, "val_time_s": time.perf_counter() - t0}


class Validator:
    """The training loop's side: validates when due (at start with `val_at_start`, after every
    `val_period`-th step), appends each validation to `run_dir/validation.jsonl` (one line each,
    with `step`: the last step trained, -1 before any) and returns the val_* fields for that step's
    metrics row. On resume, lines of policy versions past the resumed one are dropped (they will be
    measured again), as metrics.jsonl drops the steps it repeats, and so is a last line cut mid-write."""

    def __init__(self, cfg: MinirlConfig, controller, run_dir: Path, start: int):
        self.cfg, self.controller, self.path = cfg, controller, Path(run_dir) / "validation.jsonl"
        # a last line cut mid-write is dropped with a warning; another that does not parse is a RecordError
        keep = checkpoint.keep_records(self.path, lambda record: record["val_policy_version"] <= start)
        if cfg.grpo.val_at_start and not any(record["val_policy_version"] == start for record in keep):
            self._run(start, step=start - 1)

    def after(self, step: int) -> dict:
        """Validate the weights of version step + 1 when `step` ends a `val_period`; {} otherwise."""
        period = self.cfg.grpo.val_period
        return self._run(step + 1, step) if period and (step + 1) % period == 0 else {}

    def _run(self, version: int, step: int) -> dict:
        import ray

        metrics = ray.get(self.controller.validate.remote(version))
        with naming(self.path), open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.cfg.logger.progress:
            print(f"validation of version {version}: reward {metrics['val_reward_mean']:.3f}  success "
                  f"{metrics['val_success_rate']:.2f}  ({metrics['val_num_rollouts']} held-out rollouts, "
                  f"{metrics['val_time_s']:.1f}s)", file=sys.stdout, flush=True)
        return metrics
