"""The front end runs vLLM's InputProcessor itself (minirl.generation.frontend.EngineClient), built from the
engine's `processor_config` after the pickle that carries it to the front end's process: it makes the
EngineCoreRequest the engine's own processor makes, refuses what the engine's refuses with vLLM's error,
and the engine samples from it the tokens it samples from the raw prompt."""

from __future__ import annotations

import pickle

import msgspec
import pytest
from vllm import SamplingParams
from vllm.v1.engine.input_processor import InputProcessor

from minirl.generation.frontend import make_request

PROMPT = [1, 388, 201, 300, 7, 9]
CASES = [
    dict(max_tokens=8, seed=3, logprobs=0),
    dict(temperature=0.0, max_tokens=4, stop_token_ids=[5], logprobs=2),
    dict(seed=11, top_p=0.9, top_k=20, min_tokens=2, max_tokens=6, detokenize=False),
    dict(seed=12, skip_special_tokens=False, repetition_penalty=1.2),  # max_tokens from the context left
    dict(seed=13, allowed_token_ids=[5, 6, 7], max_tokens=3),
]


def _fields(request) -> dict:
    """The request's fields but its arrival time (set when it is made)."""
    return {k: v for k, v in msgspec.structs.asdict(request).items() if k != "arrival_time"}


def _engines(engine, params: SamplingParams):
    """The engine's own InputProcessor on `params`, on its thread: the request or the error."""
    def own(llm):
        try:
            return llm.llm_engine.input_processor.process_inputs(
                "r", {"prompt_token_ids": PROMPT}, params, supported_tasks=("generate",))
        except Exception as exc:
            return exc
    return engine.run(own).result(timeout=60)


def _made(ours: InputProcessor, rid: str, params: SamplingParams):
    """As the front end makes it (`EngineClient.generate`)."""
    return make_request(ours, rid, PROMPT, params)


def test_the_front_ends_processor_makes_the_engines_request(engine):
    ours = InputProcessor(pickle.loads(pickle.dumps(engine.processor_config())))
    for kw in CASES:
        made = _made(ours, "r", SamplingParams(**kw))
        assert _fields(made) == _fields(_engines(engine, SamplingParams(**kw))), kw
    for bad in (dict(allowed_token_ids=[10**6]), dict(logprobs=10**4), dict(prompt_logprobs=10**4)):
        theirs = _engines(engine, SamplingParams(**bad))
        assert isinstance(theirs, Exception), bad
        with pytest.raises(type(theirs)) as err:
            _made(ours, "r", SamplingParams(**bad))
        assert str(err.value) == str(theirs), bad


def test_the_engine_samples_the_same_from_a_processed_request(engine):
    ours = InputProcessor(pickle.loads(pickle.dumps(engine.processor_config())))
    for i, kw in enumerate(CASES):
        raw = engine.generate(PROMPT, SamplingParams(**kw), f"raw-{i}").result(timeout=300)
        made = _made(ours, f"made-{i}", SamplingParams(**kw))
        served = engine.generate(made, None, f"made-{i}").result(timeout=300)
        assert served.token_ids == raw.token_ids and served.finish_reason == raw.finish_reason, kw
        assert served.logprobs == pytest.approx(raw.logprobs, abs=1e-5), kw
