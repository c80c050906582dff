"""Gym's failure facts -> minirl's lanes, in one place: what NeMo Gym 0.7.0 reports about a failed
episode (`mask_sample`, an `EpisodeFailure{terminal, failure_kind, stage}`, the collector's
`_ng_failure_*` stamps) read as INFRA (retried), DATA (never retried) or a masked rollout, each
failure with a kind from Gym's vocabulary (`FAILURE_KINDS`). docs/gym.md ("Gym's failure facts")
holds the table; the first row that applies decides.

Invariant: imports `minirl.wire` only; every reader here is total over JSON shapes: a result without
facts gives None, a fact of the wrong type a RolloutDataFailure naming it, never another exception;
every text it passes on is bounded and has its control characters escaped.
"""

from __future__ import annotations

import json
import re

from minirl.wire import (
    DATA,
    INFRA,
    GenerationUnavailable,
    DeterministicFailure,
    GymTransportError,
    RolloutDataFailure,
    RolloutInfraFailure,
    RolloutTimeout,
    classify,
    http_class,
    printable,
    short,
)

FAILURE_KINDS = frozenset({
    "transport_unreachable", "transport_peer_drop", "transport_timeout", "transport_local_resource",
    "agent_run_error", "agent_request_failed", "agent_timeout", "agent_command_not_allowed",
    "judge_failed", "judge_unparseable", "verifier_error",
    "provider_unavailable", "provider_quota_exhausted", "provider_oom_killed",
    "session_lost", "session_expired", "session_release_failed",
    "cancelled", "kill_shaped", "shutdown", "persistence_failed", "cohort_incomplete",
})
"""Gym 0.7.0's shared vocabulary (`nemo_gym.failure_kinds.FAILURE_KINDS`), name for name."""
STAGES = ("admission", "seed", "agent", "verification", "cleanup")
"""Gym's `FailureStage`: where an episode failed."""
NG_TERMINAL = "_ng_failure_terminal"
NG_CLASS = "_ng_failure_class"
NG_FAILURE_PREFIX = "_ng_failure_"
"""Every key Gym's collector stamps on a failed row starts so (`_ng_failure_message`, `_stage`, ...)."""
RESULT_FACTS = ("failure", "mask_sample", "failure_kind", "failure_reason")
"""A result's failure facts outside the `_ng_failure_*` stamps (`without_result_facts`)."""
MASK_SAMPLE = "mask_sample"
"""The mask reason of a rollout whose verifier said its reward is not a measurement."""
_NAMESPACED = re.compile(r"[a-z][a-z0-9_]*:[a-z][a-z0-9_]*")
_SERVER_DID_NOT_RUN = (429, 502, 503, 504)  # Gym's collector: something in front of the agent answered


def known_kind(name) -> bool:
    """Whether `name` is in Gym's vocabulary or namespaced `<server>:<kind>` (Gym warns on others)."""
    return isinstance(name, str) and (name in FAILURE_KINDS or bool(_NAMESPACED.fullmatch(name)))


KIND_LIMIT = 64
"""Characters of a `failure_kind` (or `_ng_failure_class`) kept: Gym's names are low-cardinality
labels of at most ~30, safe as a metric key; a longer one is cut, with a marker saying so."""
REASON_LIMIT = 2000
"""Characters of a `failure_reason` kept (Gym's `EpisodeFailure.failure_reason` max_length)."""


def _bounded(value: str) -> str:
    value = printable(value)
    return value if len(value) <= KIND_LIMIT else f"{value[:KIND_LIMIT]}...(cut from {len(value)} chars)"


def _kind(value, default: str) -> str:
    return _bounded(value) if isinstance(value, str) and value else default


def _reason(value) -> str:
    return printable(str(value)[:REASON_LIMIT])


def _class_kind(name) -> str:
    """A kind for a `_ng_failure_class` that comes without one: the class where it is a kind of Gym's
    vocabulary (`judge_failed`), `agent_timeout` for Gym's legacy `timeout_exceeded`, else
    `agent_run_error` (as Gym's collector files `environment_server_failed` and the other classes
    that predate the vocabulary: the server answered, and the episode broke)."""
    if known_kind(name):
        return _bounded(name)
    return "agent_timeout" if name == "timeout_exceeded" else "agent_run_error"


def _flag(container: dict, key: str, field: str) -> bool:
    """A boolean fact: absent or null is False. Any other type is a malformed result naming the field;
    minirl does not coerce as Gym's pydantic models would ("true", 1), nor read truthiness as Gym's
    collector reads `_ng_failure_terminal` (where "false" would be terminal)."""
    value = container.get(key)
    if value is None or isinstance(value, bool):
        return bool(value)
    raise RolloutDataFailure(f"malformed /run result: {field} must be a boolean (true, false or null), "
                             f"got {short(value)}")


