"""What crosses a process boundary: rollout coordinates (`Coords`) and the HTTP header that carries
them, the failure taxonomy (INFRA / DATA, as NeMo-RL's `nemo_rl/experience/failures.py` draws it),
the typed error body of a failed `/run`, where a `/run` row carries its per-request sampling extras,
and Gym's collector keys. Every layer imports these from here; this module imports nothing of minirl's.

Invariants: `classify` is total (every exception gets INFRA or DATA, anything unrecognised DATA); a
header or `_minirl` value that does not parse raises `BadCoordinates` (a ValueError), never anything
else; `extra_body` returns exactly what `with_extra_body` wrote, and neither drops a key already there.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass

ROLLOUT_HEADER = "X-Minirl-Rollout"
"""HTTP header carrying a model call's coordinates (`s0.g1.r0.a0.c2`) from the agent to the model server."""

SEED_HEADER = "X-Minirl-Seed"
"""HTTP header by which minirl's own agents (`SEED_AS_SENT`) tell the model server that a call's seed
already differs per call (`seed + call`), so it samples with it as sent; any other headerless call's
seed is made per call by the server (minirl.generation.server.call_seed)."""
SEED_AS_SENT = "per-call"

_N = "([0-9]{1,9})"  # ASCII digits only: `\d` takes any Unicode digit, which int() would read
_KEY = re.compile(rf"s{_N}\.g{_N}\.r{_N}\.a{_N}")  # matched whole (fullmatch: `$` lets a trailing newline by)
_CALL_KEY = re.compile(r"(s[0-9]{1,9}\.g[0-9]{1,9}\.r[0-9]{1,9}\.a[0-9]{1,9})\.(c[0-9]{1,9}|s[0-9]{1,9}a[0-9]{1,9})")
COORD_FIELDS = ("step", "group", "rollout", "attempt")


class BadCoordinates(ValueError):
    """A rollout header or `_minirl` block that does not parse; the message names what is wrong."""


@dataclass(frozen=True)
class Coords:
    """Where a rollout attempt sits: step, group (dispatch order), rollout in group, attempt of it.

    Written `s0.g1.r0.a0` (`key`); a model call appends `.c2` (a summary call `.s1a0`: compaction 1,
    attempt 0; `parse_call_key`). A `/run` row carries them as
    `_minirl: {step, group, rollout, attempt, group_attempt}` (`from_row`)."""

    step: int
    group: int
    rollout: int
    attempt: int

    @property
    def key(self) -> str:
        return f"s{self.step}.g{self.group}.r{self.rollout}.a{self.attempt}"

    @classmethod
    def from_key(cls, key: str) -> "Coords":
        m = _KEY.fullmatch(key) if isinstance(key, str) else None
        if m is None:
            raise BadCoordinates(f"rollout coordinates must look like s0.g1.r0.a0, got {short(key)}")
        return cls(*map(int, m.groups()))

    @classmethod
    def from_row(cls, row: dict) -> "Coords | None":
        """The coordinates of a `/run` row's `_minirl` block, or None for a row without one."""
        block = row.get("_minirl")
        if block is None:
            return None
        if not isinstance(block, dict):
            raise BadCoordinates("_minirl must be an object")
        values = [block.get(k) for k in COORD_FIELDS]
        bad = [k for k, v in zip(COORD_FIELDS, values) if isinstance(v, bool) or not isinstance(v, int) or v < 0]
        if bad:
            raise BadCoordinates(f"_minirl.{bad[0]} must be a non-negative integer, got {short(block.get(bad[0]))}")
        return cls(*values)

    def as_dict(self) -> dict:
        return {"step": self.step, "group": self.group, "rollout": self.rollout, "attempt": self.attempt}


def parse_call_key(key: str) -> tuple[Coords, int | str]:
    """`s0.g1.r0.a0.c2` -> (Coords(0, 1, 0, 0), 2); a summary call `s0.g1.r0.a0.s1a2` (compaction 1,
    attempt 2) -> (Coords(0, 1, 0, 0), "s1a2"), a call index no per-call fault matches. Raises BadCoordinates."""
    m = _CALL_KEY.fullmatch(key) if isinstance(key, str) else None
    if m is None:
        raise BadCoordinates(f"{ROLLOUT_HEADER} must look like s0.g1.r0.a0.c2, got {short(key)}")
    call = m.group(2)
    return Coords.from_key(m.group(1)), int(call[1:]) if call[0] == "c" else call


