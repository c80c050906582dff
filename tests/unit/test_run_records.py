"""A resume rewrites the run's JSONL records (metrics.jsonl, validation.jsonl) to the lines it keeps. A
last line cut mid-write (a full disk, a kill) is the interrupted tail: dropped with one warning naming
the file. Any other line that does not parse is an error naming the file and the line (before, both
were a bare JSONDecodeError naming no file, on every resume)."""

from __future__ import annotations

import json

import pytest

from minirl.config import load_config
from minirl.train import _truncate_metrics
from minirl.trainer.checkpoint import RecordError
from minirl.validation import Validator

LINES = ['{"step": 0, "loss": 0.1}', '{"step": 1, "loss": 0.2}', '{"step": 2, "loss": 0.3}']


def test_a_cut_last_metrics_line_is_dropped_with_a_warning_naming_the_file(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(LINES) + '\n{"step": 3, "lo')
    _truncate_metrics(tmp_path, 2)
    assert path.read_text() == LINES[0] + "\n" + LINES[1] + "\n"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "last line 4, cut mid-write" in err[0], err
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"], "no temporary file left"
    _truncate_metrics(tmp_path, 5)  # a whole file: kept as it is, nothing said
    assert path.read_text() == LINES[0] + "\n" + LINES[1] + "\n" and capsys.readouterr().err == ""


@pytest.mark.parametrize("bad", ['{"step": 1, "lo', "[1, 2]", '{"loss": 0.2}'], ids=["cut", "list", "no_step"])
def test_a_bad_line_before_the_last_names_the_file_and_the_line(tmp_path, bad):
    path = tmp_path / "metrics.jsonl"
    text = "\n".join([LINES[0], "", bad, LINES[2]]) + "\n"
    path.write_text(text)
    with pytest.raises(RecordError, match=rf"^{path}, line 3: not a JSON record \("):
        _truncate_metrics(tmp_path, 2)
    assert path.read_text() == text, "left as it was"


def test_a_cut_last_validation_line_is_dropped_with_a_warning(tmp_path, capsys):
    path = tmp_path / "validation.jsonl"
    rows = [json.dumps({"step": s - 1, "val_policy_version": s, "val_reward_mean": 0.5}) for s in range(3)]
    path.write_text("\n".join(rows) + '\n{"step": 2, "val_pol')
    Validator(load_config(None, []), None, tmp_path, start=1)  # val_at_start off: measures nothing here
    assert path.read_text() == rows[0] + "\n" + rows[1] + "\n"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "cut mid-write" in err[0], err
    path.write_text(rows[0] + "\n{oops\n" + rows[1] + "\n")
    with pytest.raises(RecordError, match=rf"^{path}, line 2: "):
        Validator(load_config(None, []), None, tmp_path, start=1)


def test_the_kept_records_reach_the_disk_before_they_replace_the_file(tmp_path, monkeypatch):
    """Found by review: the rewrite renamed its temporary file over metrics.jsonl unsynced, so a machine
    crash right after a resume could leave an empty metrics.jsonl. The temporary file is fsynced before the
    rename, the folder after it (the order of the real calls, recorded on their way through)."""
    import os

    from minirl.trainer import checkpoint

    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(LINES) + "\n")
    order, fsync, replace = [], os.fsync, os.replace
    monkeypatch.setattr(checkpoint.os, "fsync", lambda fd: (order.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                            fsync(fd))[1])
    monkeypatch.setattr(checkpoint.os, "replace", lambda a, b: (order.append(("replace", str(b))), replace(a, b))[1])
    _truncate_metrics(tmp_path, 2)
    assert order == [("fsync", str(tmp_path / ".metrics.jsonl.tmp")), ("replace", str(path)), ("fsync", str(tmp_path))]
    assert path.read_text() == LINES[0] + "\n" + LINES[1] + "\n"
