"""Incremental detokenization with stop-string hold-back.

Text is released only once it is final: a token that ends inside a multi-byte character decodes
to U+FFFD and waits for the next one (vLLM's prefix/read offsets), and the tail that could still
grow into a stop string waits until the request finishes, because OpenAI's stop strings are not
part of the returned text.
"""

from __future__ import annotations

import functools
from typing import Any

from runtime.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
SHORT = 4  # decodes of at most this many ids are cached


@functools.lru_cache(maxsize=1 << 16)
def _decode_short(tokenizer: Any, ids: tuple[int, ...]) -> str:  # Any: the cache hashes it by identity
    return tokenizer.decode(list(ids))


def decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    """`tokenizer.decode(ids)`, cached for the short windows streaming decodes: each token decodes
    the previous one and the pair (two calls per token, per stream), and replies repeat pairs. A
    decode is a pure function of the ids, so a hit is exact."""
    if len(ids) <= SHORT:
        return _decode_short(tokenizer, tuple(ids))  # type: ignore[arg-type]  # hashed by identity
    return tokenizer.decode(ids)


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self._prefix = 0  # ids before this are fully decoded into self.text
        self._read = 0
        self.text = ""  # every character decoded so far
        self._sent = 0  # characters of self.text already released
        self.stopped = False

    def push(self, token: int) -> str:
        """Add one generated token; return the text that became final."""
        self.ids.append(token)
        new = decode(self.tokenizer, self.ids[self._prefix:])
        if new.endswith(REPLACEMENT):
            return ""  # an unfinished character: wait for its remaining bytes
        old = decode(self.tokenizer, self.ids[self._prefix:self._read])
        self.text += new[len(old):]
        self._prefix, self._read = self._read, len(self.ids)
        return self._release(final=False)

    def flush(self) -> str:
        """At the end of the request: decode what is left and release everything before a stop."""
        rest = decode(self.tokenizer, self.ids[self._prefix:])
        old = decode(self.tokenizer, self.ids[self._prefix:self._read])
        self.text += rest[len(old):]
        self._prefix = self._read = len(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        end = len(self.text)
        cut = min((i for s in self.stop if (i := self.text.find(s)) >= 0), default=-1)
        if cut >= 0:
            end, self.stopped = cut, True
        elif not final and self.stop:
            end -= max(len(s) for s in self.stop) - 1
        end = max(end, self._sent)
        out = self.text[self._sent:end]
        self._sent = end
        return out
