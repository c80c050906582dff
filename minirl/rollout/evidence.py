"""Per-call evidence -> physical traces -> a validated rollout; and the ledger of every attempt.
A `/run` result carries, per model call, `prompt_token_ids`, `generation_token_ids` and
`generation_log_probs` on one output item; each physical trace (`split_traces`) is one training
sequence whose loss mask covers only generated tokens.

Invariant: `parse_rollout` either returns a rollout whose traces hold exactly the result's
generated tokens, in order, each once, with a float32-finite reward and finite logprobs <= 0, or
raises RolloutDataFailure naming the field that is wrong; and the Ledger lets only a committed
attempt's calls reach the optimizer, retiring the rest as a unit.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from minirl.agents.compaction import counter_names
from minirl.agents.compaction.summarize import SUMMARY_COUNTERS
from minirl.algo.grpo import rollout_votes
from minirl.gym.failures import MASK_SAMPLE, episode_failure, sample_mask
from minirl.rollout.masking import stronger_mask
from minirl.runtime.files import naming
from minirl.types import Call, Rollout, Trace
from minirl.wire import Coords, RolloutDataFailure, is_summary_call, short as _short

FLOAT32_MAX = 3.4028234663852886e38
ADVANTAGE_EPS = 1e-6
"""minirl.algo.grpo.group_advantages' eps: a normalised advantage is divided by (std + eps)."""
GRAD_HEADROOM = 1e4
"""What the reward bound leaves between |advantage| and sqrt(float32 max) for the per-token weight
and the score gradient's norm (the default model's is about 1; see `reward_bound`)."""


def split_traces(calls: list[Call], allow_rewrites: bool = True) -> list[Trace]:
    """Calls -> physical traces. Without `allow_rewrites` (no context compaction) every call must
    extend the previous one, as upstream asserts.

    A call whose prompt starts with the previous call's prompt + generation extends that trace
    (append-compatible); any other call (the agent rewrote its history) starts a new physical trace
    under context compaction, and is upstream's "Non-contiguous messages found!" failure without it.
    A summarizing compaction's accepted summary (an item marked `trace_kind: compaction_summary`) is
    a trace of its own, whatever it extends, and the call after it starts a new one. Every trace of a
    rollout carries that rollout's advantage and identity."""
    traces: list[Trace] = []
    for i, c in enumerate(calls):
        last = traces[-1] if traces else None
        extends = last is not None and c.prompt[: len(last.tokens)] == last.tokens
        if last is not None and not allow_rewrites and not extends:
            raise RolloutDataFailure(
                f"Non-contiguous messages found! Model call {i} does not extend the previous call's prompt and "
                "reply; only a context-compaction run may rewrite its history"
            )
        if extends and last.kind == c.kind == "turns":
            gap = len(c.prompt) - len(last.tokens)  # tool output and template between the calls
            last.tokens = c.prompt + c.gen
            last.loss_mask += [0] * gap + [1] * len(c.gen)
            last.logprobs += [0.0] * gap + list(c.logprobs)
            last.calls += 1
        else:
            traces.append(Trace(c.prompt + c.gen, [0] * len(c.prompt) + [1] * len(c.gen),
                                [0.0] * len(c.prompt) + list(c.logprobs), kind=c.kind, compaction=c.compaction))
    return traces


def reward_bound(normalize_rewards: bool, eps: float = ADVANTAGE_EPS) -> float:
    """The largest |reward| a `/run` result may carry: the bound that keeps advantage x tokens, and
    the gradient norm built from it, finite in float32 (docs/reliability.md, "Bounds on a /run result").

    |A| <= 2 |r|max (r_i minus a mean of rewards), times 1/eps where the group's std is normalised
    (a spread std + eps can be as small as eps). The loss sums |A| x weight over at most every token
    of the step and the gradient-norm computation squares each entry, so what has to stay finite is
    |A| x GRAD_HEADROOM <= sqrt(float32 max) (1.8e19), GRAD_HEADROOM (1e4) covering the per-token
    weight and the score gradient's norm; the loss's own sum (|A| x tokens, tokens <= 1e9) is then
    far inside float32."""
    amplification = 2.0 * (1.0 / eps if normalize_rewards and eps < 1.0 else 1.0)
    return math.sqrt(FLOAT32_MAX) / (amplification * GRAD_HEADROOM)


