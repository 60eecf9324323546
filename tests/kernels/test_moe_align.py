"""align_tokens has two implementations (the one-program Triton kernel for few routed rows, a stable
sort + scans above ALIGN_KERNEL_MAX_ROWS); they must build exactly one layout, element for element,
or a batch whose routed-row count crosses the threshold would group its rows differently.

Runs the Triton kernel under the interpreter on CPU (integer work: exact there) and on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from runtime.kernels.triton import moe

pytestmark = pytest.mark.kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def kernel_layout(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel's layout, whatever the row count (the threshold raised past it)."""
    saved = moe.ALIGN_KERNEL_MAX_ROWS
    moe.ALIGN_KERNEL_MAX_ROWS = ids.numel()
    try:
        return moe.align_tokens(ids, experts)
    finally:
        moe.ALIGN_KERNEL_MAX_ROWS = saved


def sort_layout(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    saved = moe.ALIGN_KERNEL_MAX_ROWS
    moe.ALIGN_KERNEL_MAX_ROWS = 0
    try:
        return moe.align_tokens(ids, experts)
    finally:
        moe.ALIGN_KERNEL_MAX_ROWS = saved


@settings(max_examples=10)
@given(seed=st.integers(0, 2**31 - 1), tokens=st.sampled_from([1, 3, 16, 43, 64]),
       experts=st.sampled_from([1, 5, 64, 256]), top_k=st.sampled_from([1, 2, 6]),
       skew=st.sampled_from([0.0, 0.9]))
@example(seed=0, tokens=64, experts=256, top_k=6, skew=0.0)
def test_sort_path_builds_the_kernels_layout_exactly(seed, tokens, experts, top_k, skew):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen)
    if skew:  # most rows on one expert: long runs, many padded tiles elsewhere
        hot = torch.rand(tokens, top_k, generator=gen) < skew
        ids = torch.where(hot, torch.zeros_like(ids), ids)
    ids = ids.to(torch.int32).to(DEVICE)
    want_rows, want_tiles = kernel_layout(ids, experts)
    got_rows, got_tiles = sort_layout(ids, experts)
    assert torch.equal(got_tiles.cpu(), want_tiles.cpu()), "tile owners differ"
    assert torch.equal(got_rows.cpu(), want_rows.cpu()), "row placement differs"


def test_layout_comparison_catches_a_reordered_expert():
    """Negative control: the same rows of one expert in another order must fail the comparison."""
    ids = torch.tensor([[3, 1], [3, 0], [1, 3]], dtype=torch.int32, device=DEVICE)
    want_rows, _ = kernel_layout(ids, 4)
    got_rows, _ = sort_layout(ids, 4)
    planted = got_rows.clone()
    real = (planted < ids.numel()).nonzero().flatten()
    planted[real[-2:]] = planted[real[-2:]].flip(0)  # swap expert 3's last two rows
    assert torch.equal(got_rows.cpu(), want_rows.cpu())
    assert not torch.equal(planted.cpu(), want_rows.cpu())