def is_summary_call(call) -> bool:
    """Whether a call-log record's `call` is a summary call's (`s<k>a<j>`, see parse_call_key)."""
    return isinstance(call, str) and call.startswith("s")


# -------------------------------------------------------------------------------------- taxonomy
# INFRA failures (the fleet, the network, a timeout) are worth retrying with backoff; DATA failures (a
# bad result, a 4xx, anything unrecognised) are retried without backoff and then skipped or raised.
# RolloutRedispatchExhausted, RolloutStall and GenerationFleetUnhealthy are deliberately not
# RolloutFailures, so no per-attempt retry loop ever catches them.
INFRA = "infra"
DATA = "data"


class RolloutFailure(Exception):
    """Base of failures the retry policy handles."""


class RolloutInfraFailure(RolloutFailure):
    """The fleet failed: retry with backoff."""


class RolloutTimeout(RolloutInfraFailure):
    """A rollout exceeded its deadline."""


class GenerationUnavailable(RolloutInfraFailure):
    """No generation server could serve the call."""


NO_HEALTHY_BACKEND = "NoHealthyBackendError"
"""The `error.type` of the generation router's answer when no worker is eligible (its status is
`async_rl.generation_router.no_healthy_backend_status`, a 4xx so that Gym does not retry it): a
fleet outage, which minirl's model client raises as GenerationUnavailable, whatever the status."""


class GymTransportError(RolloutInfraFailure):
    """`/run` failed at the transport or with an INFRA HTTP status.

    `error_type` is the `type` field of the agent server's error body (e.g. `ContextGuardRejected`),
    when it sent one."""

    def __init__(self, message: str, error_type: str | None = None):
        super().__init__(message)
        self.error_type = error_type


class AgentUnreachable(GymTransportError):
    """`/run` could not reach the agent server: the connection was refused or reset (the server is
    down, or restarting at its port). Re-sent on another agent server at once; a group that reaches
    none keeps retrying for `rollout_failure.agent_restart_window_s` of backoff."""


class RolloutDataFailure(RolloutFailure):
    """The rollout's result is unusable: retry without backoff, then skip or raise."""

    def __init__(self, message: str, error_type: str | None = None):
        super().__init__(message)
        self.error_type = error_type


class AgentBadAnswer(RolloutDataFailure):
    """An agent server answered `/run` with 200 and a body that is not JSON (a proxy's error page, a
    server of another kind): the server's own failure, so the row is re-sent at once on another
    agent server where one is up, and a server that keeps answering so is marked down. With no
    other server up it is DATA as any malformed result."""


class DeterministicFailure(RolloutDataFailure):
    """A row's `/run` answered the same 5xx and error text on `max_identical_failures` sends in a row:
    it will not pass, so its group is never retried again (skipped as DATA, or the run ends naming it)."""


class RolloutRedispatchExhausted(RuntimeError):
    """The consecutive-drop budget ran out: the generation fleet is not recovering."""


class RolloutStall(RuntimeError):
    """No rollout completed within the stall watchdog's timeout."""


class GenerationFleetUnhealthy(RuntimeError):
    """Fewer generation workers out of quarantine than `generation_fleet_health.min_healthy_shards`:
    the run ends, naming the quarantined workers and their failed probes."""


class ContextGuardRejected(RuntimeError):
    """The context guard refused a model call (upstream raises RuntimeError with this text)."""


class SummaryFailed(RolloutInfraFailure):
    """A summarizing compaction ran out of summary attempts (`on_summary_failure=raise`): a retryable
    harness failure (HTTP 500 across the hop, INFRA), never a reward of 0."""


SUMMARY_FAILED_SCORED = "summary_failed_scored"
"""The end reason (evidence `end_reason`) of an episode whose summary attempts ran out under
`on_summary_failure=end_episode_scored`: a policy failure, so the rollout trains, never masked; a
held-out one scores 0, as `summary_failed` does."""


