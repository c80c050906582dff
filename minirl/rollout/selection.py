"""Which captured model calls of a committed rollout train: NeMo-RL's selection policies
(`context_compaction.call_selection`: `returned_history`, `all_captured`, or a custom
`package.module:function`). The policy chooses membership; reconstruction stays minirl's: the
selected records, in order, become the rollout's calls and `split_traces` builds its traces, so each
sampled token is on exactly one row's loss mask, in the very context the engine sampled it in.

Invariant: a rollout's reward is observed once whatever the selection (the group's baseline counts
rollouts, not traces); a selected record must be one of the attempt's usable records and the
terminal response one of the selected ones, or the run ends naming the policy; a rollout that is
masked, or one of whose traces is, keeps its returned history (its mask is about those calls).
"""

from __future__ import annotations

from typing import Callable

from minirl.config import SELECTION_BUILTINS, load_callable
from minirl.rollout.evidence import SUMMARY_KIND, Ledger, same_call, split_traces
from minirl.types import Call, Rollout
from minirl.wire import is_summary_call

Policy = Callable[[list[dict], dict], tuple[list[dict], "str | None"]]


def usable(rec: dict) -> bool:
    """A record that can train: answered (200), with generated tokens and one logprob per token."""
    gen, lps = rec.get("generation_token_ids"), rec.get("generation_log_probs")
    return rec.get("status") == 200 and bool(gen) and isinstance(lps, list) and len(lps) == len(gen)


def returned_history(records: list[dict], result: dict) -> tuple[list[dict], str | None]:
    """Upstream's default: the records of the calls the agent returned, in the returned order. Each
    returned call takes one usable record alike in tokens, the first not taken yet (as the ledger
    matches them, `Ledger._trains`): two token-identical records are two calls, and a summary request
    the harness rejected is none of them (`Ledger._rejected_summaries`)."""
    rejected = Ledger._rejected_summaries(records, result["returned"])
    free = [rec for rec in records if usable(rec) and id(rec) not in rejected]
    out = []
    for call in result["returned"]:
        i = next((i for i, rec in enumerate(free) if same_call(rec, call)), None)
        if i is not None:
            out.append(free.pop(i))
    return out, out[-1]["key"] if out else None


def select_all_captured(records: list[dict], result: dict) -> tuple[list[dict], str | None]:
    """Every usable record, except the summary requests none of the returned calls is (rejected
    attempts: dead leaves the harness discarded, never scored; a returned summary is its request's
    record, found by call key, `Ledger._rejected_summaries`, so its token-identical rejected siblings
    stay out); the terminal response is the last returned call's."""
    rejected = Ledger._rejected_summaries(records, result["returned"])
    kept = [rec for rec in records if usable(rec) and id(rec) not in rejected]
    last = result["returned"][-1] if result["returned"] else None
    terminal = next((rec["key"] for rec in reversed(kept) if last is not None and same_call(rec, last)), None)
    return kept, terminal


BUILTINS: dict[str, Policy] = {"returned_history": returned_history, "all_captured": select_all_captured,
                               "select_all_captured": select_all_captured}
assert set(BUILTINS) == set(SELECTION_BUILTINS)


def resolve_selection_policy(name: str) -> Policy:
    """A built-in's name or an importable `package.module:function` -> the policy (upstream's rule).

    A policy is a synchronous callable `(records, result) -> (selected_records, terminal_response_id)`:
    `records` are the generation servers' call records of the rollout's committed attempt (dicts with
    `key`, `call`, `status`, `prompt_token_ids`, `generation_token_ids`, `generation_log_probs`,
    `t_start`), in the order they started ("order determines root/path priority"); `result` is
    `{"reward", "coords", "returned"}`, `returned` the calls of the history the agent returned, as
    records. Built-ins: `returned_history` (what parse_rollout already built, so the controller does
    nothing for it) and `all_captured` / `select_all_captured`. minirl's own agents return every call
    they make, so for them `all_captured` trains what `returned_history` does."""
    return BUILTINS.get(name) or load_callable(name, "context_compaction.call_selection")


def select_calls(name: str, rollouts: list[Rollout], server_calls: list[dict], max_len: int) -> int:
    """Rebuild each unmasked rollout's calls and traces from the records the policy selects.
    Returns how many rollouts changed. Raises RuntimeError naming the policy when it returns a
    record the attempt did not capture usably, or a terminal response it did not select."""
    policy = resolve_selection_policy(name)
    by_attempt: dict[tuple, list[dict]] = {}
    for rec in sorted(server_calls, key=lambda rec: (rec.get("t_start", 0.0), str(rec.get("key")))):
        attempt = (rec.get("step"), rec.get("group"), rec.get("rollout"), rec.get("attempt"))
        by_attempt.setdefault(attempt, []).append(rec)
    changed = 0
    for r in rollouts:
        if r.mask_reason is not None or any(t.mask_reason for t in r.traces):
            continue
        c = r.coords
        records = by_attempt.get((c.step, c.group, c.rollout, c.attempt), [])
        result = {"reward": r.reward, "coords": c.as_dict(), "returned": r.calls}
        selected, terminal = policy(records, result)
        _check_selection(name, r, records, selected, terminal)
        calls = [_as_call(rec, r.calls) for rec in selected]
        traces = split_traces(calls, allow_rewrites=True)
        if calls == r.calls or any(len(t.tokens) > max_len for t in traces):
            continue  # nothing new, or a reconstruction the trainer cannot hold: the returned history stands
        r.calls, r.traces = calls, traces
        changed += 1
    return changed


def _check_selection(name: str, r: Rollout, records: list[dict], selected: list[dict], terminal) -> None:
    """Upstream's "shared capture validation remains authoritative": a selected record must be a
    usable one of the attempt's, and not a summary request the harness rejected (the ledger retires
    those: they are never trained)."""
    rejected = Ledger._rejected_summaries(records, r.calls)
    ok = {id(rec) for rec in records if usable(rec) and id(rec) not in rejected}
    stray = [rec.get("key") for rec in selected if id(rec) not in ok]
    if stray:
        raise RuntimeError(f"context_compaction.call_selection={name} selected {len(stray)} record(s) "
                           f"that are not usable captured calls of attempt {r.coords.key} (e.g. {stray[0]!r})")
    if terminal is not None and terminal not in {rec.get("key") for rec in selected}:
        raise RuntimeError(f"context_compaction.call_selection={name} named terminal response {terminal!r} of attempt "
                           f"{r.coords.key}, which it did not select")


def _as_call(rec: dict, returned: list[Call]) -> Call:
    """A record as a Call: a returned call keeps its kind and compaction record; another summary
    request is a summary call; the rest are turns."""
    same = next((c for c in returned if same_call(rec, c)), None)
    if same is not None:
        return same
    kind = SUMMARY_KIND if is_summary_call(rec.get("call")) else "turns"
    return Call(list(rec["prompt_token_ids"]), list(rec["generation_token_ids"]),
                [float(x) for x in rec["generation_log_probs"]], kind)
