"""Prompt tokenization that encodes each stretch of text between added tokens once. Every chat
request re-renders its whole conversation, and the Rust tokenizer encodes each stretch between
added tokens (`<|im_start|>`, `<think>`, ...) on its own, so `SegmentEncoder` caches stretch ids.

Invariant: `encode(text)` equals `tokenizer(text, add_special_tokens=False)["input_ids"]`, the call
`apply_chat_template(tokenize=True)` makes on its rendered text; where that equality does not hold
by construction, every text goes through the tokenizer's own call.
"""

from __future__ import annotations

import re
import threading

PROBE = ("<|im_start|>system\n a <tools>f(x)</tools><|im_end|>\n"
         "<|im_start|>user\nRoom 1.<image>red  blue\nlamp3</image><|im_end|><|im_end|>\n"
         "<|im_start|>assistant\n<think> x </think>\n\n<tool_call>{\"name\": \"f\"}</tool_call>é ")


class SegmentEncoder:
    """Keeps the ids of the stretches it has seen (the regex pre-tokenizer costs ~0.3 us a character
    here): the ids of a text are its stretches' ids, in order, with each added token's id between.

    Used only where that equals the tokenizer's own call by construction: a fast tokenizer without
    truncation or padding, whose added tokens are all matched on the raw text as whole strings (no
    lstrip, rstrip, single_word or normalized), checked once at start-up on a probe text. A text of up
    to `inline_chars` characters is encoded with the Rust `encode` (it holds the GIL, as the event loop
    parsing it does anyway), a longer stretch with `encode_batch`, which releases it for a handler in
    a worker thread. The cache holds at most `max_entries` stretches of at most `max_chars` each."""

    def __init__(self, tokenizer, inline_chars: int, max_entries: int = 8192, max_chars: int = 4096):
        self.tokenizer, self.inline_chars = tokenizer, inline_chars
        self.max_entries, self.max_chars = max_entries, max_chars
        self.cache: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        backend = tokenizer._tokenizer if getattr(tokenizer, "is_fast", False) else None
        plain = (backend is not None and backend.truncation is None and backend.padding is None
                 and not tokenizer.split_special_tokens)
        self.backend = backend if plain else None
        added = {t.content: i for i, t in tokenizer.added_tokens_decoder.items()
                 if not (t.lstrip or t.rstrip or t.single_word or t.normalized)}
        whole = self.backend is not None and len(added) == len(tokenizer.added_tokens_decoder) and added
        self.ids = added if whole else {}
        alternatives = "|".join(map(re.escape, sorted(added, key=len, reverse=True)))
        self.split = re.compile("(" + alternatives + ")") if whole else None
        if self.split is not None and self.encode(PROBE + PROBE) != self._whole(PROBE + PROBE):
            self.split = None  # the tokenizer does not split as assumed: every text in one piece

    def _whole(self, text: str) -> list[int]:
        if self.backend is None:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(text) <= self.inline_chars:
            return self.backend.encode(text, add_special_tokens=False).ids
        return self.backend.encode_batch([text], add_special_tokens=False)[0].ids

    def encode(self, text: str) -> list[int]:
        if self.split is None:
            return self._whole(text)
        out: list[int] = []
        for i, piece in enumerate(self.split.split(text)):
            if i % 2:
                out.append(self.ids[piece])
            elif piece:
                ids = self.cache.get(piece)
                if ids is None:
                    ids = self._whole(piece)
                    if len(piece) <= self.max_chars:
                        self._keep(piece, ids)
                out.extend(ids)
        return out

    def _keep(self, piece: str, ids: list[int]) -> None:
        with self._lock:  # a handler in a worker thread may add at the same time
            if len(self.cache) >= self.max_entries:
                self.cache.pop(next(iter(self.cache)))  # the oldest stretch
            self.cache[piece] = ids
