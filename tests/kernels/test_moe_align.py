"""align_tokens has two implementations (the one-program register sort up to ALIGN_SORT_KERNEL_MAX_ROWS, a library
sort + scans above); they must build exactly one layout, element for element, or a batch whose routed-row count
crosses the threshold would group its rows differently. And fused_moe's `alignment` (its layout computed
beforehand) gives the bits of the path that computes it.

Runs the Triton kernels under the interpreter on CPU (integer work: exact there) and on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from runtime.kernels.triton import moe

pytestmark = pytest.mark.kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def register_sort_layout(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    return moe.align_tokens(ids, experts, path="register_sort")


def sort_layout(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    return moe.align_tokens(ids, experts, path="library_sort")


@settings(max_examples=10)
@given(seed=st.integers(0, 2**31 - 1), tokens=st.sampled_from([1, 3, 16, 43, 64]),
       experts=st.sampled_from([1, 5, 64, 256]), top_k=st.sampled_from([1, 2, 6]),
       skew=st.sampled_from([0.0, 0.9]))
@example(seed=0, tokens=64, experts=256, top_k=6, skew=0.0)
def test_register_sort_builds_the_library_sorts_layout_exactly(seed, tokens, experts, top_k, skew):
    """Few routed rows (one token's, the decode step's at bs 3-64), the expert counts 1 to 256, skewed or not."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen)
    if skew:  # most rows on one expert: long runs, many padded tiles elsewhere
        hot = torch.rand(tokens, top_k, generator=gen) < skew
        ids = torch.where(hot, torch.zeros_like(ids), ids)
    ids = ids.to(torch.int32).to(DEVICE)
    want_rows, want_tiles = sort_layout(ids, experts)
    got_rows, got_tiles = moe.align_tokens(ids, experts)  # the default dispatch: the register sort
    assert torch.equal(got_tiles.cpu(), want_tiles.cpu()), "tile owners differ"
    assert torch.equal(got_rows.cpu(), want_rows.cpu()), "row placement differs"


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), tokens=st.sampled_from([43, 64, 128, 200, 341]),
       experts=st.sampled_from([5, 256]), skew=st.sampled_from([0.0, 0.9]))
@example(seed=0, tokens=128, experts=256, skew=0.0)  # the decode step at bs 128: 768 routed rows
@example(seed=1, tokens=341, experts=256, skew=0.9)  # 2,046 rows, one expert holding most
def test_register_sort_builds_the_library_sorts_layout_at_decode_and_prefill_sizes(seed, tokens, experts, skew):
    """Up to ALIGN_SORT_KERNEL_MAX_ROWS at top-6."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, experts, (tokens, 6), generator=gen)
    if skew:
        ids = torch.where(torch.rand(tokens, 6, generator=gen) < skew, torch.zeros_like(ids), ids)
    ids = ids.to(torch.int32).to(DEVICE)
    assert ids.numel() <= moe.ALIGN_SORT_KERNEL_MAX_ROWS
    want_rows, want_tiles = sort_layout(ids, experts)
    got_rows, got_tiles = moe.align_tokens(ids, experts)  # the default dispatch: the register sort
    assert torch.equal(got_tiles.cpu(), want_tiles.cpu()), "tile owners differ"
    assert torch.equal(got_rows.cpu(), want_rows.cpu()), "row placement differs"


def test_layout_comparison_catches_a_reordered_expert():
    """Negative control: the same rows of one expert in another order must fail the comparison."""
    ids = torch.tensor([[3, 1], [3, 0], [1, 3]], dtype=torch.int32, device=DEVICE)
    want_rows, _ = register_sort_layout(ids, 4)
    got_rows, _ = sort_layout(ids, 4)
    planted = got_rows.clone()
    real = (planted < ids.numel()).nonzero().flatten()
    planted[real[-2:]] = planted[real[-2:]].flip(0)  # swap expert 3's last two rows
    assert torch.equal(got_rows.cpu(), want_rows.cpu())
    assert not torch.equal(planted.cpu(), want_rows.cpu())


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU the tests above compile it for real")
@pytest.mark.parametrize("block", [16, 64, 512, 2048])
def test_register_sort_compiles_for_the_gpu_without_one(block):
    """sort, histogram and gather through sm_90's compiler (the interpreter accepts more)."""
    from tests.kernels.test_indexer_topk import compile_for_sm90

    signature = dict(ids_ptr="*i32", sorted_rows_ptr="*i32", tile_expert_ptr="*i32", num_rows="i32",
                     num_experts="i32", num_tiles="i32")
    done = compile_for_sm90("runtime.kernels.triton.moe", "_align_sort_kernel", signature,
                            dict(BLOCK_M=moe.BLOCK_M, BLOCK=block, BINS=512, FILL=512), num_warps=8)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("block_m", [32, 64, 128])  # 128: the H200 bf16 I=256 table's 4,096-token bucket
