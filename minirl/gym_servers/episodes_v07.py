"""A nemo-gym 0.7.0 Environment Server whose episodes fail, for `make gym-check`'s check that Gym's
`EpisodeFailure` drives minirl's lanes; it runs in the Gym 0.7 venv (it imports `nemo_gym`). Built on
Gym's own `BaseEnvironmentServer`, whose `/run` (Gym's `run_request`) turns the `HandledEpisodeError`
raised here into Gym's `BaseEpisodeResponse{..., failure: EpisodeFailure{...}}`.

Invariant: every `/run` answers 200 with exactly one `failure`, terminal iff the row's group is 0.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from nemo_gym.base_environment_server import BaseEnvironmentServer, HandledEpisodeError
from nemo_gym.config_types import AggregateMetrics, AggregateMetricsRequest
from nemo_gym.episode_types import BaseEpisodeResponse, EpisodeFailure, EpisodeId, TaskId


class RowEpisodeRequest(BaseModel):
    """A minirl `/run` row read as an episode request: its identity from `_minirl`."""

    model_config = ConfigDict(extra="allow")

    @property
    def coords(self) -> dict:
        return (self.model_extra or {})["_minirl"]

    @property
    def episode_id(self) -> EpisodeId:
        c = self.coords
        return EpisodeId(rollout_id=f"s{c['step']}.g{c['group']}.r{c['rollout']}", attempt=c["attempt"])

    @property
    def task(self) -> SimpleNamespace:
        c = self.coords
        return SimpleNamespace(task_id=TaskId(taskset="minirl:doors", task_id=f"s{c['step']}.g{c['group']}"))


class FailingEpisodes(BaseEnvironmentServer):
    request_model: ClassVar[type] = RowEpisodeRequest
    response_model: ClassVar[type] = BaseEpisodeResponse[Any]

    async def run(self, request: RowEpisodeRequest, cleanup) -> BaseEpisodeResponse:
        """minirl's row as it is (the episode id from `_minirl`: `s0.g1.r0`, attempt a): group 0's
        episodes fail terminally (`provider_quota_exhausted`: the task cannot run), every other
        group's not (`provider_unavailable`, stage `seed`)."""
        if request.coords["group"] == 0:
            raise HandledEpisodeError(EpisodeFailure(failure_reason="the task's quota is spent; it will not run",
                                                     terminal=True, failure_kind="provider_quota_exhausted",
                                                     stage="admission"))
        raise HandledEpisodeError(EpisodeFailure(failure_reason="the sandbox provider did not answer", terminal=False,
                                                 failure_kind="provider_unavailable", stage="seed"))

    async def aggregate_metrics(self, body: AggregateMetricsRequest) -> AggregateMetrics:
        return AggregateMetrics()  # no episode ever scores
