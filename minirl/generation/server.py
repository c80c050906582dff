"""OpenAI-style HTTP server over one engine: `POST /v1/chat/completions`, `POST /tokenize`,
`GET /v1/models`, `GET /health`. In a generation worker it runs in the worker's front-end process,
over an `EngineClient` (minirl.generation.frontend); tests also run it in-process over a `VllmEngine`.
Shapes and errors are vLLM's (its own protocol classes); `ModelServer` lists minirl's extensions.

Invariants: every request with a parseable rollout header leaves exactly one call-log record,
whatever its outcome (success, 4xx, 5xx, or 499 when its client left), with the token ids and
logprobs the engine produced; the call log holds at most `CALL_LOG_STEPS` steps; the event loop
answers `/health` while any request is being prepared.
"""

from __future__ import annotations

import asyncio
from collections import deque
import hashlib
import json
import math
import os
import signal
import time
import uuid
from http import HTTPStatus
from pathlib import Path

import numpy as np

from aiohttp import web
from pydantic import ValidationError
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionNamedToolChoiceParam, ChatCompletionRequest
from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse, ModelCard, ModelList
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
from vllm.entrypoints.serve.exception_handling.handlers.validation import _format_error, clean_loc_for_param
from vllm.entrypoints.serve.exception_handling.utils import sanitize_message
from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest, TokenizeCompletionRequest, TokenizeResponse
from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
from vllm.exceptions import GenerationError
from vllm.parser.parser_manager import ParserManager
from vllm.utils import random_uuid

from minirl.runtime import jsonio
from minirl.config import VllmConfig
from minirl.faults import FaultPlan, fault_site
from minirl.generation.chat_format import PrefixMismatch, normalize_content, parse_reply, rendered_chars, splice_prefix
from minirl.generation.detokenize import Detokenizer, moves
from minirl.generation.segments import SegmentEncoder
from minirl.runtime.http_thread import INLINE_BYTES, off_loop
from minirl.wire import ROLLOUT_HEADER, SEED_AS_SENT, SEED_HEADER, BadCoordinates, Coords, parse_call_key

PREFIX_FIELD = "required_prefix_token_ids"
SEED_SPACE = 2**31  # derived seeds lie in [0, SEED_SPACE), as minirl.data.sampling_seed's do
CLIENT_LEFT = 499  # nginx's "client closed request": the status recorded when the caller disconnected
HEALTH_TIMEOUT_S = 5.0
"""How long /health waits for the engine's process (the router's probe_timeout_s is usually shorter)."""


class HTTPError(Exception):
    """A failed request, carrying vLLM's OpenAI-style error body."""

    def __init__(self, body: ErrorResponse):
        super().__init__(body.error.message)
        self.body = body

    @property
    def status(self) -> int:
        return self.body.error.code

    @classmethod
    def bad_request(cls, message: str, param: str | None = None) -> "HTTPError":
        return cls(create_error_response(message, param=param))

    @classmethod
    def of(cls, exc: Exception) -> "HTTPError":
        """vLLM's own mapping: its client errors, ValueError and TypeError are 400, the rest 5xx."""
        if isinstance(exc, RecursionError):  # vLLM would answer 500; it is the client's JSON
            return cls.bad_request("request JSON nests deeper than the server parses")
        if isinstance(exc, ValidationError):
            return cls(_validation_error(exc))
        return cls(create_error_response(exc))

    @classmethod
    def of_http(cls, exc: web.HTTPException) -> "HTTPError":
        """aiohttp's own refusal (a body over `max_request_bytes`: 413) in the body `vllm serve`'s
        `http_exception_handler` gives a Starlette HTTPException: its text, its status and the status's phrase."""
        return cls(ErrorResponse(error=ErrorInfo(message=sanitize_message(exc.text or exc.reason),
                                                 type=HTTPStatus(exc.status).phrase, code=exc.status)))

    @classmethod
    def internal(cls, exc: Exception) -> "HTTPError":
        """A failure of this server's own code (every client error is an HTTPError by then): a 500."""
        return cls(create_error_response(f"internal server error: {exc!r}", "InternalServerError",
                                         HTTPStatus.INTERNAL_SERVER_ERROR))

    def response(self) -> web.Response:
        return web.json_response(self.body.model_dump(), status=self.status)


