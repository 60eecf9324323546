"""Token sampling: greedy, or temperature / top-k / top-p with each request's own generator.

Rows are sampled one at a time from their own generator, so a request's tokens depend only on its
logits and its seed, never on its neighbours in the batch. The order is vLLM's and SGLang's:
temperature, then top-k, then top-p, then one draw. Top-k and top-p are one joint filter on the
tempered distribution, as SGLang applies them (the top-p mass is counted before top-k's
renormalisation; vLLM renormalises first). The server never sets top_k, so the two agree there;
tests/unit/test_sampling_order.py holds the reference. Logprobs are of the raw model
distribution (before temperature), as SGLang reports them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from runtime.engine.request import Request


class SampleOutput(NamedTuple):
    """One row's result. A tuple, not a dataclass: one is built per row per step, and a frozen
    dataclass's constructor costs twice as much."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def forced_token(req: Request) -> int | None:
    """The token a constrained opening imposes at this position, if any. Counted by samples, not by
    output_ids: the overlap loop samples a request's next token before the last one is recorded."""
    forced = req.params.forced_ids
    return forced[req.num_sampled] if req.num_sampled < len(forced) else None


def sample_row(logits: torch.Tensor, req: Request) -> SampleOutput:
    # logits: [V] float32
    params = req.params
    logprobs = torch.log_softmax(logits, dim=-1)
    forced = forced_token(req)
    req.num_sampled += 1
    if forced is not None:
        token = forced  # no draw: the generator's stream starts after the forced opening
    elif params.temperature == 0:
        token = int(torch.argmax(logits))  # first maximum: ties go to the lower id
    else:
        # The batched draw on one row: one implementation of temperature, top-k, top-p and the draw
        # for this path and the device sampler's (`draw_rows`).
        uniform = torch.rand(1, generator=req.generator, dtype=torch.float64)
        token = int(draw_rows(logits[None], torch.tensor([params.temperature], dtype=torch.float32),
                              torch.tensor([params.top_k or 0]), torch.tensor([params.top_p], dtype=torch.float32),
                              uniform)[0])
    top: list[tuple[int, float]] = []
    if params.top_logprobs:
        values, ids = torch.topk(logprobs, params.top_logprobs)
        top = [(int(i), float(v)) for i, v in zip(ids, values)]
    return SampleOutput(token, float(logprobs[token]), top)


def draw_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              uniform: torch.Tensor) -> torch.Tensor:
    """`sample_row`'s draw for many rows at once, on the rows' device, with each row's uniform drawn
    beforehand from its request's generator (the draw does not depend on the logits, so the host can
    take it without waiting for them). logits [m, V] float32; temperature, top_p [m] float32; top_k
    [m] int64 (0: off); uniform [m] float64 -> tokens [m] int64.

    `sample_row` draws its one row through this too. On the GPU softmax and the scans round
    differently from the CPU's, so a token can differ from the host's only where the draw falls
    within rounding of a boundary of the cumulative distribution."""
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    order = torch.sort(probs, dim=-1, descending=True, stable=True)
    sorted_probs, sorted_ids = order.values, order.indices
    positions = torch.arange(sorted_probs.shape[-1], device=logits.device)
    keep = (top_k[:, None] == 0) | (positions[None, :] < top_k[:, None])
    # top_p == 1 means no nucleus filter at all (as sample_row skips it): a cumulative sum that
    # rounds up to 1.0 before the tail must not drop the tail.
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep &= (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    kept = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    cdf = torch.cumsum(kept, dim=-1)
    target = (uniform * cdf[:, -1].double()).to(cdf.dtype)
    index = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    index = torch.minimum(index, keep.sum(dim=-1) - 1)
    return sorted_ids.gather(1, index[:, None])[:, 0]
