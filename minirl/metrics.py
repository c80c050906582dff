"""Run outputs: the event log, per-step metrics (JSONL + TensorBoard) and the progress line.

Invariant: `metrics.jsonl` gets exactly one line per completed optimizer step, written after the
step's update and weight sync (a non-finite value is written as null), and TensorBoard the same
scalars, a resumed run first purging those of the steps it runs again; `events.jsonl` gets one
line per drop, retry, mask, compaction, guard decision, fault and failure, each flushed as it
happens, so a crash loses nothing logged; the progress line never fails on a missing value.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

REQUIRED_FIELDS = (
    "step",
    "groups_target",
    "groups_trained",
    "dropped_prompt_groups",
    "redispatched_groups",
    "rollouts_trained",
    "rollouts_masked",
    "traces_trained",
    "tokens_trained",
    "compactions",
    "guard_rejections",
    "reward_mean",
    "loss",
    "step_time_s",
    "gen_tokens_per_s",
)


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _fmt(value, spec: str) -> str:
    """`value` formatted with `spec`, or `-` where it is missing or not a number."""
    return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


class EventLog:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(path, "a", buffering=1)

    def write(self, event: dict) -> None:
        self.f.write(json.dumps({"t": round(time.time(), 3), **event}, default=str) + "\n")


class MetricsLogger:
    def __init__(self, run_dir: Path, tensorboard: bool, progress: bool, total_steps: int, start: int = 0):
        """`start`: the first step this process runs (a resume's); TensorBoard drops the scalars an earlier
        process wrote for it and the steps after (metrics.jsonl is cut there by the caller), as it does for a
        restarted TensorFlow job."""
        self.f = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self.progress, self.total = progress, total_steps
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start)

    def log(self, metrics: dict) -> None:
        missing = [k for k in REQUIRED_FIELDS if k not in metrics]
        assert not missing, f"metrics lack {missing}"
        row = {k: _clean(v) for k, v in metrics.items()}
        self.f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                    self.tb.add_scalar(k, v, row["step"])
            self.tb.flush()
        if self.progress:
            m = row
            print(
                f"step {m['step'] + 1:>4}/{self.total}  reward {_fmt(m['reward_mean'], '.3f')}  "
                f"groups {m['groups_trained']}/{m['groups_target']}  masked {m['rollouts_masked']}"
                f"  redisp {m['redispatched_groups']}  traces {m['traces_trained']}  loss {_fmt(m['loss'], '+.4f')}"
                f"  {_fmt(m['gen_tokens_per_s'], '.0f')} tok/s  {_fmt(m['step_time_s'], '.1f')}s",
                file=sys.stdout,
                flush=True,
            )

    def close(self) -> None:
        self.f.close()
        if self.tb is not None:
            self.tb.close()
