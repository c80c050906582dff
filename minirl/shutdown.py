"""How a run that is stopped says what it keeps: the SIGTERM handler of `python -m minirl.train`
(`scancel`, a batch system's time limit or preemption) and the `minirl: stopped:` line.

Invariant: the first SIGTERM prints what the run keeps at once (a batch system sends SIGKILL soon
after: Slurm's KillWait, 30 s by default) and ends the run as Ctrl-C does; later SIGTERMs are
ignored so that the shutdown finishes; the `minirl: stopped:` line is printed at most once per run.
A run a SIGTERM ended is reported as `Terminated: SIGTERM: ...` (its last stderr line, its
`run_failed` event), even where the exception that reached the driver is the bare KeyboardInterrupt
that `ray.get` makes of it (`cluster.describe`, from `cluster.INTERRUPTED_BY`).
"""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

from minirl.trainer import checkpoint


class Terminated(KeyboardInterrupt):
    """SIGTERM (`scancel`, a batch system's time limit or preemption): ends the run as Ctrl-C does."""


_RUN_DIR: list[Path] = []  # the armed run's directory, until its report is printed


def arm(run_dir: Path) -> None:
    """Report on `run_dir` when the run stops; install the SIGTERM handler (main thread only)."""
    from minirl.cluster import INTERRUPTED_BY  # the entry point has loaded it: no Ray start-up here

    _RUN_DIR[:] = [run_dir]
    INTERRUPTED_BY.clear()  # an earlier run's SIGTERM (in this process) is not this one's
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum, frame) -> None:
    from minirl.cluster import INTERRUPTED_BY

    signal.signal(signal.SIGTERM, lambda *_: None)
    # recorded: raised inside ray.get, it reaches the driver as a bare KeyboardInterrupt
    INTERRUPTED_BY[:] = [Terminated("SIGTERM: the job was cancelled, hit its time limit or was stopped by its "
                                    "launcher")]
    report_kept()
    raise INTERRUPTED_BY[0]


def report_kept() -> None:
    """`minirl: stopped: <what the run keeps>` on stdout, once."""
    if not _RUN_DIR:
        return
    run_dir = _RUN_DIR.pop()
    try:
        print(f"minirl: stopped: {kept(run_dir)}", flush=True)
    except Exception as exc:  # the failure's own line matters more
        print(f"minirl: stopped; could not read what the run kept: {exc}", flush=True)


def kept(run_dir: Path) -> str:
    """What a run that ended early leaves: its last logged step (a last line cut mid-write, which a resume
    drops, is passed over), its newest complete checkpoint and the steps a resume from that checkpoint runs
    again. Complete: every file of the manifest there at its size. The sha256s are left to the resume:
    hashing a large model's weights and optimizer state could outlast the launcher's grace before SIGKILL."""
    path = run_dir / "metrics.jsonl"
    last = None
    for line in reversed(path.read_text().splitlines() if path.exists() else []):
        try:
            last = json.loads(line)["step"]
            break
        except (ValueError, KeyError, TypeError):
            continue
    ckpt, _ = checkpoint.latest_verified(run_dir, hashes=False)
    done = "no step logged" if last is None else f"last logged step {last}"
    if ckpt is None:
        return f"{done}; no complete checkpoint: every step is lost"
    saved = checkpoint.read_state(ckpt)["next_step"] - 1
    lost = "nothing after it is lost" if last is None or last <= saved else f"steps {saved + 1}-{last} are lost"
    return f"{done}; newest complete checkpoint {ckpt} (step {saved}): {lost}; resume with checkpoint.resume=auto"
