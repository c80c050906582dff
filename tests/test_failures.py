"""The failure taxonomy: classification and the cause chain walk."""

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
    classify,
)


class Status(Exception):
    def __init__(self, status):
        self.status = status


@pytest.mark.parametrize("status,kind", [(500, INFRA), (503, INFRA), (408, INFRA), (429, INFRA), (400, DATA), (404, DATA), (422, DATA)])
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


def test_walk_stops_after_eight_links_and_on_cycles():
    links = [ValueError(str(i)) for i in range(8)] + [ConnectionError()]
    assert classify(chain(*links)) == DATA  # the INFRA cause is the 9th link
    assert classify(chain(*links[-8:])) == INFRA
    a, b = ValueError("a"), ValueError("b")
    a.__cause__, b.__cause__ = b, a
    assert classify(a) == DATA


def test_budget_errors_are_not_rollout_failures():
    assert not issubclass(RolloutRedispatchExhausted, RolloutFailure)
    assert not issubclass(RolloutStall, RolloutFailure)
    assert issubclass(RolloutRedispatchExhausted, RuntimeError)