def _int_list(value, what: str, vocab_size: int, where: str = "") -> list[int]:
    # set(map(type, ...)), min and max run in C: this check is on the controller's hot path
    if not isinstance(value, list) or not set(map(type, value)) <= {int}:
        raise RolloutDataFailure(f"malformed /run result: {what} must be a list of integers{where}")
    if value and not (0 <= min(value) and max(value) < vocab_size):
        bad = next(t for t in value if not 0 <= t < vocab_size)
        raise RolloutDataFailure(f"token id {_short(bad)} in {what} is out of vocabulary (size {vocab_size}){where}")
    return value


def _logprobs(lps, n: int, where: str) -> list[float]:
    """One float32-finite number <= 0 per generated token, as floats. A JSON integer is exact and
    unbounded in Python, so it is bounded before it is converted (10**400 overflows a float)."""
    types = set(map(type, lps)) if isinstance(lps, list) else {object}
    if not isinstance(lps, list) or len(lps) != n or not types <= {int, float}:
        raise RolloutDataFailure(
            f"malformed /run result: generation_log_probs must be one number per generated token{where}")
    if int in types:
        ints = [x for x in lps if type(x) is int]
        if not (min(ints) >= -FLOAT32_MAX and max(ints) <= 0):
            bad = next(x for x in ints if not -FLOAT32_MAX <= x <= 0)
            raise RolloutDataFailure(f"malformed /run result: generation_log_probs must be finite and <= 0, got "
                                     f"{_short(bad)} (finite in float32: at least {-FLOAT32_MAX!r}){where}")
        lps = list(map(float, lps))
    if any(map(math.isnan, lps)):
        raise RolloutDataFailure(f"Generation logprobs contain NaN{where}")
    if lps and not (max(lps) <= 0.0 and min(lps) >= -FLOAT32_MAX):
        bad = next(x for x in lps if not -FLOAT32_MAX <= x <= 0.0)
        raise RolloutDataFailure(f"malformed /run result: generation_log_probs must be finite and <= 0, got {bad!r} "
                                 f"(finite in float32: at least {-FLOAT32_MAX!r}){where}")
    return lps


def _reward(reward, bound: float) -> float:
    number = not isinstance(reward, bool) and isinstance(reward, (int, float))
    if not number or reward != reward or not -bound <= reward <= bound:
        raise RolloutDataFailure(f"malformed /run result: reward must be a finite number with |reward| <= {bound:.4g} "
                                 f"(the bound that keeps advantage x tokens finite in float32), got {_short(reward)}")
    return float(reward)  # within the bound: an integer converts exactly enough, and never overflows


SUMMARY_COUNTS = SUMMARY_COUNTERS
"""The summarizing compaction's counters (declared by its policy), summed by `summary_stats`."""
EVIDENCE_COUNTS = ("calls", "compactions", *counter_names())
"""The evidence's integer counts: the agent loop's two and every compaction policy's declared counters."""
SUMMARY_KIND = "compaction_summary"
"""An output item's `trace_kind` for a summary call (agents/compaction/summarize.py writes it)."""
_SCALARS = (str, int, float, bool, type(None))


