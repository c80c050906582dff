"""The switch matrix's books: what every run must balance, read only from the run's own files
(metrics.jsonl, events.jsonl, ledger/, checkpoints/) and its exit. `check_run` checks them in order:
exit, finite, target, fates, events, ledger, served, dispatched, resume, each checker's docstring
saying its rule (docs/experiments.md, "The books", says them all in one place).

Invariant: `check_run` names the first broken invariant of a run in one line, or returns None; it
never reads the process that ran (a run's files are its only testimony, as for a user).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

BUDGET_ERRORS = (
    "RolloutRedispatchExhausted:",  # max_consecutive_dropped_prompts
    "RuntimeError: training step",  # the floor (min_step_batch_fraction)
    "RolloutDataFailure:",          # max_skipped_prompts (upstream's text, or the original DATA failure at 0)
    "ValueError: CC optimizer step requires",  # CC without fix 1: the full count, or every rollout of every kept group
)
"""Run-ending errors a budget raises: a run may end with one of these when the cell's injected faults
used the budget up. Anything else that ends a run is a bug the matrix found."""

QUARANTINED = "was quarantined with this request in flight"
"""The router's 503 for a request in flight on a worker it quarantines (minirl/generation/router.py): under
an injected `worker_hang`, every request then on the hung worker fails so, its group's fault too."""

LEDGER_STATUSES = {"trained", "masked", "retired", "matched", "stale", "logprob_mismatch"}


def read_jsonl(path: Path) -> list[dict]:
    """A run file's lines as dicts ([] when the file is absent)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def check_run(run_dir: Path, rc: int, last_line: str, cfg, resumed_from: int | None = None) -> str | None:
    """The first broken invariant of the run in `run_dir` (one line), or None. `cfg` is the run's
    resolved MinirlConfig; `resumed_from`: the step the last resume started at, if the run was killed
    and resumed."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    events = read_jsonl(run_dir / "events.jsonl")
    for check in (_exit, _finite, _target, _fates, _events, _ledger, _served, _dispatched, _resume):
        problem = check(run_dir, rc, last_line, cfg, rows, events, resumed_from)
        if problem:
            return f"{check.__name__.strip('_')}: {problem}"
    return None


def _exit(run_dir, rc, last_line, cfg, rows, events, resumed_from):
    """0, or 1 with a budget's run-ending error (BUDGET_ERRORS) where every lost group (dropped or
    skipped) had an injected fault (a request cut by the quarantine of a worker an injected
    `worker_hang` wedged counts): the faults, not something else, used the budget up."""
    if rc == 0:
        return None
    faulted = {(e.get("step"), e.get("group")) for e in events if e.get("type") == "fault"}
    lost = {(e.get("step"), e.get("group")) for e in events
            if e.get("type") == "drop" or (e.get("type") == "failure" and e.get("decision") == "skipped")}
    if any(e.get("type") == "fault" and e.get("kind") == "worker_hang" for e in events):
        faulted |= {(e.get("step"), e.get("group")) for e in events  # the hung worker's quarantine cut these
                    if e.get("type") == "failure" and QUARANTINED in str(e.get("error"))}
    if rc == 1 and last_line.startswith(BUDGET_ERRORS) and faulted and lost <= faulted:
        return None
    unexplained = sorted(lost - faulted, key=str)
    return (f"exit {rc} ({len(faulted)} groups with injected faults"
            + (f"; lost groups without one: {unexplained[:4]}" if unexplained else "") + f"): {last_line[:300]}")


def _finite(run_dir, rc, last_line, cfg, rows, events, resumed_from):
    """Every step's loss and grad_norm are finite."""
    for r in rows:
        for key in ("loss", "grad_norm"):
            if not isinstance(r.get(key), (int, float)) or not math.isfinite(r[key]):
                return f"step {r['step']}: {key} = {r.get(key)!r}"
    return None


def _target(run_dir, rc, last_line, cfg, rows, events, resumed_from):
    """Every step reports `groups_target` = grpo.num_prompts_per_step and trains at least the floor."""
    from minirl.config import step_floor

    n, floor = cfg.grpo.num_prompts_per_step, step_floor(cfg)
    for r in rows:
        if r["groups_target"] != n:
            return f"step {r['step']}: groups_target {r['groups_target']}, the config says {n}"
        if r["groups_trained"] < floor:
            return f"step {r['step']}: trained {r['groups_trained']} groups, under the floor {floor}"
    return None


def _stamps(cfg) -> bool:
    return not cfg.async_rl.enabled or cfg.async_rl.sampler.name == "in_order"