class ModelCallFailed(RuntimeError):
    """A model call answered with an error other than the context-length 400 (which the agent absorbs:
    docs/failure-policy.md, lane A). As in Gym's `simple_agent`, the agent does not absorb it: `/run`
    fails with HTTP 500 (INFRA). `status` is the model server's HTTP status, so `classify` reads a 4xx
    as DATA."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def _infra_types() -> tuple[type, ...]:
    types: list[type] = [TimeoutError, asyncio.TimeoutError, ConnectionError]
    try:
        import aiohttp

        types += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, aiohttp.ServerTimeoutError]
    except ImportError:  # pragma: no cover
        pass
    try:  # upstream's list (NeMo-RL 7ea279a): the actor, its scheduling, its worker, node, raylet and RPC, its
        # objects and the object store, a get that timed out, memory
        import ray.exceptions as rex

        types += [rex.RayActorError, rex.ActorDiedError, rex.ActorUnavailableError, rex.ActorUnschedulableError,
                  rex.TaskUnschedulableError, rex.WorkerCrashedError, rex.NodeDiedError, rex.LocalRayletDiedError,
                  rex.RpcError, rex.ObjectLostError, rex.OwnerDiedError, rex.ObjectFetchTimedOutError,
                  rex.GetTimeoutError, rex.OutOfMemoryError, rex.ObjectStoreFullError, rex.RaySystemError]
    except (ImportError, AttributeError):  # pragma: no cover
        pass
    return tuple(types)


_INFRA_TYPES = _infra_types()


def http_class(status: int) -> str:
    return INFRA if status >= 500 or status in (408, 429) else DATA


def classify(exc: BaseException) -> str:
    """INFRA or DATA, as upstream's `classify_rollout_failure`: a RolloutDataFailure is DATA; else INFRA
    when any link of the `__cause__` chain is (at most 8 links; it stops at a cycle), anything else DATA."""
    if isinstance(exc, RolloutDataFailure):
        return DATA
    seen: set[int] = set()
    link: BaseException | None = exc
    for _ in range(8):
        if link is None or id(link) in seen:
            break
        seen.add(id(link))
        if _is_infra(link):
            return INFRA
        link = link.__cause__
    return DATA


def _is_infra(link: BaseException) -> bool:
    """One link, as upstream's `_is_infra`: a RolloutFailure by its class (the status minirl's carry is the
    answer they came from, already read into the class); another HTTP answer by its status (a 4xx
    describes the request: the walk goes on to its cause); anything else by its type."""
    if isinstance(link, (RolloutDataFailure, RolloutInfraFailure)):
        return isinstance(link, RolloutInfraFailure)
    status = getattr(link, "status", None)
    if isinstance(status, int) and 100 <= status < 600:
        return http_class(status) == INFRA
    return isinstance(link, _INFRA_TYPES)


# ------------------------------------------------------------------------------ /run error body
ERROR_BODY_LIMIT = 4096
"""Characters of an error body kept in a failure (enough for a whole validation error)."""


def run_error_body(exc: BaseException, status: int | None = None, stage: str = "agent") -> dict:
    """The JSON body of a failed `/run` (`status`, default `run_error_status(exc)`): Gym's middleware
    text (`repr(e)`) and the exception's type, plus Gym 0.7's `failure_kind` (the exception's own,
    else one named from the status and `stage`), `stage` and `terminal` (a 4xx is terminal: it
    answers the same way again), so that one classifier reads minirl's agent pool and Gym's."""
    status = run_error_status(exc) if status is None else status
    kind = getattr(exc, "failure_kind", None)
    if not isinstance(kind, str):
        kind = ("agent_run_error" if status >= 500
                else "minirl:" + ("bad_row" if stage == "admission" else "bad_request"))
    facts = {"type": type(exc).__name__, "failure_kind": kind, "stage": stage, "terminal": http_class(status) == DATA}
    return {**facts, "error": repr(exc)[:ERROR_BODY_LIMIT]}  # the facts first, the text bounded: a reader keeps both


def run_error_status(exc: BaseException) -> int:
    """The status of a failed `/run`: 500, as Gym's middleware answers any agent exception, except
    for a failure known to be the data's (an explicit RolloutDataFailure, or a model server's 4xx
    other than 408/429), which answers 400 so that it stays DATA across the hop."""
    known = isinstance(exc, RolloutDataFailure) or isinstance(exc, ModelCallFailed)
    return 400 if classify(exc) == DATA and known else 500


_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if c not in (0x09, 0x0A)}


def printable(text: str) -> str:
    """`text` with its control characters (ESC, CR, NUL, BEL, DEL, C1; not tab or newline) written as
    `\\xNN`: what an agent or environment says can reach a terminal's last line without driving it."""
    return text.translate(_CONTROL)