def _evidence(evidence) -> dict:
    """The agent's evidence, checked for what minirl reads from it (an external agent sends none).
    Only the known keys are kept, each of the shape its readers expect."""
    if evidence is None:
        return {}
    if not isinstance(evidence, dict):
        raise RolloutDataFailure(f"malformed /run result: evidence must be an object, got {_short(evidence)}")
    out = {}
    for key in EVIDENCE_COUNTS:
        if key in evidence:
            v = evidence[key]
            if type(v) is not int or not 0 <= v <= 2**31:
                raise RolloutDataFailure(
                    f"malformed /run result: evidence.{key} must be a non-negative integer, got {_short(v)}")
            out[key] = v
    if "capture_failed" in evidence:
        if not isinstance(evidence["capture_failed"], bool):
            raise RolloutDataFailure(f"malformed /run result: evidence.capture_failed must be a boolean, got "
                                     f"{_short(evidence['capture_failed'])}")
        out["capture_failed"] = evidence["capture_failed"]
    if "end_reason" in evidence:
        if not isinstance(evidence["end_reason"], str):
            raise RolloutDataFailure(
                f"malformed /run result: evidence.end_reason must be a string, got {_short(evidence['end_reason'])}")
        out["end_reason"] = evidence["end_reason"]
    for key in ("guard", "summary"):
        if key not in evidence and key != "guard":
            continue
        records = evidence.get(key, [])
        if not isinstance(records, list) or not all(_flat(g) for g in records):
            raise RolloutDataFailure(
                f"malformed /run result: evidence.{key} must be a list of flat objects, got {_short(records)}")
        out[key] = records
    errors = evidence.get("errors", [])
    if not isinstance(errors, list) or not all(isinstance(e, str) for e in errors):
        raise RolloutDataFailure(
            f"malformed /run result: evidence.errors must be a list of strings, got {_short(errors)}")
    out["errors"] = errors
    if "segment_rewards" in evidence:
        out["segment_rewards"] = _segment_rewards(evidence["segment_rewards"])
    return out


def _segment_rewards(values) -> list[float | None]:
    """Evidence `segment_rewards` (grpo.summary_credit=next_segment): a list of rewards (bounded as a
    rollout's reward is) or nulls."""
    bound = reward_bound(True)
    ok = isinstance(values, list) and all(
        v is None or (not isinstance(v, bool) and isinstance(v, (int, float)) and v == v and -bound <= v <= bound)
        for v in values)
    if not ok:
        raise RolloutDataFailure("malformed /run result: evidence.segment_rewards must be a list of finite numbers "
                                 f"with |x| <= {bound:.4g} or nulls, got {_short(values)}")
    return [None if v is None else float(v) for v in values]


def _flat(record) -> bool:
    return isinstance(record, dict) and all(isinstance(k, str) and isinstance(v, _SCALARS) for k, v in record.items())


def parse_scored(result, max_abs_reward: float) -> dict:
    """A held-out `/run` result (validation reads only its score): the reward, the checked
    evidence, the response's status and the verifier's `mask_sample` (`mask`: its kind and reason,
    None when the reward is a measurement), in a dict of known shapes. Raises RolloutDataFailure
    naming the field, as parse_rollout does for the same fields."""
    if not isinstance(result, dict):
        raise RolloutDataFailure("malformed /run result: not a JSON object")
    response = result.get("response")
    if not isinstance(response, dict):
        raise RolloutDataFailure(f"malformed /run result: response must be an object, got {_short(response)}")
    status = response.get("status")
    return {"reward": _reward(result.get("reward"), max_abs_reward), "evidence": _evidence(result.get("evidence")),
            "response": {"status": status if isinstance(status, str) else None}, "mask": sample_mask(result)}


