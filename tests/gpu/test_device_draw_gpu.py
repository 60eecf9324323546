"""The seeded draw on the GPU (`draw_rows` through `sample_on_device`) against `sample_row` on the
host with the same logits and each request's own generator. The GPU's softmax and scans round
differently from the CPU's, so the oracle is not token equality: the GPU's token must be the one
whose interval of the host's cumulative distribution holds the draw, up to float32 rounding of that
distribution (a mismatch is allowed only where the draw sits on a boundary). A draw that used
another row's uniform lands far outside its interval: the negative control."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.engine import device_sampler, sampler
from runtime.engine.request import Request, SamplingParams
from runtime.engine.sampler import sample_row
from tests.utils import sampled_rows

pytestmark = [pytest.mark.gpu]
BOUNDARY = 1e-5  # float32 rounding of a cumulative sum over <= 32K probabilities, with room


def interval_misses(logits: torch.Tensor, params: list[SamplingParams], uniforms: list[float],
                    tokens: list[int]) -> list[str]:
    """Rows whose token's interval [cdf before it, cdf at it] of the host's kept, sorted, tempered
    distribution misses uniform * total by more than BOUNDARY."""
    misses = []
    for i, (p, u, token) in enumerate(zip(params, uniforms, tokens)):
        probs = torch.softmax(logits[i] / p.temperature, dim=-1)
        order = torch.sort(probs, descending=True, stable=True)
        keep = torch.ones_like(order.values, dtype=torch.bool)
        if p.top_k:
            keep[p.top_k:] = False
        if p.top_p < 1.0:
            keep &= (torch.cumsum(order.values, 0) - order.values) < p.top_p
        cdf = torch.cumsum(torch.where(keep, order.values, 0.0).double(), 0)
        target = u * float(cdf[-1])
        j = int((order.indices == token).nonzero()[0])
        low, high = (float(cdf[j - 1]) if j else 0.0), float(cdf[j])
        if not low - BOUNDARY <= target <= high + BOUNDARY:  # a dropped token's interval is empty, at the top
            misses.append(f"row {i}: token {token} at sorted position {j} covers [{low:.7f}, {high:.7f}], "
                          f"draw {target:.7f}")
    return misses


def draw_on_gpu(seed: int, n: int, vocab: int, draw=sampler.draw_rows):
    logits, params = sampled_rows(seed, n, vocab)
    requests = [Request(f"r{i}", [0], p) for i, p in enumerate(params)]
    copies = [torch.Generator().set_state(r.generator.get_state()) for r in requests]
    uniforms = [float(torch.rand((), generator=g, dtype=torch.float64)) for g in copies]
    original = device_sampler.draw_rows
    device_sampler.draw_rows = draw
    try:
        tokens = device_sampler.sample_on_device(logits.cuda(), requests)[0].tolist()
    finally:
        device_sampler.draw_rows = original
    return logits, params, uniforms, tokens


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 96), vocab=st.sampled_from([64, 1000, 32000]))
def test_gpu_draw_lands_in_the_host_draws_interval(seed, n, vocab):
    logits, params, uniforms, tokens = draw_on_gpu(seed, n, vocab)
    assert interval_misses(logits, params, uniforms, tokens) == []
    # Away from boundaries the tokens are the host's own: count the rows that differ (expected 0).
    solo = [sample_row(logits[i], Request(f"r{i}", [0], p)).token for i, p in enumerate(params)]
    assert sum(a != b for a, b in zip(tokens, solo)) <= 1


def test_negative_control_a_neighbours_uniform_misses_the_interval():
    def shifted(logits, temperature, top_k, top_p, uniform):
        return sampler.draw_rows(logits, temperature, top_k, top_p, uniform.roll(1))

    logits, params, uniforms, tokens = draw_on_gpu(3, 64, 1000, draw=shifted)
    assert len(interval_misses(logits, params, uniforms, tokens)) > 16
