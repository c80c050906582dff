"""Gym's side of `make gym-check`, run with the Gym venv's python: Gym's `vllm_model` (pointed at
minirl's generation router, `return_token_id_information: true`) and two environments, each a
resources server behind its own Gym `simple_agent`: minirl's doors server (agent `simple_agent`) and
Gym's example `example_tool_call_multireward` (agent `example_simple_agent`), on 127.0.0.1, in one
process. `--check-rows ROWS.jsonl` instead validates rows against the real `SimpleAgentRunRequest`;
`--example-jsonl` prints the path of the example's own rows.

Invariant: prints one line `gym-servers ready {json of URLs by server name}` once all answer, and
nothing that matters after; exits when killed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


EXAMPLE = "example_tool_call_multireward"
"""The Gym example environment gym-check trains besides doors (nemo-gym 0.4.0's resources_servers/)."""


def example_jsonl() -> str:
    """The path of the example environment's own rows in the installed nemo-gym package."""
    from importlib.util import find_spec
    from pathlib import Path

    return str(Path(find_spec(f"resources_servers.{EXAMPLE}.app").origin).parent / "data" / "example.jsonl")


def check_rows(path: str) -> None:
    from responses_api_agents.simple_agent.app import SimpleAgentRunRequest

    rows = [json.loads(line) for line in open(path)]
    for row in rows:
        SimpleAgentRunRequest.model_validate(row)  # raises pydantic's ValidationError naming the field
    print(f"gym-rows ok: {len(rows)} rows validate against nemo-gym's SimpleAgentRunRequest")


def gym_config(args: argparse.Namespace, host: str) -> dict:
    """Gym's global config for the servers on free ports of `host`, as `ng_run` would build it."""
    names = ("head", "policy_model", "doors", "simple_agent", EXAMPLE, "example_simple_agent")
    ports = {name: free_port() for name in names}
    common = lambda name: {"host": host, "port": ports[name], "entrypoint": "app.py"}  # noqa: E731
    model_cfg = {**common("policy_model"), "base_url": args.router.rstrip("/") + "/v1", "api_key": "none",
                 "model": args.model, "return_token_id_information": True,
                 "uses_reasoning_parser": bool(args.uses_reasoning_parser)}

    def agent(name: str, resources: str) -> dict:
        return {"responses_api_agents": {"simple_agent": {
            **common(name), "max_steps": args.max_steps,
            "resources_server": {"type": "resources_servers", "name": resources},
            "model_server": {"type": "responses_api_models", "name": "policy_model"}}}}

    return {
        "head_server": {"host": host, "port": ports["head"]},
        "policy_model": {"responses_api_models": {"vllm_model": model_cfg}},
        "doors": {"resources_servers": {"doors": common("doors")}},
        "simple_agent": agent("simple_agent", "doors"),
        EXAMPLE: {"resources_servers": {EXAMPLE: common(EXAMPLE)}},
        "example_simple_agent": agent("example_simple_agent", EXAMPLE),
    }


def gym_servers(global_cfg: dict) -> list:
    """Gym's own server objects (model; per environment its resources server and agent) for
    `global_cfg`, sharing one `ServerClient`: Gym's own server classes, apps, session and exception
    middleware, built from a Gym global config as `ng_run` builds them. Only the launcher differs
    (`serve`): `ng_run` gives each server its own process, venv and Ray cluster, which a 2-core
    machine cannot spare."""
    from omegaconf import OmegaConf

    from minirl.gym_servers.doors_resources_server import DoorsResourcesServer
    from nemo_gym.base_resources_server import BaseResourcesServerConfig
    from nemo_gym.config_types import BaseServerConfig
    from nemo_gym.server_utils import ServerClient
    from resources_servers.example_tool_call_multireward.app import (
        ToolCallMultiRewardResourcesServer,
        ToolCallMultiRewardResourcesServerConfig,
    )
    from responses_api_agents.simple_agent.app import SimpleAgent, SimpleAgentConfig
    from responses_api_models.vllm_model.app import VLLMModel, VLLMModelConfig

    client = ServerClient(head_server_config=BaseServerConfig(**global_cfg["head_server"]),
                          global_config_dict=OmegaConf.create(global_cfg))
    model_cfg = global_cfg["policy_model"]["responses_api_models"]["vllm_model"]
    doors_cfg = global_cfg["doors"]["resources_servers"]["doors"]
    example_cfg = global_cfg[EXAMPLE]["resources_servers"][EXAMPLE]
    agents = [SimpleAgent(config=SimpleAgentConfig(name=name,
                                                   **global_cfg[name]["responses_api_agents"]["simple_agent"]),
                          server_client=client) for name in ("simple_agent", "example_simple_agent")]
    return [
        VLLMModel(config=VLLMModelConfig(name="policy_model", **model_cfg), server_client=client),
        DoorsResourcesServer(config=BaseResourcesServerConfig(name="doors", **doors_cfg), server_client=client),
        ToolCallMultiRewardResourcesServer(config=ToolCallMultiRewardResourcesServerConfig(name=EXAMPLE, **example_cfg),
                                           server_client=client),
        *agents,
    ]


async def serve(servers: list, host: str) -> None:
    """Serve every server's app with uvicorn on one loop (one process for all, where `ng_run` starts
    one each); print the ready line once all have started."""
    import uvicorn

    uvicorns = []
    for server in servers:
        app = server.setup_webserver()
        server.setup_liveness(app)
        server.setup_exception_middleware(app)
        uvicorns.append(uvicorn.Server(uvicorn.Config(app, host=host, port=server.config.port, log_level="warning",
                                                      timeout_keep_alive=30)))
    tasks = [asyncio.create_task(u.serve()) for u in uvicorns]
    while not all(u.started for u in uvicorns):
        await asyncio.sleep(0.05)
    urls = {s.config.name: f"http://{host}:{s.config.port}" for s in servers}
    print("gym-servers ready " + json.dumps(urls), flush=True)
    await asyncio.gather(*tasks)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--router", help="minirl's generation router URL")
    ap.add_argument("--model", help="the served model's name, minirl's policy.model_name "
                    "(another is the server's 404, as in vLLM)")
    ap.add_argument("--max-steps", type=int, default=4)
    ap.add_argument("--uses-reasoning-parser", type=int, default=1)
    ap.add_argument("--check-rows")
    ap.add_argument("--example-jsonl", action="store_true", help="print the example environment's rows' path and exit")
    args = ap.parse_args()
    if args.check_rows:
        return check_rows(args.check_rows)
    if args.example_jsonl:
        return print(example_jsonl())
    if not args.router or not args.model:
        ap.error("--router and --model are required to serve")
    host = "127.0.0.1"
    global_cfg = gym_config(args, host)
    os.environ["NEMO_GYM_CONFIG_DICT"] = json.dumps(global_cfg)  # Gym's child-process route to its config
    asyncio.run(serve(gym_servers(global_cfg), host))


if __name__ == "__main__":
    sys.exit(main())
