"""Train the canary BPE tokenizer (HF `tokenizers`) on rendered sessions.

Pre-tokenization isolates every digit and capital letter, so numbers, nonces and ids are spelled
one character per token: copying them is the same easy operation wherever they appear, and a
corrupted character changes exactly one token. Role markers and DSML tags are added tokens.
"""

from __future__ import annotations

import re
from pathlib import Path

from runtime.train.corpus import TRAIN_SEED_BASE, make_session, session_messages
from runtime.train.template import MARKERS, SPECIAL, render
from runtime.train.tools import TOOLS

# Tokenizer sessions come from their own seed range, disjoint from model training and evaluation.
TOKENIZER_SEED_BASE = 5 * TRAIN_SEED_BASE


def _plain_text(text: str) -> list[str]:
    """Split a rendering at added tokens: BPE merges must never learn pieces of a tag."""
    pattern = "|".join(re.escape(t) for t in sorted(SPECIAL + MARKERS, key=len, reverse=True))
    return [part for part in re.split(pattern, text) if part]


def train_tokenizer(vocab_size: int, num_sessions: int, out: Path) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex("[A-Z0-9]"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(MARKERS), special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)

    def texts():
        for i in range(num_sessions):
            session = make_session(TOKENIZER_SEED_BASE + i)
            yield from _plain_text(render(session_messages(session), TOOLS, session.tool_choice))

    tok.train_from_iterator(texts(), trainer=trainer)
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
