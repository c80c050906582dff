"""minirl.wire: the failure taxonomy (classification, the cause chain walk), coordinates and the
header, and the typed /run error body."""

import asyncio

import aiohttp
import pytest

from minirl.wire import (
    DATA,
    INFRA,
    GenerationUnavailable,
    GymTransportError,
    RolloutDataFailure,
    RolloutFailure,
    RolloutRedispatchExhausted,
    RolloutStall,
    RolloutTimeout,
    BadCoordinates,
    ContextGuardRejected,
    Coords,
    ModelCallFailed,
    classify,
    parse_call_key,
    parse_error_body,
    run_error_body,
    run_error_status,
)


class Status(Exception):
    def __init__(self, status):
        self.status = status


@pytest.mark.parametrize("status,kind",
                         [(500, INFRA), (503, INFRA), (408, INFRA), (429, INFRA), (400, DATA), (404, DATA),
                          (422, DATA)])
def test_http_statuses(status, kind):
    assert classify(Status(status)) == kind


@pytest.mark.parametrize(
    "exc,kind",
    [
        (RolloutTimeout("x"), INFRA),
        (GymTransportError("x"), INFRA),
        (GenerationUnavailable("x"), INFRA),
        (asyncio.TimeoutError(), INFRA),
        (ConnectionResetError(), INFRA),
        (aiohttp.ServerDisconnectedError(), INFRA),
        (RolloutDataFailure("x"), DATA),
        (ModelCallFailed("x", 500), INFRA),
        (ModelCallFailed("x", 429), INFRA),
        (ModelCallFailed("x", 400), DATA),
        (KeyError("x"), DATA),
        (ValueError("x"), DATA),
    ],
)
def test_types(exc, kind):
    assert classify(exc) == kind


def chain(top, *causes):
    exc = top
    for c in causes:
        exc.__cause__ = c
        exc = c
    return top


def test_cause_chain_is_walked():
    assert classify(chain(ValueError("wrapper"), KeyError("inner"), ConnectionError())) == INFRA
    assert classify(chain(RuntimeError("a"), Status(503))) == INFRA


def test_explicit_data_failure_wins_over_infra_cause():
    assert classify(chain(RolloutDataFailure("bad"), ConnectionError())) == DATA


def test_the_walk_goes_on_past_a_4xx_or_a_data_link_as_upstreams():
    """Upstream's `_is_infra` reads one link: a 4xx or a RolloutDataFailure below the top is not INFRA, and
    the walk goes on to its cause (the first recognisable link decided before)."""
    assert classify(chain(RuntimeError("wrapper"), Status(400), ConnectionError())) == INFRA
    assert classify(chain(RuntimeError("wrapper"), RolloutDataFailure("bad"), TimeoutError())) == INFRA
    assert classify(chain(RuntimeError("wrapper"), Status(400), KeyError("x"))) == DATA


def test_walk_stops_after_eight_links_and_on_cycles():
    links = [ValueError(str(i)) for i in range(8)] + [ConnectionError()]
    assert classify(chain(*links)) == DATA  # the INFRA cause is the 9th link
    assert classify(chain(*links[-8:])) == INFRA
    a, b = ValueError("a"), ValueError("b")
    a.__cause__, b.__cause__ = b, a
    assert classify(a) == DATA


class Counted(Exception):
    """A link that counts how often the walk looks at it (through its `status`)."""

    def __init__(self):
        super().__init__("counted")
        self.looks = 0

    @property
    def status(self):
        self.looks += 1
        return None


def test_walk_looks_at_eight_links_at_most_and_at_each_link_of_a_cycle_once():
    """Upstream's walk: at most 8 links, with a cycle guard. A chain of 20 is read 8 links deep;
    a cycle of 3 is read once per link and not 8 times round, and ends as DATA."""
    links = [Counted() for _ in range(20)]
    assert classify(chain(*links)) == DATA
    assert [x.looks for x in links] == [1] * 8 + [0] * 12
    a, b, c = Counted(), Counted(), Counted()
    a.__cause__, b.__cause__, c.__cause__ = b, c, a
    assert classify(a) == DATA
    assert (a.looks, b.looks, c.looks) == (1, 1, 1)
    d = Counted()  # a cycle that reaches an INFRA link on its way round still finds it
    d.__cause__ = ConnectionError()
    d.__cause__.__cause__ = d
    assert classify(d) == INFRA


