"""Gym 0.7's side of `make gym-check`, run with the Gym 0.7 venv's python (`.venv-gym07`): Gym 0.7's
`vllm_model` (with `request_prompt_and_generation_token_ids: true`: the chat request asks for
`return_token_ids`, so no `/tokenize` call), Gym's `simple_agent`, the doors server on 0.7's classes
with the run's fault plan (doors_v07.py), and `failing_episodes` (episodes_v07.py), launched as
`serve` launches 0.4's. `--check-shapes` instead validates rows and the failure shapes minirl reads
against Gym 0.7's own models (`check_shapes`).

Invariant: needs nemo-gym 0.7.0; prints `gym-servers ready {json of URLs}` once all three answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from minirl.gym_servers.serve import free_port, gym_config, gym_servers, serve


def check_shapes(rows_path: str) -> None:
    """The rows and the failure facts' shapes against Gym 0.7.0's models; raises on a mismatch: an
    `EpisodeFailure` in a `BaseEpisodeResponse` (terminal and not), a `BaseVerifyResponse` with
    `mask_sample`, and the vocabulary of kinds, as minirl/gym/failures.py reads them."""
    import nemo_gym.failure_kinds as fk
    from nemo_gym.base_resources_server import BaseVerifyResponse
    from nemo_gym.episode_types import EpisodeFailure
    from nemo_gym.rollout_collection import NG_TERMINAL_KEY
    from responses_api_agents.simple_agent.app import SimpleAgentRunRequest

    from minirl.gym.failures import FAILURE_KINDS, NG_TERMINAL, STAGES, episode_failure, sample_mask
    from minirl.wire import DATA, INFRA, classify

    rows = [json.loads(line) for line in open(rows_path)]
    for row in rows:
        SimpleAgentRunRequest.model_validate(row)
    assert FAILURE_KINDS == fk.FAILURE_KINDS and NG_TERMINAL == NG_TERMINAL_KEY, \
        "minirl's copy of Gym's vocabulary differs"
    assert set(STAGES) == set(fk.FailureStage.__args__)
    for terminal, lane in ((True, DATA), (False, INFRA)):
        failure = EpisodeFailure(failure_reason="lost", terminal=terminal, failure_kind="session_lost", stage="seed")
        body = {"episode_id": {"id": "e"}, "task_id": {"id": "t"}, "failure": failure.model_dump(mode="json")}
        assert classify(episode_failure(body)) == lane, body
    response = {"id": "r", "created_at": 0, "model": "m", "object": "response", "output": [],
                "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}
    verify = BaseVerifyResponse(**rows[0], response=response,
                                reward=0.0, mask_sample=True, failure_kind="judge_failed", failure_reason="judge down")
    assert sample_mask(verify.model_dump(mode="json")) == {"failure_kind": "judge_failed",
                                                           "failure_reason": "judge down"}
    print(f"gym07-shapes ok: {len(rows)} rows validate against SimpleAgentRunRequest; EpisodeFailure (terminal "
          f"and not), BaseVerifyResponse.mask_sample and the {len(FAILURE_KINDS)} failure kinds read as minirl "
          "maps them")


def gym07_servers(global_cfg: dict, faults: dict, max_live_episodes: int) -> list:
    """`minirl.gym_servers.serve`'s servers with 0.7's inline token ids and the doors server on 0.7's classes."""
    from minirl.gym_servers.doors_resources_server import DoorsResourcesServer
    from minirl.gym_servers.doors_v07 import DoorsResourcesServer07

    from minirl.gym_servers.episodes_v07 import FailingEpisodes
    from nemo_gym.base_environment_server import BaseEnvironmentServerConfig

    servers = gym_servers(global_cfg)
    for i, server in enumerate(servers):
        if type(server) is DoorsResourcesServer:
            servers[i] = DoorsResourcesServer07(config=server.config, server_client=server.server_client, faults=faults,
                                                max_live_episodes=max_live_episodes)
    host = servers[0].config.host
    episodes = BaseEnvironmentServerConfig(name="failing_episodes", host=host, port=free_port(), entrypoint="app.py",
                                           cleanup_timeout_seconds=5)
    return [*servers, FailingEpisodes(config=episodes, server_client=servers[0].server_client)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--router")
    ap.add_argument("--model")
    ap.add_argument("--max-steps", type=int, default=4)
    ap.add_argument("--uses-reasoning-parser", type=int, default=1)
    ap.add_argument("--faults", default="{}", help="minirl's faults.* as JSON: {seed, inject: [...], rate: {...}}")
    ap.add_argument("--max-live-episodes", type=int, default=4096, help="the doors server's episodes held at once")
    ap.add_argument("--check-shapes")
    args = ap.parse_args()
    if args.check_shapes:
        return check_shapes(args.check_shapes)
    if not args.router or not args.model:
        ap.error("--router and --model are required to serve")
    from minirl.config import ConfigError, faults_section

    try:  # before any server starts: a misspelt key would match every rollout, an unknown kind never fire
        faults_section(json.loads(args.faults))
    except (ConfigError, ValueError) as exc:
        print(f"minirl: --faults: {exc}", file=sys.stderr)
        return 2
    host = "127.0.0.1"
    global_cfg = gym_config(args, host)
    global_cfg["policy_model"]["responses_api_models"]["vllm_model"]["request_prompt_and_generation_token_ids"] = True
    os.environ["NEMO_GYM_CONFIG_DICT"] = json.dumps(global_cfg)
    asyncio.run(serve(gym07_servers(global_cfg, json.loads(args.faults), args.max_live_episodes), host))


if __name__ == "__main__":
    sys.exit(main())
