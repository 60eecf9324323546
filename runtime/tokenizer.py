"""Tokenizers behind one small interface: a byte-level one for `tiny-random` (no files) and an HF
`tokenizers` one loaded from tokenizer.json."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    vocab_size: int
    bos_token_id: int
    eos_token_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; specials follow. Decoding drops specials and repairs partial
    UTF-8 with U+FFFD, so any id sequence decodes."""

    def __init__(self, vocab_size: int, bos_token_id: int, eos_token_id: int, pad_token_id: int) -> None:
        if vocab_size < 259:
            raise ValueError("ByteTokenizer needs vocab_size >= 259")
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: Path, bos_token_id: int, eos_token_id: int) -> None:
        from tokenizers import Tokenizer as _HF

        self._tok = _HF.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size()
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)
