"""The near-tie rule, in one place: two runs of one workload agree token for token up to their first
divergence; there, the divergence is benign only when it is a near-tie, the two tokens' logprobs
(as a top-k recorded them) within `margin` nats of each other. After it the contexts differ, so the
rest of the sequence is not compared.

Used by the golden store (one side's top-k recorded), the engine gates, and the pairwise checks of
runs whose reductions differ in order (TP=2 vs TP=1, static vs eager runner, Triton vs torch), which
read both sides' top-k the way vLLM's `check_logprobs_close` does.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


def first_mismatch(a: Sequence[Hashable], b: Sequence[Hashable]) -> int | None:
    """The first position where the sequences differ (the shorter one's length when one is a prefix
    of the other), or None when they are equal."""
    for pos, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return pos
    return None if len(a) == len(b) else min(len(a), len(b))


def logprob_gap(top: Mapping[Any, float], own: Hashable, other: Hashable) -> float | None:
    """logprob(own) - logprob(other) in one side's top-k; None when either token is not in it."""
    if own not in top or other not in top:
        return None
    return top[own] - top[other]


def is_near_tie(gap: float | None, margin: float) -> bool:
    return gap is not None and abs(gap) <= margin


@dataclass(frozen=True)
class Generation:
    tokens: list[Any]  # token ids, or token strings where a server reports only those
    logprobs: list[float]
    top: list[list[tuple[Any, float]]]  # per position: (token, logprob), best first


@dataclass(frozen=True)
class NearTie:
    index: int  # which sequence
    position: int
    tokens: tuple[int, int]  # (reference, test)
    gaps: tuple[float, float]  # each side's logprob gap between its own token and the other's


class NotClose(AssertionError):
    pass


def check_logprobs_close(reference: list[Generation], test: list[Generation], *, margin: float,
                         logprob_atol: float) -> list[NearTie]:
    """Returns the near-ties; raises `NotClose` at the first divergence that is not one. Before it,
    every shared token's logprob must agree within `logprob_atol`."""
    if len(reference) != len(test):
        raise NotClose(f"{len(reference)} reference sequences vs {len(test)} test sequences")
    ties = []
    for index, (ref, out) in enumerate(zip(reference, test)):
        pos = first_mismatch(ref.tokens, out.tokens)
        agreed = len(ref.tokens) if pos is None else pos
        for p in range(min(agreed, len(out.tokens))):
            if abs(ref.logprobs[p] - out.logprobs[p]) > logprob_atol:
                raise NotClose(f"seq {index} pos {p}: token {ref.tokens[p]} logprob {ref.logprobs[p]} vs "
                               f"{out.logprobs[p]} (atol {logprob_atol})")
        if pos is None:
            continue
        if pos >= min(len(ref.tokens), len(out.tokens)):
            raise NotClose(f"seq {index}: same tokens but lengths {len(ref.tokens)} vs {len(out.tokens)}")
        a, b = ref.tokens[pos], out.tokens[pos]
        ref_top, out_top = dict(ref.top[pos]), dict(out.top[pos])
        gaps = (logprob_gap(ref_top, a, b), logprob_gap(out_top, b, a))
        if gaps[0] is None or gaps[1] is None:
            raise NotClose(f"seq {index} pos {pos}: tokens {a} vs {b}, not in each other's top-{len(ref_top)}")
        if not all(is_near_tie(gap, margin) for gap in gaps):
            raise NotClose(f"seq {index} pos {pos}: tokens {a} vs {b} differ by logprob gaps {gaps} > {margin}")
        ties.append(NearTie(index, pos, (a, b), (gaps[0], gaps[1])))
    return ties