def test_budget_errors_are_not_rollout_failures():
    assert not issubclass(RolloutRedispatchExhausted, RolloutFailure)
    assert not issubclass(RolloutStall, RolloutFailure)
    assert issubclass(RolloutRedispatchExhausted, RuntimeError)


def test_ray_errors_follow_upstreams_infra_list():
    """NeMo-RL 7ea279a's `_INFRA_TYPES`, every Ray entry (seven were missing: a node out of memory was DATA)."""
    import ray.exceptions as rex

    for cls in (rex.RayActorError, rex.ActorDiedError, rex.ActorUnavailableError, rex.ActorUnschedulableError,
                rex.TaskUnschedulableError, rex.WorkerCrashedError, rex.NodeDiedError, rex.LocalRayletDiedError,
                rex.OwnerDiedError, rex.RpcError, rex.GetTimeoutError, rex.ObjectFetchTimedOutError,
                rex.ObjectLostError, rex.OutOfMemoryError, rex.ObjectStoreFullError, rex.RaySystemError):
        exc = cls.__new__(cls)  # constructors differ; classification looks at the type only
        assert classify(exc) == INFRA, cls


def test_coordinates_round_trip_and_bad_ones_are_named():
    c = Coords(3, 1, 0, 2)
    assert Coords.from_key(c.key) == c and parse_call_key(c.key + ".c4") == (c, 4)
    assert Coords.from_row({"_minirl": {**c.as_dict(), "group_attempt": "grp-1"}}) == c
    assert Coords.from_row({}) is None
    for bad in ("s1.g1", "s1.g1.r1.a1.cx", "s-1.g0.r0.a0.c0", "x" * 5000, 7):
        with pytest.raises(BadCoordinates, match="must look like s0.g1.r0.a0.c2"):
            parse_call_key(bad)
    for block, field in (({"step": 0, "group": 0, "rollout": 0}, "attempt"),
                         ({"step": "0", "group": 0, "rollout": 0, "attempt": 0}, "step"),
                         ({"step": 0, "group": True, "rollout": 0, "attempt": 0}, "group")):
        with pytest.raises(BadCoordinates, match=f"_minirl.{field} must be a non-negative integer"):
            Coords.from_row({"_minirl": block})
    with pytest.raises(BadCoordinates, match="_minirl must be an object"):
        Coords.from_row({"_minirl": [1]})


def test_coordinates_take_ascii_digits_only_and_name_a_huge_value_briefly():
    # `$` let a trailing newline by, and `\d` took any Unicode digit, which int() reads as a number
    for key in ("s0.g1.r0.a0\n", "s\uff10.g1.r0.a0", "s\u0660.g1.r0.a0"):
        with pytest.raises(BadCoordinates, match="must look like s0.g1.r0.a0"):
            Coords.from_key(key)
    for key in ("s0.g1.r0.a0.c2\n", "s0.g1.r0.a0.c\u0662"):
        with pytest.raises(BadCoordinates, match="must look like s0.g1.r0.a0.c2"):
            parse_call_key(key)
    with pytest.raises(BadCoordinates) as huge_key:
        Coords.from_key("y" * 100_000)
    with pytest.raises(BadCoordinates) as huge_value:
        Coords.from_row({"_minirl": {"step": "x" * 100_000, "group": 0, "rollout": 0, "attempt": 0}})
    assert len(str(huge_key.value)) < 200 and len(str(huge_value.value)) < 200  # were 100,051 characters