def parse_rollout(result, coords: Coords, *, vocab_size: int, max_len: int, overlong_filtering: bool,
                  allow_rewrites: bool = True, max_abs_reward: float | None = None) -> Rollout:
    """Validate a `/run` result and turn it into a Rollout: the one parser of a result, total over
    JSON shapes. Any malformed shape raises RolloutDataFailure naming the field, before any
    arithmetic; nothing else escapes (tests/unit/test_evidence.py's table and property test), but for a
    result that reports Gym's EpisodeFailure (its lane's exception, minirl.gym.failures). A result
    whose verifier set `mask_sample` is masked (`mask_sample`, its kind and reason in the evidence).

    `max_abs_reward` defaults to `reward_bound(normalize_rewards=True)`, the tighter one.
    The rollout is truncated (and masked under `overlong_filtering`) when one of its traces
    reaches `max_len` tokens, as upstream marks it; a reply cut by the per-call cap is not."""
    if not isinstance(result, dict):
        raise RolloutDataFailure("malformed /run result: not a JSON object")
    failed = episode_failure(result)  # Gym's EpisodeFailure / _ng_failure_* stamps: its lane (gym.failures)
    if failed is not None:
        raise failed
    response = result.get("response")
    if not isinstance(response, dict) or not isinstance(response.get("output"), list):
        raise RolloutDataFailure("malformed /run result: missing response.output")
    reward = _reward(result.get("reward"), reward_bound(True) if max_abs_reward is None else max_abs_reward)
    evidence = _evidence(result.get("evidence"))
    gym_mask = sample_mask(result)  # the verifier's mask_sample: the reward is not a measurement

    calls: list[Call] = []
    capture_failed = evidence.get("capture_failed", False)
    for i, item in enumerate(response["output"]):
        where = f" (response.output[{i}])"
        if not isinstance(item, dict):
            raise RolloutDataFailure(f"malformed /run result: an output item is not an object{where}")
        if "generation_token_ids" not in item:
            if item.get("type") == "message" and item.get("role") == "assistant" and not _text(item, i):
                capture_failed = True  # an empty model reply without tokens: the call failed (lane A)
            continue
        gen = _int_list(item["generation_token_ids"], "generation_token_ids", vocab_size, where)
        prompt = _int_list(item.get("prompt_token_ids"), "prompt_token_ids", vocab_size, where)
        lps = _logprobs(item.get("generation_log_probs"), len(gen), where)
        if gen:
            calls.append(Call(prompt, gen, lps, *_trace_kind(item, where)))
    if not calls and not capture_failed and gym_mask is None:
        raise RolloutDataFailure("empty episode: the /run result has no trainable model call")
    traces = split_traces(calls, allow_rewrites)
    for t in traces:
        if len(t.tokens) > max_len:
            raise RolloutDataFailure(
                f"trace of {len(t.tokens)} tokens exceeds policy.max_total_sequence_length={max_len}"
            )
    # a summarizing agent that reached max_compactions ends its rollout as truncated
    truncated = any(len(t.tokens) >= max_len for t in traces) or evidence.get("end_reason") == "max_compactions"
    mask_reason = "capture_failed" if capture_failed else ("overlong" if truncated and overlong_filtering else None)
    if evidence.get("end_reason") == "summary_failed":  # on_summary_failure=end_episode
        mask_reason = mask_reason or "summary_failed"
    if gym_mask is not None:  # the verifier's flag, unless the episode has no result to measure
        mask_reason = stronger_mask(MASK_SAMPLE, mask_reason)
        evidence.update(gym_mask)
    return Rollout(coords, reward, calls, traces, capture_failed, evidence, mask_reason)


def _trace_kind(item: dict, where: str) -> tuple[str, dict | None]:
    """A call item's trace kind and compaction record (a summary call's), checked."""
    kind = item.get("trace_kind", "turns")
    if kind not in ("turns", SUMMARY_KIND):
        raise RolloutDataFailure(
            f"malformed /run result: trace_kind must be turns or {SUMMARY_KIND}, got {_short(kind)}{where}")
    record = item.get("compaction")
    if record is not None and not _flat(record):
        raise RolloutDataFailure(
            f"malformed /run result: compaction must be a flat object, got {_short(record)}{where}")
    return kind, record


def _text(item: dict, i: int = 0) -> str:
    """An output message's text: `content` as a string, or a list of parts whose `text` is a string."""
    content = item.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict)]
        if all(isinstance(t, str) for t in texts):
            return "".join(texts)
    raise RolloutDataFailure(f"malformed /run result: response.output[{i}].content must be a string or a list of parts "
                             f"with string text, got {_short(content)}")


