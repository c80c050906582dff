"""`make slurm-check`: slurm/minirl.sbatch under real Slurm daemons, on two nodes of one cluster.

The cluster (Debian's slurm-wlm 22.05 and munge, installed with apt-get when missing):
- two nodes, mrl-n1 (10.77.0.1) and mrl-n2 (10.77.0.2), each a network, UTS, PID and mount
  namespace made here: a veth pair to a bridge (10.77.0.254, this host's end, machine-internal),
  the node's own hostname, its own /etc/hosts (bind-mounted) and /tmp, and a PID namespace whose
  init is a shell running that node's `slurmd`. A node's `ray stop` therefore sees that node's
  processes only, as on a real machine, and cannot touch any other Ray on this host;
- on this host (the "login node"): munged, MariaDB and slurmdbd (so `sacct` works), slurmctld.
Every file lives under one state directory (default /var/tmp/minirl-slurm-check, wiped first);
nothing under /etc is written beyond what the packages install.

The checks, each printed with its time:
  1. the packages; the cluster up (sinfo: 2 nodes idle);
  2. the real job: `sbatch --nodes=2 slurm/minirl.sbatch grpo.max_num_steps=3 ...` from the repo,
     as a user submits it: the job's output shows 2 Ray nodes and the trained steps, metrics and
     a checkpoint land in the run dir, no Ray process is left on either node, sacct: COMPLETED 0:0;
  3. the worker node's raylet killed mid-run: the job fails within a bound, its output's last
     `error:` line names the node, nothing is left running, sacct: FAILED;
  4. `scancel` mid-run: the driver states what it lost and closes the run's books (events.jsonl's
     `run_failed` then `run_end`, ledger/run_end.jsonl: the sidecars keep Ray up until the driver is
     done), Ray stops on every node, sacct: CANCELLED;
  5. a cluster that never becomes ready (the worker's Ray cannot start): the job fails at
     MINIRL_READY_TIMEOUT_S with its one `error:` line.

Invariant: whatever happens (a failed check, an exception, SIGINT/SIGTERM), every daemon and node
it started is killed and the namespaces and bridge removed before it exits; a run begins by
clearing what an interrupted earlier run may have left (idempotent). Exit 0 only if all checks pass.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "slurm" / "minirl.sbatch"
NODES = {"mrl-n1": "10.77.0.1", "mrl-n2": "10.77.0.2"}
CTL, CTL_IP = "mrl-ctl", "10.77.0.253"
BRIDGE, BRIDGE_IP = "mrl-br0", "10.77.0.254"
PACKAGES = ["slurm-wlm", "munge", "slurmdbd", "mariadb-server"]
BINARIES = ["slurmctld", "slurmd", "slurmdbd", "munged", "mungekey", "mariadbd", "mariadb-install-db", "sacct"]
DB_PORT = 33069
# Small, CPU: one Ray CPU per node, so the generation worker and the policy worker land on
# different nodes (PACK cannot put both bundles on one) and the run really spans the two.
TRAIN = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "env.num_rooms=1",
         "logger.tensorboard=false"]
RAY_START_ARGS = "--num-cpus=1 --object-store-memory=200000000"

T0 = time.monotonic()
FAILED: list[str] = []


def say(msg: str) -> None:
    print(f"slurm-check [{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def check(name: str, ok: bool, detail: str = "", started: float | None = None) -> bool:
    took = f" ({time.monotonic() - started:.1f}s)" if started is not None else ""
    say(f"{'PASS' if ok else 'FAIL'} {name}{took}{': ' + detail if detail else ''}")
    if not ok:
        FAILED.append(name)
    return ok


def sh(cmd: str | list[str], check_rc: bool = True, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    args = cmd if isinstance(cmd, list) else ["bash", "-c", cmd]
    res = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kw)
    if check_rc and res.returncode != 0:
        raise RuntimeError(f"{cmd if isinstance(cmd, str) else shlex.join(cmd)} exited {res.returncode}: "
                           f"{(res.stderr or res.stdout).strip()[-800:]}")
    return res


class Cluster:
    """The state directory, the daemons (Popen handles) and the nodes' init shells."""

    def __init__(self, state: Path):
        self.state = state
        self.procs: dict[str, subprocess.Popen] = {}
        self.conf = state / "slurm.conf"
        self.host = socket.gethostname().split(".")[0]
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for k in [k for k in self.env if k.startswith(("SLURM_", "MINIRL_")) and k != "SLURM_CONF"]:
            del self.env[k]

    # ------------------------------------------------------------------------------ teardown
    def teardown(self) -> None:
        """Kill what this run started (and what an earlier run left), remove the namespaces."""
        for name, proc in reversed(list(self.procs.items())):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # each daemon is a session leader: its group is ours
                except ProcessLookupError:
                    pass
                proc.wait(timeout=30)
        self.procs.clear()
        self.kill_leftovers()
        for i, node in enumerate([*NODES, CTL], 1):
            sh(f"ip netns del {node}; ip link del mrl-h{i}", check_rc=False)
        sh(f"ip link del {BRIDGE}", check_rc=False)

    def kill_leftovers(self) -> None:
        """Daemons of an interrupted earlier run, found by the pid files and the node-init marker
        of this state directory (never by a broad name)."""
        marker = f"MRL_NODE_INIT={self.state}"
        for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit()):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(e.decode(errors="replace").startswith(marker) for e in env):
                try:
                    os.kill(pid, signal.SIGKILL)  # a node's init: its PID namespace dies with it
                except ProcessLookupError:
                    pass
        for pidfile in self.state.glob("run/*.pid") if self.state.exists() else []:
            try:
                pid = int(pidfile.read_text().split()[0])
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except (OSError, ValueError, IndexError):
                continue
            if str(self.state).encode() in cmd:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    # ------------------------------------------------------------------------------ bring-up
    def start(self, name: str, cmd: list[str], ready: str, timeout: float = 60) -> None:
        """Start a daemon in the foreground (its own session), then wait for `ready` to succeed."""
        log = open(self.state / "log" / f"{name}.out", "w")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True, cwd=self.state)
        deadline = time.monotonic() + timeout
        while True:
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited {self.procs[name].returncode}: "
                                   f"{(self.state / 'log' / f'{name}.out').read_text()[-1500:]}")
            if sh(ready, check_rc=False, env=self.env, timeout=30).returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not ready after {timeout}s (`{ready}`); see {self.state}/log")
            time.sleep(0.5)

    def network(self) -> None:
        sh(f"ip link add {BRIDGE} type bridge && ip addr add {BRIDGE_IP}/24 dev {BRIDGE} && ip link set {BRIDGE} up")
        for i, (node, ip) in enumerate({**NODES, CTL: CTL_IP}.items(), 1):
            sh(f"""set -e
                ip netns add {node}
                ip link add mrl-h{i} type veth peer name mrl-v{i}
                ip link set mrl-v{i} netns {node}
                ip link set mrl-h{i} master {BRIDGE} && ip link set mrl-h{i} up
                ip -n {node} addr add {ip}/24 dev mrl-v{i}
                ip -n {node} link set mrl-v{i} up && ip -n {node} link set lo up""")

    def write_files(self) -> None:
        s = self.state
        for sub in ["log", "run", "ctld", "munge", "jobs"]:
            (s / sub).mkdir(parents=True, exist_ok=True)
        (s / "munge").chmod(0o700)
        hosts = "127.0.0.1 localhost\n" + "".join(f"{ip} {n}\n" for n, ip in NODES.items()) + f"{CTL_IP} {CTL}\n"
        for node in NODES:
            (s / "nodes" / node / "tmp").mkdir(parents=True, exist_ok=True)
            (s / "nodes" / node / "tmp").chmod(0o1777)
            (s / "nodes" / node / "spool").mkdir(parents=True, exist_ok=True)
            (s / "nodes" / node / "hosts").write_text(hosts)
        auth = f"AuthType=auth/munge\nAuthInfo=socket={s}/munge/munge.socket\n"
        node_lines = "".join(f"NodeName={n} NodeAddr={ip} CPUs=2 State=UNKNOWN\n" for n, ip in NODES.items())
        self.conf.write_text(f"""ClusterName=minirl
SlurmctldHost={CTL}({CTL_IP})
SlurmUser=root
{auth}CredType=cred/munge
StateSaveLocation={s}/ctld
SlurmdSpoolDir={s}/nodes/%n/spool
SlurmctldPidFile={s}/run/slurmctld.pid
SlurmdPidFile={s}/run/slurmd-%n.pid
SlurmctldLogFile={s}/log/slurmctld.log
SlurmdLogFile={s}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost={CTL_IP}
AccountingStoragePass={s}/munge/munge.socket
JobCompType=jobcomp/filetxt
JobCompLoc={s}/log/jobcomp.txt
{node_lines}PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
""")
        dbd = s / "slurmdbd.conf"
        dbd.write_text(f"""{auth}DbdHost={CTL}
DbdAddr={CTL_IP}
SlurmUser=root
PidFile={s}/run/slurmdbd.pid
LogFile={s}/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={DB_PORT}
StorageUser=slurm
StoragePass=minirl
StorageLoc=slurm_acct_db
""")
        dbd.chmod(0o600)

    def up(self) -> None:
        s = self.state
        self.network()
        self.write_files()
        # The controller's daemons share the mrl-ctl namespace (hostname mrl-ctl): this host reaches
        # the namespaces on the bridge, but a namespace cannot open a connection to the bridge's
        # own address under gVisor (measured), so slurmctld and slurmdbd cannot live out here.
        in_ctl = ["ip", "netns", "exec", CTL, "unshare", "--uts", "bash", "-c", f'hostname {CTL} && exec "$@"', CTL]
        sh(["mungekey", "--create", f"--keyfile={s}/munge/munge.key"])
        self.start("munged", ["munged", "--foreground", "--force", f"--socket={s}/munge/munge.socket",
                              f"--key-file={s}/munge/munge.key", f"--pid-file={s}/run/munged.pid",
                              f"--log-file={s}/log/munged.log", f"--seed-file={s}/munge/seed"],
                   f"munge -S {s}/munge/munge.socket -n | unmunge -S {s}/munge/munge.socket")
        sh(["mariadb-install-db", "--no-defaults", f"--datadir={s}/mysql", "--user=root",
            "--auth-root-authentication-method=normal", "--skip-test-db"], timeout=300)
        sock = f"{s}/run/mysql.sock"
        self.start("mariadb", [*in_ctl, "mariadbd", "--no-defaults", f"--datadir={s}/mysql", f"--socket={sock}",
                               f"--port={DB_PORT}", "--bind-address=127.0.0.1", "--user=root",
                               f"--pid-file={s}/run/mariadb.pid", f"--log-error={s}/log/mariadb.log"],
                   f"mariadb --no-defaults -S {sock} -u root -e 'select 1'", timeout=120)
        sh(["mariadb", "--no-defaults", "-S", sock, "-u", "root", "-e",
            "CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'minirl'; "
            "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"])
        self.start("slurmdbd", [*in_ctl, "slurmdbd", "-D"], "sacctmgr -n list cluster", timeout=120)
        sh("sacctmgr -i add cluster minirl", env=self.env)
        self.start("slurmctld", [*in_ctl, "slurmctld", "-D", "-i", "-f", str(self.conf)], "scontrol ping | grep -q UP")
        for node in NODES:
            self.start_node(node)
        deadline = time.monotonic() + 120
        while sh("sinfo -h -N -o '%N %t'", env=self.env).stdout.split().count("idle") < len(NODES):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    "the nodes did not become idle within 120 s:\n" + sh("sinfo -N", env=self.env).stdout)
            time.sleep(1)

    def start_node(self, node: str) -> None:
        """`slurmd` as the node: its netns, then a new UTS, PID and mount namespace whose init shell
        sets the hostname, mounts the node's /etc/hosts and /tmp, and runs slurmd in the foreground."""
        d = self.state / "nodes" / node
        # a checkout under /tmp (a fresh clone there) must stay visible under the node's own /tmp
        under_tmp = REPO.is_relative_to("/tmp")
        keep_repo = (f"mkdir -p {d}/tmp/{REPO.relative_to('/tmp')} && "
                     f"mount --bind {REPO} {d}/tmp/{REPO.relative_to('/tmp')}") if under_tmp else ":"
        init = f"""set -e
            hostname {node}
            mount --bind {d}/hosts /etc/hosts
            {keep_repo}
            mount --rbind {d}/tmp /tmp
            slurmd -D -f {self.conf} &
            trap 'kill -TERM $! 2>/dev/null' TERM
            wait $!"""
        # nsenter, not `ip netns exec`: that one remounts /sys, hiding the cgroup mounts slurmd's
        # cgroup plugin insists on finding even with proctrack/linuxproc.
        cmd = ["nsenter", f"--net=/run/netns/{node}", "unshare", "--uts", "--pid", "--fork", "--kill-child",
               "--mount-proc", "--propagation", "private", "env", f"MRL_NODE_INIT={self.state}", "bash", "-c", init]
        self.start(f"node-{node}", cmd, f"scontrol show node {node} | grep -q 'State=IDLE'", timeout=90)

    # ------------------------------------------------------------------------------ inside nodes
    def node_pid(self, node: str) -> int:
        """The root-namespace pid of the node's init shell (the child of `unshare`)."""
        unshare = self.procs[f"node-{node}"].pid  # nsenter execs unshare: same pid
        for pid in (p for p in os.listdir("/proc") if p.isdigit()):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            if f"\nPPid:\t{unshare}\n" in status:
                return int(pid)
        raise RuntimeError(f"node {node}: no init process under unshare (pid {unshare})")

    def in_node(self, node: str, cmd: str, **kw) -> subprocess.CompletedProcess:
        return sh(["nsenter", "-t", str(self.node_pid(node)), "-p", "-m", "-u", "-n", "bash", "-c", cmd], **kw)

    def node_procs(self, node: str) -> list[str]:
        """The node's processes (`pid comm args`) other than its init shell, its slurmd and this look."""
        look = "ps -eo pid=,comm=,args="
        out = self.in_node(node, look, check_rc=False).stdout.splitlines()
        rows = [line.split(None, 2) for line in out if line.strip()]
        return [" ".join(r)[:160] for r in rows
                if r[0] != "1" and r[1] not in ("slurmd", "ps", "nsenter") and look not in (r[2] if len(r) > 2 else "")]

    def procs_left(self) -> dict[str, list[str]]:
        """Per node, every process a job left (Ray's, Python's, a step's)."""
        return {node: procs for node in NODES if (procs := self.node_procs(node))}


