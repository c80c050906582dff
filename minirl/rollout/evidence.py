"""Per-call evidence -> physical traces -> a validated rollout; and the ledger of every attempt.

A `/run` result carries, per model call, `prompt_token_ids`, `generation_token_ids` and
`generation_log_probs` on one output item. A call whose prompt starts with the previous call's
prompt + generation extends that trace (append-compatible); any other call (the agent rewrote its
history) starts a new physical trace under context compaction, and is upstream's "Non-contiguous
messages found!" failure without it. Each trace is one training sequence whose loss mask covers
only generated tokens; every trace of a rollout carries that rollout's advantage and identity.

Invariant: `parse_rollout` either returns a rollout whose traces hold exactly the result's
generated tokens, in order, each once, with a float32-finite reward and finite logprobs <= 0, or
raises RolloutDataFailure naming the field that is wrong; and the Ledger lets only a committed
attempt's calls reach the optimizer, retiring the rest as a unit.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from minirl.wire import Coords, RolloutDataFailure

FLOAT32_MAX = 3.4028234663852886e38


@dataclass
class Call:
    prompt: list[int]
    gen: list[int]
    logprobs: list[float]


@dataclass
class Trace:
    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]  # the generator's logprob per token (0 where loss_mask is 0)
    calls: int = 1


@dataclass
class Rollout:
    """One committed rollout attempt: what the trainer needs, plus what the metrics report."""

    coords: Coords
    reward: float
    calls: list[Call]
    traces: list[Trace]
    capture_failed: bool
    truncated: bool
    evidence: dict = field(default_factory=dict)
    mask_reason: str | None = None

    @property
    def sample_mask(self) -> int:
        return 0 if self.mask_reason else 1


def split_traces(calls: list[Call], allow_rewrites: bool = True) -> list[Trace]:
    """Calls -> physical traces. Without `allow_rewrites` (no context compaction) every call must
    extend the previous one, as upstream asserts."""
    traces: list[Trace] = []
    for i, c in enumerate(calls):
        last = traces[-1] if traces else None
        if last is not None and not allow_rewrites and c.prompt[: len(last.tokens)] != last.tokens:
            raise RolloutDataFailure(
                f"Non-contiguous messages found! Model call {i} does not extend the previous call's prompt and "
                "reply; only a context-compaction run may rewrite its history"
            )
        if last is not None and c.prompt[: len(last.tokens)] == last.tokens:
            gap = len(c.prompt) - len(last.tokens)  # tool output and template between the calls
            last.tokens = c.prompt + c.gen
            last.loss_mask += [0] * gap + [1] * len(c.gen)
            last.logprobs += [0.0] * gap + list(c.logprobs)
            last.calls += 1
        else:
            traces.append(Trace(c.prompt + c.gen, [0] * len(c.prompt) + [1] * len(c.gen), [0.0] * len(c.prompt) + list(c.logprobs)))
    return traces


def _int_list(value, what: str, vocab_size: int) -> list[int]:
    # set(map(type, ...)), min and max run in C: this check is on the controller's hot path
    if not isinstance(value, list) or not set(map(type, value)) <= {int}:
        raise RolloutDataFailure(f"malformed /run result: {what} must be a list of integers")
    if value and not (0 <= min(value) and max(value) < vocab_size):
        bad = next(t for t in value if not 0 <= t < vocab_size)
        raise RolloutDataFailure(f"token id {bad} in {what} is out of vocabulary (size {vocab_size})")
    return value


def parse_rollout(result, coords: Coords, *, vocab_size: int, max_len: int, overlong_filtering: bool,
                  allow_rewrites: bool = True) -> Rollout:
    """Validate a `/run` result and turn it into a Rollout. Raises RolloutDataFailure.

    The rollout is truncated (and masked under `overlong_filtering`) when one of its traces
    reaches `max_len` tokens, as upstream marks it; a reply cut by the per-call cap is not."""
    if not isinstance(result, dict):
        raise RolloutDataFailure("malformed /run result: not a JSON object")
    response, reward = result.get("response"), result.get("reward")
    if not isinstance(response, dict) or not isinstance(response.get("output"), list):
        raise RolloutDataFailure("malformed /run result: missing response.output")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward) \
            or abs(reward) > FLOAT32_MAX:
        raise RolloutDataFailure(f"malformed /run result: reward must be a finite number within float32 range, got {reward!r}")
    evidence = result.get("evidence") if isinstance(result.get("evidence"), dict) else {}

    calls: list[Call] = []
    capture_failed = bool(evidence.get("capture_failed"))
    for item in response["output"]:
        if not isinstance(item, dict):
            raise RolloutDataFailure("malformed /run result: an output item is not an object")
        if "generation_token_ids" not in item:
            if item.get("type") == "message" and item.get("role") == "assistant" and not _text(item):
                capture_failed = True  # an empty model reply without tokens: the call failed (lane A)
            continue
        gen = _int_list(item["generation_token_ids"], "generation_token_ids", vocab_size)
        prompt = _int_list(item.get("prompt_token_ids"), "prompt_token_ids", vocab_size)
        lps = item.get("generation_log_probs")
        if not isinstance(lps, list) or len(lps) != len(gen) or not set(map(type, lps)) <= {int, float}:
            raise RolloutDataFailure("malformed /run result: generation_log_probs must be one number per generated token")
        if any(map(math.isnan, lps)):
            raise RolloutDataFailure("Generation logprobs contain NaN")
        if lps and not (max(lps) <= 0.0 and min(lps) > -math.inf):
            bad = next(x for x in lps if not -math.inf < x <= 0.0)
            raise RolloutDataFailure(f"malformed /run result: generation_log_probs must be finite and <= 0, got {bad!r}")
        if gen:
            calls.append(Call(prompt, gen, list(map(float, lps))))
    if not calls and not capture_failed:
        raise RolloutDataFailure("empty episode: the /run result has no trainable model call")
    traces = split_traces(calls, allow_rewrites)
    for t in traces:
        if len(t.tokens) > max_len:
            raise RolloutDataFailure(
                f"trace of {len(t.tokens)} tokens exceeds policy.max_total_sequence_length={max_len}"
            )
    truncated = any(len(t.tokens) >= max_len for t in traces)
    mask_reason = "capture_failed" if capture_failed else ("overlong" if truncated and overlong_filtering else None)
    return Rollout(coords, float(reward), calls, traces, capture_failed, truncated, evidence, mask_reason)


def _text(item: dict) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict))


class Ledger:
    """Every model call of every attempt, keyed by (step, group, rollout, attempt), owned by the
    controller and written to `run_dir/ledger/step_N.jsonl`.

    Sources: the generation servers' call logs (what the engine produced for each attempt, even
    when the attempt then failed) and the committed `/run` results (which calls the agent kept).
    """

    def __init__(self, directory: Path | None):
        self.dir = directory
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)

    def match_external(self, step: int, pool: list[dict], rollouts: list[Rollout], version: int,
                       oldest: int | None = None) -> tuple[Counter, list[dict]]:
        """An external agent's calls carry no rollout header: find each committed call in `pool`
        (the servers' headerless records) by its token content, prompt ids + generated ids. A call
        not found masks its rollout (`unrecorded_calls`), as for minirl's own agents; a matched
        call outside the version window raises. Returns the counts and the records left unmatched
        (another step's, or a failed attempt's)."""
        oldest = version if oldest is None else oldest
        index: dict[tuple, list[dict]] = {}
        for rec in pool:
            index.setdefault((tuple(rec.get("prompt_token_ids") or ()), tuple(rec.get("generation_token_ids") or ())), []).append(rec)
        counts: Counter = Counter()
        lines = []
        for r in rollouts:
            for i, c in enumerate(r.calls):
                found = index.get((tuple(c.prompt), tuple(c.gen)))
                if not found:
                    counts["calls_unrecorded"] += 1
                    r.mask_reason = r.mask_reason or "unrecorded_calls"
                    continue
                rec = found.pop()
                versions = {rec.get("version_start"), rec.get("version_end")} - {None}
                if versions and not (oldest <= min(versions) and max(versions) <= version):
                    raise RuntimeError(f"policy-version discipline: a call of {r.coords.key} ran under weights "
                                       f"{sorted(versions)}, but step {step} trains versions {oldest}..{version}")
                counts["calls_matched"] += 1
                counts["tokens_matched"] += len(c.gen)
                lines.append({**r.coords.as_dict(), "call": i, **{k: rec.get(k) for k in ("finish_reason", "version_start",
                              "version_end", "generation_token_ids")}, "http_status": 200, "ledger_status": "matched"})
        self._write(step, lines)
        return counts, [rec for recs in index.values() for rec in recs]

    def _write(self, step: int, lines: list[dict]) -> None:
        if self.dir is not None:
            with open(self.dir / f"step_{step}.jsonl", "w") as f:
                for line in lines:
                    f.write(json.dumps(line) + "\n")

    @staticmethod
    def _attempt_key(record: dict) -> tuple:
        return (record["step"], record["group"], record["rollout"], record["attempt"])

    def close_step(self, step: int, server_calls: list[dict], rollouts: list[Rollout], version: int,
                   oldest: int | None = None) -> Counter:
        """Check the committed rollouts against the server's record, retire the rest, persist.

        The rollouts came from minirl's own agents, whose calls carry the rollout header, so the
        servers recorded every one of them. A committed call missing from its attempt's record
        fails the check: when the record is short (a restarted server lost its log) the
        rollout is masked (`unrecorded_calls`) and counted in `calls_unrecorded`; when the record
        is complete and still lacks the call, or a trained call ran under a policy version outside
        [oldest, version] (`oldest` defaults to `version`: synchronous, one version per step), it
        raises RuntimeError. A call may span versions (an in-flight weight update) within the window.
        """
        oldest = version if oldest is None else oldest
        by_attempt: dict[tuple, list[dict]] = {}
        for rec in server_calls:
            by_attempt.setdefault(self._attempt_key(rec), []).append(rec)
        counts: Counter = Counter()
        for r in rollouts:
            key = (r.coords.step, r.coords.group, r.coords.rollout, r.coords.attempt)
            seen = [(c.get("prompt_token_ids"), c.get("generation_token_ids")) for c in by_attempt.get(key, []) if c.get("status") == 200]
            missing = [c for c in r.calls if (c.prompt, c.gen) not in seen]
            if not missing:
                continue
            if len(seen) >= len(r.calls):
                raise RuntimeError(
                    f"ledger mismatch: a trained call of attempt {r.coords.key} is not in the generation server's record "
                    "of that attempt"
                )
            counts["calls_unrecorded"] += len(missing)
            r.mask_reason = r.mask_reason or "unrecorded_calls"
        committed = {(r.coords.step, r.coords.group, r.coords.rollout, r.coords.attempt): r for r in rollouts}
        lines = []
        for key, recs in sorted(by_attempt.items()):
            rollout = committed.get(key)
            status = "retired" if rollout is None else ("masked" if rollout.sample_mask == 0 else "trained")
            for rec in recs:
                versions = {rec.get("version_start"), rec.get("version_end")} - {None}
                if status in ("trained", "masked") and versions and not (oldest <= min(versions) and max(versions) <= version):
                    window = f"version {version}" if oldest == version else f"versions {oldest}..{version}"
                    raise RuntimeError(
                        f"policy-version discipline: call {rec['key']} ran under weights {sorted(versions)}, "
                        f"but step {step} trains {window}"
                    )
                counts[f"calls_{status}"] += 1
                lines.append({**{k: rec.get(k) for k in ("step", "group", "rollout", "attempt", "call", "status", "finish_reason",
                                                          "version_start", "version_end", "generation_token_ids")},
                              "http_status": rec.get("status"), "ledger_status": status, "error": rec.get("error")})
        self._write(step, lines)
        return counts
