"""A helper process that lives exactly as long as the Ray actor that starts it: the generation
worker's HTTP front end (minirl.generation.frontend) and the agent server (minirl.agents.process).
An HTTP server that answers every request of a step runs in a plain child process, away from the
actor's Ray core worker and its GIL; the actor stays as its handle (restarts, placement, methods).

Invariants: the child exits once the actor's process is gone, however it died (`child_spec`); the
actor SIGKILLs its own process once the child exits unless it stopped the child itself (`die_with`),
so Ray restarts the whole actor, at the same port. A child started by `spawn_server` reports its
start exactly once: its URL, or why it failed to start.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PARENT_POLL_S = 0.2


def spawn(module: str, spec: dict, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    """`python -m module` with `spec` on its stdin (and the repo on its PYTHONPATH, as a Ray worker
    has it); its stdout and stderr stay the actor's.

    Why a process of its own: a Ray actor's process carries Ray's core worker, whose main thread
    checks for signals every 10 ms under the GIL, besides its other threads: ~10 ms of CPU a second
    in an idle actor here (minirl's agent server idled at the same rate as an empty actor), and a GIL
    taken away from whatever else the process serves."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE, env=env, pass_fds=pass_fds)
    proc.stdin.write(pickle.dumps({**spec, "parent": os.getpid()}))
    proc.stdin.close()
    return proc


def spawn_server(module: str, spec: dict, what: str, timeout_s: float) -> tuple[subprocess.Popen, str]:
    """`spawn` a child that serves HTTP, and its URL once it serves: the child reports its start on
    a pipe of its own (`tell_ready`). RuntimeError naming `what` and the cause if it failed, exited
    or stayed silent for `timeout_s` (the child is killed then)."""
    read_fd, write_fd = os.pipe()
    try:
        proc = spawn(module, {**spec, "ready_fd": write_fd}, pass_fds=(write_fd,))
    finally:
        os.close(write_fd)
    deadline, data = time.monotonic() + timeout_s, b""
    try:
        while time.monotonic() < deadline:
            if not select.select([read_fd], [], [], 0.5)[0]:
                continue
            chunk = os.read(read_fd, 65536)
            data += chunk
            if chunk and not data.endswith(b"\n"):
                continue
            status, _, text = data.decode(errors="replace").strip().partition(" ")
            if status == "ready":
                return proc, text
            proc.kill()
            code = proc.wait()  # reaped: no child left behind
            if status == "failed":
                raise RuntimeError(f"{what} (pid {proc.pid}) failed to start: {text}")
            raise RuntimeError(f"{what} (pid {proc.pid}) exited with code {code} before serving "
                               "(its stderr is in this actor's log)")
        proc.kill()
        proc.wait()
        raise RuntimeError(f"{what} (pid {proc.pid}) did not serve within {timeout_s:.0f} s")
    finally:
        os.close(read_fd)


def die_with(proc: subprocess.Popen, what: str, owner: str, stopping: threading.Event | None = None) -> None:
    """A thread that SIGKILLs this process once `proc` exits, so that Ray restarts `owner` whole;
    not when `stopping` was set first (the actor stopped its child itself)."""

    def watch() -> None:
        code = proc.wait()
        if stopping is not None and stopping.is_set():
            return
        print(f"minirl: {what} (pid {proc.pid}) exited with code {code}; ending {owner} so that Ray restarts it whole",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name=f"watch-{proc.pid}", daemon=True).start()


# -- the child's side ---------------------------------------------------------------------------------
def child_spec() -> dict:
    """The spec `spawn` sent (a pickled dict, with the actor's pid as `parent`), read from stdin; from
    here on the process exits with its parent (polled every PARENT_POLL_S)."""
    spec = pickle.load(sys.stdin.buffer)
    threading.Thread(target=_exit_with_parent, args=(spec["parent"],), name="parent-watch", daemon=True).start()
    return spec


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(0)  # the actor's process is gone: so is its child


def tell_ready(spec: dict, url: str | None = None, error: BaseException | None = None) -> None:
    """Report the start on the ready pipe, once: the URL served, or the error that stopped it."""
    line = f"ready {url}\n" if error is None else f"failed {type(error).__name__}: {error}".replace("\n", " ") + "\n"
    os.write(spec["ready_fd"], line.encode())
    os.close(spec["ready_fd"])
