"""The front end detokenizes what the engine generated with `detokenize=False` exactly as vLLM's engine
does with `detokenize=True` (minirl.generation.detokenize): the same text and the same logprob strings,
over sampled tokens that end on EOS and on the length limit, with wide logprobs, special tokens kept or
skipped, and byte tokens that decode alone to a replacement character."""

from __future__ import annotations

import random

from vllm import SamplingParams

from minirl.generation.detokenize import Detokenizer, moves


def _pairs(engine, prompts, **kw):
    """Each prompt generated twice on the real engine with one seed: vLLM detokenizing, and not."""
    futs = [(engine.generate(p, SamplingParams(seed=100 + i, **kw)),
             engine.generate(p, SamplingParams(seed=100 + i, detokenize=False, **kw)))
            for i, p in enumerate(prompts)]
    return [(a.result(timeout=300), b.result(timeout=300)) for a, b in futs]


def test_the_front_ends_detokenizing_equals_the_engines(engine, tokenizer):
    rng = random.Random(0)
    vocab = len(tokenizer)
    texts = ["Open the door on the left.", "héllo wörld, naïve café", "你好，世界 🙂🚪", "<|im_start|>user\nhi"]
    prompts = [tokenizer(t)["input_ids"] for t in texts] + [[rng.randrange(vocab) for _ in range(40)]
                                                           for _ in range(12)]
    detok = Detokenizer(tokenizer)
    finishes, repaired, compared = set(), 0, 0
    for kw in (dict(logprobs=0), dict(logprobs=3), dict(logprobs=0, skip_special_tokens=False)):
        for vllm_side, ours in _pairs(engine, prompts, max_tokens=24, temperature=1.5, **kw):
            assert ours.token_ids == vllm_side.token_ids  # the same sample: only the text differs
            assert ours.text == "" and set(ours.decoded) == {None}  # the engine skipped the work
            params = SamplingParams(seed=0, detokenize=False, **kw)
            filled = detok.fill(ours, params)
            assert filled.text == vllm_side.text
            assert filled.decoded == vllm_side.decoded
            assert filled.top == vllm_side.top
            finishes.add(vllm_side.finish_reason)
            repaired += sum(s.endswith("\ufffd") for s in detok._strings_of(ours.token_ids))
            compared += len(ours.token_ids)
    assert finishes == {"stop", "length"} and repaired > 0 and compared > 500, (finishes, repaired, compared)


def test_a_request_with_stop_strings_keeps_its_detokenizing_in_the_engine():
    assert moves(SamplingParams())
    assert not moves(SamplingParams(stop=["\n"]))
    assert not moves(SamplingParams(detokenize=False))  # asked for no text: none is made anywhere
