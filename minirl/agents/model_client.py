"""The agent's side of the model server: chat completions with token evidence, and `/tokenize`.
Like Gym's model proxy, it asks for `logprobs=true, top_logprobs=0` and token ids.

Invariant: only vLLM's context-length HTTP 400 becomes a failed call (an empty reply with
`finish_reason="length"` and no token evidence: the agent ends the episode and the rollout is masked,
"lane A" of docs/failure-policy.md). Any other HTTP error raises ModelCallFailed carrying its status,
whatever the body, so a 4xx stays DATA and a 5xx INFRA; an unreachable server, and the generation
router's answer that no worker is eligible (typed `NO_HEALTHY_BACKEND`, whatever its status), raise
GenerationUnavailable (INFRA), as the same outage does through Gym's `vllm_model`. Either fails the
whole `/run`, as in Gym's `simple_agent`.
"""

from __future__ import annotations

import zlib

import aiohttp
import yarl

from minirl.runtime import jsonio
from minirl.agents.episode import ModelReply
from minirl.wire import (NO_HEALTHY_BACKEND, ROLLOUT_HEADER, SEED_AS_SENT, SEED_HEADER, GenerationUnavailable,
                         ModelCallFailed)

LANE_A_MARKERS = ("context length", "maximum context length", "max_tokens")


def is_lane_a(status: int, data) -> bool:
    """Whether a model call's error answer is a context overflow (lane A): as Gym's `vllm_model`, a 400 with
    a marker anywhere in its body, which is read whole (the error's message is cut to 2,000 characters)."""
    return status == 400 and any(m in str(data) for m in LANE_A_MARKERS)
GYM_NO_REASONING_PARSER = (
    "NeMo Gym server `{name}` config has explicitly been set to not use a reasoning parser i.e. "
    "`uses_reasoning_parser: false`. Please do not use a reasoning parser in your vLLM endpoint, or fix the "
    "`{name}` server config!"
)
"""Gym's `vllm_model` (nemo-gym 0.4.0, responses_api_models/vllm_model/app.py) asserts this when a reply
carries `reasoning_content` / `reasoning` under `uses_reasoning_parser: false`; Gym's middleware makes it a 500."""


def chat_body(
    model: str, messages: list[dict], tools: list[dict] | None, params: dict, required_prefix: list[int] | None = None
) -> dict:
    """The chat-completions body an agent's model call sends: token evidence asked for as Gym's
    model proxy asks, and the row's sampling params (`responses_create_params` names) under
    vLLM's names."""
    body = {
        "model": model,
        "messages": messages,
        "logprobs": True,
        "top_logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    if tools:
        body["tools"] = tools
    for ours, theirs in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("max_output_tokens", "max_completion_tokens"),
        ("seed", "seed"),
    ):
        if ours in params:
            body[theirs] = params[ours]
    if required_prefix:
        body["required_prefix_token_ids"] = required_prefix
    return body