def _fates(run_dir, rc, last_line, cfg, rows, events, resumed_from):
    """In a step that stamps its groups (sync, `in_order`), every target group has exactly one fate:
    trained + dropped + skipped = target; under the other samplers a step trains at most its target."""
    for r in rows:
        fates = r["groups_trained"] + r["dropped_prompt_groups"] + r.get("skipped_prompt_groups", 0)
        if _stamps(cfg) and fates != r["groups_target"]:
            return (f"step {r['step']}: trained {r['groups_trained']} + dropped {r['dropped_prompt_groups']} + "
                    f"skipped {r.get('skipped_prompt_groups', 0)} = {fates}, target {r['groups_target']}")
        if r["groups_trained"] > r["groups_target"]:
            return f"step {r['step']}: trained {r['groups_trained']} groups, more than its target {r['groups_target']}"
    return None


def _events(run_dir, rc, last_line, cfg, rows, events, resumed_from):
    """Sync: a step's prompts are its own, so drop and mask events (named by prompt coordinates) number
    exactly what the metrics count, the died step's drops added. Async: the pump runs ahead, so a group of
    prompt step 15 may train at step 2, and a group given up on after the last step is no step's: every
    counted drop and mask has its event, and events may exceed the counts."""
    if resumed_from is not None:  # a re-run step's first events stand beside its second's
        return None
    count = {kind: sum(e.get("type") == kind for e in events) for kind in ("drop", "mask", "evict")}
    want = {"drop": sum(r["dropped_prompt_groups"] for r in rows), "mask": sum(r["rollouts_masked"] for r in rows),
            "evict": sum(r.get("stale_groups_evicted", 0) for r in rows)}
    if not cfg.async_rl.enabled:
        died = {e.get("step") for e in events if e.get("type") == "run_failed"}
        want["drop"] += sum(e.get("type") == "drop" and e.get("step") in died for e in events)
        count["mask"] -= sum(e.get("type") == "mask" and e.get("step") in died for e in events)
    for kind in ("drop", "mask", "evict"):
        exact = not cfg.async_rl.enabled and kind != "evict"
        if count[kind] < want[kind] or (exact and count[kind] != want[kind]):
            return f"{count[kind]} {kind} events, the metrics count {want[kind]}"
    return None


def _ledger(run_dir, rc, last_line, cfg, rows, events, resumed_from):
    """No call of an attempt is trained twice, every ledger line has a known status, and every trained
    call ran under a version in its step's window [v - S, v]."""
    s = cfg.async_rl.sampler.max_staleness_versions if cfg.async_rl.enabled else 0
    trained: set = set()
    for r in {r["step"]: r for r in rows}.values():  # a re-run step's ledger replaced the first run's
        version = r["policy_version"]
        for line in read_jsonl(run_dir / "ledger" / f"step_{r['step']}.jsonl"):
            status = line.get("ledger_status")
            if status not in LEDGER_STATUSES:
                return f"step {r['step']}: a ledger line with status {status!r}"
            if status not in ("trained", "matched"):
                continue
            key = tuple(line.get(k) for k in ("step", "group", "rollout", "attempt", "call"))
            if key in trained:
                return f"call {key} is trained twice"
            trained.add(key)
            versions = {line.get("version_start"), line.get("version_end")} - {None}
            if versions and not (version - s <= min(versions) and max(versions) <= version):
                return f"step {r['step']} (version {version}, S={s}) trained call {key} of versions {sorted(versions)}"
    return None


def _ledger_lines(run_dir: Path, resumed_from: int | None) -> dict[int, list[dict]]:
    """The ledger's step files this process wrote (a resume rewrote those from its step on), by step."""
    out = {}
    for path in (run_dir / "ledger").glob("step_*.jsonl"):
        step = int(path.stem.split("_")[1])
        if resumed_from is None or step >= resumed_from:
            out[step] = read_jsonl(path)
    return out


def _call_key(line: dict) -> tuple:
    return tuple(line.get(k) for k in ("step", "group", "rollout", "attempt", "call"))


def _served(run_dir, rc, last_line, cfg, rows, events, resumed_from):
    """The servers' own account against the ledger: every call a generation server served this run, by
    its own list (ledger/served.jsonl, written at the run's end from each server's call log), is in a
    ledger line: a step's (trained, masked, retired, ...) or ledger/run_end.jsonl's (retired when the
    run ended); a run without its `run_end` event did not close its books. A served call no ledger
    line holds was lost between the server and the books (a call log's bound evicted it, a source
    dropped it, a resume forgot it)."""
    from minirl.wire import parse_call_key

    if cfg.agent.external_url:
        return None  # an external agent's calls carry no key: matched by content (Ledger.match_external)
    if not any(e.get("type") == "run_end" for e in events):
        return "no run_end event: the run did not close its books (unfinished groups, leftover calls)"
    accounts = read_jsonl(run_dir / "ledger" / "served.jsonl")
    if not accounts:
        return "ledger/served.jsonl holds no generation server's account of what it served"
    have = Counter(_call_key(line) for lines in _ledger_lines(run_dir, resumed_from).values() for line in lines)
    have.update(_call_key(line) for line in read_jsonl(run_dir / "ledger" / "run_end.jsonl"))
    for account in accounts:
        if account.get("error"):
            return f"generation worker {account['rank']} gave no account of what it served: {account['error'][:200]}"
        if account["dropped"]:
            return f"generation worker {account['rank']}'s call log evicted {account['dropped']} records no ledger took"
        for key in account["served"]:
            coords, call = parse_call_key(key)
            k = (coords.step, coords.group, coords.rollout, coords.attempt, call)
            if have[k] <= 0:
                return (f"call {key}, served by generation worker {account['rank']}, is in no ledger line "
                        "(trained or retired)")
            have[k] -= 1
    return None


