"""Logprob `bytes` are each token's own bytes (OpenAI's field: for byte-level BPE, the token's
characters mapped back to bytes), so a client joins them into the reply's UTF-8. A token inside a
multi-byte character decodes alone to U+FFFD; the bytes of that U+FFFD rebuild nothing. The oracle
is the tokenizer's own decoding: any id sequence decodes to what its joined bytes decode to."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from canary.workload import MULTIBYTE_NOTES
from runtime.server.output import ChoiceBuilder, OutputOptions, fold
from runtime.tokenizer import HFTokenizer

pytestmark = pytest.mark.unit

CANARY = Path(__file__).resolve().parents[2] / "golden" / "models" / "canary-moe-v2"
TOK = HFTokenizer(CANARY / "tokenizer.json", 0, 1)
MODEL_VOCAB = json.loads((CANARY / "config.json").read_text())["vocab_size"]  # ids past the tokenizer's too


def lossy(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def joined(ids) -> bytes:
    return b"".join(TOK.token_bytes(i) for i in ids)


def test_every_token_decodes_as_its_bytes_alone_and_in_pairs():
    """Every id the model can emit (the tokenizer's vocab, its added tokens, and the model's extra ids,
    which have no text) alone; every pair of tokens that hold part of a character (U+FFFD alone:
    where the old bytes, the UTF-8 of that U+FFFD, were wrong) and pairs of those with a sample of all."""
    ids = range(MODEL_VOCAB)
    assert all(lossy(TOK.token_bytes(i)) == TOK.decode([i]) for i in ids)
    partial = [i for i in ids if "\ufffd" in TOK.decode([i])]
    assert len(partial) >= 128  # the byte alphabet's non-ASCII half, at least
    pairs = [(a, b) for a in partial for b in partial]
    rng = random.Random(0)
    pairs += [(a, b) for a in ids for b in rng.sample(partial, 8)]
    pairs += [(b, a) for a, b in pairs[-len(ids) * 8:]]
    wrong = [(a, b) for a, b in pairs if lossy(joined((a, b))) != TOK.decode([a, b])]
    assert not wrong, f"{len(wrong)} pairs, e.g. {wrong[:3]}"


@pytest.mark.parametrize("text", MULTIBYTE_NOTES)
def test_logprob_bytes_rebuild_a_multibyte_reply_unary_and_streamed(text):
    """The canary's multi-byte probe texts (CJK, emoji with a variation selector and a ZWJ, combining
    accents) as a reply: its entries' bytes, and each first top_logprobs alternative's (the token
    itself), join into the reply's UTF-8, in the folded response and in the streamed chunks' JSON."""
    ids = TOK.encode_text(text)
    assert any("\ufffd" in TOK.decode([i]) for i in ids)  # the probe really splits characters
    builder = ChoiceBuilder(TOK, OutputOptions(logprobs=True, top_logprobs=2))
    deltas = [builder.push(t, -0.5, [(t, -0.5), (ids[0], -2.0)], False) for t in ids]
    deltas.append(builder.finish("stop")[0])
    folded = fold(deltas)
    streamed = [entry for d in deltas if d.logprobs for entry in json.loads(f"[{d.logprobs[0].as_json()}]")]
    assert folded["message"]["content"] == text
    for entries in (folded["logprobs"], streamed):
        assert b"".join(bytes(e["bytes"]) for e in entries) == text.encode("utf-8")
        assert b"".join(bytes(e["top_logprobs"][0]["bytes"]) for e in entries) == text.encode("utf-8")
        assert all(lossy(bytes(e["bytes"])) == e["token"] for e in entries)


def test_negative_control_the_texts_bytes_fail_both_oracles():
    """The bytes of each token's decoded text (the server's old `bytes`) fail both oracles."""
    def text_bytes(i: int) -> bytes:
        return TOK.decode([i]).encode("utf-8")

    text = MULTIBYTE_NOTES[0]
    assert b"".join(text_bytes(i) for i in TOK.encode_text(text)) != text.encode("utf-8")
    partial = [i for i in range(MODEL_VOCAB) if "\ufffd" in TOK.decode([i])]
    assert any(lossy(text_bytes(a) + text_bytes(b)) != TOK.decode([a, b]) for a in partial for b in partial)
