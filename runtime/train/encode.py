"""Sessions -> token ids and loss masks for training.

A session is rendered once through the chat template and tokenized as a whole; the loss covers
exactly what the model generates when served: each assistant span after `<｜Assistant｜></think>`
up to and including its `<｜end▁of▁sentence｜>`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from runtime.train.corpus import Session, make_session, session_messages
from runtime.train.template import ASSISTANT, EOS, PAD, THINK_END, render
from runtime.train.tools import TOOLS


@dataclass(frozen=True)
class Example:
    ids: list[int]
    loss_mask: list[bool]


@lru_cache(maxsize=2)
def load_tokenizer(path: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def special_ids(tok) -> dict[str, int]:
    return {"eos": tok.token_to_id(EOS), "pad": tok.token_to_id(PAD), "think_end": tok.token_to_id(THINK_END)}


def encode_session(session: Session, tokenizer_path: str) -> Example:
    tok = load_tokenizer(tokenizer_path)
    ids = tok.encode(render(session_messages(session), TOOLS, session.tool_choice), add_special_tokens=False).ids
    sid = special_ids(tok)
    assistant = tok.token_to_id(ASSISTANT)
    mask, inside, previous = [], False, None
    for token in ids:
        mask.append(inside)
        # Only the generation header opens a span: the tools preamble's own text names </think> too.
        if token == sid["think_end"] and previous == assistant:
            inside = True
        elif token == sid["eos"]:
            inside = False
        previous = token
    return Example(ids, mask)


def encode_seed(args: tuple[int, str]) -> Example:
    """Picklable entry point for worker pools: (seed, tokenizer path) -> Example."""
    seed, path = args
    return encode_session(make_session(seed), path)
