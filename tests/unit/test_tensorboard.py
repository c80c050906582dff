"""The driver's TensorBoard writer (minirl.metrics.TensorBoardScalars) writes the events torch's SummaryWriter
writes: the same events field for field (the clock aside), and over a resume that purges the steps it runs
again, the same scalars in TensorBoard's own reader. (That the driver imports no torch for it is checked in a
fresh process: tests/integration/test_fresh_process.py.)"""

from __future__ import annotations

import pytest

from minirl.metrics import TensorBoardScalars


def _write(make, log_dir, start: int, steps: range, scale: float) -> None:
    writer = make(log_dir, start)
    for step in steps:
        writer.add_scalar("loss", scale / (step + 1), step)
        writer.add_scalar("reward_mean", scale * step * 0.1, step)
        writer.flush()
    writer.close()


def _events(log_dir) -> list[list]:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    files = sorted(log_dir.glob("events.out.tfevents.*"))
    out = []
    for f in files:
        events = []
        for e in EventFileLoader(str(f)).Load():
            e.wall_time = 0.0
            events.append(e.SerializeToString())
        out.append(events)
    return out


def test_the_events_and_the_purge_are_torchs_summary_writers(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    makers = {"ours": lambda d, s: TensorBoardScalars(d, purge_step=s),
              "torch": lambda d, s: SummaryWriter(str(d), purge_step=s)}
    for name, make in makers.items():
        _write(make, tmp_path / name, 0, range(4), 1.0)  # a run, then its resume at step 2 with other values
        _write(make, tmp_path / name, 2, range(2, 5), 2.0)
    assert _events(tmp_path / "ours") == _events(tmp_path / "torch") and len(_events(tmp_path / "ours")) == 2
    for tag in ("loss", "reward_mean"):
        shown = {name: [(e.step, e.value) for e in EventAccumulator(str(tmp_path / name)).Reload().Scalars(tag)]
                 for name in makers}
        assert shown["ours"] == shown["torch"]
        assert [s for s, _ in shown["ours"]] == [0, 1, 2, 3, 4]  # steps 2-3 of the first process purged
    assert shown["ours"][2][1] == pytest.approx(2.0 * 2 * 0.1)

