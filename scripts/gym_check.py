"""`make gym-check`: train minirl through the real `nemo-gym` package's servers, on 127.0.0.1.

1. minirl's generation side, started as docs/gym.md's walkthrough starts it (`python -m
   minirl.gym_servers.generation`, its output to a file): one detached generation worker and the generation
   router in front of it; the printed base URL and model name are what Gym gets;
2. Gym's side, in the Gym venv (`minirl.gym_servers.serve`), its output to a file (a pipe nobody reads
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
   the example (its reward need not rise);
8. docs/gym.md's walkthrough on nemo-gym 0.4.0 (scripts/gym_walk.py): Gym's own `ng_run` starts
   `example_single_tool_call` behind `simple_agent` and `vllm_model_for_training.yaml`; 2 steps on its
   own example rows;
9. the nemo-gym 0.7.0 half (scripts/gym07_check.py), then the walkthrough on 0.7.0: `ng_run` starts
   `example_single_tool_call` behind Gym 0.7's Environment Server `single_agent_turn_legacy`; one row
   through it, 2 steps through it, one Gym episode per rollout.

Exits 0 only if every check holds; prints one `gym-check:` line per check, then for each Gym version
the list of what it checked, and stops everything it started (the Gym processes, the runs, the
generation side) whatever happens.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
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


CHECKED: dict[str, list[tuple[str, bool]]] = {"0.4.0": [], "0.7.0": []}
"""What was checked for each Gym version, and whether it held (the closing summary)."""


def check(ok: bool, what: str, failures: list, name: str, version: str = "0.4.0") -> None:
    say(("PASS " if ok else "FAIL ") + (f"[{version}] " if version != "0.4.0" else "") + what)
    CHECKED[version].append((name, ok))
    ok or failures.append(name if version == "0.4.0" else f"{version} {name}")


def summary() -> None:
    """One line per Gym version: each check it ran, and whether it held."""
    import gym07_check

    CHECKED["0.7.0"][:0] = gym07_check.CHECKED
    for version, venv in (("0.4.0", ".venv-gym, Python 3.12"), ("0.7.0", ".venv-gym07, Python 3.13.0")):
        done = CHECKED[version]
        verdict = "not run" if not done else "all held" if all(ok for _, ok in done) else "FAILED"
        say(f"checked for nemo-gym {version} ({venv}): {verdict}: "
            + "; ".join(f"{n} {'ok' if ok else 'FAIL'}" for n, ok in done))


def start_generation(work: Path, env: dict) -> tuple[subprocess.Popen, dict]:
    """Step 1 of docs/gym.md: `python -m minirl.gym_servers.generation` with the check's overrides; returns the
    process and what it printed (policy_base_url, policy_model_name, router, attach)."""
    path = work / "generation.log"
    gen = subprocess.Popen([sys.executable, "-m", "minirl.gym_servers.generation", "--name", "gym-gen",
                            *TRAIN_OVERRIDES], cwd=REPO,
                           env=env, stdout=open(path, "w"), stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 600
    while time.time() < deadline and gen.poll() is None:
        ready = [x for x in path.read_text().splitlines() if x.startswith("generation-ready ")]
        if ready:
            return gen, json.loads(ready[0].split(" ", 1)[1])
        time.sleep(0.5)
    stop_generation(gen)
    raise RuntimeError(f"the generation side did not start; see {path}:\n{path.read_text()[-3000:]}")


def stop_generation(gen: subprocess.Popen | None) -> None:
    """Ctrl-C, as a user stops it (it stops its Ray cluster); SIGKILL to its group after 60 s."""
    if gen is None or gen.poll() is not None:
        return
    gen.send_signal(signal.SIGINT)
    try:
        gen.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(gen.pid, signal.SIGKILL)


def stop_gym(gym: subprocess.Popen | None) -> None:
    """Stop a Gym process `start_gym` began (None: it never started)."""
    if gym is None:
        return
    gym.terminate()
    try:
        gym.wait(timeout=10)
    except subprocess.TimeoutExpired:
        gym.kill()


def start_gym(python: str, cfg, router: str, work: Path, env: dict, module: str = "minirl.gym_servers.serve",
              extra: tuple = (), log: str = "gym-servers.log") -> tuple[subprocess.Popen, dict]:
    """Gym's servers (`module`: 0.4's `minirl.gym_servers.serve`, 0.7's `minirl.gym_servers.serve_v07`) in one process
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
        req = urllib.request.Request(doors + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
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


def check_training(label: str, agent_url: str, extra: list, attach: list, work: Path, env: dict, failures: list,
                   version: str = "0.4.0") -> None:
    """2 training steps through `agent_url`; the run's metrics checked per step."""
    run_dir = work / f"run-{label}"
    t0 = time.time()
    train = subprocess.run([sys.executable, "-m", "minirl.train", f"run_dir={run_dir}",
                            f"agent.external_url={agent_url}",
                            *attach, *TRAIN_OVERRIDES, *extra], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=900)
    say(f"[{label}] train exit {train.returncode} in {time.time() - t0:.0f}s; stdout tail:\n"
        + "\n".join(train.stdout.splitlines()[-8:]))
    if train.returncode != 0:
        say("stderr tail:\n" + "\n".join(train.stderr.splitlines()[-15:]))
        check(False, f"[{label}] training run", failures, f"{label} train", version)
        return
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [s["rollouts_trained"] for s in steps]
    err = [s.get("logprob_abs_error") if s.get("tokens_trained") else None for s in steps]
    check(len(steps) == STEPS and all(t > 0 for t in trained), f"[{label}] rollouts_trained per step {trained} (> 0)",
          failures, f"{label} rollouts_trained", version)
    check(all(e is not None and e < 1e-3 for e in err), f"[{label}] logprob_abs_error per step {err} (< 1e-3)",
          failures, f"{label} logprob_abs_error", version)
    matched, unrecorded = [s.get("calls_matched") for s in steps], [s.get("calls_unrecorded") for s in steps]
    check(all(m and m > 0 for m in matched) and all(u == 0 for u in unrecorded),
          f"[{label}] ledger: calls_matched per step {matched} (> 0), calls_unrecorded {unrecorded} (= 0)", failures,
          f"{label} ledger", version)
    seeds = [tuple(s["prompt_seeds"]) for s in steps]
    check(len(set(seeds)) == len(seeds), f"[{label}] each step trained its own prompts: {seeds}; reward per step "
          f"{[s['reward_mean'] for s in steps]}, tokens {[s['tokens_trained'] for s in steps]}", failures,
          f"{label} prompts", version)
    say(f"[{label}] endpoints.json: {(run_dir / 'endpoints.json').read_text().strip()}")


def sent_rows(cfg, example: str) -> tuple[list[dict], list[dict]]:
    """The rows minirl sends at step 0 for each environment (`minirl.data.run_body`, as the rollout manager sends
    them): doors, and the example's own rows."""
    import copy

    from minirl.data import prompt_row, run_body
    from minirl.wire import Coords

    ex = copy.deepcopy(cfg)
    ex.data.train_jsonl = example
    return tuple([run_body(c, prompt_row(c, 0, g), Coords(0, g, 0, 0), "x") for g in range(c.grpo.num_prompts_per_step)]
                 for c in (cfg, ex))


def check_gym04(args, cfg, gen: dict, work: Path, env: dict, failures: list) -> Path:
    """Steps 2-7 of the module docstring (nemo-gym 0.4.0, Gym's servers in one process); returns the doors
    rows' file (the 0.7.0 half sends them too). The Gym process is stopped before this returns."""
    attach, gym = gen["attach"], None
    try:
        gym, urls = start_gym(args.gym_python, cfg, gen["router"], work, env)
        say(f"Gym servers up: {urls}")
        example = subprocess.run([args.gym_python, "-m", "minirl.gym_servers.serve", "--example-jsonl"], cwd=work,
                                 env=env,
                                 capture_output=True, text=True, check=True).stdout.strip()
        # doors rows; the example's, as minirl sends them
        rows, example_rows = work / "rows.jsonl", work / "example-rows.jsonl"
        doors_sent, example_sent = sent_rows(cfg, example)
        rows.write_text("".join(json.dumps(row) + "\n" for row in doors_sent))
        example_rows.write_text("".join(json.dumps(row) + "\n" for row in example_sent))
        for label, path in (("doors", rows), ("example_tool_call_multireward", example_rows)):
            checked = subprocess.run([args.gym_python, "-m", "minirl.gym_servers.serve", "--check-rows", str(path)],
                                     cwd=work, env=env,
                                     capture_output=True, text=True)
            check(checked.returncode == 0, f"[{label}] " + (checked.stdout.strip() or checked.stderr.strip()[-2000:]),
                  failures, f"{label} rows")
        status, result = post(urls["simple_agent"] + "/run", json.loads(rows.read_text().splitlines()[0]))
        (work / "run_result.json").write_text(json.dumps(result, indent=1))
        calls = [it for it in (result.get("response") or {}).get("output", []) if it.get("generation_token_ids")]
        check(status == 200 and bool(calls),
              f"one /run through simple_agent -> HTTP {status}, reward {result.get('reward')}, "
              f"{len(calls)} model call(s) with token ids", failures, "/run")
        long_input = [{"role": "user", "content": "door " * (cfg.policy.generation.vllm_cfg.max_model_len * 2)}]
        status, reply = post(urls["policy_model"] + "/v1/responses", {"input": long_input})
        out = reply.get("output") or []
        lane_a = (status == 200 and reply.get("incomplete_details") == {"reason": "max_output_tokens"} and len(out) == 1
                  and out[0].get("type") == "message" and not any(p.get("text") for p in out[0].get("content", []))
                  and "generation_token_ids" not in out[0])
        check(lane_a, f"too-long prompt through Gym's vllm_model -> HTTP {status}, incomplete_details="
              f"{reply.get('incomplete_details')}, output={json.dumps(out)[:200]}", failures, "lane A")
        check_after_last_door(urls["doors"], failures)
        check_training("doors", urls["simple_agent"], [], attach, work, env, failures)
        check_training("example_tool_call_multireward", urls["example_simple_agent"], [f"data.train_jsonl={example}"],
                       attach, work, env, failures)
        tracebacks = (work / "gym-servers.log").read_text().count("Traceback (most recent call last)")
        say(f"Gym servers' log: {tracebacks} traceback(s), {(work / 'gym-servers.log').stat().st_size} bytes (drained "
            "to a file)")
        return rows
    finally:
        stop_gym(gym)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gym-python", required=True)
    ap.add_argument("--gym07-python", help="the nemo-gym 0.7.0 venv's python: also run scripts/gym07_check.py's half")
    args = ap.parse_args()
    args.gym_python = str(Path(args.gym_python).absolute())  # the Gym servers run from a scratch directory
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "RAY_AUTH_MODE": "disabled"}
    os.environ.update(RAY_AUTH_MODE="disabled")
    import gym07_check
    import gym_walk

    from minirl.config import load_config

    cfg = load_config(None, TRAIN_OVERRIDES)
    gen = None
    work = Path(tempfile.mkdtemp(prefix="gym-check-"))
    failures = []
    try:
        gen, ready = start_generation(work, env)
        say("generation side up (python -m minirl.gym_servers.generation): policy_base_url "
            f"{ready['policy_base_url']}, "
            f"policy_model_name {ready['policy_model_name']}, workers {ready['workers']}, attach {ready['attach']}")
        rows = check_gym04(args, cfg, ready, work, env, failures)
        gym_walk.walk("0.4.0", args.gym_python, ready, work, check, check_training, ready["attach"], env,
                      TRAIN_OVERRIDES, failures)
        if args.gym07_python:  # nemo-gym 0.7.0 on the same generation side (issue 32)
            gym07 = str(Path(args.gym07_python).absolute())
            failures += gym07_check.run(post, start_gym, stop_gym, gym07, cfg, ready["router"], ready["attach"],
                                        TRAIN_OVERRIDES, rows, work, env)
            check07 = functools.partial(check, version="0.7.0")
            gym_walk.walk("0.7.0", gym07, ready, work, check07, check_training, ready["attach"], env, TRAIN_OVERRIDES,
                          failures)
    except Exception as exc:  # report, then stop everything below
        check(False, f"{type(exc).__name__}: {exc}", failures, type(exc).__name__)
    finally:
        stop_generation(gen)
    summary()
    say(f"{'OK' if not failures else 'FAILED: ' + ', '.join(failures)} (logs in {work})")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
