"""The generation worker as training runs it: a real Ray actor stepping the engine, with its HTTP
front end in a child process (minirl.generation.frontend)."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import aiohttp
import psutil
import pytest
import ray

from minirl.config import load_config
from minirl.wire import ROLLOUT_HEADER

pytestmark = pytest.mark.slow


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(*pids: int, timeout: float = 30.0) -> bool:
    deadline = time.time() + timeout
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)
    return not any(alive(p) for p in pids)


def chat(url: str, key: str | None, timeout: float | None = None, **extra) -> tuple[int, dict | None]:
    async def go():
        headers = {ROLLOUT_HEADER: key} if key else {}
        body = {"messages": [{"role": "user", "content": "open door 3"}], "max_completion_tokens": 8, "seed": 1,
                **extra}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
            async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                return r.status, await r.json()

    try:
        return asyncio.run(go())
    except (asyncio.TimeoutError, aiohttp.ClientError):  # the client gave up, or the server went away
        return 0, None


def restarted_url(worker, timeout: float = 600.0) -> str:
    deadline = time.time() + timeout
    while True:
        try:
            return ray.get(worker.start.remote(), timeout=timeout)
        except ray.exceptions.ActorUnavailableError:  # Ray is restarting it
            if time.time() > deadline:
                raise
            time.sleep(1.0)


def health(url: str) -> tuple[int, dict]:
    async def go():
        async with aiohttp.ClientSession() as http, http.get(url + "/health") as r:
            return r.status, await r.json()

    return asyncio.run(go())


WATCHDOG = ["policy.generation.vllm_cfg.step_timeout_s=12"]


def test_engines_spin_only_while_their_threads_fit_the_cores(monkeypatch):
    from minirl.cluster import THROTTLED_SPIN, engine_env

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    one, two = load_config(), load_config(None, ["cluster.num_generation_workers=2"])
    assert engine_env(one) == {"OMP_NUM_THREADS": "2"}  # 2 threads on 4 cores: libgomp's own rule
    assert engine_env(two) == {"OMP_NUM_THREADS": "2"}  # 4 on 4
    assert engine_env(load_config(None, ["cluster.num_generation_workers=3"]))["GOMP_SPINCOUNT"] == THROTTLED_SPIN
    assert engine_env(load_config(None,
                                  ["policy.generation.vllm_cfg.omp_threads=5"]))["GOMP_SPINCOUNT"] == THROTTLED_SPIN
    # a joined cluster's placement is unknown here: libgomp decides on each node
    remote = load_config(None, ["cluster.num_generation_workers=3", "cluster.ray_address=10.0.0.1:6379"])
    assert "GOMP_SPINCOUNT" not in engine_env(remote)
    monkeypatch.setenv("GOMP_SPINCOUNT", "20k")  # the driver's own setting wins, either way
    assert engine_env(one)["GOMP_SPINCOUNT"] == engine_env(two)["GOMP_SPINCOUNT"] == "20k"


def test_ray_env_sets_the_daemons_defaults_and_a_set_value_wins(monkeypatch):
    from minirl.cluster import ACTOR_ENV, RAY_DAEMON_ENV, ray_env

    monkeypatch.delenv("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert ray_env() == {**ACTOR_ENV, "RAY_AUTH_MODE": "token"}
    assert os.environ["RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"] == RAY_DAEMON_ENV["RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"]
    monkeypatch.setenv("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "1000")
    ray_env()
    assert os.environ["RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"] == "1000"


def test_the_front_end_runs_apart_from_the_engine_and_dies_with_it(base_cfg):
    from minirl.cluster import ray_env, start_generation_workers
    from minirl.trainer.policy_worker import PolicyWorker

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="error", log_to_driver=False,
             runtime_env={"env_vars": ray_env()})
    try:
        # Ray's daemons, started by this process, inherit RAY_DAEMON_ENV: the log monitor lists its folder every
        # 0.5 s (so does the shared cluster's, a grandchild here when the session's shared engine runs)
        monitors = [p for p in psutil.Process().children(recursive=True) if "log_monitor" in " ".join(p.cmdline())]
        assert monitors and all(p.environ()["RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"] == "0" for p in monitors)
        # two restarts allowed: the engine_hang's and the worker_kill's below; the engine_crash's death is its last
        bounded = load_config(None, [*WATCHDOG, "cluster.generation_worker_max_restarts=2"])
        (worker,) = start_generation_workers(bounded, "127.0.0.1")
        url = ray.get(worker.start.remote(), timeout=300)
        engine_pid, front_pid = ray.get(worker.pid.remote()), ray.get(worker.frontend_pid.remote())
        assert engine_pid != front_pid and alive(front_pid)
        assert psutil.Process(front_pid).ppid() == engine_pid
        # set before torch loads
        assert psutil.Process(engine_pid).environ()["GOMP_SPINCOUNT"] == os.environ["GOMP_SPINCOUNT"]

        # a call crosses to the engine and back, and lands in the front end's call log
        t_call, steps_before = time.monotonic(), ray.get(worker.stats.remote())["steps"]
        status, body = chat(url, "s3.g0.r1.a0.c0", return_token_ids=True)
        assert status == 200 and body["choices"][0]["token_ids"]
        (record,) = ray.get(worker.take_calls.remote(3))
        assert record["status"] == 200 and record["generation_token_ids"] == body["choices"][0]["token_ids"]
        assert ray.get(worker.take_calls.remote(3)) == []
        assert ray.get(worker.stats.remote())["tokens"] == len(record["generation_token_ids"])
        steps = ray.get(worker.steps_since.remote(t_call))  # its engine steps, each with the one request in the engine
        assert len(steps) == ray.get(worker.stats.remote())["steps"] - steps_before and {r for _, _, r in steps} == {1}
        assert all(t >= t_call and s > 0 for t, s, _ in steps)

        # required_prefix_token_ids: vLLM's vocabulary check runs in the engine's process
        status, err = chat(url, None, required_prefix_token_ids=[10**9])
        assert (status == 400 and "out of vocabulary" in err["error"]["message"]
                and err["error"]["param"] == "required_prefix_token_ids")

        # a caller that leaves is recorded as 499 and the engine stops stepping its request
        before = ray.get(worker.stats.remote())["steps"]
        status, _ = chat(url, "s4.g0.r0.a0.c0", timeout=1.0, max_completion_tokens=900, ignore_eos=True)
        assert status == 0
        deadline = time.time() + 30
        while not (left := ray.get(worker.take_calls.remote(4))) and time.time() < deadline:
            time.sleep(0.2)
        assert [r["status"] for r in left] == [499]
        readings = [ray.get(worker.stats.remote())["steps"]]
        while time.time() < deadline and (len(readings) < 2 or readings[-1] != readings[-2]):
            time.sleep(0.5)
            readings.append(ray.get(worker.stats.remote())["steps"])
        assert readings[-1] == readings[-2] < before + 900, f"the aborted request is still being stepped: {readings}"

        # a weight update is what /health reports as soon as update_weights returns
        weights = PolicyWorker(base_cfg).get_weights()
        assert ray.get(worker.update_weights.remote(weights, 7), timeout=300)["version"] == 7
        assert health(url) == (200, {"status": "ok", "version": 7})
        status, body = chat(url, "s5.g0.r0.a0.c0")
        (record,) = ray.get(worker.take_calls.remote(5))
        assert status == 200 and (record["version_start"], record["version_end"]) == (7, 7)

        # a new run's reset ends the previous run's engine_hang (sweeps reuse workers): the same engine steps again
        cfg = load_config(None,
                          [*WATCHDOG, "faults.inject=[{kind: engine_hang, step: 9, group: 0, rollout: 0, attempt: 0}]"])
        ray.get(worker.reset.remote(cfg))
        assert chat(url, "s9.g0.r0.a0.c0", timeout=2.0)[0] == 0
        steps = ray.get(worker.stats.remote())["steps"]
        ray.get(worker.reset.remote(load_config(None, WATCHDOG)))
        assert chat(url, "s9.g0.r0.a0.c0", timeout=30)[0] == 200
        assert ray.get(worker.stats.remote())["steps"] > steps and ray.get(worker.pid.remote()) == engine_pid
        # ... and its own gather (vllm_cfg.gather_*): what the engine serves the new run with
        def gather(actor):
            return actor.engine.gather_gap_s, actor.engine.gather_max_s, actor.engine.gather_first_s

        assert ray.get(worker.__ray_call__.remote(gather)) == (0.02, 0.25, 0.01)
        ray.get(worker.reset.remote(load_config(None, [*WATCHDOG, "policy.generation.vllm_cfg.gather_gap_s=0"])))
        assert ray.get(worker.__ray_call__.remote(gather)) == (0.0, 0.25, 0.0)  # the first window is at most the gap
        ray.get(worker.reset.remote(load_config(None, WATCHDOG)))

        # engine_hang: a step that never returns. The front end still answers, but /health turns 503 once the step
        # has run for STUCK_STEP_S; past step_timeout_s the engine is dead and the worker ends itself, so Ray
        # restarts it (vLLM's executor gives up on a step after VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS)
        cfg = load_config(None,
                          [*WATCHDOG, "faults.inject=[{kind: engine_hang, step: 8, group: 0, rollout: 0, attempt: 0}]"])
        ray.get(worker.reset.remote(cfg))
        assert chat(url, "s8.g0.r0.a0.c0", timeout=2.0)[0] == 0
        deadline = time.time() + 10
        while (answer := health(url))[0] == 200 and time.time() < deadline:
            time.sleep(0.5)
        assert answer[0] == 503 and "an engine step has been running for" in answer[1]["error"], answer
        assert wait_gone(engine_pid, front_pid), "the worker outlived an engine step that never returned"
        assert restarted_url(worker) == url
        engine_pid, front_pid = ray.get(worker.pid.remote()), ray.get(worker.frontend_pid.remote())
        assert health(url) == (200, {"status": "ok", "version": 0})  # no weights store here: the model's own weights

        # worker_kill fires in the front end and ends the whole worker; Ray restarts it at the same port
        cfg = load_config(None, ["faults.inject=[{kind: worker_kill, step: 6, group: 0, rollout: 0, attempt: 0}]"])
        assert ray.get(worker.reset.remote(cfg)) == url
        assert ray.get(worker.take_calls.remote(None)) == []
        status, _ = chat(url, "s6.g0.r0.a0.c0", timeout=60)
        assert status == 0
        assert wait_gone(engine_pid, front_pid), "the killed worker left a process behind"
        assert restarted_url(worker) == url
        new_engine, new_front = ray.get(worker.pid.remote()), ray.get(worker.frontend_pid.remote())
        assert new_engine != engine_pid and new_front != front_pid and health(url)[0] == 200

        # engine_crash: a step fails, so the engine is dead; the worker ends itself (as `vllm serve` exits when its
        # engine dies) rather than failing every call, so Ray restarts it as above; its front end goes with it
        cfg = load_config(None, ["faults.inject=[{kind: engine_crash, step: 10, group: 0, rollout: 0, attempt: 0}]"])
        ray.get(worker.reset.remote(cfg))
        assert chat(url, "s10.g0.r0.a0.c0", timeout=60)[0] in (0, 500)
        assert wait_gone(new_engine, new_front), "the worker outlived its dead engine, or the front end its worker"

        # past cluster.generation_worker_max_restarts the worker stays dead: a call on it fails at once with Ray's
        # ActorDiedError naming the worker and why its process died (with -1, as before, a worker that died at
        # every start was restarted for good and every call on it waited)
        t0 = time.monotonic()
        with pytest.raises(ray.exceptions.ActorDiedError) as died:
            ray.get(worker.start.remote(), timeout=120)
        assert time.monotonic() - t0 < 30, "the call waited for a restart past the bound"
        assert f"name: generation-worker-0-job-{ray.get_runtime_context().get_job_id()}" in str(died.value), died.value
        assert "The actor is dead because its worker process has died" in str(died.value), died.value
    finally:
        ray.shutdown()


def test_a_front_end_that_cannot_start_is_a_clear_error(engine, base_cfg):
    from minirl.generation.frontend import FrontEnd

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"generation worker 0's HTTP front end \(pid \d+\) at 127.0.0.1:{port} "
                                               r"failed to start: OSError: .*address already in use"):
            FrontEnd(engine, base_cfg, 0, "127.0.0.1", port)
