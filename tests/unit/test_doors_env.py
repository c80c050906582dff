"""The doors environment's reading of a tool call (`parse_code`), which sees whatever an untrained
model writes: anything that is not a JSON object with an integer `code` is a malformed call, an error
observation for the model and a failed try in `verify`, never an exception (before, a string nested past
Python's recursion limit, or `None`, raised out of the episode: a 500, read as INFRA and retried); and
`verify`'s reading of a transcript: only the calls the environment answered are tries."""

from __future__ import annotations

import asyncio
import json

import pytest

from minirl.agents.agent import ModelReply, run_episode
from minirl.agents.env import TOOL_NAME, DoorsEnv, make_rooms, verify
from minirl.config import load_config
from minirl.data import prompt_row
from minirl.wire import with_extra_body

ERROR = [{"type": "input_text", "text": "Error: call open_door with an integer code."}]


def answered(call: dict, env: DoorsEnv) -> list[dict]:
    """`call` and the environment's reply to it, as the agent's transcript holds them."""
    return [call, {"type": "function_call_output", "call_id": call["call_id"],
                   "output": env.step(call["name"], call["arguments"])}]


@pytest.mark.parametrize("arguments", ["[" * 5000, '{"a":' * 3000, None, "null", "[1]", '"code"', "{",
                                       '{"code": true}', '{"code": 1.5}', '{"code": "1"}'])
def test_a_malformed_call_is_an_error_observation_and_a_failed_try(arguments):
    env = DoorsEnv(3, 2)
    assert env.step(TOOL_NAME, arguments) == ERROR and env.room == 0
    task = {"seed": 3, "num_rooms": 2}
    call = {"type": "function_call", "call_id": "c0", "name": TOOL_NAME, "arguments": arguments}
    assert verify(task, answered(call, DoorsEnv(3, 2))) == 0.0
    right = {**call, "call_id": "c1", "arguments": f'{{"code": {make_rooms(3, 2)[0].code}}}'}
    env = DoorsEnv(3, 2)
    transcript = answered(call, env) + answered(right, env)
    assert verify(task, transcript) == 0.25, "room 1 of 2 opened on its second try (the malformed call is a try)"


class CutAfterTheCall:
    """A model whose every reply carries a complete, right `open_door` call and then runs into the
    token cap (`finish_reason` "length"), as the generation server reports a reply whose text after a
    parsed `<tool_call>` hit `max_tokens`."""

    def __init__(self, code: int):
        self.code = code

    async def chat(self, messages, tools, params, key, required_prefix):
        fn = {"name": TOOL_NAME, "arguments": json.dumps({"code": self.code})}
        message = {"role": "assistant", "content": " and then I kept talking until the cap",
                   "tool_calls": [{"id": "call_x", "type": "function", "function": fn}]}
        return ModelReply(message, "length", {"prompt_token_ids": [1], "generation_token_ids": [2, 3],
                                              "generation_log_probs": [-0.5, -0.5]})

    async def count_tokens(self, messages, tools, key, required_prefix):
        return 1


def test_a_call_the_environment_never_ran_scores_nothing():
    """A reply cut by the token cap ends the episode before its calls run: the door stays shut, and
    `verify` does not credit it. Before, it replayed every `function_call` in the output, answered or
    not, and scored the room opened (reward 1.0)."""
    cfg = load_config(overrides=["env.num_rooms=1", "agent.max_steps=4"])
    row = {**prompt_row(cfg, 0, 0), "_rowidx": 0, "_minirl": {"step": 0, "group": 0, "rollout": 0, "attempt": 0}}
    row["responses_create_params"] = with_extra_body(row["responses_create_params"], seed=7)
    task = row["task"]
    model = CutAfterTheCall(make_rooms(task["seed"], task["num_rooms"])[0].code)
    result = asyncio.run(run_episode(row, cfg.agent, model))
    output = result["response"]["output"]
    assert result["evidence"]["end_reason"] == "length" and result["evidence"]["calls"] == 1
    (call,) = [it for it in output if it["type"] == "function_call"]
    assert not [it for it in output if it["type"] == "function_call_output"]  # never run
    assert result["reward"] == 0.0
    env = DoorsEnv(task["seed"], task["num_rooms"])
    assert verify(task, answered(call, env)) == 1.0  # had it run, it opened the door