def _dispatched(run_dir, rc, last_line, cfg, rows, events, resumed_from):
    """Async: every prompt group the pump dispatched (a `dispatch` event; after a resume, those and the
    restored buffer's) has exactly one fate over the run: trained (its calls in one step's ledger as
    trained or masked), evicted, replaced (a `replace` event that found its place a stand-in),
    unfinished (in the buffer or in flight at the end: the `run_end` event), or else dropped or
    skipped (its `drop` event, its `failure` event with decision `skipped`); then `_step_counts`."""
    if not cfg.async_rl.enabled:
        return None  # sync: `_fates` checks every step's target groups
    if resumed_from is not None:  # the resumed process's books: its dispatches and its restored buffer
        last = max(i for i, e in enumerate(events) if e.get("type") == "resumed")
        events = events[last:]
        rows = list({r["step"]: r for r in rows if r["step"] >= resumed_from}.values())  # a re-run step's last row
    key = lambda e: (e.get("step"), e.get("group"))  # noqa: E731
    dispatched = {key(e) for e in events if e.get("type") == "dispatch"}
    for e in events:
        if e.get("type") == "buffer_restored":
            dispatched |= {tuple(k) for k in e.get("kept", [])}
    end = next((e for e in events if e.get("type") == "run_end"), None)
    if end is None:
        return "no run_end event: the groups left unfinished are not named"
    exits = {"unfinished": {tuple(k) for ks in end["unfinished"].values() for k in ks},
             "evicted": {key(e) for e in events if e.get("type") == "evict"},
             "replaced": {key(e) for e in events if e.get("type") == "replace" and e.get("decision") != "shrink"}}
    trained_at: dict[tuple, list[int]] = {}
    lines = _ledger_lines(run_dir, resumed_from)
    for step, ledger in lines.items():
        for k in {(x["step"], x["group"]) for x in ledger
                  if x.get("ledger_status") in ("trained", "masked", "matched")}:
            trained_at.setdefault(k, []).append(step)
    exits["trained"] = set(trained_at)
    lost = {key(e) for e in events if e.get("type") == "drop"
            or (e.get("type") == "failure" and e.get("decision") == "skipped")}
    fates = Counter()
    for group in sorted(dispatched, key=str):
        mine = [name for name, keys in exits.items() if group in keys]
        if len(trained_at.get(group, [])) > 1:
            return f"group {list(group)} is trained by steps {sorted(trained_at[group])}"
        if len(mine) > 1:
            return f"group {list(group)} has {len(mine)} fates: {', '.join(mine)}"
        if not mine and group not in lost:
            return (f"group {list(group)} was dispatched and has no fate "
                    "(trained, evicted, replaced, dropped, skipped, unfinished)")
        fates[mine[0] if mine else "lost"] += 1
    return _step_counts(rows, lines, rc, fates)


def _step_counts(rows: list[dict], lines: dict[int, list[dict]], rc: int, fates: Counter) -> str | None:
    """Each step's ledger trains the groups its metrics count; (exit 0) the run's evictions and lost
    groups (dropped or skipped) number what the metrics sum to."""
    for r in rows:
        trained = {(x["step"], x["group"]) for x in lines.get(r["step"], [])
                   if x.get("ledger_status") in ("trained", "masked", "matched")}
        if len(trained) != r["groups_trained"]:
            return f"step {r['step']}: its ledger trains {len(trained)} groups, its metrics count {r['groups_trained']}"
    evicted = sum(r.get("stale_groups_evicted", 0) for r in rows)
    lost = sum(r["dropped_prompt_groups"] + r.get("skipped_prompt_groups", 0) for r in rows)
    if rc == 0 and (fates["evicted"], fates["lost"]) != (evicted, lost):
        return (f"{fates['evicted']} groups evicted and {fates['lost']} dropped or skipped over the run, "
                f"the metrics sum to {evicted} and {lost}")
    return None


def _resume(run_dir, rc, last_line, cfg, rows, events, resumed_from):
    """The steps in metrics.jsonl run 0..n-1, and a step appears twice only when a resume re-ran it (it
    is newer than the checkpoint the resume started from)."""
    steps = [r["step"] for r in rows]
    if sorted(set(steps)) != list(range(len(set(steps)))):
        return f"the steps in metrics.jsonl are {steps}, not 0..n-1"
    twice = sorted({s for s in steps if steps.count(s) > 1})
    if twice and (resumed_from is None or min(twice) < resumed_from):
        return f"steps {twice} appear twice in metrics.jsonl, resumed from {resumed_from}"
    return None