class _Facts:
    """Gym's facts about one failure, carried on the exception."""

    def __init__(self, message: str, failure_kind: str, stage: str | None, terminal: bool, error_type: str | None):
        super().__init__(message, error_type)
        self.failure_kind, self.stage, self.terminal = failure_kind, stage, terminal


class EpisodeFailed(_Facts, GymTransportError):
    """A non-terminal episode failure reported by the environment: INFRA, retried."""


class EpisodeFailedTerminal(_Facts, RolloutDataFailure):
    """A terminal episode failure reported by the environment: DATA, never retried."""


def _failure(message: str, kind: str, stage, terminal: bool,
             error_type: str | None) -> RolloutInfraFailure | RolloutDataFailure:
    cls = EpisodeFailedTerminal if terminal else EpisodeFailed
    return cls(message, kind, stage if stage in STAGES else None, terminal, error_type)


def episode_failure(result, what: str = "/run") -> RolloutInfraFailure | RolloutDataFailure | None:
    """The failure a 200 `/run` result reports (an EpisodeFailure body, or a row stamped by Gym's
    collector), as the lane's exception; None for any other result. A stamp whose class is null is
    success (Gym's collector: `_ng_failure_class is None`); a non-terminal stamp beside `mask_sample`
    is not a failure but a masked rollout (Gym's `judge_failsafe` writes both; NeMo-RL reads the mask).
    Raises RolloutDataFailure naming a fact of the wrong type."""
    if not isinstance(result, dict):
        return None
    masked = sample_mask(result) is not None  # its facts' types are checked first, whatever else decides
    failure = result.get("failure")
    if isinstance(failure, dict):
        terminal = failure.get("terminal")
        if not isinstance(terminal, bool):
            raise RolloutDataFailure("malformed /run result: failure.terminal must be a boolean "
                                     f"(Gym's EpisodeFailure), got {short(terminal)}")
        return _failure(f"{what} reported an EpisodeFailure (terminal={terminal}): "
                        f"{_reason(failure.get('failure_reason'))}",
                        _kind(failure.get("failure_kind"), "agent_run_error"), failure.get("stage"), terminal,
                        "EpisodeFailure")
    name = result.get(NG_CLASS)
    if name is not None and not isinstance(name, str):
        raise RolloutDataFailure(f"malformed /run result: {NG_CLASS} must be a string or null, got {short(name)}")
    terminal = _flag(result, NG_TERMINAL, NG_TERMINAL)
    if not terminal and (name is None or masked):
        return None
    shown = None if name is None else _bounded(name)
    reason = _reason(result.get("_ng_failure_message") or shown)
    return _failure(f"{what} reported {NG_CLASS}={shown!r} ({NG_TERMINAL}={terminal}): {reason}",
                    _kind(result.get("failure_kind"), _class_kind(name)), result.get("_ng_failure_stage"),
                    terminal, shown)


def sample_mask(result) -> dict | None:
    """`{failure_kind, failure_reason}` when a `/run` result's verifier set `mask_sample` (top level,
    or Gym's legacy `instance_config.mask_sample`); None when the reward is a measurement. Raises
    RolloutDataFailure naming a `mask_sample` that is not a boolean (or null)."""
    if not isinstance(result, dict):
        return None
    legacy = result.get("instance_config")
    masked = _flag(result, MASK_SAMPLE, MASK_SAMPLE)
    if isinstance(legacy, dict):
        masked = _flag(legacy, MASK_SAMPLE, f"instance_config.{MASK_SAMPLE}") or masked
    if not masked:
        return None
    reason = result.get("failure_reason")
    return {"failure_kind": _kind(result.get("failure_kind"), "verifier_error"),
            "failure_reason": _reason(reason) if reason is not None else None}


def error_failure(status: int, raw: bytes, message: str,
                  error_type: str | None) -> RolloutInfraFailure | RolloutDataFailure:
    """A non-200 `/run` as the lane's exception: by the body's `terminal` where it has one (minirl's
    agent pool, a Gym server that sends facts), else by status (`wire.http_class`); the body's kind
    and stage ride on it."""
    try:  # the whole body, as parse_error_body reads it: a long error text before the facts would cut them off
        facts = json.loads(raw)
    except (ValueError, RecursionError):
        facts = None
    facts = facts if isinstance(facts, dict) else {}
    terminal = facts.get("terminal") if isinstance(facts.get("terminal"), bool) else None
    default = "agent_request_failed" if status in _SERVER_DID_NOT_RUN else "agent_run_error"
    data = terminal if terminal is not None else http_class(status) == DATA
    exc = (RolloutDataFailure if data else GymTransportError)(message, error_type)
    exc.failure_kind, exc.stage, exc.terminal = _kind(facts.get("failure_kind"), default), facts.get("stage"), terminal
    return exc