LOGPROB_TOLERANCE = 1e-3
"""How far an external agent's logprob may sit from the engine's record of the same token. JSON
carries the engine's float exactly, so only a client that rounds (or clamps at -9999, as vLLM's chat
logprobs do) moves it; a forged number moves it by much more."""


def logprob_gap(reported: list[float], recorded) -> float:
    """The largest |reported - recorded| over a call's tokens, the record clamped at -9999 as the
    chat API writes it; inf when the record holds none to compare."""
    if not isinstance(recorded, list) or len(recorded) != len(reported):
        return math.inf
    return max((abs(a - max(b, -9999.0)) for a, b in zip(reported, recorded)), default=0.0)


def same_call(rec: dict, call: Call) -> bool:
    """Whether a call-log record holds `call`'s tokens (its prompt and generated ids)."""
    return (list(rec.get("prompt_token_ids") or ()) == call.prompt
            and list(rec.get("generation_token_ids") or ()) == call.gen)


Drop = Callable[[], set[tuple[int, int]]]
"""Called by the ledger once a step's masks are set: the (step, group) of the committed groups dropped for them."""


class Ledger:
    """Every model call of every attempt, keyed by (step, group, rollout, attempt), owned by the
    controller and written to `run_dir/ledger/step_N.jsonl`.

    Sources: the generation servers' call logs (what the engine produced for each attempt, even
    when the attempt then failed) and the committed `/run` results (which calls the agent kept).
    """

    def __init__(self, directory: Path | None, segment_validity: str = "all"):
        self.dir = directory
        self.segment_validity = segment_validity
        """`grpo.segment_validity`: whether a short record masks the whole rollout (`all`) or, while
        another of its segments is whole, only the segments holding the unrecorded calls (`any`)."""
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)

    def match_external(self, step: int, pool: list[dict], rollouts: list[Rollout], version: int,
                       oldest: int | None = None, drop: Drop | None = None) -> tuple[Counter, list[dict]]:
        """An external agent's calls carry no rollout header: find each committed call in `pool`
        (the servers' headerless records) by its token content, prompt ids + generated ids. Each
        of these masks its rollout (counted; the controller writes the `mask` event) and never
        ends the run, since an external agent is not minirl's to trust:
        - a call not found (`calls_unrecorded`, mask `unrecorded_calls`), as for minirl's own agents;
        - a call whose logprobs differ from the engine's record by more than LOGPROB_TOLERANCE
          (`calls_logprob_mismatch`, mask `logprob_mismatch`): the agent reported numbers the engine
          did not produce, so neither they nor the rollout's reward are trusted;
        - a call the engine ran under weights outside [oldest, version] (`calls_stale`, mask
          `stale_calls`): e.g. an earlier step's call returned again.
        Returns the counts and the records left unmatched (another step's, or a failed attempt's). The
        lines go in coordinate order, and records alike in content are taken in one order (by seed),
        so a rerun of a seeded run writes the same ledger whatever the arrival order. `drop`: as
        `close_step`'s."""
        oldest = version if oldest is None else oldest
        index: dict[tuple, list[dict]] = {}
        for rec in pool:
            content = (tuple(rec.get("prompt_token_ids") or ()), tuple(rec.get("generation_token_ids") or ()))
            index.setdefault(content, []).append(rec)
        for recs in index.values():  # records alike in content are taken in one order, whatever their arrival
            recs.sort(key=lambda rec: (rec.get("seed") or 0, str(rec.get("version_start"))), reverse=True)
        counts: Counter = Counter()
        lines = []
        for r in sorted(rollouts, key=lambda r: (r.coords.step, r.coords.group, r.coords.rollout, r.coords.attempt)):
            for i, c in enumerate(r.calls):
                found = index.get((tuple(c.prompt), tuple(c.gen)))
                if not found:
                    counts["calls_unrecorded"] += 1
                    r.mask_reason = stronger_mask(r.mask_reason, "unrecorded_calls")
                    continue
                rec = found.pop()
                status = "matched"
                versions = {rec.get("version_start"), rec.get("version_end")} - {None}
                gap = logprob_gap(c.logprobs, rec.get("generation_log_probs"))
                if versions and not (oldest <= min(versions) and max(versions) <= version):
                    status = "stale"
                    r.evidence.setdefault("errors", []).append(
                        f"call {i} ran under weights {sorted(versions)}, "
                        f"but step {step} trains versions {oldest}..{version}")
                elif gap > LOGPROB_TOLERANCE:
                    status = "logprob_mismatch"
                    r.evidence.setdefault("errors", []).append(
                        f"call {i}: a logprob differs from the engine's record by {gap:.4g} "
                        f"(tolerance {LOGPROB_TOLERANCE})")
                if status == "matched":
                    counts["calls_matched"] += 1
                    counts["tokens_matched"] += len(c.gen)
                else:
                    counts[f"calls_{status}"] += 1
                    r.mask_reason = stronger_mask(r.mask_reason, {"stale": "stale_calls"}.get(status, status))
                fields = ("finish_reason", "version_start", "version_end", "generation_token_ids", "seed")
                lines.append({**r.coords.as_dict(), "call": i, **{k: rec.get(k) for k in fields},
                              "http_status": 200, "ledger_status": status})
        self._write(step, self._retire(lines, counts, drop))
        return counts, [rec for recs in index.values() for rec in recs]

    @staticmethod
    def _retire(lines: list[dict], counts: Counter, drop: Drop | None) -> list[dict]:
        """The masks are set: the groups `drop` drops for them (no valid owner) train nothing, and
        their calls' lines say `retired`, so the step's ledger trains the groups its metrics count."""
        dropped = drop() if drop is not None else set()
        for line in lines:
            if (line["step"], line["group"]) in dropped and line["ledger_status"] != "retired":
                counts[f"calls_{line['ledger_status']}"] -= 1
                counts["calls_retired"] += 1
                line["ledger_status"] = "retired"
        return lines

    def _write(self, step: int, lines: list[dict]) -> None:
        if self.dir is not None:
            path = self.dir / f"step_{step}.jsonl"
            with naming(path), open(path, "w") as f:
                for line in lines:
                    f.write(json.dumps(line) + "\n")

    def _mask_segments(self, r: Rollout, calls: set[int], reason: str) -> None:
        """Mask the segments (traces, in call order) that hold `calls`; the rollout takes the reason
        too unless `rollout_votes` under `segment_validity` says it still counts."""
        first = 0
        for t in r.traces:
            if any(first <= i < first + t.calls for i in calls):
                t.mask_reason = t.mask_reason or reason
            first += t.calls
        if not rollout_votes([t.mask_reason is None for t in r.traces] or [False], self.segment_validity):
            r.mask_reason = stronger_mask(r.mask_reason, reason)

    @staticmethod
    def _attempt_key(record: dict) -> tuple:
        return (record["step"], record["group"], record["rollout"], record["attempt"])

    @staticmethod
    def _rejected_summaries(recs: list[dict], calls: list[Call]) -> set[int]:
        """ids of an attempt's summary-call records that none of its committed summary calls (`calls`) is.

        A compaction's requests share their prompt, and a peaked model may answer them alike, so a kept
        summary is found by its request's call key (`s<k>a<n>`, the `call` of its compaction record,
        agents/compaction/summarize.py), never by content alone: token-identical rejected requests stay
        rejected. A summary call without that key (another agent's) takes one record alike in content,
        the newest."""
        kept = [c for c in calls if c.kind != "turns"]
        keys = {(c.compaction or {}).get("call") for c in kept} - {None}
        summaries = [rec for rec in recs if is_summary_call(rec.get("call"))]
        taken = {id(rec) for rec in summaries if rec.get("call") in keys}
        for c in kept:
            if (c.compaction or {}).get("call") is None:
                rec = next((rec for rec in reversed(summaries) if id(rec) not in taken and same_call(rec, c)), None)
                if rec is not None:
                    taken.add(id(rec))
        return {id(rec) for rec in summaries if id(rec) not in taken}

    @staticmethod
    def _trains(r: Rollout, recs: list[dict], rejected: set[int]) -> dict[int, bool]:
        """id of each record that is one of the rollout's calls -> whether that call trains: its rollout
        counts and the segment (trace) holding it is not masked. Calls take records alike in content in
        order, one each. Empty when no segment is masked: every call then goes with its rollout."""
        if all(t.mask_reason is None for t in r.traces):
            return {}
        trains = []
        for t in r.traces:
            trains += [r.sample_mask == 1 and t.mask_reason is None] * t.calls
        free: dict[tuple, list[dict]] = {}
        for rec in recs:
            if rec.get("status") == 200 and id(rec) not in rejected:
                content = (tuple(rec.get("prompt_token_ids") or ()), tuple(rec.get("generation_token_ids") or ()))
                free.setdefault(content, []).append(rec)
        out: dict[int, bool] = {}
        for c, ok in zip(r.calls, trains):
            found = free.get((tuple(c.prompt), tuple(c.gen)))
            if found:
                out[id(found.pop(0))] = ok
        return out

    def close_step(self, step: int, server_calls: list[dict], rollouts: list[Rollout], version: int,
                   oldest: int | None = None, drop: Drop | None = None) -> Counter:
        """Check the committed rollouts against the server's record, retire the rest, persist.

        The rollouts came from minirl's own agents, whose calls carry the rollout header, so the
        servers recorded every one of them. A committed call missing from its attempt's record
        fails the check: when the record is short (a restarted server lost its log) the
        segments holding the missing calls are masked (`unrecorded_calls`), their rollout too
        under `segment_validity=all`, and counted in `calls_unrecorded`; when the record
        is complete and still lacks the call, or a trained call ran under a policy version outside
        [oldest, version] (`oldest` defaults to `version`: synchronous, one version per step), it
        raises RuntimeError. A call may span versions (an in-flight weight update) within the window.
        A committed attempt's summary requests that no trained call is (rejected, or refused as too
        long: agents/compaction/summarize.py) are retired: never trained, never a mismatch, never a mask.
        Every other record of a committed attempt is `masked` when its rollout is masked or the segment
        holding its call is (`segment_validity=any` trains the rollout's other segments), else `trained`.
        `drop` is called once the masks are set, and returns the (step, group) of the committed groups
        the caller drops for them (under CC, a group left with no valid owner): their calls are `retired`.
        """
        oldest = version if oldest is None else oldest
        by_attempt: dict[tuple, list[dict]] = {}
        for rec in server_calls:
            by_attempt.setdefault(self._attempt_key(rec), []).append(rec)
        committed = {(r.coords.step, r.coords.group, r.coords.rollout, r.coords.attempt): r for r in rollouts}
        rejected = {key: self._rejected_summaries(by_attempt.get(key, []), r.calls) for key, r in committed.items()}
        counts: Counter = Counter()
        for key, r in committed.items():
            seen = [(c.get("prompt_token_ids"), c.get("generation_token_ids")) for c in by_attempt.get(key, [])
                    if c.get("status") == 200 and id(c) not in rejected[key]]
            missing = [c for c in r.calls if (c.prompt, c.gen) not in seen]
            if not missing:
                continue
            if len(seen) >= len(r.calls):
                raise RuntimeError(
                    f"ledger mismatch: a trained call of attempt {r.coords.key} "
                    "is not in the generation server's record of that attempt"
                )
            counts["calls_unrecorded"] += len(missing)
            unrecorded = {i for i, c in enumerate(r.calls) if (c.prompt, c.gen) not in seen}
            self._mask_segments(r, unrecorded, "unrecorded_calls")
        lines = []
        for key, recs in sorted(by_attempt.items()):
            rollout = committed.get(key)
            trains = {} if rollout is None else self._trains(rollout, recs, rejected[key])
            for rec in recs:
                status = "retired" if rollout is None or id(rec) in rejected[key] else (
                    "trained" if trains.get(id(rec), rollout.sample_mask == 1) else "masked")
                versions = {rec.get("version_start"), rec.get("version_end")} - {None}
                if status in ("trained", "masked") and versions and not (
                        oldest <= min(versions) and max(versions) <= version):
                    window = f"version {version}" if oldest == version else f"versions {oldest}..{version}"
                    raise RuntimeError(
                        f"policy-version discipline: call {rec['key']} ran under weights {sorted(versions)}, "
                        f"but step {step} trains {window}"
                    )
                counts[f"calls_{status}"] += 1
                lines.append(self._line(rec, status))
        self._write(step, self._retire(lines, counts, drop))
        return counts

    @staticmethod
    def _line(rec: dict, status: str) -> dict:
        return {**{k: rec.get(k) for k in ("step", "group", "rollout", "attempt", "call", "status", "finish_reason",
                                          "version_start", "version_end", "generation_token_ids", "seed")},
                "http_status": rec.get("status"), "ledger_status": status, "error": rec.get("error")}

    def retire(self, step: int, records: list[dict], reason: str) -> None:
        """Records no rollout took, retired at `step` (an external agent's, kept in the controller's pool
        for the window's steps): appended to the step's ledger file as `retired` lines with `reason`."""
        if self.dir is None or not records:
            return
        path = self.dir / f"step_{step}.jsonl"
        with naming(path), open(path, "a") as f:
            for rec in sorted(records, key=lambda rec: (str(rec.get("key")), rec.get("seed") or 0)):
                f.write(json.dumps({**self._line(rec, "retired"), "reason": reason}) + "\n")

    def close_run(self, left: list[dict], served: list[dict]) -> None:
        """The run's end: the call records no step's ledger took (of groups still buffered or in flight,
        late records of retired attempts) are retired into `run_end.jsonl`, each with its `reason`; each
        generation server's own account of what it served this run (`CallLog.finish`: its rank, the keys,
        the count, the records its bound evicted) is one line of `served.jsonl`. With the step files,
        every call a server served is then in exactly one ledger line (minirl/experiments/invariants.py)."""
        if self.dir is None:
            return
        run_end, served_path = self.dir / "run_end.jsonl", self.dir / "served.jsonl"
        with naming(run_end), open(run_end, "w") as f:
            for rec in sorted(left, key=lambda rec: str(rec.get("key"))):
                f.write(json.dumps({**self._line(rec, "retired"), "reason": "run_end: no step took its group"}) + "\n")
        with naming(served_path), open(served_path, "w") as f:
            for account in served:
                f.write(json.dumps({k: account[k] for k in ("rank", "served_count", "dropped", "served", "error")
                                    if k in account}) + "\n")


def summary_stats(rollouts: list[Rollout]) -> dict:
    """The summarizing compaction's per-step metrics over the kept rollouts' evidence (nan: none to
    average): summaries per rollout, generated tokens per summary, prompt tokens before / after,
    the share of needed memory facts the summaries carried, rejected attempts, failed summaries."""
    total: Counter = Counter()
    for r in rollouts:
        total.update({k: r.evidence.get(k, 0) for k in SUMMARY_COUNTS})

    def ratio(a: str, b: str) -> float:
        return total[a] / total[b] if total[b] else float("nan")

    return {
        "summaries": total["summaries"] / len(rollouts) if rollouts else float("nan"),
        "summary_tokens_mean": ratio("summary_tokens", "summaries"),
        "compaction_ratio": ratio("summary_tokens_before", "summary_tokens_after"),
        "summary_recall": ratio("summary_facts_recalled", "summary_facts_needed"),
        "summary_attempts_rejected": total["summary_attempts_rejected"],
        "summaries_failed": total["summaries_failed"],
    }
