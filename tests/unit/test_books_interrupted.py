"""A SIGTERM that comes while the driver closes the run's books (`Cluster.__exit__`: the controller's
`finish` waits up to 30 s, `run_failed` up to 10 s). Found by review: the interrupt escaped `__exit__`, so a run
whose steps had all completed ended with exit 1 and no `run_failed` event, and a run that had failed already
ended naming the SIGTERM instead of its failure. The signal is real and so is minirl's handler
(`shutdown.arm`); the books' write is where it lands: the cluster was never started (no Ray, no controller),
so `run_failed` goes straight into events.jsonl, as the driver writes it when the controller cannot."""

from __future__ import annotations

import json
import os
import signal

import pytest

from minirl import shutdown
from minirl.cluster import Cluster
from minirl.config import load_config


@pytest.fixture
def armed(tmp_path, monkeypatch):
    before = signal.getsignal(signal.SIGTERM)
    shutdown.arm(tmp_path)
    cluster = Cluster(load_config(None, [f"run_dir={tmp_path}"]), tmp_path)
    monkeypatch.setattr(cluster, "_finish", lambda: os.kill(os.getpid(), signal.SIGTERM))  # lands while it closes
    yield cluster
    signal.signal(signal.SIGTERM, before)


def run_failed(tmp_path) -> list[str]:
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    return [e["error"] for e in map(json.loads, lines) if e["type"] == "run_failed"]


def test_a_run_that_ended_well_ends_with_the_sigterm_and_its_run_failed(armed, tmp_path):
    with pytest.raises(shutdown.Terminated):
        armed.__exit__(None, None, None)
    (error,) = run_failed(tmp_path)
    assert error.startswith("Terminated: SIGTERM"), error


def test_a_run_that_failed_already_ends_with_its_own_failure(armed, tmp_path):
    boom = RuntimeError("boom in step 3")
    assert armed.__exit__(RuntimeError, boom, None) is None  # the `with` re-raises `boom`, not the SIGTERM
    assert run_failed(tmp_path) == ["RuntimeError: boom in step 3"]
