"""`make gym-check`: train minirl through the real `nemo-gym` package's servers, on 127.0.0.1.

1. minirl's generation side: a Ray cluster owned by this script, one detached generation worker
   and the generation router in front of it (its fixed-range port is what Gym needs up front);
2. Gym's side, in the Gym venv (`minirl.gym.serve`), its output to a file (a pipe nobody reads
   would block Gym at 64 KiB of tracebacks): `vllm_model` (return_token_id_information: true) with
   base_url = the router, and two environments: minirl's doors resources server behind Gym's
   `simple_agent`, and Gym's own example `example_tool_call_multireward` behind a second
   `simple_agent` (`example_simple_agent`);
3. the rows minirl sends for both (doors rows, and the example's own `data/example.jsonl` read as
   `data.train_jsonl`), checked against Gym's own `SimpleAgentRunRequest`;
4. a too-long prompt through Gym's `vllm_model`: Gym's lane A (an empty output, incomplete_details);
5. the doors server answers a call after the last door with the environment's reply;
6. per environment, `python -m minirl.train agent.external_url=<its agent>` for 2 steps, attached
   to the worker (the example with `data.train_jsonl=<its example.jsonl>`, no proxy);
7. checks, per environment: rollouts_trained > 0, logprob_abs_error < 1e-3 and the ledger matched
   every trained call to the engine's record by its tokens (calls_unrecorded = 0, calls_matched >
   0) at every step, and the two steps trained different prompts. The tiny model does not solve
   the example (its reward need not rise).

Exits 0 only if every check holds; prints one `gym-check:` line per check and stops everything it
started (the Gym process, the runs, the Ray cluster) whatever happens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from http.cookiejar import CookieJar
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

STEPS = 2
TRAIN_OVERRIDES = [
    f"grpo.max_num_steps={STEPS}", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
    "env.num_rooms=1", "checkpoint.enabled=false", "logger.tensorboard=false",
]


def say(msg: str) -> None:
    print(f"gym-check: {msg}", flush=True)


def post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {"raw": exc.read().decode(errors="replace")}


def check(ok: bool, what: str, failures: list, name: str) -> None:
    say(("PASS " if ok else "FAIL ") + what)
    ok or failures.append(name)


def stop_gym(gym: subprocess.Popen | None) -> None:
    """Stop a Gym process `start_gym` began (None: it never started)."""
    if gym is None:
        return
    gym.terminate()
    try:
        gym.wait(timeout=10)
    except subprocess.TimeoutExpired:
        gym.kill()


def start_gym(python: str, cfg, router: str, work: Path, env: dict, module: str = "minirl.gym.serve",
              extra: tuple = (), log: str = "gym-servers.log") -> tuple[subprocess.Popen, dict]:
    """Gym's servers (`module`: 0.4's `minirl.gym.serve`, 0.7's `minirl.gym.serve_v07`) in one process
    of a Gym venv's `python`; stdout and stderr go to a file, never to a pipe that would fill (at 64 KiB
    Gym would block on its write and the check time out)."""
    path = work / log
    gym = subprocess.Popen([python, "-m", module, "--router", router, "--model", cfg.policy.model_name,
                            "--max-steps", str(cfg.agent.max_steps), *extra], cwd=work, env=env, stdout=open(path, "w"),
                           stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and gym.poll() is None:
        ready = [x for x in path.read_text().splitlines() if x.startswith("gym-servers ready ")]
        if ready:
            return gym, json.loads(ready[0].split(" ", 2)[2])
        time.sleep(0.5)
    gym.kill()
    raise RuntimeError(f"Gym servers did not start; see {path}:\n{path.read_text()[-3000:]}")


def check_after_last_door(doors: str, failures: list) -> None:
    """A one-room episode on the doors server (Gym's session cookie): the right code, then two more
    calls; each after the last door is answered as the environment answers it."""
    from minirl.agents.env import ALL_OPEN, DoorsEnv

    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(CookieJar()))

    def call(path: str, body: dict) -> tuple[int, str]:
        req = urllib.request.Request(doors + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            with opener.open(req, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")

    code = DoorsEnv(seed=5, num_rooms=1).rooms[0].code
    seeded = call("/seed_session", {"task": {"env": "doors", "seed": 5, "num_rooms": 1}})
    replies = [call("/open_door", {"code": c}) for c in (code, code, code + 1)]
    ok = seeded[0] == 200 and replies == [(200, ALL_OPEN)] * 3
    check(ok, f"doors server after the last door: {replies}", failures, "after last door")


def check_training(label: str, agent_url: str, extra: list, attach: list, work: Path, env: dict, failures: list) -> None:
    """2 training steps through `agent_url`; the run's metrics checked per step."""
    run_dir = work / f"run-{label}"
    t0 = time.time()
    train = subprocess.run([sys.executable, "-m", "minirl.train", f"run_dir={run_dir}", f"agent.external_url={agent_url}",
                            *attach, *TRAIN_OVERRIDES, *extra], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    say(f"[{label}] train exit {train.returncode} in {time.time() - t0:.0f}s; stdout tail:\n" + "\n".join(train.stdout.splitlines()[-8:]))
    if train.returncode != 0:
        say("stderr tail:\n" + "\n".join(train.stderr.splitlines()[-15:]))
        failures.append(f"{label} train")
        return
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [s["rollouts_trained"] for s in steps]
    err = [s.get("logprob_abs_error") if s.get("tokens_trained") else None for s in steps]
    check(len(steps) == STEPS and all(t > 0 for t in trained), f"[{label}] rollouts_trained per step {trained} (> 0)",
          failures, f"{label} rollouts_trained")
    check(all(e is not None and e < 1e-3 for e in err), f"[{label}] logprob_abs_error per step {err} (< 1e-3)",
          failures, f"{label} logprob_abs_error")
    matched, unrecorded = [s.get("calls_matched") for s in steps], [s.get("calls_unrecorded") for s in steps]
    check(all(m and m > 0 for m in matched) and all(u == 0 for u in unrecorded),
          f"[{label}] ledger: calls_matched per step {matched} (> 0), calls_unrecorded {unrecorded} (= 0)", failures, f"{label} ledger")
    seeds = [tuple(s["prompt_seeds"]) for s in steps]
    check(len(set(seeds)) == len(seeds), f"[{label}] each step trained its own prompts: {seeds}; reward per step "
          f"{[s['reward_mean'] for s in steps]}, tokens {[s['tokens_trained'] for s in steps]}", failures, f"{label} prompts")
    say(f"[{label}] endpoints.json: {(run_dir / 'endpoints.json').read_text().strip()}")


def sent_rows(cfg, example: str) -> tuple[list[dict], list[dict]]:
    """The rows minirl sends at step 0 for each environment: doors, and the example's own rows."""
    import copy

    from minirl.data import prompt_row, sampling_seed
    from minirl.wire import with_extra_body

    ex = copy.deepcopy(cfg)
    ex.data.train_jsonl = example
    out = ([], [])
    for c, sent in zip((cfg, ex), out):
        for g in range(c.grpo.num_prompts_per_step):
            row = prompt_row(c, 0, g)
            row["responses_create_params"] = with_extra_body(row["responses_create_params"], seed=sampling_seed(c, 0, g, 0, 0))
            sent.append({**row, "_rowidx": 0, "_minirl": {"step": 0, "group": g, "rollout": 0, "attempt": 0, "group_attempt": "x"}})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gym-python", required=True)
    ap.add_argument("--gym07-python", help="the nemo-gym 0.7.0 venv's python: also run scripts/gym07_check.py's half")
    args = ap.parse_args()
    args.gym_python = str(Path(args.gym_python).absolute())  # the Gym servers run from a scratch directory
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "RAY_AUTH_MODE": "disabled"}
    os.environ.update(RAY_AUTH_MODE="disabled")

    import ray

    from minirl.cluster import start_shared_generation
    from minirl.config import load_config
    from minirl.generation.router import start_router

    cfg = load_config(None, TRAIN_OVERRIDES)
    gym = None
    work = Path(tempfile.mkdtemp(prefix="gym-check-"))
    failures = []
    try:
        attach = start_shared_generation(cfg, "gym-gen")
        workers = [ray.get(ray.get_actor("gym-gen-0", namespace="minirl").start.remote())]
        _router, router = start_router(cfg, workers, "127.0.0.1", name="gym-gen")
        say(f"generation side up: router {router}, workers {workers}")

        gym, urls = start_gym(args.gym_python, cfg, router, work, env)
        say(f"Gym servers up: {urls}")
        example = subprocess.run([args.gym_python, "-m", "minirl.gym.serve", "--example-jsonl"], cwd=work, env=env,
                                 capture_output=True, text=True, check=True).stdout.strip()

        rows, example_rows = work / "rows.jsonl", work / "example-rows.jsonl"  # doors rows; the example's, as minirl sends them
        doors_sent, example_sent = sent_rows(cfg, example)
        rows.write_text("".join(json.dumps(row) + "\n" for row in doors_sent))
        example_rows.write_text("".join(json.dumps(row) + "\n" for row in example_sent))
        for label, path in (("doors", rows), ("example_tool_call_multireward", example_rows)):
            checked = subprocess.run([args.gym_python, "-m", "minirl.gym.serve", "--check-rows", str(path)], cwd=work, env=env,
                                     capture_output=True, text=True)
            check(checked.returncode == 0, f"[{label}] " + (checked.stdout.strip() or checked.stderr.strip()[-2000:]),
                  failures, f"{label} rows")

        status, result = post(urls["simple_agent"] + "/run", json.loads(rows.read_text().splitlines()[0]))
        (work / "run_result.json").write_text(json.dumps(result, indent=1))
        calls = [it for it in (result.get("response") or {}).get("output", []) if it.get("generation_token_ids")]
        ok = status == 200 and bool(calls)
        say(f"{'PASS' if ok else 'FAIL'} one /run through simple_agent -> HTTP {status}, reward {result.get('reward')}, "
            f"{len(calls)} model call(s) with token ids")
        ok or failures.append("/run")

        long_input = [{"role": "user", "content": "door " * (cfg.policy.generation.vllm_cfg.max_model_len * 2)}]
        status, reply = post(urls["policy_model"] + "/v1/responses", {"input": long_input})
        out = reply.get("output") or []
        lane_a = (status == 200 and reply.get("incomplete_details") == {"reason": "max_output_tokens"} and len(out) == 1
                  and out[0].get("type") == "message" and not any(p.get("text") for p in out[0].get("content", []))
                  and "generation_token_ids" not in out[0])
        say(f"{'PASS' if lane_a else 'FAIL'} too-long prompt through Gym's vllm_model -> HTTP {status}, "
            f"incomplete_details={reply.get('incomplete_details')}, output={json.dumps(out)[:200]}")
        lane_a or failures.append("lane A")

        check_after_last_door(urls["doors"], failures)
        check_training("doors", urls["simple_agent"], [], attach, work, env, failures)
        check_training("example_tool_call_multireward", urls["example_simple_agent"], [f"data.train_jsonl={example}"],
                       attach, work, env, failures)
        tracebacks = (work / "gym-servers.log").read_text().count("Traceback (most recent call last)")
        say(f"Gym servers' log: {tracebacks} traceback(s), {(work / 'gym-servers.log').stat().st_size} bytes (drained to a file)")
        if args.gym07_python:  # nemo-gym 0.7.0 on the same generation side (issue 32)
            import gym07_check

            failures += gym07_check.run(post, start_gym, stop_gym, str(Path(args.gym07_python).absolute()), cfg, router, attach,
                                        TRAIN_OVERRIDES, rows, work, env)
    except Exception as exc:  # report, then stop everything below
        say(f"FAIL {type(exc).__name__}: {exc}")
        failures.append(type(exc).__name__)
    finally:
        stop_gym(gym)
        ray.shutdown()
    say(f"{'OK' if not failures else 'FAILED: ' + ', '.join(failures)} (logs in {work})")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
