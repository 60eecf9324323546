"""Tokenizers behind one small interface: a byte-level one for `tiny-random` (no files) and an HF
`tokenizers` byte-level BPE one loaded from tokenizer.json (the canary's, DeepSeek's)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    vocab_size: int
    bos_token_id: int
    eos_token_id: int
    # Spelling -> id of every token that text never encodes to (role markers, DSML tags, BOS/EOS):
    # a prompt gets them only where its template puts them (runtime/server/prompt.py).
    control_tokens: dict[str, int]

    def encode(self, text: str) -> list[int]: ...

    def encode_text(self, text: str) -> list[int]:
        """`text` as plain text: a spelling of a control token is encoded as its characters."""
        ...

    def decode(self, ids: list[int]) -> str: ...

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token adds to the UTF-8 of any text it is part of (a logprob's `bytes`): a
        token inside a multi-byte character has part of its bytes, not the U+FFFD it decodes to
        alone, so a client can join them into the text. b"" for an id with no text."""
        ...


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
        self.control_tokens: dict[str, int] = {}  # specials have no spelling: bytes are always text

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    encode_text = encode

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        return bytes([token]) if 0 <= token < 256 else b""


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, as HF `tokenizers`' ByteLevel writes bytes: a character for each
    byte value. Printable Latin-1 bytes stand for themselves; the other 68 (controls, space, NBSP,
    soft hyphen) are U+0100 onward, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in chars.values())
    chars.update((chr(0x100 + n), b) for n, b in enumerate(shifted))
    return chars


class HFTokenizer:
    def __init__(self, path: Path, bos_token_id: int, eos_token_id: int) -> None:
        import json

        from tokenizers import Tokenizer as _HF

        spec = json.loads(path.read_text(encoding="utf-8"))
        self._tok = _HF.from_str(json.dumps(spec))
        # `tokenizers` matches added tokens in any text it encodes; the same pipeline without them
        # is how content stays text (the one-segment-at-a-time split is the same as the full one's).
        self._text_only = _HF.from_str(json.dumps({**spec, "added_tokens": []}))
        self.control_tokens = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
        self._control_text = {i: text for text, i in self.control_tokens.items()}  # id -> its text
        decoder = spec.get("decoder") or {}
        decoders = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
        if not any(d.get("type") == "ByteLevel" for d in decoders):
            # Token bytes read through the byte-level alphabet; any other decoder needs its own reading.
            raise ValueError(f"{path}: only byte-level BPE tokenizers are supported (decoder {decoder.get('type')})")
        self._byte_of = byte_level_alphabet()
        self._token_bytes: dict[int, bytes] = {}  # filled per id on first use (the logprob hot path)
        self.vocab_size = self._tok.get_vocab_size()
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    def encode(self, text: str) -> list[int]:
        """Text with control-token spellings matched: only for text the server itself wrote."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        return list(self._encode_text_cached(text)) if text else []

    @functools.lru_cache(maxsize=1 << 14)  # noqa: B019 - one tokenizer per process, kept for its lifetime
    def _encode_text_cached(self, text: str) -> tuple[int, ...]:
        # A conversation is re-rendered whole on every turn, and the server encodes it between control
        # tokens: every earlier message's text comes back unchanged. Encoding is a pure function of
        # the text, so a cache hit is exact (it was 14% of the server's event loop in the H200 gate).
        return tuple(self._text_only.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_bytes(self, token: int) -> bytes:
        cached = self._token_bytes.get(token)
        if cached is None:
            cached = self._token_bytes[token] = self._read_token_bytes(token)
        return cached

    def _read_token_bytes(self, token: int) -> bytes:
        if token in self._control_text:  # added tokens are stored as their text, not in the byte alphabet
            return self._control_text[token].encode("utf-8")
        piece = self._tok.id_to_token(token) if token >= 0 else None
        return b"" if piece is None else bytes(self._byte_of[c] for c in piece)