def test_run_error_body_is_typed_and_parsed_back():
    exc = ContextGuardRejected("Context guard rejected model call at complete action boundary: step=2 "
                               "guards=max_total_tokens")
    body = run_error_body(exc)
    assert body == {"error": repr(exc), "type": "ContextGuardRejected", "failure_kind": "agent_run_error",
                    "stage": "agent", "terminal": False} and run_error_status(exc) == 500
    assert list(body)[-1] == "error"  # the facts first: a reader that cuts a long body still has them
    import json

    assert parse_error_body(json.dumps(body).encode()) == (repr(exc), "ContextGuardRejected")
    assert parse_error_body(b'{"error": "boom"}') == ("boom", None)  # Gym's own middleware body
    assert parse_error_body(b'{"error": {"message": "bad", "type": "BadRequestError"}}') == ("bad", "BadRequestError")
    assert parse_error_body(b"plain text 500") == ("plain text 500", None)
    deep = b'{"error": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"  # issue 29: an agent's 500 nested 200k deep
    text, kind = parse_error_body(deep)
    assert kind is None and text.startswith('{"error": [[[') and len(text) == 4096
    long = json.dumps({"error": "x" * 10000, "type": "T"}).encode()
    assert len(parse_error_body(long)[0]) == 4096  # kept whole up to a few KB, not 300 characters
    assert run_error_status(ModelCallFailed("m", 400)) == 400 and run_error_status(ModelCallFailed("m", 503)) == 500
    assert run_error_status(RuntimeError("agent bug")) == 500


def test_a_long_4xx_body_keeps_its_facts_through_the_reader():
    """A model server's 400 text (cut to 2,000 characters by the agent's client) of emoji is ~24 KB of
    JSON (`\\ud83d\\ude00` each): the reader parsed only the first 16 KiB, so the body's `terminal: true`
    was lost and the row was sent again as an agent_run_error."""
    import json

    from minirl.gym.failures import error_failure
    from minirl.rollout.manager import will_not_pass

    exc = ModelCallFailed("model call failed with HTTP 400: " + "\U0001F600" * 2000, 400)
    raw = json.dumps(run_error_body(exc)).encode()
    assert len(raw) > 16384
    failure = error_failure(400, raw, "NeMo-Gym /run failed with HTTP 400", "ModelCallFailed")
    assert (failure.terminal, failure.failure_kind, failure.stage) == (True, "minirl:bad_request", "agent")
    assert will_not_pass(failure)
    assert len(run_error_body(ModelCallFailed("x" * 100_000, 400))["error"]) == 4096  # the text is bounded too


def test_the_restart_window_a_failed_attempt_may_wait_out():
    """Past max_infra_attempts_per_prompt, a group keeps retrying only while a restart may end its
    outage: no agent server reached (agent_restart_window_s), or every row's agent reached no model
    server (generation_restart_window_s: a generation worker that Ray restarts after its engine
    died; before, such a group was dropped after 7.5 s of backoff); any other mix gets none."""
    from minirl.config import load_config
    from minirl.rollout.manager import restart_window
    from minirl.wire import AgentUnreachable

    rf = load_config().async_rl.rollout_failure
    assert (rf.agent_restart_window_s, rf.generation_restart_window_s) == (60.0, 120.0)
    model_down = GymTransportError("NeMo-Gym /run failed with HTTP 500: GenerationUnavailable(...)",
                                   "GenerationUnavailable")
    assert restart_window(rf, [AgentUnreachable("refused"), AgentUnreachable("reset")]) == 60.0
    assert restart_window(rf, [model_down, model_down]) == 120.0
    assert restart_window(rf, [model_down, GymTransportError("HTTP 500: ValueError()", "ValueError")]) == 0.0
    assert restart_window(rf, [model_down, AgentUnreachable("refused")]) == 0.0
    assert restart_window(load_config("configs/upstream_pr4124.yaml").async_rl.rollout_failure, [model_down]) == 0.0


def test_lane_a_reads_the_whole_error_body():
    """Gym's `vllm_model` looks for "context length" or "max_tokens" in vLLM's whole 400 body. minirl looked in
    the error's message as its client cuts it (2,000 characters): a server that puts a long text first (a
    proxy's, or vLLM's own with a long prompt echoed) turned an overflow into a ModelCallFailed (DATA)."""
    from minirl.agents.model_client import is_lane_a

    long = {"error": {"message": "x" * 2500 + " This model's maximum context length is 512 tokens.",
                      "type": "BadRequestError", "code": 400}}
    assert is_lane_a(400, long)
    assert is_lane_a(400, "not JSON: " + "y" * 3000 + " context length exceeded")
    assert is_lane_a(400, {"error": {"message": "bad", "param": "max_tokens"}})  # anywhere in the body
    assert not is_lane_a(500, long)  # a 400 only
    assert not is_lane_a(400, {"error": {"message": "x" * 2500, "type": "BadRequestError"}})
