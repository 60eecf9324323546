"""`check_logprobs_close`: compare two runs of the same workload whose reductions differ in order
(TP=2 vs TP=1), the way vLLM's check does: tokens must match exactly up to the first divergence;
there, each side's token must be in the other side's top-k and within `margin` of that side's best
logprob (a recorded near-tie); the rest of that sequence is not compared (the contexts differ).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Generation:
    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]  # per position: (token, logprob), best first


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
    """Returns the near-ties; raises `NotClose` at the first divergence that is not one."""
    if len(reference) != len(test):
        raise NotClose(f"{len(reference)} reference sequences vs {len(test)} test sequences")
    ties = []
    for index, (ref, out) in enumerate(zip(reference, test)):
        for pos, (a, b) in enumerate(zip(ref.tokens, out.tokens)):
            if a == b:
                if abs(ref.logprobs[pos] - out.logprobs[pos]) > logprob_atol:
                    raise NotClose(f"seq {index} pos {pos}: token {a} logprob {ref.logprobs[pos]} vs "
                                   f"{out.logprobs[pos]} (atol {logprob_atol})")
                continue
            ref_top, out_top = dict(ref.top[pos]), dict(out.top[pos])
            if b not in ref_top or a not in out_top:
                raise NotClose(f"seq {index} pos {pos}: tokens {a} vs {b}, not in each other's top-{len(ref_top)}")
            gaps = (ref_top[a] - ref_top[b], out_top[b] - out_top[a])
            if max(gaps) > margin:
                raise NotClose(f"seq {index} pos {pos}: tokens {a} vs {b} differ by logprob gaps {gaps} > {margin}")
            ties.append(NearTie(index, pos, (a, b), gaps))
            break
        else:
            if len(ref.tokens) != len(out.tokens):
                raise NotClose(f"seq {index}: same tokens but lengths {len(ref.tokens)} vs {len(out.tokens)}")
    return ties
