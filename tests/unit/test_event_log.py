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