def short(value) -> str:
    """A bounded description of any JSON value (a container's repr could recurse past the limit,
    and an integer's str is refused past 4300 digits)."""
    if isinstance(value, (list, dict)):
        return f"a {type(value).__name__} of {len(value)} item(s)"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_error_body(raw: bytes) -> tuple[str, str | None]:
    """(error text, type) from a `/run` error body: ours, `{"error": ...}`, Gym's middleware body (a
    JSON string, `repr(e)`: read once, so its text carries no extra level of escaping), or plain
    text; control characters escaped (`printable`)."""
    text = raw[:ERROR_BODY_LIMIT].decode(errors="replace")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # an agent's body nested past the parser's limit is text too
        return printable(text), None
    if isinstance(body, str):
        return printable(body[:ERROR_BODY_LIMIT]), None
    if isinstance(body, dict):
        error, kind = body.get("error"), body.get("type")
        if isinstance(error, dict):  # OpenAI-style {"error": {"message", "type"}}
            error, kind = error.get("message"), kind or error.get("type")
        if error is not None:
            return printable(str(error)[:ERROR_BODY_LIMIT]), kind if isinstance(kind, str) else None
    return printable(text), None


EXTRA_BODY = "responses_create_params.metadata.extra_body"
"""Where a `/run` row carries its per-request sampling extras (the seed). Gym's
`responses_create_params` is the Responses API's create-params, which has no `seed`; Gym's
`vllm_model` merges `metadata.extra_body`, a JSON object written as a string (metadata values are
strings), into each chat-completions request it sends. So a row's seed travels there, and minirl's
own agent reads it from the same place. A malformed `extra_body` raises ValueError naming this key."""


def extra_body(params: dict) -> dict:
    """The per-request extras of a row's `responses_create_params` ({} when there are none)."""
    metadata = params.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise ValueError(f"responses_create_params.metadata must be an object, got {type(metadata).__name__}")
    raw = (metadata or {}).get("extra_body")
    if raw is None:
        return {}
    try:
        extras = json.loads(raw) if isinstance(raw, str) else None
    except (ValueError, RecursionError):
        extras = None
    if not isinstance(extras, dict):
        raise ValueError(f"{EXTRA_BODY} must be a JSON object written as a string, got {short(raw)}")
    return extras


def with_extra_body(params: dict, **extras) -> dict:
    """A copy of `params` whose `metadata.extra_body` also holds `extras` (later keys win)."""
    metadata = dict(params.get("metadata") or {})
    metadata["extra_body"] = json.dumps({**extra_body(params), **extras}, sort_keys=True)
    return {**params, "metadata": metadata}


TASK_INDEX, ROLLOUT_INDEX = "_ng_task_index", "_ng_rollout_index"
ATTEMPT_INDEX, ROLLOUT_ID = "_ng_attempt_index", "_ng_rollout_id"
"""Gym 0.7's collector keys (`nemo_gym/global_config.py`: TASK_INDEX_KEY_NAME, ...). minirl is the
rollout collector, so each `/run` carries them (`collector_keys`), and a flat-row Environment Server
(`environment_servers/single_agent_turn_legacy`) reads them to name the episode: one episode per
rollout attempt, never shared by two rollouts of a row, nor by the same row at two steps."""


def collector_keys(coords: Coords, task_index: int) -> dict:
    """The keys Gym's collector puts on a `/run` row, for one attempt of one rollout: the task's index
    in its dataset, the rollout's index among its row's repeats, the attempt, and an explicit rollout id
    (`s0.g1.r0`: Gym's `{task}-{rollout}` would repeat when a later step trains the same row). Gym
    derives the episode id from them: (`_ng_rollout_id`, `_ng_attempt_index`), capture key `s0.g1.r0-a1`."""
    return {TASK_INDEX: task_index, ROLLOUT_INDEX: coords.rollout, ATTEMPT_INDEX: coords.attempt,
            ROLLOUT_ID: f"s{coords.step}.g{coords.group}.r{coords.rollout}"}
