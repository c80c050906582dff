"""Run outputs: the event log, per-step metrics (JSONL + TensorBoard) and the progress line.

Invariant: `metrics.jsonl` gets exactly one line per completed optimizer step, written after the
step's update and weight sync (a non-finite value is written as null), and TensorBoard the same
scalars, a resumed run first purging those of the steps it runs again; `events.jsonl` gets one
line per drop, retry, mask, compaction, guard decision, fault and failure, each flushed as it
happens, so a crash loses nothing logged (and a line a crash cut is mended before the next is
appended); the progress line never fails on a missing value.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from minirl.runtime.files import naming

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
    """Appends to `path`, after mending the end an earlier process left there (`mend_tail`)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        mend_tail(path)
        self.f = open(path, "a", buffering=1)

    def write(self, event: dict) -> None:
        with naming(self.f.name):
            self.f.write(json.dumps({"t": round(time.time(), 3), **event}, default=str) + "\n")


def _line_start(f, end: int, chunk: int = 1 << 16) -> int:
    """The offset of the line `end` ends: just past the newline before it, or 0."""
    start = end
    while start > 0:
        start = max(0, start - chunk)
        f.seek(start)
        newline = f.read(end - start).rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
    return 0


def last_record(path: Path) -> dict | None:
    """The last line of a JSONL log, parsed; None when there is none, or it was cut mid-write."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, 2)
            f.seek(max(0, end - 1))
            if end == 0 or f.read(1) != b"\n":
                return None
            start = _line_start(f, end - 1)
            f.seek(start)
            record = json.loads(f.read(end - 1 - start))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def mend_tail(path: Path, chunk: int = 1 << 16) -> None:
    """A JSONL log whose last line a kill or a full disk cut mid-write: the next line appended would join
    it, and both would be lost to every reader. A cut tail that is a whole record gets its newline; any
    other is dropped, with one warning line on stderr naming the file (as `checkpoint.keep_records` does)."""
    if not path.exists():
        return
    with open(path, "rb+") as f:
        end = f.seek(0, 2)
        start = _line_start(f, end, chunk)
        if start == end:
            return
        f.seek(start)
        tail = f.read()
        try:
            whole = isinstance(json.loads(tail), dict)
        except ValueError:
            whole = False
        if whole:
            f.write(b"\n")
            return
        f.truncate(start)
    shown = tail[:40].decode("utf-8", "replace")
    print(f"minirl: {path}: dropping its last line, cut mid-write (not a JSON record: {shown!r}"
          f"{'...' if len(tail) > 40 else ''})", file=sys.stderr, flush=True)


class TensorBoardScalars:
    """Scalars in TensorBoard's event files, written by the `tensorboard` package's own `EventFileWriter` as
    torch's `SummaryWriter(log_dir, purge_step=start).add_scalar` writes them (a `Summary` value with
    `simple_value`; first the file version and a START session log at `purge_step`, which hides the steps an
    earlier process wrote from there on), without torch: importing `torch.utils.tensorboard` cost the driver
    ~2 s of CPU a run, the `tensorboard` package's writer ~0.4 s."""

    def __init__(self, log_dir: Path, purge_step: int):
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary
        self._writer = EventFileWriter(str(log_dir), max_queue_size=10, flush_secs=120)
        self._writer.add_event(Event(wall_time=time.time(), step=purge_step, file_version="brain.Event:2"))
        self._writer.add_event(Event(wall_time=time.time(), step=purge_step,
                                     session_log=SessionLog(status=SessionLog.START)))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=float(value))])
        self._writer.add_event(self._event(summary=summary, wall_time=time.time(), step=int(step)))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MetricsLogger:
    def __init__(self, run_dir: Path, tensorboard: bool, progress: bool, total_steps: int, start: int = 0):
        """`start`: the first step this process runs (a resume's); TensorBoard drops the scalars an earlier
        process wrote for it and the steps after (metrics.jsonl is cut there by the caller), as it does for a
        restarted TensorFlow job."""
        self.f = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self.progress, self.total = progress, total_steps
        self.tb = None
        if tensorboard:
            self.tb = TensorBoardScalars(run_dir / "tensorboard", purge_step=start)

    def log(self, metrics: dict) -> None:
        missing = [k for k in REQUIRED_FIELDS if k not in metrics]
        assert not missing, f"metrics lack {missing}"
        row = {k: _clean(v) for k, v in metrics.items()}
        with naming(self.f.name):
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