def test_taller_tiles_build_one_layout_on_every_path(block_m):
    """bench/moe_tiles.py's taller tiles go through both paths."""
    gen = torch.Generator().manual_seed(block_m)
    ids = torch.randint(0, 256, (60, 6), generator=gen).to(torch.int32).to(DEVICE)  # 360 rows
    layouts = [moe.align_tokens(ids, 256, block_m, path=path) for path in moe.ALIGN_PATHS]
    for rows, tiles in layouts[1:]:
        assert torch.equal(tiles.cpu(), layouts[0][1].cpu()) and torch.equal(rows.cpu(), layouts[0][0].cpu())
    assert layouts[0][0].numel() % block_m == 0



def _small_moe(tokens: int, experts: int = 8, top_k: int = 6, hidden: int = 64, inter: int = 32):
    gen = torch.Generator().manual_seed(tokens)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(DEVICE)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(DEVICE)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    ids = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :top_k].to(torch.int32).to(DEVICE)
    route_w = (torch.rand(tokens, top_k, generator=gen) + 0.25).to(DEVICE)
    return moe.PackedMoE(w13, w2), x, ids, route_w


@pytest.mark.parametrize("block_m", [moe.BLOCK_M, 32])
def test_fused_moe_with_a_precomputed_alignment_gives_the_default_paths_bits(block_m):
    """`alignment` (bench/sglang_kernels.py times fused_moe without its alignment launch): the
    precomputed layout gives exactly what fused_moe computes itself. Negative control: another
    batch's layout changes the output, so the argument is what the kernels read."""
    packed, x, ids, route_w = _small_moe(5)  # 30 routed rows: the aligned path
    assert ids.numel() > moe.PER_ROW_MAX_ROWS
    config = {**moe.DEFAULT_CONFIG, "BLOCK_M": block_m}
    default = moe.fused_moe(x, packed, route_w, ids, config=config)
    given = moe.fused_moe(x, packed, route_w, ids, config=config,
                          alignment=moe.align_tokens(ids, packed.w2.shape[0], block_m))
    assert torch.equal(given, default)
    other = moe.align_tokens((ids + 1) % packed.w2.shape[0], packed.w2.shape[0], block_m)
    assert not torch.equal(moe.fused_moe(x, packed, route_w, ids, config=config, alignment=other), default)


def test_fused_moe_refuses_an_alignment_that_cannot_be_used():
    packed, x, ids, route_w = _small_moe(5)
    wrong_height = moe.align_tokens(ids, packed.w2.shape[0], 32)  # fused_moe's default config: BLOCK_M 16
    with pytest.raises(ValueError, match="BLOCK_M"):
        moe.fused_moe(x, packed, route_w, ids, config=moe.DEFAULT_CONFIG, alignment=wrong_height)
    packed, x, ids, route_w = _small_moe(2)  # 12 routed rows: the per-row path, no alignment
    with pytest.raises(ValueError, match="per-row path"):
        moe.fused_moe(x, packed, route_w, ids, alignment=moe.align_tokens(ids, packed.w2.shape[0]))


def test_an_unknown_alignment_path_is_refused():
    with pytest.raises(ValueError, match="alignment path 'counting'"):
        moe.align_tokens(torch.zeros(4, 2, dtype=torch.int32, device=DEVICE), 8, path="counting")


@pytest.mark.skipif(DEVICE == "cuda", reason="the refusal of a host without CUDA")
@pytest.mark.parametrize("bench, argv", [("moe_align", ["--rows", "48"]), ("moe_anatomy", ["--batches", "8"])])
def test_moe_benches_refuse_a_host_without_cuda(bench, argv, capsys):
    import importlib

    with pytest.raises(SystemExit):
        importlib.import_module(f"bench.{bench}").main(argv)
    assert "needs a CUDA device" in capsys.readouterr().err
