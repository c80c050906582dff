"""OpenAI-style HTTP server over one engine: `POST /v1/chat/completions`, `POST /tokenize`,
`GET /v1/models`, `GET /health`.

Requests and responses are parsed and built with vLLM's own protocol classes, so the shapes are
vLLM's: `logprobs`/`top_logprobs`, `return_tokens_as_token_ids` and `return_token_ids` (which adds
`prompt_token_ids` and per-choice `token_ids`) behave as in `vllm serve`, and a prompt longer than
the context gets vLLM's HTTP 400 "maximum context length" error.

minirl extensions: a `required_prefix_token_ids` body field keeps earlier turns' exact tokens (see
`splice_prefix`), and a request carrying the `X-Minirl-Rollout` header (`s0.g1.r0.a0.c2`) is
recorded in the call log that the controller's ledger drains after each step. The engine-side
fault sites (`context_overflow`, `model_error`, `worker_kill`) fire here, keyed by that header.

Invariant: every request with a rollout header leaves exactly one call-log record, whatever its
outcome (success, 4xx or 5xx), with the token ids and logprobs the engine produced.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import defaultdict
from http import HTTPStatus

from aiohttp import web
from pydantic import ValidationError
from vllm.entrypoints.generate.base.protocol import FunctionCall, ToolCall
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
)
from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse, ModelCard, ModelList, UsageInfo
from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest, TokenizeCompletionRequest, TokenizeResponse

from minirl.faults import FaultPlan
from minirl.wire import ROLLOUT_HEADER, parse_call_key
from minirl.generation.chat_format import normalize_content, parse_reply, splice_prefix


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    body = ErrorResponse(error=ErrorInfo(message=message, type=HTTPStatus(status).phrase.replace(" ", ""), param=param, code=status))
    return web.json_response(body.model_dump(), status=status)


def context_length_message(max_model_len: int, prompt_len: int) -> str:
    """vLLM 0.32's wording for a prompt that does not fit (renderers/params.py)."""
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
        f"contains {prompt_len} input tokens, which exceeds this limit even without any output "
        f"tokens. Please reduce the length of the input prompt."
    )


