"""Detokenizing in the front end's process: a finished generation's text and each logprob entry's token
string, made by vLLM's own detokenizer classes as its output processor makes them, so that the engine's
thread skips that work on every step. vLLM's own server splits the work the same way: its API server
process detokenizes, its EngineCore only steps.

Invariant: for a request that `moves` (no stop strings: vLLM matches those on its text as it steps),
`Detokenizer.fill(result, params)` returns the GenResult the engine returns with `detokenize=True`: the
same text and the same decoded strings (tests/integration/test_engine_detokenize.py compares both on the
real engine).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens
from vllm.tokenizers.hf import get_cached_tokenizer
from vllm.v1.engine.detokenizer import IncrementalDetokenizer
from vllm.v1.engine.logprobs import LogprobsProcessor


def moves(params) -> bool:
    """Whether a request's detokenizing can run in the front end. A request with stop strings keeps it in
    the engine: vLLM ends it when its text shows one."""
    return bool(params.detokenize) and not params.stop


class Detokenizer:
    """vLLM's `IncrementalDetokenizer` for the text and its logprobs processor's per-token strings
    (`convert_ids_list_to_tokens`, with the UTF-8 repair of `LogprobsProcessor._verify_tokens`)."""

    def __init__(self, tokenizer):
        self.tokenizer = get_cached_tokenizer(tokenizer)  # the class vLLM's engine detokenizes with
        self._repair = LogprobsProcessor(tokenizer=self.tokenizer, logprobs=None, prompt_logprobs=None,
                                         cumulative_logprob=None, num_logprobs=None,
                                         num_prompt_logprobs=None)._correct_decoded_token
        self._strings: dict[int, str] = {}  # a token's string alone depends on its id only

    def fill(self, result, params):
        """`result` (generated with `detokenize=False`) with the text and strings vLLM would have given it."""
        request = SimpleNamespace(request_id="", sampling_params=params, prompt_token_ids=result.prompt_token_ids,
                                  prompt_embeds=None)
        detok = IncrementalDetokenizer.from_new_request(self.tokenizer, request)
        detok.update(list(result.token_ids), result.finish_reason == "stop")  # a stop token is not text
        ids = result.token_ids
        decoded = [self._repaired(ids, i, t, s) for i, (t, s) in enumerate(zip(ids, self._strings_of(ids)))]
        top = None
        if result.top is not None:  # each position's entries, the sampled token first
            top = [[(t, lp, self._repaired(ids, i, t, s)) for (t, lp, _), s in
                    zip(entries, self._strings_of([t for t, _, _ in entries]))] for i, entries in enumerate(result.top)]
        return replace(result, text=detok.get_next_output_text(finished=True, delta=False), decoded=decoded, top=top)

    def _repaired(self, sampled: list[int], i: int, token: int, s: str) -> str:
        """An entry of position `i` as vLLM's logprobs processor shows it: its string alone, or, ending in a
        replacement character, repaired from the (up to 4) tokens sampled before it."""
        return self._repair(token, sampled[max(0, i - 4):i]) if s.endswith("\ufffd") else s

    def _strings_of(self, ids: list[int]) -> list[str]:
        """Each id's string alone (vLLM's `convert_ids_list_to_tokens`), cached: it depends on the id only."""
        missing = [t for t in ids if t not in self._strings]
        if missing:
            self._strings.update(zip(missing, convert_ids_list_to_tokens(self.tokenizer, missing)))
        return [self._strings[t] for t in ids]
