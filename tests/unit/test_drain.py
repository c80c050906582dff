"""The controller's drain of the generation workers' call records (`Controller._drain`): a take that
fails on one worker fails the drain, and the records the other workers handed over (their servers no
longer hold them) reach the ledger's run_end at the run's end instead of vanishing. Before, the drain
stopped at the first failed answer, and the records already handed over were in no ledger line.

The workers are stand-ins at their Ray handles' boundary (`take_calls.remote`, `finish_run.remote`):
no fault site makes a real worker's take fail (a killed worker is restarted and answers with an empty
log); the takes through real servers are in tests/integration/test_sync_take.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from minirl.config import load_config
from minirl.controller import Controller


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return asyncio.ensure_future(self.fn(*args))


class _Worker:
    """A generation worker's handle: `take_calls` hands over (and forgets) its records, or raises."""

    def __init__(self, records: list[dict], fails: bool = False):
        self.records, self.fails = records, fails
        self.take_calls, self.finish_run = _Method(self._take), _Method(self._finish)

    async def _take(self, step):
        await asyncio.sleep(0.01)
        if self.fails:
            raise ConnectionError("the worker's front end did not answer")
        out, self.records = self.records, []
        return out

    async def _finish(self):
        return {"left": [], "served_count": 0, "dropped": 0, "served": []}


def _record(rank: int, call: int) -> dict:
    return {"key": f"s0.g0.r{rank}.a0.c{call}", "step": 0, "group": 0, "rollout": rank, "attempt": 0,
            "call": call, "policy_version": 0, "generation_token_ids": [1, 2]}


@pytest.mark.parametrize("failing", [0, 1])
def test_a_take_failing_on_one_worker_leaves_the_others_records_to_run_end(tmp_path, failing):
    healthy = 1 - failing
    workers = [None, None]
    workers[healthy] = _Worker([_record(healthy, 0), _record(healthy, 1)])
    workers[failing] = _Worker([_record(failing, 0)], fails=True)

    async def run():
        controller = Controller(load_config(), str(tmp_path), ["http://127.0.0.1:9"], workers, 512, 0)
        with pytest.raises(ConnectionError):
            await controller._drain(0)
        return await controller.finish()

    event = asyncio.run(run())
    retired = [json.loads(line) for line in (tmp_path / "ledger" / "run_end.jsonl").read_text().splitlines()]
    assert sorted((r["rollout"], r["call"]) for r in retired) == [(healthy, 0), (healthy, 1)]
    assert event["calls_retired_at_end"] == 2


def test_an_external_agents_record_no_rollout_took_is_retired_into_a_step_ledger(tmp_path):
    """agent.external_url: the records no rollout matched wait in the controller's pool for the window's
    steps, then are retired and counted in `calls_retired`. Before, they left the pool with no ledger line
    in any step's file nor run_end.jsonl (the ledger holds every call, docs/failure-policy.md)."""
    from minirl.types import SOURCE_COUNTS, StepTake

    unmatched = {"prompt_token_ids": [9, 9], "generation_token_ids": [7], "generation_log_probs": [-0.1],
                 "seed": 1, "version_start": 0, "version_end": 0, "status": 200}
    worker = _Worker([unmatched])
    cfg = load_config(None, ["agent.external_url=http://127.0.0.1:9", "agent.name=ext"])

    async def run():
        controller = Controller(cfg, str(tmp_path), ["http://127.0.0.1:9"], [worker], 512, 0)
        retired = []
        for step in range(3):
            take = StepTake([], [], [], 0.0, dict.fromkeys(SOURCE_COUNTS, 0))
            ledger, _ = await controller._check_ledger(step, step, take, [])
            retired.append(ledger["calls_retired"])
        return retired

    assert asyncio.run(run()) == [0, 0, 1]
    lines = [json.loads(line) for line in (tmp_path / "ledger" / "step_2.jsonl").read_text().splitlines()]
    assert [(x["generation_token_ids"], x["ledger_status"]) for x in lines] == [([7], "retired")]
    assert lines[0]["reason"].startswith("external:")