def _validation_error(exc: ValidationError) -> ErrorResponse:
    """A request body that fails the protocol's schema, worded as `vllm serve`'s validation handler
    words it (type "Bad Request", at most 10 errors, each value echoed in at most 200 characters)."""
    errors = exc.errors()
    reported = errors[:10]
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "".join(f"  {_format_error(e)}\n" for e in reported)
    if len(errors) > len(reported):
        message += f"  ...and {len(errors) - len(reported)} more {label}\n"
    param = clean_loc_for_param(tuple(errors[0]["loc"])) if errors and errors[0].get("loc") else None
    return ErrorResponse(error=ErrorInfo(message=message.rstrip(), type=HTTPStatus.BAD_REQUEST.phrase,
                                         param=param, code=HTTPStatus.BAD_REQUEST))


def parse_json_object(raw: bytes) -> dict:
    """A request body as a JSON object, or an HTTPError 400 saying why not (`json`'s result and error
    text, through msgspec: `jsonio.loads`)."""
    try:
        body = jsonio.loads(raw)
    except RecursionError as exc:
        raise HTTPError.of(exc) from None
    except ValueError as exc:
        raise HTTPError.bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise HTTPError.bad_request(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def context_length_message(max_model_len: int, prompt_len: int) -> str:
    """vLLM 0.32's wording for a prompt that does not fit (renderers/params.py)."""
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
        f"contains {prompt_len} input tokens, which exceeds this limit even without any output "
        f"tokens. Please reduce the length of the input prompt."
    )


def input_text_message(max_model_len: int, chars: int, max_chars: int) -> str:
    """vLLM 0.32's wording for a prompt text too long to be tokenized at all (renderers/params.py)."""
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
        f"contains {chars} characters (more than {max_chars} characters, which is the upper bound "
        f"for {max_model_len} input tokens). Please reduce the length of the input prompt."
    )


def call_seed(seed: int, prompt_token_ids: list[int]) -> int:
    """The seed a headerless call samples with: a stable hash of the request's seed and its prompt's
    token ids. An external agent that sends one seed on every call of a rollout gets a new sample
    each turn (each turn's prompt differs), the same one on a re-run or a retry of the same call."""
    digest = hashlib.blake2b(int(seed).to_bytes(8, "little", signed=True), digest_size=8)
    digest.update(np.asarray(prompt_token_ids, dtype=np.int64).tobytes())
    return int.from_bytes(digest.digest(), "little") % SEED_SPACE


def served_as(name: str, served: str) -> bool:
    """Does a request's `model` name the served model: the served path, the same directory by
    another absolute path, or a trailing part of the path (`models/tiny-doors`, `tiny-doors`)?"""
    if name == served:
        return True
    if os.path.isabs(name):
        return os.path.realpath(name) == os.path.realpath(served)
    want, have = Path(os.path.normpath(name)).parts, Path(served).parts
    return ".." not in want and 0 < len(want) <= len(have) and have[-len(want):] == want


CALL_LOG_STEPS = 64
"""Steps the call log holds at once: the async controller drains several prompt steps at a time
(up to the buffer's `max_buffered_rollouts` groups' worth), the sync one a single step."""


SERVED_KEYS = 200_000
"""Call keys a run's `served` list holds (a few MB); past that only `served_count` grows, and the matrix's
served-calls check compares counts (minirl/experiments/invariants.py)."""


UNKEYED_CALLS = 20_000
"""Successful calls without a rollout header (an external agent's, e.g. Gym's `vllm_model`) held
until the controller matches them by content; the oldest go first."""