def failure_facts(exc: BaseException) -> dict:
    """`{failure_kind, stage, terminal}` for any failure: what it carries, else named from its class.
    `terminal` says the row is never sent again for it: the failure's own fact where it has one,
    else true only for a deterministic failure (a DATA failure without the fact is retried). A
    deterministic failure is its repeated answer's kind and stage (an agent's 500 stays `agent_run_error`)."""
    if isinstance(exc, DeterministicFailure) and exc.__cause__ is not None:
        return {**failure_facts(exc.__cause__), "terminal": True}
    kind = getattr(exc, "failure_kind", None)
    if not isinstance(kind, str):
        kind = _kind_of(exc)
    terminal = getattr(exc, "terminal", None)
    stage = getattr(exc, "stage", None)
    return {"failure_kind": kind, "stage": stage if stage in STAGES else None,
            "terminal": terminal if isinstance(terminal, bool) else isinstance(exc, DeterministicFailure)}


def _kind_of(exc: BaseException) -> str:
    """A kind for a failure that carries none, from its minirl class."""
    if isinstance(exc, RolloutTimeout):
        return "agent_timeout"
    if isinstance(exc, GenerationUnavailable):
        return "transport_unreachable"
    link = exc.__cause__ if isinstance(exc, GymTransportError) and exc.__cause__ is not None else exc
    if isinstance(link, TimeoutError):
        return "transport_timeout"
    if isinstance(link, ConnectionRefusedError) or "Connector" in type(link).__name__:
        return "transport_unreachable"
    if link is not exc or isinstance(link, ConnectionError):
        return "transport_peer_drop"  # failed in transport after connecting
    if isinstance(exc, RolloutDataFailure):
        return "minirl:bad_result"
    if classify(exc) == INFRA:
        return "agent_run_error"
    return "minirl:" + re.sub(r"(?<!^)(?=[A-Z])", "_", type(exc).__name__).lower()


def mask_facts(reason: str, evidence: dict) -> dict:
    """The kind (and reason) of a masked rollout: the verifier's under `mask_sample`, else `minirl:<reason>`."""
    if reason == MASK_SAMPLE:
        return {"failure_kind": evidence.get("failure_kind", "verifier_error"),
                "failure_reason": evidence.get("failure_reason")}
    return {"failure_kind": f"minirl:{reason}"}


# ------------------------------------------------------------------ minirl's agent pool, in Gym's shapes
LOST_SESSION = {"failure_kind": "session_lost",
                "failure_reason": "the resources session was lost before verification "
                "(injected session_lost fault): the reward is not a measurement"}
"""What a verifier reports for a session the seeded fault plan loses (`faults.*` kind `session_lost`)."""
EXPIRED_SESSION = {"failure_kind": "session_expired",
                   "failure_reason": "the resources session is not held (never seeded, or dropped as the oldest "
                   "past the server's max_live_episodes): the reward is not a measurement"}
"""What the Gym 0.7 doors server's verifier reports for a session it does not hold."""


def without_result_facts(row: dict) -> dict:
    """`row` without the result facts a request may carry (a row copied from a rollout dump): an
    EpisodeFailure `failure`, Gym's `_ng_failure_*` stamps, the verify fields and the legacy
    `instance_config.mask_sample`. An agent echoes its request into its result, and these there
    would report a failure (or a mask) that this episode never had."""
    out = {k: v for k, v in row.items() if k not in RESULT_FACTS and not k.startswith(NG_FAILURE_PREFIX)}
    legacy = out.get("instance_config")
    if isinstance(legacy, dict) and MASK_SAMPLE in legacy:
        out["instance_config"] = {k: v for k, v in legacy.items() if k != MASK_SAMPLE}
    return out


def verified(result: dict, mask: dict | None = None) -> dict:
    """A `/run` result (the request's row, echoed, plus the episode's) with Gym 0.7's verify-response
    fields: `mask_sample` and, when masked, why, with reward 0.0 as Gym's failsafes report it (the score
    is not a measurement); no result fact echoed from the request."""
    result = without_result_facts(result)
    if mask is None:
        return {**result, "mask_sample": False, "failure_kind": None, "failure_reason": None}
    return {**result, "reward": 0.0, "mask_sample": True, "failure_kind": mask["failure_kind"],
            "failure_reason": mask.get("failure_reason")}


def kind_counts(outcomes, kept) -> dict:
    """The step's `failures_by_kind` (the `failure` events of the groups it took, lost or evicted,
    summed over their outcomes) and `masked_by_kind` (its `kept` rollouts that are masked)."""
    failures: dict[str, int] = {}
    for o in outcomes:
        for kind, n in o.failures_by_kind.items():
            failures[kind] = failures.get(kind, 0) + n
    masked: dict[str, int] = {}
    for r in kept:
        if r.mask_reason:
            kind = mask_facts(r.mask_reason, r.evidence)["failure_kind"]
            masked[kind] = masked.get(kind, 0) + 1
    return {"failures_by_kind": dict(sorted(failures.items())), "masked_by_kind": dict(sorted(masked.items()))}
