"""The `/run` request shape of `nemo-gym` 0.4.0, written down from its models, for checking rows
without a Gym install. Only the input items minirl sends (messages) are written down;
`scripts/gym_check.py` checks the same rows against the real package's models.

Invariant: `RunRequest.model_validate(row)` raises pydantic's ValidationError, naming the field,
for every row the package's own models reject in the fields written down here.
"""

from __future__ import annotations

import json

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import Required, TypedDict


class InputText(TypedDict, total=False):
    type: Required[Literal["input_text"]]
    text: Required[str]


class InputImage(TypedDict, total=False):
    type: Required[Literal["input_image"]]
    detail: Required[Literal["low", "high", "auto"]]
    image_url: Optional[str]
    file_id: Optional[str]


class FunctionTool(TypedDict, total=False):
    """The Responses `FunctionToolParam`: `name`, `parameters` and `strict` are required (`strict` may
    be null). Like the package's TypedDicts, these ignore unknown keys inside tools and content parts;
    an `input_image` part requires `detail` (low | high | auto)."""

    type: Required[Literal["function"]]
    name: Required[str]
    parameters: Required[Optional[dict]]
    strict: Required[Optional[bool]]
    description: Optional[str]


class EasyInputMessage(BaseModel):
    content: Union[str, list[Union[InputText, InputImage]]]
    role: Literal["user", "assistant", "system", "developer"]
    type: Literal["message"] = "message"


class ResponsesCreateParams(BaseModel):
    """`NeMoGymResponseCreateParamsNonStreaming`: forbids unknown fields, so no `seed`. `metadata` maps
    strings to strings; `vllm_model` merges `metadata.extra_body` (a JSON string) into the chat
    request."""

    model_config = ConfigDict(extra="forbid")

    background: Optional[bool] = None
    include: Optional[list[str]] = None
    input: Union[str, list[EasyInputMessage]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    max_tool_calls: Optional[int] = None
    metadata: Optional[dict[str, str]] = None
    model: Optional[str] = None
    parallel_tool_calls: bool = True
    previous_response_id: Optional[str] = None
    prompt: Optional[dict] = None
    reasoning: Optional[dict] = None
    service_tier: Optional[Literal["auto", "default", "flex", "scale", "priority"]] = None
    store: Optional[bool] = None
    temperature: Optional[float] = None
    text: Optional[dict] = None
    tool_choice: Union[str, dict] = "auto"
    tools: list[FunctionTool] = Field(default_factory=list)
    top_logprobs: Optional[int] = None
    top_p: Optional[float] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    user: Optional[str] = None
    stream: Optional[Literal[False]] = None


def params_problem(params: dict) -> str | None:
    """What Gym's request model refuses among a row's `responses_create_params` (an unknown field, a field
    of the wrong type), its `input` items aside (written down here for messages only: a row's other item
    types are Gym's to judge), as one line naming the field; None when it passes."""
    from pydantic import ValidationError

    try:
        ResponsesCreateParams.model_validate({**params, "input": ""})
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        field = ".".join(str(part) for part in err["loc"])
        return (f"responses_create_params.{field}: {err['msg']}, got {json.dumps(err.get('input'), default=str)[:80]} "
                "(nemo-gym's request model refuses it, so a Gym /run would answer 422)")
    return None


class RunRequest(BaseModel):
    """`simple_agent`'s `/run` body (`SimpleAgentRunRequest`): extra top-level fields are allowed
    (`task`, `agent_ref`, `_rowidx`, `_minirl` ride there)."""

    model_config = ConfigDict(extra="allow")

    responses_create_params: ResponsesCreateParams
