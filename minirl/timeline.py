"""Where an optimizer step's wall time goes: the `timing/*` fields of metrics.jsonl, named as
NeMo-RL's timer names them (`TIMING_FIELDS` says what each measures; docs/contracts.md). Two lanes
over the same wall clock: the trainer's (the driver's loop: the wait for the step's groups, their
processing, the update, the weight sync) and the generation lane (the engines, from one weight
publish to the next). A sync run's lanes take turns; an async run's overlap.

Invariant: only clock reads (perf_counter / monotonic deltas) and totals the components keep anyway;
nothing here waits on a device or adds a round trip of its own. Each lane's parts add up to its whole.
"""

from __future__ import annotations

import time

TIMING_FIELDS = {
    "timing/train/total_step_time": "the step's wall time on the trainer's lane (= step_time_s)",
    "timing/train/exposed_generation": "the controller's wait for the step's prompt groups: sync, their whole "
                                       "generation; async, the train pump's wait on the buffer (the trainer idle)",
    "timing/train/data_processing": "the rest of the collect: step checks, ledger, assembly, events, the hand-over "
                                    "of the stats (rollout_time_s minus exposed_generation)",
    "timing/train/policy_training": "the policy update, the batch's transfer to the policy workers included "
                                    "(= train_time_s)",
    "timing/train/policy_compute": "of policy_training, rank 0's forward, backward and optimizer step",
    "timing/train/weight_sync": "the weight sync: the pump paused, the weights to every generation worker, "
                                "served (= sync_time_s)",
    "timing/generation/cycle": "the generation lane's wall time: from the previous step's weight publish to this "
                               "step's (for the first step after start or resume: from its collect)",
    "timing/generation/engine_busy": "the engines stepping (mean over the generation workers)",
    "timing/generation/weight_load": "the engines loading new weights (mean over the workers)",
    "timing/generation/gather": "idle engines holding a burst's first requests before their first step "
                                "(vllm_cfg.gather_gap_s; mean over the workers)",
    "timing/generation/rollout_wait": "rollouts in flight while the engines neither step, load nor gather: "
                                      "tool latency, agent servers, HTTP hops",
    "timing/generation/idle": "no rollout in flight and the engines idle (sync: training and syncing; async: "
                              "the pump held by the staleness gate, the buffer or a weight sync)",
    "timing/generation/weight_drain": "weight updates waiting for the requests in flight to finish "
                                      "(async_rl.in_flight_weight_updates=false); inside weight_sync, "
                                      "overlaps engine_busy",
}
"""Every `timing/*` metric, with what it measures (seconds per step)."""


class Occupancy:
    """Wall time during which at least one of a counted kind of thing (rollouts in flight) exists."""

    def __init__(self):
        self.count, self.since, self.total = 0, 0.0, 0.0

    def enter(self) -> None:
        if self.count == 0:
            self.since = time.monotonic()
        self.count += 1

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self.total += time.monotonic() - self.since

    def read(self) -> float:
        """The total so far, the interval still open included."""
        return self.total + (time.monotonic() - self.since if self.count else 0.0)


def trainer_lane(t0: float, t1: float, t2: float, t3: float, exposed: float) -> dict:
    """The trainer's lane from the loop's clock marks (collect, train and sync end at t1, t2, t3) and
    the controller's wait for the groups (policy_compute comes from the policy worker itself)."""
    return {"timing/train/total_step_time": t3 - t0, "timing/train/exposed_generation": exposed,
            "timing/train/data_processing": max(t1 - t0 - exposed, 0.0), "timing/train/policy_training": t2 - t1,
            "timing/train/weight_sync": t3 - t2}


CLOCK_KEYS = ("busy_s", "weights_s", "drain_s", "gather_s")


class EngineClocks:
    """The generation workers' run totals (`GenerationWorker.clock`, in worker order) made continuous
    across a worker's restarts: a restarted worker counts from 0 in a new `epoch`, so the totals of its
    earlier lives, as last read, are carried over, and the difference of two readings is never negative
    (what the engine did between its last reading and its death is not counted)."""

    def __init__(self):
        self.last: dict[int, dict] = {}  # rank -> the last reading taken in
        self.carried: dict[int, dict] = {}  # rank -> the totals of its earlier lives

    def read(self, readings: list[dict]) -> list[dict]:
        out = []
        for rank, reading in enumerate(readings):
            last = self.last.get(rank)
            carried = self.carried.setdefault(rank, dict.fromkeys(CLOCK_KEYS, 0.0))
            if last is not None and last.get("epoch") != reading.get("epoch"):
                for k in CLOCK_KEYS:
                    carried[k] += last[k]
            self.last[rank] = reading
            out.append({k: reading[k] + carried[k] for k in CLOCK_KEYS})
        return out


def clocks(engines: list[dict], active_s: float) -> tuple[float, ...]:
    """One reading of the run's totals: (now, engine busy, weight load, weight drain, gather: means
    over the workers' `GenerationWorker.clock`, rollouts-in-flight occupancy)."""
    n = max(len(engines), 1)
    means = (sum(e[k] for e in engines) / n for k in CLOCK_KEYS)
    return (time.monotonic(), *means, active_s)


def generation_lane(before: tuple[float, ...], after: tuple[float, ...], loads_in_flight: bool = True) -> dict:
    """The generation lane between two `clocks` readings. Engine time is counted as taken inside the
    time rollouts are in flight (a gather too: it holds their calls), so rollout_wait is what is left of
    that time; a weight load only with `loads_in_flight` (async: the groups in flight go on through a
    sync). A sync run loads between steps with no rollout in flight, so its load is outside that time
    (counted inside it, rollout_wait lost the load and idle gained it)."""
    cycle, busy, load, drain, gather, active = (b - a for a, b in zip(before, after))
    wait = max(active - busy - (load if loads_in_flight else 0.0) - gather, 0.0)
    return {"timing/generation/cycle": cycle, "timing/generation/engine_busy": busy,
            "timing/generation/weight_load": load, "timing/generation/gather": gather,
            "timing/generation/rollout_wait": wait,
            "timing/generation/idle": max(cycle - busy - load - gather - wait, 0.0),
            "timing/generation/weight_drain": drain}
