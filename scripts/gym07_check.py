"""`make gym-check`'s nemo-gym 0.7.0 half (issue 32), called by scripts/gym_check.py with the
generation side it started (router, attached worker): everything the 0.4.0 half proves, against
0.7.0's servers, plus Gym 0.7's failure facts driving minirl's lanes.

1. rows, and the failure shapes minirl's mapping reads, against Gym 0.7's own models
   (`minirl.gym_servers.serve_v07 --check-shapes`);
2. Gym 0.7's `vllm_model` (0.7's inline token ids: `request_prompt_and_generation_token_ids`),
   `simple_agent` and minirl's doors server on 0.7's classes (minirl/gym_servers/doors_v07.py), with the
   run's fault plan: `session_lost` at step 1, group 0, rollout 0;
3. one `/run` through `simple_agent` returns token ids; a too-long prompt comes back as Gym's lane A;
4. 2 training steps: rollouts trained, logprob_abs_error < 1e-3, every trained call matched in the
   ledger (calls_unrecorded = 0); at step 1 the verifier's mask_sample masks exactly that rollout
   (mask event with reason mask_sample and failure_kind session_lost, masked_by_kind counts it, the
   rest of its group trains);
5. the doors server holds at most `--max-live-episodes` (MAX_LIVE): a session that never verifies (its
   `/run`'s model call failed) is dropped as the oldest, and verifies as Gym's `session_expired` (masked);
   a misspelt `--faults` key is refused (exit 2) before any server starts;
6. Gym 0.7's own Environment Server failures (`BaseEnvironmentServer.run_request` answering an
   `EpisodeFailure`, minirl/gym_servers/episodes_v07.py) through minirl's rollout manager: terminal ones
   are never retried, non-terminal ones are, within the INFRA budget.

Returns the names of the checks that failed; prints one `gym-check 0.7.0:` line per check.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

VERSION = "0.7.0"
LOST = {"kind": "session_lost", "step": 1, "group": 0, "rollout": 0}
"""The session the seeded fault plan loses: its verifier answers mask_sample (Gym's session_lost)."""
MAX_LIVE = 64
"""The doors server's `--max-live-episodes` here: above the training check's rollouts in flight (8 x 4)."""


def say(msg: str) -> None:
    print(f"gym-check {VERSION}: {msg}", flush=True)


CHECKED: list[tuple[str, bool]] = []
"""Each check this half ran, and whether it held (gym_check's closing summary)."""


def _check(ok: bool, what: str, failures: list, name: str) -> None:
    say(("PASS " if ok else "FAIL ") + what)
    CHECKED.append((name, ok))
    ok or failures.append(f"{VERSION} {name}")


def check_serving(post, python: str, urls: dict, rows: Path, cfg, work: Path, env: dict, failures: list) -> None:
    shapes = subprocess.run([python, "-m", "minirl.gym_servers.serve_v07", "--check-shapes", str(rows)], cwd=work,
                            env=env,
                            capture_output=True, text=True)
    _check(shapes.returncode == 0, shapes.stdout.strip() or shapes.stderr.strip()[-2000:], failures, "shapes")
    status, result = post(urls["simple_agent"] + "/run", json.loads(rows.read_text().splitlines()[0]))
    (work / "run_result_07.json").write_text(json.dumps(result, indent=1))
    calls = [it for it in (result.get("response") or {}).get("output", []) if it.get("generation_token_ids")]
    _check(status == 200 and bool(calls),
           f"one /run through simple_agent -> HTTP {status}, reward {result.get('reward')}, "
           f"mask_sample {result.get('mask_sample')}, {len(calls)} model call(s) with token ids (inline)", failures,
           "/run")
    long_input = [{"role": "user", "content": "door " * (cfg.policy.generation.vllm_cfg.max_model_len * 2)}]
    status, reply = post(urls["policy_model"] + "/v1/responses", {"input": long_input})
    out = reply.get("output") or []
    lane_a = (status == 200 and reply.get("incomplete_details") == {"reason": "max_output_tokens"} and len(out) == 1
              and not any(p.get("text") for p in out[0].get("content", [])) and "generation_token_ids" not in out[0])
    _check(lane_a, f"too-long prompt through vllm_model -> HTTP {status}, "
                   f"incomplete_details={reply.get('incomplete_details')}, "
           f"output={json.dumps(out)[:160]}", failures, "lane A")


def check_sessions(python: str, doors: str, rows: Path, work: Path, env: dict, failures: list) -> None:
    """MAX_LIVE + 1 sessions seeded, none verified (as `/run`s whose model call failed leave them): the
    first verifies as `session_expired` with mask_sample, the last as a live one; then a bad `--faults`."""
    from http.cookiejar import CookieJar
    from urllib.error import HTTPError
    from urllib.request import Request, build_opener, HTTPCookieProcessor

    def call(opener, path: str, body: dict) -> tuple[int, dict]:
        req = Request(doors + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            with opener.open(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except HTTPError as exc:
            return exc.code, {"raw": exc.read().decode(errors="replace")}

    row = json.loads(rows.read_text().splitlines()[0])
    openers = [build_opener(HTTPCookieProcessor(CookieJar())) for _ in range(MAX_LIVE + 1)]
    seeded = {call(o, "/seed_session", {"task": row["task"]})[0] for o in openers}
    response = {"id": "r", "created_at": 0, "model": "m", "object": "response", "output": [],
                "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}
    body = {"responses_create_params": row["responses_create_params"], "task": row["task"], "response": response}
    (s_old, oldest), (s_new, newest) = (call(o, "/verify", body) for o in (openers[0], openers[-1]))
    got = [(s, v.get("mask_sample"), v.get("failure_kind")) for s, v in ((s_old, oldest), (s_new, newest))]
    _check(seeded == {200} and got == [(200, True, "session_expired"), (200, False, None)],
           f"{MAX_LIVE + 1} sessions seeded on a server holding {MAX_LIVE}, none verified: (status, mask_sample, "
           f"failure_kind) of the oldest and the newest {got}", failures, "sessions")
    bad = subprocess.run([python, "-m", "minirl.gym_servers.serve_v07", "--router", "http://127.0.0.1:9",
                          "--model", "m", "--faults", json.dumps({"inject": [{"kind": "session_lost", "grup": 0}]})],
                         cwd=work, env=env, capture_output=True, text=True, timeout=120)
    _check(bad.returncode == 2 and "faults.inject[0].grup: unknown config key" in bad.stderr,
           f"--faults with a misspelt key -> exit {bad.returncode}: "
           f"{next((ln for ln in bad.stderr.splitlines() if ln.startswith('minirl:')), bad.stderr.strip()[-200:])}",
           failures, "faults")


def check_training(urls: dict, attach: list, overrides: list, work: Path, env: dict, failures: list) -> None:
    run_dir = work / "run07"
    # the manager logs the planned fault
    lost = "faults.inject=[{" + ", ".join(f"{k}: {v}" for k, v in LOST.items()) + "}]"
    t0 = time.time()
    train = subprocess.run([sys.executable, "-m", "minirl.train", f"run_dir={run_dir}",
                            f"agent.external_url={urls['simple_agent']}",
                            *attach, *overrides, lost], cwd=Path(__file__).resolve().parent.parent, env=env,
                           capture_output=True, text=True, timeout=900)
    say(f"train exit {train.returncode} in {time.time() - t0:.0f}s; stdout tail:\n"
        + "\n".join(train.stdout.splitlines()[-6:]))
    if train.returncode != 0:
        say("stderr tail:\n" + "\n".join(train.stderr.splitlines()[-15:]))
        _check(False, "training run", failures, "train")
        return
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    err = [s.get("logprob_abs_error") for s in steps]
    _check(len(steps) == 2 and all(s["rollouts_trained"] > 0 for s in steps),
           f"rollouts_trained per step {[s['rollouts_trained'] for s in steps]} (> 0)", failures, "rollouts_trained")
    _check(all(e is not None and e < 1e-3
               for e in err), f"logprob_abs_error per step {err} (< 1e-3)", failures, "logprob")
    matched, unrecorded = [s.get("calls_matched") for s in steps], [s.get("calls_unrecorded") for s in steps]
    _check(all(m and m > 0 for m in matched) and all(u == 0 for u in unrecorded),
           f"ledger: calls_matched per step {matched} (> 0), calls_unrecorded {unrecorded} (= 0)", failures, "ledger")
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    masks = [e for e in events if e["type"] == "mask"]
    want = {k: LOST[k] for k in ("step", "group", "rollout")}
    ok = (len(masks) == 1 and {k: masks[0].get(k) for k in want} == want and masks[0]["reason"] == "mask_sample"
          and masks[0].get("failure_kind") == "session_lost" and steps[1].get("masked_by_kind") == {"session_lost": 1}
          and steps[1]["rollouts_masked"] == 1 and steps[1]["rollouts_trained"] == steps[0]["rollouts_trained"] - 1)
    _check(ok, f"the verifier's mask_sample masked {want} only: mask events {masks}; step 1 masked_by_kind "
           f"{steps[1].get('masked_by_kind')}, rollouts_masked {steps[1]['rollouts_masked']}, rollouts_trained per "
           "step "
           f"{[s['rollouts_trained'] for s in steps]} (its group's other rollout trains; it is out of the baseline: "
           "grpo.baseline_excludes_masked)", failures, "mask_sample")


def check_episode_failures(url: str, cfg, failures: list) -> None:
    """minirl's rollout manager against Gym 0.7's Environment Server (minirl/gym_servers/episodes_v07.py):
    group 0's terminal EpisodeFailure is sent once per row and skipped; group 1's non-terminal one is
    retried within the INFRA budget (row re-sends x group attempts), then dropped."""
    import asyncio

    from minirl.data import prompt_row
    from minirl.rollout.manager import RolloutManager

    events: list[dict] = []

    async def go():
        m = RolloutManager(cfg, [url], events.append, vocab_size=10**6)  # the real backoff between group attempts
        try:
            return await m.run_step(0, [prompt_row(cfg, 0, g) for g in range(2)])
        finally:
            await m.session.close()

    outcomes = asyncio.run(go())
    rf, G = cfg.async_rl.rollout_failure, cfg.grpo.num_generations_per_prompt
    budget = rf.max_infra_attempts_per_prompt * rf.nemo_gym.max_row_attempts * G
    kinds = sorted({(e["group"], e["class"], e["failure_kind"], e["terminal"])
                    for e in events if e["type"] == "failure"})
    ok = ([(o.status, o.row_sends) for o in outcomes] == [("skipped", G), ("dropped", budget)]
          and kinds == [(0, "data", "provider_quota_exhausted", True), (1, "infra", "provider_unavailable", False)])
    _check(ok, f"Gym's EpisodeFailure through the rollout manager: (status, /run sends) per group "
           f"{[(o.status, o.row_sends) for o in outcomes]} (terminal: skipped after {G}, one per row, never retried; "
           f"non-terminal: dropped after {budget} = max_infra_attempts_per_prompt x max_row_attempts x G); "
           f"failure events (group, class, kind, terminal) {kinds}", failures, "EpisodeFailure")


def run(post, start_gym, stop_gym, python: str, cfg, router: str, attach: list, overrides: list, rows: Path, work: Path,
        env: dict) -> list[str]:
    """The 0.7.0 half (`post`, `start_gym`, `stop_gym`: gym_check's); returns the failed checks' names. Stops its Gym
    process whatever happens."""
    failures: list[str] = []
    gym = None
    try:
        faults = {"seed": cfg.faults.seed, "inject": [LOST]}  # the Gym 0.7 doors server's fault plan
        gym, urls = start_gym(python, cfg, router, work, env, "minirl.gym_servers.serve_v07",
                              ("--faults", json.dumps(faults), "--max-live-episodes", str(MAX_LIVE)),
                              "gym07-servers.log")
        say(f"Gym servers up: {urls}")
        check_serving(post, python, urls, rows, cfg, work, env, failures)
        check_sessions(python, urls["doors"], rows, work, env, failures)
        check_episode_failures(urls["failing_episodes"], cfg, failures)
        check_training(urls, attach, overrides, work, env, failures)
    except Exception as exc:  # report, then stop the Gym process
        _check(False, f"{type(exc).__name__}: {exc}", failures, type(exc).__name__)
    finally:
        stop_gym(gym)
    return failures