class CallLog:
    """Call records by step, until the controller takes what has arrived for a step (`take`).

    A step may be taken many times (the async controller takes a group's step whenever a group
    resolves, and late records of retired attempts arrive after that), in any order.
    Bound: at most CALL_LOG_STEPS steps are held; a record for a new step when that many are held
    evicts the step written least recently (a made-up step written once goes first; steps being
    generated are written all the time). `dropped` counts every record evicted. The header is
    trusted from any caller, so this bounds memory, not mischief.
    Successful calls without a header wait apart (`unkeyed`, at most UNKEYED_CALLS, the oldest evicted first),
    and `unkeyed_dropped` counts those evicted; not `dropped`, which the run's books read as keyed records no
    ledger took (an internal run never takes its validation's headerless calls: evicting them loses nothing
    it accounts for).
    """

    def __init__(self):
        self.steps: dict[int, list[dict]] = {}  # ordered least recently written first
        self.unkeyed: deque[dict] = deque(maxlen=UNKEYED_CALLS)  # calls without a header (external agents)
        self.dropped = 0
        self.unkeyed_dropped = 0  # unkeyed records evicted by UNKEYED_CALLS (`add_unkeyed`)
        self.lost = 0  # records a `call_log_lost` fault kept out of the log (minirl.faults)
        self.served: list[str] = []  # every keyed call this run recorded, in arrival order (the first SERVED_KEYS)
        self.served_count = 0  # ... and how many in all: the server's own total, never the controller's

    def add(self, step: int, record: dict) -> None:
        self.served_count += 1
        if len(self.served) < SERVED_KEYS:
            self.served.append(record.get("key"))
        records = self.steps.pop(step, None)
        if records is None:
            records = []
            if len(self.steps) >= CALL_LOG_STEPS:
                self.dropped += len(self.steps.pop(next(iter(self.steps))))
        records.append(record)
        self.steps[step] = records

    def take(self, step: int) -> list[dict]:
        return self.steps.pop(step, [])

    def add_unkeyed(self, record: dict) -> None:
        """A successful call without a header, for the controller to match by content; the oldest held is
        evicted (and counted) once UNKEYED_CALLS are."""
        if len(self.unkeyed) == self.unkeyed.maxlen:
            self.unkeyed_dropped += 1
        self.unkeyed.append(record)

    def finish(self) -> dict:
        """The run ends: every record no step took, and what this run served (its keys, its count, the
        records the bounds evicted), in one go on the server's loop, so no record falls between them."""
        left = [rec for records in self.steps.values() for rec in records]
        self.steps.clear()
        return {"left": left, "served": list(self.served), "served_count": self.served_count, "dropped": self.dropped,
                "unkeyed_dropped": self.unkeyed_dropped}

    def take_unkeyed(self) -> list[dict]:
        out = list(self.unkeyed)
        self.unkeyed.clear()
        return out

    def clear(self) -> None:
        self.__init__()


