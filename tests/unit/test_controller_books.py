"""The controller's books: a `run_failed` event counts the sends and results of the groups in no metrics
line, and every event line carries its step, group, rollout, attempt, reason and decision (docs/contracts.md;
GUIDE.md's events.jsonl). The controller and its rollout manager are real; the step source is a stand-in at
the `StepSource` boundary that hands over one step's finished groups (the sources themselves are tested with
the rollout manager in tests/unit/test_pump_failures.py and through the CLI)."""

from __future__ import annotations

import asyncio
import json

from minirl.config import load_config
from minirl.controller import Controller
from minirl.types import SOURCE_COUNTS, GroupOutcome, Rollout, StepTake, Trace
from minirl.wire import Coords


class _Source:
    window = 0

    def __init__(self, take: StepTake):
        self.take_ = take

    async def take(self, step, version):
        return self.take_

    def ledgered(self):
        pass


def _group(g: int, sends: int) -> GroupOutcome:
    out = GroupOutcome(g, "committed", step=0, row_sends=sends, rows_returned=2)
    out.rollouts = {r: Rollout(Coords(0, g, r, 0), float(r), [], [Trace([1, 2, 3, 4], [0, 0, 1, 1], [0, 0, -.5, -.5])],
                               False) for r in range(2)}
    return out


def _run_failed(tmp_path, line_written: bool) -> dict:
    cfg = load_config(None, ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
                             "policy.train_global_batch_size=4"])
    groups = [_group(0, 3), _group(1, 2)]

    async def run():
        controller = Controller(cfg, str(tmp_path), ["http://127.0.0.1:9"], [], 64, 0)
        for o in groups:  # as run_group registers each group it begins
            controller.manager.unsettled[o.step, o.group] = o
        controller.source = _Source(StepTake(groups, [0, 0], [], 0.0, dict.fromkeys(SOURCE_COUNTS, 0)))
        _, stats = await controller.collect(0, 0)
        assert stats["rollout_attempts"] == 5
        if line_written:  # the driver's metrics line, then a failure before the next collect (TensorBoard, SIGTERM)
            (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, **stats}, default=str) + "\n")
        controller.run_failed("Terminated: SIGTERM")

    asyncio.run(run())
    (event,) = [e for e in map(json.loads, (tmp_path / "events.jsonl").read_text().splitlines())
                if e["type"] == "run_failed"]
    return event


def test_a_failure_after_a_steps_metrics_line_does_not_count_its_groups_again(tmp_path):
    """Found by review: a step's groups left the books only at the next collect or checkpoint, so a failure
    between its metrics line and the next step (the line's TensorBoard write, a SIGTERM while the run's books
    close) counted them a second time in run_failed."""
    event = _run_failed(tmp_path, line_written=True)
    assert (event["rollout_attempts"], event["rollouts_generated"]) == (0, 0)


def test_a_failure_before_the_steps_metrics_line_counts_its_groups(tmp_path):
    event = _run_failed(tmp_path, line_written=False)
    assert (event["step"], event["rollout_attempts"], event["rollouts_generated"]) == (0, 5, 4)


def test_every_event_line_names_its_step_group_rollout_attempt_reason_and_decision(tmp_path):
    """Found by review: `mask` and `segment_mask` lines had no decision, `compaction` and `guard` lines no
    reason, a `drop` no rollout or attempt (a group's line: null)."""
    cfg = load_config(None, ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
                             "policy.train_global_batch_size=4",
                             "async_rl.rollout_failure.max_consecutive_dropped_prompts=4"])
    groups = [_group(0, 2), _group(1, 2)]
    groups[0].rollouts[1].mask_reason = "overlong"
    groups[1].rollouts[0].mask_reason = groups[1].rollouts[0].traces[0].mask_reason = "unrecorded_calls"

    async def run():
        controller = Controller(cfg, str(tmp_path), ["http://127.0.0.1:9"], [], 64, 0)
        controller.source = _Source(StepTake(groups, [0, 0], [], 0.0, dict.fromkeys(SOURCE_COUNTS, 0)))
        await controller.collect(0, 0)
        manager = controller.manager
        evidence = {"compactions": 1, "guard": [{"call": 2, "limit": 9, "reserved": 0, "decision": "reject"}]}
        manager._agent_events(Rollout(Coords(0, 1, 1, 0), 0.0, [], [], False, evidence))
        manager._drop(0, 1, GroupOutcome(1, "committed", step=0), RuntimeError("cut"), "lost")

    asyncio.run(run())
    lines = [e for e in map(json.loads, (tmp_path / "events.jsonl").read_text().splitlines())]
    assert {e["type"] for e in lines} >= {"mask", "segment_mask", "compaction", "guard", "drop"}
    for e in lines:
        missing = {"step", "group", "rollout", "attempt", "reason", "decision"} - set(e)
        assert not missing, (e["type"], missing)