# ---------------------------------------------------------------------------------- the checks
def submit(cl: Cluster, name: str, overrides: list[str], **env: str) -> tuple[str, Path, Path]:
    """`sbatch` from the repo, as a user would; the job's output, Ray logs and run dir under the state dir."""
    jobs = cl.state / "jobs"
    run_dir = jobs / f"run-{name}"
    job_env = {**cl.env, "MINIRL_GPUS_PER_NODE": "0", "MINIRL_RAY_START_ARGS": RAY_START_ARGS,
               "MINIRL_LOG_DIR": str(jobs / f"logs-{name}"), **env}
    res = sh(["sbatch", "--parsable", "--nodes=2", f"--job-name=minirl-{name}", f"--output={jobs}/{name}-%j.out",
              str(SCRIPT), *TRAIN, *overrides, f"run_dir={run_dir}"], cwd=REPO, env=job_env)
    job = res.stdout.strip().split(";")[0]
    return job, jobs / f"{name}-{job}.out", run_dir


def job_state(cl: Cluster, job: str) -> str:
    out = sh(f"scontrol show job {job}", check_rc=False, env=cl.env).stdout
    for word in out.split():
        if word.startswith("JobState="):
            return word.split("=", 1)[1]
    return "UNKNOWN"


def wait_job(cl: Cluster, job: str, timeout: float) -> tuple[str, float]:
    t = time.monotonic()
    while (state := job_state(cl, job)) in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
        if time.monotonic() - t > timeout:
            sh(f"scancel {job}", check_rc=False, env=cl.env)
            return f"TIMEOUT(>{timeout:.0f}s, was {state})", time.monotonic() - t
        time.sleep(1)
    return state, time.monotonic() - t


