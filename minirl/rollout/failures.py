"""Failure taxonomy for rollouts, as NeMo-RL's `nemo_rl/experience/failures.py` draws it.

INFRA failures (the fleet, the network, a timeout) are worth retrying with backoff; DATA failures
(a bad result, a 4xx, anything unrecognised) are retried without backoff and then skipped or
raised. `RolloutRedispatchExhausted` and `RolloutStall` are deliberately not RolloutFailures, so
no per-attempt retry loop ever catches them.

Invariant: `classify` is total (every exception gets INFRA or DATA) and looks at most 8 links
down the `__cause__` chain, stopping at a cycle; anything it does not recognise is DATA.
"""

from __future__ import annotations

import asyncio

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


class GymTransportError(RolloutInfraFailure):
    """`/run` failed at the transport or with an INFRA HTTP status."""


class RolloutDataFailure(RolloutFailure):
    """The rollout's result is unusable: retry without backoff, then skip or raise."""


class RolloutRedispatchExhausted(RuntimeError):
    """The consecutive-drop budget ran out: the generation fleet is not recovering."""


class RolloutStall(RuntimeError):
    """No rollout completed within the stall watchdog's timeout."""


def _infra_types() -> tuple[type, ...]:
    types: list[type] = [TimeoutError, asyncio.TimeoutError, ConnectionError]
    try:
        import aiohttp

        types += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, aiohttp.ServerTimeoutError]
    except ImportError:  # pragma: no cover
        pass
    try:
        import ray.exceptions as rex

        types += [rex.RayActorError, rex.NodeDiedError, rex.ObjectLostError, rex.GetTimeoutError]
    except ImportError:  # pragma: no cover
        pass
    return tuple(types)


_INFRA_TYPES = _infra_types()


def http_class(status: int) -> str:
    return INFRA if status >= 500 or status in (408, 429) else DATA


def classify(exc: BaseException) -> str:
    """INFRA or DATA, by the first recognisable link of the `__cause__` chain (at most 8)."""
    seen: set[int] = set()
    link: BaseException | None = exc
    for _ in range(8):
        if link is None or id(link) in seen:
            break
        seen.add(id(link))
        if isinstance(link, RolloutDataFailure):
            return DATA
        if isinstance(link, RolloutInfraFailure) or isinstance(link, _INFRA_TYPES):
            return INFRA
        status = getattr(link, "status", None)
        if isinstance(status, int) and 100 <= status < 600:
            return http_class(status)
        link = link.__cause__
    return DATA
