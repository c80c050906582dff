"""Fleet health end to end (issue L): `python -m minirl.train` with two generation workers, one of
them wedged by `worker_hang` at step 1. The router's probes quarantine it, its requests in flight
fail as INFRA and are redispatched to the healthy worker, and the run trains on; the quarantine is
in the event log and the step's metrics. (The router's state machine itself: tests/integration/test_router.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import SHARED_WORKERS, run_cli

pytestmark = pytest.mark.slow

SMALL = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=2", "logger.tensorboard=false"]
HEALTH = "async_rl.generation_fleet_health"


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def test_a_hung_worker_is_quarantined_and_the_run_trains_on(tmp_path, shared_engine):
    # attached to the session's two shared workers: the next run that attaches resets the hung one
    proc = run_cli(*SMALL, "grpo.max_num_steps=3", f"run_dir={tmp_path}", "checkpoint.enabled=false",
                   *shared_engine, f"cluster.num_generation_workers={SHARED_WORKERS}",
                   f"{HEALTH}.enabled=true", f"{HEALTH}.probe_interval_s=2", f"{HEALTH}.probe_timeout_s=1.5",
                   "faults.inject=[{kind: worker_hang, step: 1, group: 0, rollout: 0, attempt: 0}]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows, events = lines(tmp_path / "metrics.jsonl"), lines(tmp_path / "events.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2], "it finishes all its steps"
    generated = sum(r["rollouts_generated"] for r in rows)
    assert sum(r["rollouts_trained"] for r in rows) >= 0.99 * generated > 0

    assert any(e["type"] == "fault" and e["kind"] == "worker_hang" and e["step"] == 1 for e in events)
    quarantined = [e for e in events if e["type"] == "worker_quarantined"]
    hung = [e for e in quarantined if "probe_timeout_s=1.5" in e["reason"]]  # /health never answered: wedged
    assert len(hung) == 1 and hung[0]["step"] == 1 and hung[0]["rank"] in (0, 1), quarantined
    assert hung[0]["worker"] in json.loads((tmp_path / "endpoints.json").read_text())["generation_workers"]
    readmitted = [e for e in events if e["type"] == "worker_readmitted"]
    assert not any(e["worker"] == hung[0]["worker"] and e["t"] > hung[0]["t"] for e in readmitted), \
        "a wedged worker stays out"
    # on a loaded 2-core machine a healthy worker's /health may answer 503 for a few probes (an engine
    # step past engine.STUCK_STEP_S) and be quarantined: then it must come back, and it is not the hang
    for e in quarantined:
        if e is not hung[0]:
            assert any(r["worker"] == e["worker"] and r["t"] > e["t"] for r in readmitted), (e, readmitted)
    transient = len(quarantined) - 1
    assert rows[1]["workers_quarantined"] >= 1 and sum(r["workers_quarantined"] for r in rows) == 1 + transient
    assert rows[2]["healthy_generation_workers"] == 1 and rows[0]["healthy_generation_workers"] in (1, 2)
    # the rollouts caught on the hung worker failed at the quarantine, as INFRA, and were redispatched
    cut = [e for e in events if e["type"] == "failure" and "quarantined" in e["error"]]
    assert cut and {(e["class"], e["decision"]) for e in cut} == {("infra", "retried")}, cut
