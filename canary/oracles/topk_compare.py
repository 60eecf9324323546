"""Tie-aware top-k comparison: zero wrong indices, but equal scores may be chosen either way."""

from __future__ import annotations

import torch


def wrong_topk_indices(chosen: torch.Tensor, scores: torch.Tensor, candidates: torch.Tensor, k: int,
                       tie_tol: float) -> list[int]:
    """Indices in `chosen` that a correct top-k over `scores[candidates]` could not have picked.

    chosen: bool [L] selection; scores: [L] reference scores; candidates: bool [L] eligible.
    A chosen index is wrong if it is not a candidate, or if its score is below the k-th best
    candidate score by more than `tie_tol`. Too few or too many selections are wrong too (-1).
    """
    eligible = scores[candidates]
    want = min(k, int(candidates.sum()))
    if int((chosen & candidates).sum()) != want or bool((chosen & ~candidates).any()):
        return [-1] + torch.nonzero(chosen & ~candidates).flatten().tolist()
    if want == 0:
        return []
    kth = torch.sort(eligible, descending=True).values[want - 1]
    bad = chosen & candidates & (scores < kth - tie_tol)
    return torch.nonzero(bad).flatten().tolist()