class HttpModelClient:
    """`urls`: the generation workers (a rollout's calls stick to one, for its prefix cache), or with
    `async_rl.generation_fleet_health` the router alone, which routes around quarantined workers."""

    def __init__(self, urls: list[str], model: str, session: aiohttp.ClientSession, uses_reasoning_parser: bool = True):
        self.urls, self.model, self.session = urls, model, session
        self.uses_reasoning_parser = uses_reasoning_parser  # agent.uses_reasoning_parser (Gym's vllm_model flag)
        self._endpoints: dict[str, yarl.URL] = {}  # parsed once: aiohttp parses a str URL on every request (~6 us)

    def _url(self, key: str) -> str:
        # sticky per rollout (prefix cache), spread across workers
        rollout = key.rsplit(".", 1)[0]
        return self.urls[zlib.crc32(rollout.encode()) % len(self.urls)]

    def _endpoint(self, url: str) -> yarl.URL | str:
        """`url` parsed once, as aiohttp parses it (one it cannot parse stays a str, for aiohttp to refuse
        as before)."""
        try:
            return self._endpoints.setdefault(url, yarl.URL(url))
        except ValueError:
            return url

    async def _post(self, url: str, path: str, body: dict, key: str | None) -> tuple[int, dict | str]:
        """(status, parsed JSON body, or the raw text when the body is not JSON). Raises GenerationUnavailable
        when the server is unreachable or is the router with no eligible worker."""
        # the agent already sends seed + call: sample with it as sent
        headers = {SEED_HEADER: SEED_AS_SENT, "Content-Type": "application/json"}
        if key and key.startswith("s"):
            headers[ROLLOUT_HEADER] = key
        try:
            endpoint = self._endpoints.get(url + path) or self._endpoint(url + path)
            async with self.session.post(endpoint, data=jsonio.dumps(body), headers=headers) as resp:
                status, raw, encoding = resp.status, await resp.read(), resp.get_encoding()
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError) as exc:
            raise GenerationUnavailable(f"model server {url} unreachable: {exc!r}") from exc
        try:
            data = jsonio.loads_body(raw, encoding)  # loads(resp.text(errors="replace")), without the decode
        except ValueError:
            if status == 200:
                raise ModelCallFailed(
                    f"model server {url}{path} answered 200 with a body that is not JSON", 502) from None
            return status, raw.decode(encoding, errors="replace")
        error = data.get("error") if status != 200 and isinstance(data, dict) else None
        if isinstance(error, dict) and error.get("type") == NO_HEALTHY_BACKEND:
            # a 4xx only so that Gym does not retry it (through Gym a /run 500): the fleet's outage, not the data's
            raise GenerationUnavailable(
                f"generation router {url} has no eligible worker (HTTP {status}): {str(error.get('message'))[:2000]}")
        return status, data

    @staticmethod
    def _error(status: int, data, what: str) -> ModelCallFailed:
        message = data
        if isinstance(data, dict):
            err = data.get("error")
            message = err.get("message", str(err)) if isinstance(err, dict) else str(err if err is not None else data)
        return ModelCallFailed(f"{what} failed with HTTP {status}: {str(message)[:2000]}", status)

    async def chat(self, messages, tools, params, key, required_prefix) -> ModelReply:
        body = chat_body(self.model, messages, tools, params, required_prefix)
        status, data = await self._post(self._url(key), "/v1/chat/completions", body, key)
        if status != 200:
            error = self._error(status, data, "model call")
            if is_lane_a(status, data):
                return ModelReply({"content": ""}, "length", None, f"context_length: {error}")
            raise error
        choice = data["choices"][0]
        message = choice["message"]
        if not self.uses_reasoning_parser and (message.get("reasoning_content") or message.get("reasoning")):
            raise AssertionError(GYM_NO_REASONING_PARSER.format(name="policy_model"))  # as Gym's vllm_model asserts it
        evidence = {
            "prompt_token_ids": data["prompt_token_ids"],
            "generation_token_ids": choice["token_ids"],
            "generation_log_probs": [c["logprob"] for c in (choice.get("logprobs") or {}).get("content") or []],
        }
        return ModelReply(choice["message"], choice["finish_reason"], evidence)

    async def count_tokens(self, messages, tools, key, required_prefix) -> int:
        """The length of the prompt that `chat(messages, tools, ..., key, required_prefix)` sends: `/tokenize`
        of the messages with `required_prefix_token_ids`, which the server splices in as the chat call's
        (the earlier turns' tokens kept verbatim; None: the messages as rendered), asked of the worker
        that call goes to (`key`). Upstream Gym's guard counts `/tokenize` of the messages alone; minirl
        counts the prompt it will send, what the engine sees: a reply not in the template's canonical
        form re-renders to another length, and the context guard would then admit a prompt over
        `max_total_tokens`, or reject one that fits. No rollout header: a count is no call of the log."""
        body = {"model": self.model, "messages": messages, "add_generation_prompt": True}
        if tools:
            body["tools"] = tools
        if required_prefix:
            body["required_prefix_token_ids"] = required_prefix
        status, data = await self._post(self._url(key), "/tokenize", body, None)
        if status != 200:
            raise self._error(status, data, "/tokenize")
        return data["count"]
