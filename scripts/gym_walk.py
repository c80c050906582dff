"""`make gym-check`'s walkthrough half: docs/gym.md's "From a fresh clone to a trained step" as a new
user follows it, for one environment that is not doors (Gym's own `example_single_tool_call`,
whose example rows ship in the wheel) on each Gym version. Called by scripts/gym_check.py, which has
done step 1 already (`python -m minirl.gym_servers.generation`, its printed `gen` passed in here).

Per version, in a scratch directory:
2. Gym's servers started by Gym's own `ng_run`: `vllm_model_for_training.yaml` with
   `+policy_base_url` / `+policy_model_name` from step 1, and the environment's config, each server's
   `.venv` linked to the side venv (`+skip_venv_if_present=true`), `RAY_ADDRESS=local`,
   `RAY_AUTH_MODE=disabled`, `++head_server.host` / `++head_server.port`; the URLs read from the head
   server's `/server_instances`;
   - 0.4.0: `example_single_tool_call.yaml` (the environment behind Gym's `simple_agent`);
   - 0.7.0: `example_single_tool_call_single_agent_turn.yaml` (the environment and a session agent
     behind Gym 0.7's flat-row Environment Server `single_agent_turn_legacy`), with Gym's model-call
     capture on (`+observability_enabled=true`): one file per episode, named by its capture key;
3. the dataset: the environment's own `data/example.jsonl`, from the installed package;
4. `python -m minirl.train` for 2 steps through it (0.7.0: `agent.external_url` = the Environment
   Server, `agent.name` = its session agent), checked as gym_check's other runs are, and, from the
   run's ledger, that no two calls of one rollout sampled with the same seed (the tiny model calls
   the tool, then answers: several calls per rollout).
0.7.0 also sends one row through the Environment Server with minirl's rollout manager first, and
checks Gym's capture: each rollout of the run is its own episode (a capture file of its own).

Invariant: every Gym process this starts is stopped (its whole process group, Ray included) whatever
happens; each check is reported through `check` with its version.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

ENV = "example_single_tool_call"
MODEL_CONFIG = "responses_api_models/vllm_model/configs/vllm_model_for_training.yaml"
SERVER_DIRS = ("responses_api_models/vllm_model", f"resources_servers/{ENV}", "responses_api_agents/simple_agent",
               "environment_servers/single_agent_turn_legacy")
"""Every server directory the two configs start; ng_run looks for `<cwd>/<dir>/.venv`."""
WALKS = {
    "0.4.0": {"config": f"resources_servers/{ENV}/configs/{ENV}.yaml", "target": f"{ENV}_simple_agent",
              "agent_name": None},
    "0.7.0": {"config": f"resources_servers/{ENV}/configs/{ENV}_single_agent_turn.yaml",
              "target": f"{ENV}_single_agent_turn",
              "agent_name": f"{ENV}_session_agent"},
}
ROW_STEP = 9
"""The step coordinate of the single Environment Server row (its episodes s9.g0.r*; the run's are s0, s1)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def example_jsonl(python: str) -> str:
    """Step 3: the environment's own rows, in the side venv's installed package."""
    code = ("import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("
            f"'resources_servers.{ENV}.app').origin).parent / 'data' / 'example.jsonl')")
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def ng_run_command(venv: Path, config: str, gen: dict, head_port: int, extra: tuple = ()) -> list[str]:
    """Step 2's command line, as docs/gym.md writes it."""
    return [str(venv / "bin" / "ng_run"), f"+config_paths=[{MODEL_CONFIG},{config}]",
            f"+policy_base_url={gen['policy_base_url']}", "+policy_api_key=none",
            f"+policy_model_name={gen['policy_model_name']}",
            "+skip_venv_if_present=true", "++head_server.host=127.0.0.1", f"++head_server.port={head_port}", *extra]


RAY_START_TIMEOUT = "The current node timed out during startup"
"""Ray's words when its raylet takes over Ray's fixed 30 s to register (a loaded 2-core machine): ng_run
then exits at once, and starting it again is what a user would do."""


def start_ng_run(venv: Path, config: str, gen: dict, scratch: Path, extra: tuple = (),
                 tries: int = 3) -> tuple[subprocess.Popen, dict]:
    """ng_run in `scratch` (its own process group), output to a file; returns it and the URLs by server
    name once its log says all servers are ready. Started again (up to `tries` times) only when its Ray
    timed out starting."""
    for d in SERVER_DIRS:
        (scratch / d).mkdir(parents=True, exist_ok=True)
        (scratch / d / ".venv").unlink(missing_ok=True)
        (scratch / d / ".venv").symlink_to(venv)
    env = {k: v
           for k, v in os.environ.items() if k != "PYTHONPATH"} | {"RAY_ADDRESS": "local", "RAY_AUTH_MODE": "disabled"}
    for attempt in range(1, tries + 1):
        head, log = free_port(), scratch / f"ng_run-{attempt}.log"
        proc = subprocess.Popen(ng_run_command(venv, config, gen, head, extra), cwd=scratch, env=env,
                                stdout=open(log, "w"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None:
            if any(x.startswith("All ") and "servers ready!" in x
                   for x in log.read_text(errors="replace").splitlines()):
                with urllib.request.urlopen(f"http://127.0.0.1:{head}/server_instances", timeout=30) as r:
                    return proc, {x["process_name"]: x["url"] for x in json.loads(r.read())}
            time.sleep(1)
        stop_ng_run(proc)
        if RAY_START_TIMEOUT not in log.read_text(errors="replace"):
            break
        print(f"gym-check: ng_run's Ray timed out starting ({log}); starting it again", flush=True)
    raise RuntimeError(f"ng_run's servers did not start; see {log}:\n{log.read_text(errors='replace')[-3000:]}")


def stop_ng_run(proc: subprocess.Popen | None) -> None:
    """Ctrl-C to ng_run's whole process group (it stops its servers and its Ray), then SIGKILL after 60 s."""
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def one_environment_server_row(url: str, cfg, captures: Path, check, failures: list) -> None:
    """One row of the dataset through Gym 0.7's `single_agent_turn_legacy`, sent by minirl's rollout
    manager: G rollouts come back with token ids and a reward, each its own episode in Gym's capture."""
    import asyncio

    from minirl.data import prompt_row
    from minirl.rollout.manager import RolloutManager

    events: list[dict] = []

    async def go():
        m = RolloutManager(cfg, [url], events.append, vocab_size=10**6)
        try:
            return await m.run_step(ROW_STEP, [prompt_row(cfg, ROW_STEP, 0)])
        finally:
            await m.session.close()

    [out] = asyncio.run(go())
    G = cfg.grpo.num_generations_per_prompt
    calls = [len(r.calls) for r in out.rollouts.values()]
    episodes = sorted(p.name.split(".capture")[0] for p in captures.glob(f"s{ROW_STEP}.g0.*.capture.jsonl"))
    ok = (out.status == "committed" and len(calls) == G and all(calls)
          and episodes == [f"s{ROW_STEP}.g0.r{r}" for r in range(G)])
    check(ok, f"[{ENV}] one row through single_agent_turn_legacy: {out.status}, {len(calls)} rollouts, model calls "
          f"with token ids {calls}, rewards {[r.reward for r in out.rollouts.values()]}; Gym's episodes (capture keys) "
          f"{episodes}; failure events {[e for e in events if e['type'] == 'failure'][:2]}", failures,
          "environment server row")


def check_episodes(run_dir: Path, captures: Path, check, failures: list) -> None:
    """Gym's capture after the 0.7 run: one episode (capture file) per rollout of each trained group,
    and as many captured model calls as the ledger matched."""
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    files = {p.name.split(".capture")[0]: len(p.read_text().splitlines())
             for p in captures.glob("s[01].*.capture.jsonl")}
    want = {f"s{s}.g{g}.r{r}" for s in range(len(steps)) for g in range(2) for r in range(2)}
    matched = sum(s.get("calls_matched") or 0 for s in steps)
    ok = want <= set(files) and all(files[k] > 0 for k in want) and sum(files.values()) >= matched > 0
    check(ok, f"[{ENV}] one Gym episode per rollout: {len(files)} capture files {sorted(files)} for the run's "
          f"{len(want)} rollouts, {sum(files.values())} captured model calls, {matched} matched in the ledger",
          failures, "episodes")


def check_seeds(run_dir: Path, check, failures: list) -> None:
    """Issue 51's acceptance for a Gym multi-turn run: no two calls of one rollout share a sampling seed
    (Gym's `vllm_model` sends the row's one seed on every call; the generation server derives each
    call's own, and the ledger records what each call sampled with)."""
    by_rollout: dict[tuple, list] = {}
    for path in sorted((run_dir / "ledger").glob("step_*.jsonl")):
        for line in path.read_text().splitlines():
            c = json.loads(line)
            by_rollout.setdefault((c["step"], c["group"], c["rollout"], c["attempt"]), []).append(c.get("seed"))
    multi = {k: v for k, v in by_rollout.items() if len(v) > 1}
    shared = {k: v for k, v in multi.items() if None in v or len(set(v)) < len(v)}
    check(bool(multi) and not shared, f"[{ENV}] a seed per call: {len(multi)} of {len(by_rollout)} rollouts made "
          f"{sum(map(len, multi.values()))} calls between them, no two calls of one rollout with one seed "
          f"(shared: {shared or 'none'})", failures, "seed per call")


def walk(version: str, python: str, gen: dict, work: Path, check, check_training, attach: list, env: dict,
         overrides: list, failures: list) -> None:
    """Steps 2-4 for `version`'s side venv (`python`); the ng_run process is stopped whatever happens."""
    from minirl.config import load_config

    spec, venv = WALKS[version], Path(python).parent.parent
    scratch = work / f"walk-{version}"  # ng_run's directory, and the run's
    captures = scratch / "captures"
    extra = ("+observability_enabled=true", f"+model_call_capture_dir={captures}") if spec["agent_name"] else ()
    proc = None
    try:
        proc, urls = start_ng_run(venv, spec["config"], gen, scratch, extra)
        check(spec["target"] in urls, f"[{ENV}] ng_run started {sorted(urls)} (Gym {version}, {spec['config']})",
              failures, "ng_run")
        data = example_jsonl(python)
        train = [f"data.train_jsonl={data}"] + ([f"agent.name={spec['agent_name']}"] if spec["agent_name"] else [])
        if spec["agent_name"]:
            cfg = load_config(None, [*overrides, *train, f"agent.external_url={urls[spec['target']]}"])
            one_environment_server_row(urls[spec["target"]], cfg, captures, check, failures)
        label = f"{ENV}-ng_run"
        check_training(label, urls[spec["target"]], train, attach, scratch, env, failures, version)
        if (scratch / f"run-{label}" / "ledger").is_dir():
            check_seeds(scratch / f"run-{label}", check, failures)
        if spec["agent_name"] and (scratch / f"run-{label}" / "metrics.jsonl").exists():
            check_episodes(scratch / f"run-{label}", captures, check, failures)
    except Exception as exc:  # report it as a failed check; the other version's half still runs
        check(False, f"[{ENV}] walkthrough: {type(exc).__name__}: {exc}", failures, f"walkthrough {type(exc).__name__}")
    finally:
        stop_ng_run(proc)
