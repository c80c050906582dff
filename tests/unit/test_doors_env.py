"""The doors environment's reading of a tool call (`parse_code`), which sees whatever an untrained
model writes: anything that is not a JSON object with an integer `code` is a malformed call, an error
observation for the model and a failed try in `verify`, never an exception (before, a string nested past
Python's recursion limit, or `None`, raised out of the episode: a 500, read as INFRA and retried)."""

from __future__ import annotations

import pytest

from minirl.agents.env import TOOL_NAME, DoorsEnv, make_rooms, verify

ERROR = [{"type": "input_text", "text": "Error: call open_door with an integer code."}]


@pytest.mark.parametrize("arguments", ["[" * 5000, '{"a":' * 3000, None, "null", "[1]", '"code"', "{",
                                       '{"code": true}', '{"code": 1.5}', '{"code": "1"}'])
def test_a_malformed_call_is_an_error_observation_and_a_failed_try(arguments):
    env = DoorsEnv(3, 2)
    assert env.step(TOOL_NAME, arguments) == ERROR and env.room == 0
    task = {"seed": 3, "num_rooms": 2}
    call = {"type": "function_call", "call_id": "c0", "name": TOOL_NAME, "arguments": arguments}
    assert verify(task, [call]) == 0.0
    right = {**call, "call_id": "c1", "arguments": f'{{"code": {make_rooms(3, 2)[0].code}}}'}
    assert verify(task, [call, right]) == 0.25, "room 1 of 2 opened on its second try (the malformed call is a try)"
