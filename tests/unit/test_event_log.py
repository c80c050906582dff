"""The event log a resumed run appends to: a last line that a kill or a full disk cut mid-write is mended
before the next line is appended (found by review: the resumed run's first event joined the cut line, and
both were lost to every reader, which `json.loads` each line)."""

from __future__ import annotations

import json

from minirl.metrics import EventLog, mend_tail


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_cut_last_line_is_dropped_with_a_warning_and_the_next_event_reads(tmp_path, capsys):
    path = tmp_path / "events.jsonl"
    path.write_text('{"t": 1.0, "type": "mask"}\n{"t": 2.0, "type": "ma')
    log = EventLog(path)
    log.write({"type": "resumed", "step": 3})
    log.f.close()
    assert [e["type"] for e in lines(path)] == ["mask", "resumed"]
    assert f"minirl: {path}: dropping its last line, cut mid-write" in capsys.readouterr().err


def test_a_whole_record_without_its_newline_is_kept(tmp_path, capsys):
    path = tmp_path / "events.jsonl"
    path.write_text('{"t": 1.0, "type": "mask"}\n{"t": 2.0, "type": "drop"}')
    EventLog(path).write({"type": "resumed"})
    assert [e["type"] for e in lines(path)] == ["mask", "drop", "resumed"]
    assert capsys.readouterr().err == ""


def test_a_whole_file_is_left_as_it_is_and_a_cut_first_line_goes(tmp_path):
    path = tmp_path / "events.jsonl"
    whole = '{"t": 1.0, "type": "mask"}\n' * 3
    path.write_text(whole)
    mend_tail(path)
    assert path.read_text() == whole
    path.write_text('{"t": 1.0, "ty')  # no newline anywhere: the one line was cut
    mend_tail(path, chunk=4)  # scanned back in small chunks, as a long tail is
    assert path.read_text() == ""
    long_tail = whole + "x" * 50
    path.write_text(long_tail)
    mend_tail(path, chunk=8)
    assert path.read_text() == whole


def test_a_full_disk_names_the_file_it_could_not_write(tmp_path):
    """A real ENOSPC (the files are links to /dev/full): the OS's error says only "No space left on device",
    which named no file on the run's last line; each log's write now names its own (minirl.runtime.files)."""
    import errno

    import pytest

    from minirl.metrics import REQUIRED_FIELDS, MetricsLogger
    from minirl.rollout.evidence import Ledger

    (tmp_path / "events.jsonl").symlink_to("/dev/full")
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    (tmp_path / "ledger").mkdir()
    (tmp_path / "ledger" / "step_0.jsonl").symlink_to("/dev/full")
    metrics = MetricsLogger(tmp_path, tensorboard=False, progress=False, total_steps=1)
    ledger = Ledger(tmp_path / "ledger")
    for write, name in ((lambda: EventLog(tmp_path / "events.jsonl").write({"type": "drop"}), "events.jsonl"),
                        (lambda: metrics.log(dict.fromkeys(REQUIRED_FIELDS, 0)), "metrics.jsonl"),
                        (lambda: ledger._write(0, [{"step": 0}]), "ledger/step_0.jsonl")):
        with pytest.raises(OSError) as err:
            write()
        assert err.value.errno == errno.ENOSPC and str(err.value).endswith(f": '{tmp_path / name}'"), err.value


def test_last_record_reads_the_last_whole_line_only(tmp_path):
    from minirl.metrics import last_record

    path = tmp_path / "metrics.jsonl"
    assert last_record(path) is None
    path.write_text("")
    assert last_record(path) is None
    path.write_text('{"step": 0}\n{"step": 1}\n')
    assert last_record(path) == {"step": 1}
    path.write_text('{"step": 0}\n{"step": 1')  # cut mid-write: not a line a run wrote whole
    assert last_record(path) is None
    path.write_text('{"step": 0}\n' + json.dumps({"step": 1, "pad": "x" * 70_000}) + "\n")  # longer than one chunk
    assert last_record(path)["step"] == 1