class ModelServer:
    """The server's routes over `engine` (a `VllmEngine`, or an `EngineClient` in a front end).

    vLLM's shapes: `logprobs`/`top_logprobs` (the sampled token first), `logprob_token_ids`,
    `return_tokens_as_token_ids` and `return_token_ids` behave as in `vllm serve`, a temperature under
    1e-5 is greedy, and a prompt longer than the context gets vLLM's 400 "maximum context length".
    vLLM's errors: a client error is a 400 with vLLM's body `{"error": {"message", "type", "param",
    "code"}}` naming the field (`HTTPError.of`); an unknown `model` is vLLM's 404 naming the served
    path whole (`served_as` lists the names answered to); only a failure of the server is a 5xx, a
    request the engine finished with `finish_reason` "error" among them (vLLM's 500, `_generate`).

    minirl's extensions: `required_prefix_token_ids` keeps earlier turns' exact tokens
    (`splice_prefix`), in a chat call and in /tokenize's chat form, which counts the prompt that call
    sends; a request with the `X-Minirl-Rollout` header (`s0.g1.r0.a0.c2`) is recorded in the `CallLog`
    the controller's ledger drains, and keys the engine-side fault sites
    (`context_overflow`, `model_error`, `worker_kill`, `worker_hang`, `engine_hang`, `engine_crash`,
    `engine_loop_crash`, and `call_log_lost`, which answers the call but keeps its record out of the log);
    a header that does not parse is a 400. A headerless call samples with `call_seed`; minirl's
    agents' `seed + call` (with the header, or `X-Minirl-Seed: per-call`) is used as sent.
    `/health` is 503 when the engine is dead, when a step or a weight reload has run past
    `engine.STUCK_STEP_S`, or when the engine's process does not answer within `HEALTH_TIMEOUT_S`.
    Work proportional to a body's size (parsing, rendering, tokenizing) runs in a worker thread for a
    body over `INLINE_BYTES`, and a prompt whose printed fields (`rendered_chars`) cannot fit
    `max_model_len` is refused before it is rendered. A client that disconnects has its request aborted
    in the engine (minirl.runtime.http_thread)."""

    reasoning_parser: str | None = "think"  # policy.generation.reasoning_parser; None: no reasoning split

    def __init__(self, engine, tokenizer, model_name: str, plan: FaultPlan | None = None):
        self.engine, self.tokenizer, self.model_name, self.plan = engine, tokenizer, model_name, plan
        self.calls = CallLog()
        self.tokens_generated = 0
        self.hung = False  # set by a `worker_hang` fault: from then on no request is answered
        # vLLM's bound (tokenizers/hf.py): no token stands for more characters than the longest
        # vocabulary entry (for byte-level BPE, one character per byte, and no character decodes
        # from less than a byte), so a prompt whose text has more than max_model_len times that
        # many characters cannot fit, however it tokenizes. vLLM checks the rendered text;
        # `rendered_chars` (every field the template prints: roles, contents, reasoning, tool
        # calls, tool names and parameter names) is a lower bound on it, so checking it before
        # rendering refuses nothing that vLLM would serve.
        self.max_chars_per_token = max(len(t) for t in tokenizer.get_vocab())
        self.segments = SegmentEncoder(tokenizer, INLINE_BYTES)
        self.detokenizer = Detokenizer(tokenizer)
        # vLLM's parser class for `--tool-call-parser hermes --enable-auto-tool-choice`: its `adjust_request`
        self.hermes = ParserManager.get_parser(tool_parser_name="hermes", enable_auto_tools=True, tokenizer=tokenizer)

    def app(self, max_request_bytes: int = VllmConfig.max_request_bytes) -> web.Application:
        app = web.Application(client_max_size=max_request_bytes, middlewares=[self.gate])
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        return app

    # -- helpers (worker threads) --------------------------------------------------------------
    def render(self, messages: list[dict], tools, add_generation_prompt: bool = True,
               continue_final_message: bool = False) -> list[int]:
        """The prompt's token ids, rendered as vLLM's HF renderer renders them: `add_generation_prompt`
        and `continue_final_message` as the request sent them (the final message left open for the model
        to continue; both at once is transformers' ValueError, a 400, as in vLLM)."""
        for m in messages:  # vLLM accepts `reasoning` or `reasoning_content` on assistant turns
            m["content"] = normalize_content(m.get("content"))  # list content flattened as vLLM does
            if "reasoning" in m and "reasoning_content" not in m:
                m["reasoning_content"] = m.pop("reasoning")
        text = self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=continue_final_message)
        return self.segments.encode(text)  # the ids tokenize=True gives, each repeated stretch encoded once

    def take_calls(self, step: int | None) -> list[dict]:
        """The records of `step`, or (None) every successful call that came without a header."""
        return self.calls.take_unkeyed() if step is None else self.calls.take(step)

    def _check_prefix(self, prefix) -> list[int]:
        """`required_prefix_token_ids` as vLLM would check token ids: a list of in-vocabulary ints
        no longer than the context (checked first, so a huge list costs O(1) to refuse)."""
        if not isinstance(prefix, list):
            raise HTTPError.bad_request(
                f"{PREFIX_FIELD} must be a list of token ids, got {type(prefix).__name__}", PREFIX_FIELD)
        if len(prefix) >= self.engine.max_model_len:
            raise HTTPError.bad_request(
                f"{context_length_message(self.engine.max_model_len, len(prefix))} "
                f"({PREFIX_FIELD} alone holds {len(prefix)} tokens)",
                PREFIX_FIELD,
            )
        bad = next((t for t in prefix if type(t) is not int), None)
        if bad is not None:
            raise HTTPError.bad_request(f"{PREFIX_FIELD} must hold integers only, got {str(bad)[:80]!r}", PREFIX_FIELD)
        try:
            self.engine.validate_token_ids(prefix, PREFIX_FIELD)
        except Exception as exc:  # VLLMValidationError: out of vocabulary
            raise HTTPError.of(exc) from None
        return prefix

    def _prepare_chat(self, raw: bytes) -> tuple[dict, ChatCompletionRequest, list[int]]:
        """Body bytes -> (body, request, prompt token ids): everything whose cost grows with the
        request's size, run in a worker thread."""
        body = parse_json_object(raw)
        try:
            req = ChatCompletionRequest.model_validate(body)
        except Exception as exc:  # ValidationError, or a VLLMValidationError from a validator
            raise HTTPError.of(exc) from None
        self._check_model(req.model)
        _refuse_template(req)
        if req.stream:
            raise HTTPError.bad_request("minirl's model server does not stream; send stream=false", "stream")
        if (req.n or 1) != 1:
            raise HTTPError.bad_request("minirl's model server supports n=1 only", "n")
        for field, given in UNSERVED:  # asked of vLLM, which would do it: refused, never silently ignored
            if given(req):
                raise HTTPError.bad_request(f"minirl's model server does not do {field}={getattr(req, field)!r}; "
                                            "leave it out", field)
        prefix = self._required_prefix(body)
        chars = rendered_chars(body["messages"], body.get("tools"))
        limit = self.engine.max_model_len * self.max_chars_per_token
        if chars > limit:
            raise HTTPError.bad_request(input_text_message(self.engine.max_model_len, chars, limit), "input_text")
        try:
            prompt = self.render(body["messages"], body.get("tools"), req.add_generation_prompt,
                                 req.continue_final_message)
        except Exception as exc:  # a template error is the client's fault, as in vLLM
            raise HTTPError.bad_request(f"chat template failed: {exc!r}"[:2000]) from None
        return body, req, self._spliced(prefix, prompt)

    def _required_prefix(self, body: dict) -> list[int] | None:
        """The body's `required_prefix_token_ids`, checked (`_check_prefix`); None when absent."""
        prefix = body.get(PREFIX_FIELD)
        return None if prefix is None else self._check_prefix(prefix)

    def _spliced(self, prefix: list[int] | None, prompt: list[int]) -> list[int]:
        """The rendered `prompt` with `prefix` kept verbatim (`splice_prefix`): the prompt a chat call
        sends, and what /tokenize counts; a prefix that is not the messages' earlier turns is a 400."""
        if not prefix:
            return prompt
        try:
            return splice_prefix(prefix, prompt, self.tokenizer.eos_token_id, self._decode)
        except PrefixMismatch as exc:
            raise HTTPError.bad_request(f"{PREFIX_FIELD} does not match the messages: {exc}", PREFIX_FIELD) from None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _check_model(self, model: str | None) -> None:
        """vLLM's `_check_model`: a request naming a model this server does not serve is a 404 (none: the
        served one); `served_as` says which names it answers to, and the 404 names them, path unsanitised."""
        if model and not served_as(model, self.model_name):
            parts = Path(self.model_name).parts
            examples = ", ".join(dict.fromkeys(str(Path(*parts[-n:])) for n in (2, 1) if len(parts) > n))
            raise HTTPError(ErrorResponse(error=ErrorInfo(
                message=f"The model `{model}` does not exist. Valid aliases: {self.model_name}, or a trailing part "
                        f"of that path ({examples}).",
                type="NotFoundError", param="model", code=HTTPStatus.NOT_FOUND)))

    def _tokenize(self, raw: bytes) -> bytes:
        """vLLM's /tokenize. The chat form also takes minirl's `required_prefix_token_ids`, checked and
        spliced as a chat call's (`_required_prefix`, `_spliced`, the same 400s), so its count is the
        length of the prompt that chat call would send (the agent's context guard counts it); like
        vLLM's, it sets no length limit on the prompt."""
        body = parse_json_object(raw)
        try:
            if "messages" in body:
                req = TokenizeChatRequest.model_validate(body)
                self._check_model(req.model)
                _refuse_template(req)
                prefix = self._required_prefix(body)
                rendered = self.render(body["messages"], body.get("tools"), req.add_generation_prompt,
                                       req.continue_final_message)
                ids = self._spliced(prefix, rendered)
            else:
                req = TokenizeCompletionRequest.model_validate(body)
                self._check_model(req.model)
                ids = self.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
        except HTTPError:
            raise
        except Exception as exc:  # vLLM's mapping: a schema or template error is the client's
            raise HTTPError.of(exc) from None
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        out = TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids, token_strs=strs)
        return json.dumps(out.model_dump(exclude_none=True)).encode()

    # -- routes --------------------------------------------------------------------------------
    @web.middleware
    async def gate(self, request: web.Request, handler) -> web.Response:
        if self.hung:  # wedged, not dead: every request, /health included, waits until its caller leaves
            await asyncio.Event().wait()
        return await handler(request)

    async def health(self, request: web.Request) -> web.Response:
        try:
            error = await asyncio.wait_for(asyncio.wrap_future(self.engine.check_health()), HEALTH_TIMEOUT_S)
        except asyncio.TimeoutError:
            error = f"the engine's process did not answer within {HEALTH_TIMEOUT_S:.0f} s"
        if error is not None:
            return web.json_response({"status": "unhealthy", "error": error}, status=503)
        return web.json_response({"status": "ok", "version": self.engine.version})

    async def models(self, request: web.Request) -> web.Response:
        cards = ModelList(data=[ModelCard(id=self.model_name, max_model_len=self.engine.max_model_len)])
        return web.json_response(cards.model_dump())

    async def tokenize(self, request: web.Request) -> web.Response:
        # vLLM's /tokenize has no length limit; the work runs off the loop
        try:
            body = await off_loop(self._tokenize, await request.read())
        except HTTPError as exc:
            return exc.response()
        except web.HTTPException as exc:  # a body over max_request_bytes: vLLM's JSON body, not aiohttp's text
            return HTTPError.of_http(exc).response()
        return web.Response(body=body, content_type="application/json")

    async def chat_completions(self, request: web.Request) -> web.Response:
        key = request.headers.get(ROLLOUT_HEADER)
        try:
            coords, call = parse_call_key(key) if key is not None else (None, None)
        except BadCoordinates as exc:
            return HTTPError.bad_request(str(exc), ROLLOUT_HEADER).response()
        record: dict = {"key": key, "t_start": time.time()}
        try:
            response, finite = await self._complete(request, coords, call, record)
            record["status"] = 200
            return web.Response(body=jsonio.dumps(response, finite), content_type="application/json", charset="utf-8")
        except HTTPError as exc:
            record.update(status=exc.status, error=exc.body.error.message)
            return exc.response()
        except asyncio.CancelledError:
            record.update(status=CLIENT_LEFT, error="client disconnected")
            raise
        except Exception as exc:  # else its record had no status, and its client aiohttp's text/plain answer
            error = HTTPError.of_http(exc) if isinstance(exc, web.HTTPException) else HTTPError.internal(exc)
            record.update(status=error.status, error=error.body.error.message)
            return error.response()
        finally:
            fires = fault_site(self.plan, coords, call=call)
            if fires("call_log_lost"):
                self.calls.lost += 1  # answered, but its record is lost: the ledger finds the attempt short
            elif coords is not None:
                record.update(coords.as_dict(), call=call, t_end=time.time())
                self.calls.add(coords.step, record)
            elif record.get("status") == 200:  # an external agent's call: matched later by its tokens
                self.calls.add_unkeyed(record)

    def _logprobs(self, req: ChatCompletionRequest, result) -> tuple[list[dict], bool]:
        """As vLLM's `_create_chat_logprobs` builds them, from vLLM's detokenized text (made in this process
        by minirl.generation.detokenize, or by the engine for a request with stop strings): each
        generated token with its logprob, and as its `top_logprobs` the first `top_logprobs` of that
        position's entries in vLLM's order (the sampled token first), all of them for -1 or with
        `logprob_token_ids`. As the dicts vLLM's `ChatCompletionLogProbsContent` dumps to (one
        pydantic object per token and per top entry cost ~0.3 ms a request); also whether every
        logprob shown is finite (`jsonio`'s fast path writes no NaN)."""
        as_ids, k = req.return_tokens_as_token_ids, req.top_logprobs
        # a position's entries shown: all, or the first `keep`
        keep = None if req.logprob_token_ids or k == -1 else max(k or 0, 0)

        def name(tok: int, text: str | None) -> str:
            if as_ids:
                return f"token_id:{tok}"
            return text if text is not None else self.tokenizer.decode([tok])

        def top(entries) -> list[dict]:
            return [{"token": (t := name(tok, text)), "logprob": float(max(lp, -9999.0)),
                     "bytes": list(t.encode("utf-8", errors="replace"))}
                    for tok, lp, text in (entries if keep is None else entries[:keep])]

        lps = [float(max(lp, -9999.0)) for lp in result.logprobs]  # vLLM's clamp
        content = []
        for i, (tok, lp, text) in enumerate(zip(result.token_ids, lps, result.decoded)):
            entry = {"token": name(tok, text), "logprob": lp}
            if text is not None:
                entry["bytes"] = list(text.encode("utf-8", errors="replace"))
            entry["top_logprobs"] = top(result.top[i] if result.top else [(tok, lp, text)]) if keep != 0 else []
            content.append(entry)
        shown = lps if keep == 0 else lps + [e["logprob"] for entry in content for e in entry["top_logprobs"]]
        return content, math.isfinite(sum(shown)) or all(map(math.isfinite, shown))  # a finite sum: all finite

    async def _complete(self, request: web.Request, coords: Coords | None, call: int | None,
                        record: dict) -> tuple[dict, bool]:
        """Parse and validate, render and tokenize (off the loop), the injected faults and the length
        check, vLLM's sampling parameters, the engine call, then the OpenAI response."""
        body, req, prompt = await off_loop(self._prepare_chat, await request.read())
        await self._before_engine(fault_site(self.plan, coords, call=call), prompt, record["key"])
        params = self._sampling_params(req, prompt)
        as_sent = coords is not None or request.headers.get(SEED_HEADER) == SEED_AS_SENT  # minirl's agents: seed + call
        if params.seed is not None and not as_sent:  # an external agent's call: its own sample each turn
            params.seed = call_seed(params.seed, prompt)
        record["seed"] = params.seed
        here = moves(params)
        if here:  # the engine's step skips detokenizing; this process does it, as vLLM's own would
            params.detokenize = False
        result = await self._generate(prompt, params, record)
        return self._response(body, req, prompt, self.detokenizer.fill(result, params) if here else result)

    async def _before_engine(self, fires, prompt: list[int], key: str | None) -> None:
        """The faults injected at this call (in this order) and the context-length check."""
        if fires("worker_kill"):
            # a real process death, mid-request (a worker's engine process follows its front end)
            os.kill(os.getpid(), signal.SIGKILL)
        if fires("worker_hang"):
            self.hung = True
            await asyncio.Event().wait()
        if fires("engine_hang"):  # the engine's next step never returns; this request (and every later one) waits on it
            self.engine.hang()
        if fires("engine_crash"):  # the engine's next step fails: it is dead (a generation worker ends with it)
            self.engine.crash()
        if fires("engine_loop_crash"):  # the engine thread fails outside a step: dead too, never silently
            self.engine.crash("loop")
        if fires("context_overflow"):
            # the engine refuses the call as too long: the same error a real overflow gets
            limit = self.engine.max_model_len
            raise HTTPError.bad_request(context_length_message(limit, max(len(prompt), limit + 1)), "input_tokens")
        if len(prompt) >= self.engine.max_model_len:
            raise HTTPError.bad_request(context_length_message(self.engine.max_model_len, len(prompt)), "input_tokens")
        if fires("model_error"):
            raise HTTPError(create_error_response(f"injected model_error at {key}", "InternalServerError",
                                                  HTTPStatus.INTERNAL_SERVER_ERROR))

    def _sampling_params(self, req: ChatCompletionRequest, prompt: list[int]):
        """The request's sampling parameters as vLLM builds them; the sampled token's logprob always asked.
        A request with tools and a `tool_choice` other than "none" first goes through vLLM's hermes parser's
        `adjust_request`, as `vllm serve --tool-call-parser hermes --enable-auto-tool-choice` renders it
        (~16 us): its reply is decoded with `skip_special_tokens=False`, so a model whose tool tokens are
        special keeps them in the text the parser reads, and a forced choice (`forces_a_call`) gets the
        structural tag that makes the reply a `<tool_call>` block."""
        if req.tools and req.tool_choice != "none":
            req = self.hermes(self.tokenizer, req.tools).adjust_request(req)
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        asked = getattr(req, field)
        if asked is not None and asked < 1:  # vLLM's own check would name max_tokens for either field
            raise HTTPError.bad_request(f"{field} must be at least 1, got {asked}.", field)
        try:  # vLLM's own clamp and checks: max_tokens < 1, temperature, top_p, ... are its 400s
            params = req.to_sampling_params(get_max_tokens(self.engine.max_model_len, asked, len(prompt), {}), {})
        except Exception as exc:
            raise HTTPError.of(exc) from None
        if params.logprobs is None and not params.logprob_token_ids:  # the sampled token's logprob, always: it is
            params.logprobs = 0  # the evidence (with `logprob_token_ids`, vLLM returns it first among those)
        return params

    async def _generate(self, prompt: list[int], params, record: dict):
        """Submit to the engine (aborted if the client leaves); the call's token evidence goes into `record`.
        A request the engine finished with `finish_reason` "error" (vLLM's FinishReason.ERROR: a grammar that
        rejected the sampled token, a KV load that failed) is vLLM's 500 "Internal server error", its
        evidence recorded."""
        rid = uuid.uuid4().hex
        try:
            result = await asyncio.wrap_future(self.engine.generate(prompt, params, rid))
        except asyncio.CancelledError:  # the client left: stop spending engine steps on it
            self.engine.abort(rid)
            raise
        except Exception as exc:  # vLLM refused it at add_request (400) or the engine failed (5xx)
            raise HTTPError.of(exc) from None
        self.tokens_generated += len(result.token_ids)
        record.update(
            prompt_token_ids=result.prompt_token_ids,
            generation_token_ids=result.token_ids,
            generation_log_probs=result.logprobs,
            finish_reason=result.finish_reason,
            version_start=result.version_start,
            version_end=result.version_end,
        )
        if result.finish_reason == "error":  # vLLM's `_raise_if_error`: the engine failed it (FinishReason.ERROR)
            raise HTTPError(create_error_response(GenerationError()))
        return result

    def _response(self, body: dict, req: ChatCompletionRequest, prompt: list[int], result) -> tuple[dict, bool]:
        """The OpenAI chat completion: the parsed reply (content, reasoning, tool calls), logprobs,
        usage; and whether its floats are all finite. Built as the dict that vLLM's
        `ChatCompletionResponse(...).model_dump(exclude_none=True)` gives, key order included
        (tests/unit/test_hot_path.py builds both and compares them): its classes' validation and dump
        cost the front end ~0.3 ms a request for what the server already holds typed."""
        tools = body.get("tools")
        tool_choice = body.get("tool_choice", "auto" if tools else "none")
        parsed = parse_reply(result.text, tools_enabled=bool(tools) and tool_choice != "none",
                             reasoning_parser=self.reasoning_parser)
        forced = forces_a_call(req)
        if not (parsed["content"] or "").strip() and (parsed["tool_calls"] or forced):
            parsed["content"] = None  # vLLM's parser: text besides the calls that is only whitespace is none
        if forced or not result.text:  # vLLM's serving: a forced choice's `content or ""`; an empty reply keeps ""
            parsed["content"] = parsed["content"] or ""
        # vLLM's `get_chat_request_role`: without a generation prompt the reply continues the final message's role
        role = "assistant" if req.add_generation_prompt else body["messages"][-1]["role"]
        message = _without_none({"role": role, "content": parsed["content"]})
        if req.parallel_tool_calls is False:  # vLLM's `maybe_filter_parallel_tool_calls`: the first call only
            parsed["tool_calls"] = parsed["tool_calls"][:1]
        if parsed["tool_calls"]:  # ChatMessage's serializer drops an empty list
            message["tool_calls"] = [{"id": tc["id"], "type": "function",
                                      "function": {"name": tc["function"]["name"],
                                                   "arguments": tc["function"]["arguments"]}}
                                     for tc in parsed["tool_calls"]]
        if parsed["reasoning"] is not None:
            message["reasoning"] = parsed["reasoning"]
        finite, choice = True, {"index": 0, "message": message}
        if req.logprobs:
            content, finite = self._logprobs(req, result)
            choice["logprobs"] = {"content": content}
        # vLLM: "tool_calls" for a reply that stopped on parsed calls, or a forced choice's only when "required"
        called = req.tool_choice == "required" if forced else bool(parsed["tool_calls"])
        choice["finish_reason"] = "tool_calls" if called and result.finish_reason == "stop" else result.finish_reason
        choice["stop_reason"] = result.stop_reason  # vLLM's, not OpenAI's: the stop string or token (None: dropped)
        if req.return_token_ids:
            choice["token_ids"] = list(result.token_ids)
        n_out = len(result.token_ids)
        response = {"id": f"chatcmpl-{random_uuid()}", "object": "chat.completion", "created": int(time.time()),
                    "model": req.model or self.model_name, "choices": [_without_none(choice)],
                    "usage": {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + n_out,
                              "completion_tokens": n_out}}
        if req.return_token_ids:
            response["prompt_token_ids"] = list(result.prompt_token_ids)
        return response, finite


UNSERVED = (("use_beam_search", lambda r: r.use_beam_search),
            ("prompt_logprobs", lambda r: r.prompt_logprobs is not None),
            ("truncate_prompt_tokens", lambda r: r.truncate_prompt_tokens is not None),
            ("include_reasoning", lambda r: r.include_reasoning is False))
"""Request fields vLLM's server honours and minirl's does not: a request that sets one is a 400 naming it."""


def _refuse_template(req) -> None:
    """vLLM's 400 for a request that brings its own chat template (`vllm serve` without
    `--trust-request-chat-template`); minirl's server renders with the model's only."""
    kwargs = req.chat_template_kwargs or {}
    if req.chat_template is not None or kwargs.get("chat_template") is not None:
        raise HTTPError.bad_request("Chat template is passed with request, but --trust-request-chat-template is not "
                                    "set. Refused request with untrusted chat template.")


def forces_a_call(req: ChatCompletionRequest) -> bool:
    """`tool_choice` "required" or a named function, with tools: vLLM constrains the reply to a call."""
    return bool(req.tools) and (req.tool_choice == "required"
                                or isinstance(req.tool_choice, ChatCompletionNamedToolChoiceParam))


def _without_none(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}
