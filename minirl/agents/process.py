"""The agent pool's server in a process of its own: `AgentProcess` is the Ray actor, and the
`AgentServer` (minirl.agents.server) runs in its child (minirl.runtime.child), as the generation worker's
front end does.

Invariant: `start` answers the URL only once the child serves it; the child lives exactly as long as
the actor (minirl.runtime.child), so `agent_kill`, which kills the child's process at its site, ends the
actor too and Ray restarts both at the same port; `stop` ends the child without ending the actor.
"""

from __future__ import annotations

import threading

from minirl.runtime import child
from minirl.config import MinirlConfig

START_TIMEOUT_S = 120.0


class AgentProcess:
    """Ray actor: starts the agent server's process in its constructor, so a restarted actor serves
    again at the same address without anyone asking.

    The child carries no Ray core worker, so the CPU it spends is the `/run` path's alone
    (bench/engine_overhead.py: the agent hop's CPU a request, 0.94 ms in the actor's process against
    0.70 ms in a plain one, measured in the same hour)."""

    def __init__(self, cfg: MinirlConfig, model_urls: list[str], host: str, port: int):
        from minirl.runtime.http_thread import resolve_host

        host = resolve_host(host)  # here, in the actor's process: the child is no Ray worker
        spec = {"cfg": cfg, "model_urls": model_urls, "host": host, "port": port}
        self.proc, self.url = child.spawn_server("minirl.agents.process", spec, f"the agent server at {host}:{port}",
                                                 START_TIMEOUT_S)
        self._stopping = threading.Event()
        child.die_with(self.proc, "the agent server", "its actor", self._stopping)

    def start(self) -> str:
        """The base URL (the server is already up: it starts in the constructor)."""
        return self.url

    def pid(self) -> int:
        """The process that serves `/run` (the child)."""
        return self.proc.pid

    def stop(self) -> None:
        self._stopping.set()
        self.proc.terminate()
        self.proc.wait()


def main() -> None:
    spec = child.child_spec()
    try:
        from minirl.agents.server import AgentServer

        server = AgentServer(spec["cfg"], spec["model_urls"], spec["host"], spec["port"])
    except BaseException as exc:
        child.tell_ready(spec, error=exc)
        raise SystemExit(1)
    child.tell_ready(spec, server.url)
    threading.Event().wait()  # the server runs on its own thread until the actor's process is gone


if __name__ == "__main__":
    main()
