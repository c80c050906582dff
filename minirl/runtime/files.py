"""Writing a run's files: an OSError that names no file (the OS's own "No space left on device" when a
full disk or a quota fails a write, or the flush at close) is given the file's path, so the run's last
line says which file it could not write.

Invariant: the exception raised is the one the OS raised, with `filename` set where it was None; nothing
is caught that is not re-raised.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path


@contextmanager
def naming(path: str | Path):
    """Around the writes (and the close) of `path`: an OSError inside that names no file names `path`."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            exc.filename = str(path)
        raise