class ModelServer:
    reasoning_parser: str | None = "think"  # policy.generation.reasoning_parser; None: no reasoning split

    def __init__(self, engine, tokenizer, model_name: str, plan: FaultPlan | None = None):
        self.engine, self.tokenizer, self.model_name, self.plan = engine, tokenizer, model_name, plan
        self.calls: dict[int, list[dict]] = defaultdict(list)
        self.tokens_generated = 0

    def app(self, max_request_bytes: int = 16_000_000) -> web.Application:
        app = web.Application(client_max_size=max_request_bytes)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        return app

    # -- helpers -------------------------------------------------------------------------------
    def render(self, messages: list[dict], tools, add_generation_prompt: bool = True) -> list[int]:
        for m in messages:  # vLLM accepts `reasoning` or `reasoning_content` on assistant turns
            m["content"] = normalize_content(m.get("content"))  # list content flattened as vLLM does
            if "reasoning" in m and "reasoning_content" not in m:
                m["reasoning_content"] = m.pop("reasoning")
        ids = self.tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
        )
        return list(ids)

    def take_calls(self, step: int) -> list[dict]:
        return self.calls.pop(step, [])

    # -- routes --------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "version": self.engine.version})

    async def models(self, request: web.Request) -> web.Response:
        cards = ModelList(data=[ModelCard(id=self.model_name, max_model_len=self.engine.max_model_len)])
        return web.json_response(cards.model_dump())

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            if "messages" in body:
                req = TokenizeChatRequest.model_validate(body)
                ids = self.render(body["messages"], body.get("tools"), req.add_generation_prompt)
            else:
                req = TokenizeCompletionRequest.model_validate(body)
                ids = self.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
        except (ValueError, ValidationError) as exc:
            return _error(400, str(exc))
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        out = TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids, token_strs=strs)
        return web.json_response(out.model_dump(exclude_none=True))

    async def chat_completions(self, request: web.Request) -> web.Response:
        key = request.headers.get(ROLLOUT_HEADER)
        record: dict = {"key": key, "t_start": time.time()}
        try:
            response = await self._complete(request, key, record)
            record["status"] = 200
            return web.json_response(response.model_dump(exclude_none=True))
        except HTTPError as exc:
            record.update(status=exc.status, error=exc.message)
            return _error(exc.status, exc.message, exc.param)
        finally:
            if key:
                coords, call = parse_call_key(key)
                record.update(coords.as_dict(), call=call, t_end=time.time())
                self.calls[coords.step].append(record)

    async def _complete(self, request: web.Request, key: str | None, record: dict) -> ChatCompletionResponse:
        try:
            body = await request.json()
            req = ChatCompletionRequest.model_validate(body)
        except (ValueError, ValidationError) as exc:
            raise HTTPError(400, str(exc)) from None
        if req.stream:
            raise HTTPError(400, "minirl's model server does not stream; send stream=false", "stream")
        if (req.n or 1) != 1:
            raise HTTPError(400, "minirl's model server supports n=1 only", "n")
        tools = body.get("tools")
        try:
            prompt = self.render(body["messages"], tools)
        except Exception as exc:  # a template error is the client's fault, as in vLLM
            raise HTTPError(400, f"chat template failed: {exc!r}") from None
        prefix = body.get("required_prefix_token_ids")
        if prefix:
            prompt = splice_prefix(list(prefix), prompt, self.tokenizer.eos_token_id) or prompt

        coords, call = parse_call_key(key) if key else (None, None)
        fires = (lambda kind: self.plan is not None and coords is not None and self.plan.fires(kind, coords, call))
        if fires("worker_kill"):
            os.kill(os.getpid(), signal.SIGKILL)  # a real process death, mid-request
        if fires("context_overflow"):
            # the engine refuses the call as too long: the same error a real overflow gets
            raise HTTPError(400, context_length_message(self.engine.max_model_len, max(len(prompt), self.engine.max_model_len + 1)), "input_tokens")
        if len(prompt) >= self.engine.max_model_len:
            raise HTTPError(400, context_length_message(self.engine.max_model_len, len(prompt)), "input_tokens")
        if fires("model_error"):
            raise HTTPError(500, f"injected model_error at {key}")

        room = self.engine.max_model_len - len(prompt)
        asked = req.max_completion_tokens or req.max_tokens
        params = req.to_sampling_params(min(asked, room) if asked else room, {})
        params.logprobs = max(params.logprobs or 0, 0)  # the sampled token's logprob, always: it is the evidence
        try:
            result = await asyncio.wrap_future(self.engine.generate(prompt, params))
        except Exception as exc:
            raise HTTPError(500, f"engine failed: {exc!r}") from None
        self.tokens_generated += len(result.token_ids)
        record.update(
            prompt_token_ids=result.prompt_token_ids,
            generation_token_ids=result.token_ids,
            generation_log_probs=result.logprobs,
            finish_reason=result.finish_reason,
            version_start=result.version_start,
            version_end=result.version_end,
        )

        tool_choice = body.get("tool_choice", "auto" if tools else "none")
        parsed = parse_reply(result.text, tools_enabled=bool(tools) and tool_choice != "none", reasoning_parser=self.reasoning_parser)
        message = ChatMessage(
            role="assistant",
            content=parsed["content"],
            reasoning=parsed["reasoning"],
            tool_calls=[ToolCall(id=tc["id"], function=FunctionCall(**tc["function"])) for tc in parsed["tool_calls"]],
        )
        logprobs = None
        if req.logprobs:
            logprobs = ChatCompletionLogProbs(
                content=[  # as vLLM builds it, from the engine's own detokenized text
                    ChatCompletionLogProbsContent(
                        token=f"token_id:{tok}" if req.return_tokens_as_token_ids else text,
                        logprob=max(lp, -9999.0),
                        bytes=None if text is None else list(text.encode("utf-8", errors="replace")),
                    )
                    for tok, lp, text in zip(result.token_ids, result.logprobs, result.decoded)
                ]
            )
        finish = "tool_calls" if parsed["tool_calls"] and result.finish_reason == "stop" else result.finish_reason
        choice = ChatCompletionResponseChoice(
            index=0,
            message=message,
            logprobs=logprobs,
            finish_reason=finish,
            token_ids=result.token_ids if req.return_token_ids else None,
        )
        usage = UsageInfo(
            prompt_tokens=len(prompt), completion_tokens=len(result.token_ids), total_tokens=len(prompt) + len(result.token_ids)
        )
        return ChatCompletionResponse(
            model=req.model or self.model_name,
            choices=[choice],
            usage=usage,
            prompt_token_ids=result.prompt_token_ids if req.return_token_ids else None,
        )
