"""`make gym-check`: train minirl through the real `nemo-gym` package's servers, on 127.0.0.1.

1. minirl's generation side: a Ray cluster owned by this script, one detached generation worker
   and the generation router in front of it (its fixed-range port is what Gym needs up front);
2. Gym's side, in the Gym venv (`minirl.gym.serve`): `vllm_model` (return_token_id_information:
   true) with base_url = the router, `simple_agent`, and the doors resources server;
3. the rows minirl sends, checked against Gym's own `SimpleAgentRunRequest`;
4. a too-long prompt through Gym's `vllm_model`: Gym's lane A (an empty output, incomplete_details);
5. `python -m minirl.train agent.external_url=<simple_agent>` for 2 steps, attached to the worker;
6. checks: rollouts_trained > 0, logprob_abs_error < 1e-3 and the ledger matched every trained
   call to the engine's record by its tokens (calls_unrecorded = 0, calls_matched > 0) at every
   step, and the two steps trained different prompts.

Exits 0 only if every check holds; prints one `gym-check:` line per check and stops everything it
started (the Gym process, the run, the Ray cluster) whatever happens.
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
    from minirl.data import prompt_row, sampling_seed
    from minirl.generation.router import start_router
    from minirl.wire import with_extra_body

    cfg = load_config(None, TRAIN_OVERRIDES)
    gym = None
    work = Path(tempfile.mkdtemp(prefix="gym-check-"))
    failures = []
    try:
        attach = start_shared_generation(cfg, "gym-gen")
        workers = [ray.get(ray.get_actor("gym-gen-0", namespace="minirl").start.remote())]
        _router, router = start_router(cfg, workers, "127.0.0.1", name="gym-gen")
        say(f"generation side up: router {router}, workers {workers}")

        log = open(work / "gym-servers.log", "w")
        gym = subprocess.Popen([args.gym_python, "-m", "minirl.gym.serve", "--router", router, "--model", cfg.policy.model_name,
                                "--max-steps", str(cfg.agent.max_steps)], cwd=work, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        line = gym.stdout.readline()
        if not line.startswith("gym-servers ready "):
            raise RuntimeError(f"Gym servers did not start; see {work / 'gym-servers.log'}:\n{(work / 'gym-servers.log').read_text()[-3000:]}")
        urls = json.loads(line.split(" ", 2)[2])
        say(f"Gym servers up: {urls}")

        rows = work / "rows.jsonl"
        with open(rows, "w") as f:
            for g in range(cfg.grpo.num_prompts_per_step):
                row = prompt_row(cfg, 0, g)
                row["responses_create_params"] = with_extra_body(row["responses_create_params"], seed=sampling_seed(cfg, 0, g, 0, 0))
                f.write(json.dumps({**row, "_rowidx": 0, "_minirl": {"step": 0, "group": g, "rollout": 0, "attempt": 0, "group_attempt": "x"}}) + "\n")
        checked = subprocess.run([args.gym_python, "-m", "minirl.gym.serve", "--check-rows", str(rows)], cwd=work, env=env,
                                 capture_output=True, text=True)
        ok = checked.returncode == 0
        say(("PASS " if ok else "FAIL ") + (checked.stdout.strip() or checked.stderr.strip()[-2000:]))
        ok or failures.append("rows")

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

        run_dir = work / "run"
        t0 = time.time()
        train = subprocess.run([sys.executable, "-m", "minirl.train", f"run_dir={run_dir}", f"agent.external_url={urls['simple_agent']}",
                                *attach, *TRAIN_OVERRIDES], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        say(f"train exit {train.returncode} in {time.time() - t0:.0f}s; stdout tail:\n" + "\n".join(train.stdout.splitlines()[-8:]))
        if train.returncode != 0:
            say("stderr tail:\n" + "\n".join(train.stderr.splitlines()[-15:]))
            failures.append("train")
        else:
            steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
            trained = [s["rollouts_trained"] for s in steps]
            err = [s.get("logprob_abs_error") if s.get("tokens_trained") else None for s in steps]
            ok = len(steps) == STEPS and all(t > 0 for t in trained)
            say(f"{'PASS' if ok else 'FAIL'} rollouts_trained per step {trained} (> 0)")
            ok or failures.append("rollouts_trained")
            ok = all(e is not None and e < 1e-3 for e in err)
            say(f"{'PASS' if ok else 'FAIL'} logprob_abs_error per step {err} (< 1e-3)")
            ok or failures.append("logprob_abs_error")
            matched, unrecorded = [s.get("calls_matched") for s in steps], [s.get("calls_unrecorded") for s in steps]
            ok = all(m and m > 0 for m in matched) and all(u == 0 for u in unrecorded)
            say(f"{'PASS' if ok else 'FAIL'} ledger: calls_matched per step {matched} (> 0), calls_unrecorded {unrecorded} (= 0)")
            ok or failures.append("ledger")
            seeds = [tuple(s["prompt_seeds"]) for s in steps]
            ok = len(set(seeds)) == len(seeds)
            say(f"{'PASS' if ok else 'FAIL'} each step trained its own prompts: {seeds}; reward per step "
                f"{[s['reward_mean'] for s in steps]}, tokens {[s['tokens_trained'] for s in steps]}")
            ok or failures.append("prompts")
            say(f"endpoints.json: {(run_dir / 'endpoints.json').read_text().strip()}")
        if args.gym07_python:  # nemo-gym 0.7.0 on the same generation side (issue 32)
            import gym07_check

            failures += gym07_check.run(post, str(Path(args.gym07_python).absolute()), cfg, router, attach, TRAIN_OVERRIDES,
                                        rows, work, env)
    except Exception as exc:  # report, then stop everything below
        say(f"FAIL {type(exc).__name__}: {exc}")
        failures.append(type(exc).__name__)
    finally:
        if gym is not None:
            gym.terminate()
            try:
                gym.wait(timeout=10)
            except subprocess.TimeoutExpired:
                gym.kill()
        ray.shutdown()
    say(f"{'OK' if not failures else 'FAILED: ' + ', '.join(failures)} (logs in {work})")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