def wait_for_text(path: Path, text: str, timeout: float) -> bool:
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        if path.exists() and text in path.read_text(errors="replace"):
            return True
        time.sleep(1)
    return False


def sacct(cl: Cluster, job: str, timeout: float = 60) -> str:
    """`JobID|State|ExitCode` of the job's allocation, once slurmdbd has its end."""
    t = time.monotonic()
    while True:
        out = sh(f"sacct -X -n -P -j {job} -o JobID,State,ExitCode", check_rc=False, env=cl.env).stdout.strip()
        if out and not any(s in out for s in ("RUNNING", "PENDING", "COMPLETING")) or time.monotonic() - t > timeout:
            return out
        time.sleep(1)


def tail(path: Path, n: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else f"(no {path})"


def last_error(path: Path) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    lines = [line for line in text.splitlines() if "error:" in line]
    return lines[-1] if lines else ""


def nothing_left(cl: Cluster, what: str) -> None:
    t = time.monotonic()
    left = cl.procs_left()
    while left and time.monotonic() - t < 30:  # `ray stop` or a step may still be finishing on a node
        time.sleep(2)
        left = cl.procs_left()
    check(f"{what}: nothing left running on either node (no Ray, no Python, no step)", not left,
          str(left) if left else f"{time.monotonic() - t:.0f}s after the job ended")


def check_job(cl: Cluster) -> None:
    t = time.monotonic()
    job, out, run_dir = submit(cl, "job", ["grpo.max_num_steps=3"])
    state, took = wait_job(cl, job, timeout=900)
    text = out.read_text(errors="replace") if out.exists() else ""
    check("job: sbatch --nodes=2 slurm/minirl.sbatch grpo.max_num_steps=3 ends COMPLETED", state == "COMPLETED",
          f"job {job} {state} after {took:.0f}s" + ("" if state == "COMPLETED" else "\n" + tail(out)), t)
    check("job: the output shows 2 Ray nodes", "Ray cluster ready: 2 nodes" in text,
          tail(out, 5) if "2 nodes" not in text else "")
    steps = [line for line in text.splitlines() if line.lstrip().startswith("step ")]
    check("job: the output shows the 3 trained steps", len(steps) >= 3, f"{len(steps)} step lines")
    metrics = run_dir / "metrics.jsonl"
    n = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    ckpts = sorted(p.name for p in run_dir.glob("checkpoints/*")) if run_dir.exists() else []
    check("job: metrics.jsonl has 3 steps and a checkpoint was written", n == 3 and bool(ckpts), f"{n} lines, {ckpts}")
    nothing_left(cl, "job")
    acct = sacct(cl, job)
    check("job: sacct shows COMPLETED 0:0", acct == f"{job}|COMPLETED|0:0", acct)
    say(f"job output ({out}):\n" + tail(out, 40))


def submit_long(cl: Cluster, name: str) -> tuple[str, Path, Path] | None:
    """A long run (a checkpoint every step), once it has logged its first step: (job, its output, its run
    dir); None if it did not."""
    t = time.monotonic()
    job, out, run_dir = submit(cl, name, ["grpo.max_num_steps=200", "checkpoint.save_period=1"])
    if not check(f"{name}: the run trains its first step", wait_for_text(run_dir / "metrics.jsonl", '"step"', 900),
                 "" if (run_dir / "metrics.jsonl").exists() else tail(out), t):
        sh(f"scancel {job}", check_rc=False, env=cl.env)
        return None
    return job, out, run_dir


def check_worker_dies(cl: Cluster) -> None:
    if (started := submit_long(cl, "kill")) is None:
        return
    job, out, _ = started
    raylet = [p.split()[0] for p in cl.node_procs("mrl-n2") if p.split()[1] == "raylet"]
    check("kill: mrl-n2 runs a raylet", len(raylet) == 1, str(cl.node_procs("mrl-n2")))
    killed = time.monotonic()
    cl.in_node("mrl-n2", f"kill -9 {raylet[0]}" if raylet else "true", check_rc=False)
    state, took = wait_job(cl, job, timeout=300)
    bound = 180
    check(f"kill: the job ends FAILED within {bound}s of the raylet's death", state == "FAILED" and took < bound,
          f"{state} after {took:.0f}s", killed)
    err = last_error(out)
    check("kill: the output's last error line names the dead node", "mrl-n2" in err, err or tail(out))
    nothing_left(cl, "kill")
    acct = sacct(cl, job)
    check("kill: sacct shows FAILED, non-zero", "|FAILED|" in acct and not acct.endswith("|0:0"), acct)
    say("kill output:\n" + tail(out, 15))


def check_scancel(cl: Cluster) -> None:
    if (started := submit_long(cl, "cancel")) is None:
        return
    job, out, run_dir = started
    t = time.monotonic()
    sh(f"scancel {job}", env=cl.env)
    state, took = wait_job(cl, job, timeout=300)
    check("scancel: the job ends CANCELLED", state == "CANCELLED", f"{state} after {took:.0f}s", t)
    text = out.read_text(errors="replace") if out.exists() else ""
    lost = [line for line in text.splitlines() if "minirl: stopped" in line]
    check("scancel: the driver states its last checkpoint and what it lost", bool(lost), lost[0] if lost else tail(out))
    events, ledger = run_dir / "events.jsonl", run_dir / "ledger" / "run_end.jsonl"
    kinds = [json.loads(x).get("type") for x in events.read_text().splitlines() if x.strip()] if events.exists() else []
    closed = "run_failed" in kinds and "run_end" in kinds[kinds.index("run_failed"):] and ledger.exists()
    check("scancel: the run closed its books (events.jsonl: run_failed, then run_end; ledger/run_end.jsonl)", closed,
          "" if closed else f"last events {kinds[-4:]}, {ledger.name} {'present' if ledger.exists() else 'missing'}")
    nothing_left(cl, "scancel")
    acct = sacct(cl, job)
    check("scancel: sacct shows CANCELLED", "|CANCELLED" in acct, acct)
    say("scancel output:\n" + tail(out, 15))


def check_never_ready(cl: Cluster) -> None:
    t = time.monotonic()
    timeout_s = 45
    # The worker node's setup hangs (a stuck shared filesystem, say): its Ray never joins, and
    # nothing dies that the job could notice; only the deadline ends it.
    job, out, _ = submit(cl, "ready", ["grpo.max_num_steps=1"], MINIRL_READY_TIMEOUT_S=str(timeout_s),
                         MINIRL_STOP_TIMEOUT_S="15",
                         MINIRL_SETUP=f"source {REPO}/.venv/bin/activate; if [[ $(hostname) == mrl-n2 ]]; then sleep "
                                      "100000; fi")
    state, took = wait_job(cl, job, timeout=300)
    err = last_error(out)
    check(f"never ready: the job fails at MINIRL_READY_TIMEOUT_S={timeout_s} with one error line",
          state == "FAILED" and f"after {timeout_s}s" in err, f"{state} after {took:.0f}s: {err or tail(out)}", t)
    nothing_left(cl, "never ready")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state", default=os.environ.get("MINIRL_SLURM_STATE", "/var/tmp/minirl-slurm-check"))
    parser.add_argument("--checks", default="job,kill,cancel,ready", help="comma-separated subset")
    parser.add_argument("--hold", type=float, default=0, help="seconds to keep the cluster up after the checks")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("slurm-check: error: needs root (apt-get, network namespaces, the daemons)", file=sys.stderr)
        return 2
    cl = Cluster(Path(args.state))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        t = time.monotonic()
        missing = [b for b in BINARIES if shutil.which(b) is None]
        if missing:
            sh("apt-get update -qq", timeout=600)
            sh(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES], timeout=1200,
               env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        check("packages: " + " ".join(PACKAGES), all(shutil.which(b) for b in BINARIES),
              ("installed " if missing else "present; ") + sh("slurmd -V").stdout.strip(), t)
        t = time.monotonic()
        cl.teardown()  # what an interrupted earlier run left
        shutil.rmtree(cl.state, ignore_errors=True)
        cl.state.mkdir(parents=True)
        cl.up()
        check("cluster up: munged, mariadb, slurmdbd, slurmctld, slurmd on mrl-n1 and mrl-n2 (sinfo: 2 idle)", True,
              " ".join(sh("sinfo -h -N -o '%N:%t'", env=cl.env).stdout.split()), t)
        hosts = {n: cl.in_node(n, "hostname; hostname --ip-address").stdout.split() for n in NODES}
        check("nodes: own hostname and address, nothing running but slurmd",
              all(hosts[n] == [n, ip] for n, ip in NODES.items()) and not cl.procs_left(), f"{hosts} {cl.procs_left()}")
        steps = {"job": check_job, "kill": check_worker_dies, "cancel": check_scancel, "ready": check_never_ready}
        for name in filter(None, args.checks.split(",")):
            steps[name](cl)
        if args.hold:
            say(f"holding the cluster for {args.hold:.0f}s: SLURM_CONF={cl.conf}")
            time.sleep(args.hold)
    except Exception as exc:  # the check fails; the teardown still runs
        check("slurm-check ran to the end", False, f"{type(exc).__name__}: {exc}")
    finally:
        t = time.monotonic()
        cl.teardown()
        left = [n for n in NODES if sh(f"ip netns list | grep -qw {n}", check_rc=False).returncode == 0]
        check("teardown: daemons killed, namespaces and bridge removed", not left, str(left), t)
    say(f"{'FAILED: ' + ', '.join(FAILED) if FAILED else 'all checks passed'} (total {time.monotonic() - T0:.0f}s)")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
