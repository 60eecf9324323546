"""The two-pass sparse MLA prefill form (runtime/kernels/triton/mla_prefill.py): the reference's
values, and the one-pass kernel's bits with MMA row sums (`sparse_mla_decode(..., rowsum_mma=True)`).

Conventions of test_triton_kernels.py (its cases and helpers are reused): without CUDA the kernels run
under the Triton interpreter in float32/float16, on a GPU in bfloat16/float16; outputs are
NaN-poisoned; data is never zero. The interpreter's dot is one numpy matmul per row
(runtime/kernels/triton/__init__.py), and a row's [1, S] x [S, BLOCK_V] product gave the same
column bits for every BLOCK_V tried, so the bit checks run there too; the GPU ones (bf16, the
deployment's H=64, C=512, R=64, S=640) are the ones that count for the H200.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import example, given, settings
from hypothesis import strategies as st

from runtime.kernels import reference
from runtime.kernels.triton import INTERPRETED, attention, mla_blocks, mla_prefill
from tests.kernels.test_triton_kernels import (
    DEVICE,
    DTYPES,
    ON_GPU,
    SEEDS,
    _attention_case,
    _trailing_padding_case,
    assert_close_scaled,
    gpu,
    poisoned,
)

pytestmark = pytest.mark.kernels


def one_pass(q, cache, slots, latent, scale, **launch):
    """The bits to keep: the one-pass kernel with MMA row sums, gathered, folding in registers."""
    out = poisoned(q.shape[0], q.shape[1], latent, dtype=q.dtype)
    attention.sparse_mla_decode(q, cache, slots, latent, scale, spread=False, merge="registers", rowsum_mma=True,
                                out=out, **launch)
    return out


def two_pass(q, cache, slots, latent, scale, **launch):
    out = poisoned(q.shape[0], q.shape[1], latent, dtype=q.dtype)
    result = mla_prefill.sparse_mla_two_pass(q, cache, slots, latent, scale, out=out, **launch)
    assert result.data_ptr() == out.data_ptr()
    return out


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert not torch.isnan(got).any(), f"NaN in the two-pass output (unwritten?) {what}"
    differ = got != want
    worst = float((got.double() - want.double()).abs().max())
    assert not differ.any(), (f"two-pass bits differ from the one-pass kernel's {what}: {int(differ.sum())} of "
                              f"{differ.numel()} values, max |diff| {worst}")


# (scores BLOCK_H, values BLOCK_H, BLOCK_V) launch shapes; none of them may change a bit.
SHAPES = st.sampled_from([(16, 16, 64), (64, 64, 64), (32, 16, 32), (64, 32, 16), (16, 64, 256)])


# Few examples: interpreted, each runs 3 kernels in Python; on the GPU each new shape compiles 3 kernels.
@settings(max_examples=6 if ON_GPU else 4, deadline=None)
@given(seed=SEEDS, queries=st.sampled_from([1, 3]), heads=st.sampled_from([1, 16, 20, 64]),
       dims=st.sampled_from([(32, 16), (48, 8), (64, 64)]), context_vs_selected=st.sampled_from([-5, 0, 40]),
       splits=st.sampled_from([1, 2, 3]), block_s=st.sampled_from([16, 32]), narrow=st.booleans(),
       shape=SHAPES, dtype=st.sampled_from(DTYPES))
@example(seed=0, queries=3, heads=20, dims=(48, 8), context_vs_selected=-5, splits=3, block_s=16, narrow=True,
         shape=(64, 32, 16), dtype=DTYPES[0])
def test_two_pass_matches_the_reference_and_the_one_pass_bits(seed, queries, heads, dims, context_vs_selected, splits,
                                                               block_s, narrow, shape, dtype):
    """Heads not a multiple of the head block, C not a power of two (48: the last column block
    partly masked), contexts shorter than window + top-k (-1 slots), 1-3 chunks: within the
    dtype's tolerance of the float64 reference, and the one-pass kernel's bits at the same N, BLOCK_S
    and narrow partials."""
    latent, rope_dim = dims
    window, topk = 8, 24
    context = max(queries, window + topk + context_vs_selected)
    q, cache, slots, dense_kv, mask = _attention_case(seed, queries, heads, latent, rope_dim, context, window, topk,
                                                      dtype)
    scale = (latent + rope_dim) ** -0.5
    numerics = dict(num_splits=splits, block_s=block_s, narrow_partials=narrow)
    scores_h, values_h, block_v = shape
    got = two_pass(q, cache, slots, latent, scale, scores_block_h=scores_h, values_block_h=values_h, block_v=block_v,
                   **numerics)
    assert_close_scaled(got, reference.sparse_attention(q.cpu(), dense_kv, mask, latent, scale), dtype)
    assert_bits_equal(got, one_pass(q, cache, slots, latent, scale, block_h=16, **numerics), f"({numerics}, {shape})")


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_pass_keeps_the_bits_of_prompt_rows_with_padding(dtype):
    """A prompt's early rows select fewer slots than S (then -1 to the end): rows whose last slot is
    the first or last of a chunk or in the first chunk, 4 chunks of 32 (2 blocks of 16), and
    every cache row nobody selects NaN-poisoned (never written): -1 slots must never be read."""
    counts = [1, 31, 32, 33, 64, 65, 97, 100]
    q, cache, slots, latent, scale = _trailing_padding_case(5, counts, 20, 100, dtype)
    used = torch.zeros(cache.shape[0], dtype=torch.bool, device=DEVICE)
    used[slots[slots >= 0].long()] = True
    cache[~used] = float("nan")
    numerics = dict(num_splits=4, block_s=16, narrow_partials=dtype != torch.float32)
    want = one_pass(q, cache, slots, latent, scale, block_h=16, **numerics)
    assert not torch.isnan(want).any()
    for shape in [dict(scores_block_h=16, values_block_h=16, block_v=64),
                  dict(scores_block_h=64, values_block_h=32, block_v=32)]:
        assert_bits_equal(two_pass(q, cache, slots, latent, scale, **numerics, **shape), want, f"({shape})")


def test_two_pass_takes_the_deployment_numerics_by_default():
    """No numerics knob given: default_launch's N, BLOCK_S and narrow partials, as sparse_mla_decode's."""
    q, cache, slots, _, _ = _attention_case(2, 2, 64, 64, 16, 700, 128, 512, DTYPES[-1])
    scale = 80 ** -0.5
    assert attention.default_launch(640, 64)["num_splits"] > 1
    assert_bits_equal(two_pass(q, cache, slots, 64, scale), one_pass(q, cache, slots, 64, scale), "(defaults)")


def test_two_pass_of_no_rows_and_the_wrong_out_dtype():
    q, cache, slots, _, _ = _attention_case(1, 1, 16, 64, 16, 40, 8, 24, DTYPES[0])
    assert mla_prefill.sparse_mla_two_pass(q[:0], cache, slots[:0], 64, 0.1).shape == (0, 16, 64)
    wrong = torch.empty(1, 16, 64, dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match="q's dtype"):
        mla_prefill.sparse_mla_two_pass(q, cache, slots, 64, 0.1, out=wrong)


# ---------------------------------------------------------------- negative controls: the bit check can fail

def test_bit_check_fails_when_the_chunks_fold_in_another_order():
    """The same selection with its four 16-slot chunks rotated (the two-pass form folding chunk 0
    last): the same attention, within tolerance of the reference, but other bits, and the bit check
    says so. Four chunks, not two: folding two chunks is symmetric (the max's side weighs 1, the
    other exp2 of the same difference), so a swap of two keeps the bits."""
    heads, latent, rope_dim, window, topk = 20, 64, 16, 8, 56
    q, cache, slots, dense_kv, mask = _attention_case(11, 3, heads, latent, rope_dim, 3 * (window + topk), window,
                                                      topk, torch.float32)
    scale = (latent + rope_dim) ** -0.5
    numerics = dict(num_splits=4, block_s=16)
    rotated = torch.cat([slots[:, 16:], slots[:, :16]], 1).contiguous()
    got = two_pass(q, cache, rotated, latent, scale, **numerics)
    assert_close_scaled(got, reference.sparse_attention(q.cpu(), dense_kv, mask, latent, scale), torch.float32)
    assert_bits_equal(two_pass(q, cache, slots, latent, scale, **numerics),
                      one_pass(q, cache, slots, latent, scale, **numerics), "(in order)")
    with pytest.raises(AssertionError, match="bits differ"):
        assert_bits_equal(got, one_pass(q, cache, slots, latent, scale, **numerics), "(chunks rotated)")


def test_bit_check_fails_without_the_narrow_rounding_of_the_chunk_sums():
    """A values pass that forgot the deployment's narrow partials (each chunk's sum rounded to 16 bits
    before the fold) is within tolerance, not bit-equal."""
    q, cache, slots, _, _ = _attention_case(12, 3, 20, 64, 16, 200, 8, 56, torch.float16)
    scale = 80 ** -0.5
    want = one_pass(q, cache, slots, 64, scale, num_splits=3, block_s=16, narrow_partials=True)
    got = two_pass(q, cache, slots, 64, scale, num_splits=3, block_s=16, narrow_partials=False)
    assert_close_scaled(got, want.double().cpu(), torch.float16)
    with pytest.raises(AssertionError, match="bits differ"):
        assert_bits_equal(got, want, "(no narrow rounding)")


@triton.jit
def _tree_sum_step(scores, m_i, l_i, dtype: tl.constexpr, BLOCK_S: tl.constexpr, PRECISION: tl.constexpr,
                   ROWSUM_MMA: tl.constexpr):
    """mla_blocks._online_step with tl.sum's row sums whatever the caller asks (the planted bug)."""
    return mla_blocks._online_step(scores, m_i, l_i, dtype, BLOCK_S, PRECISION, False)


@pytest.mark.skipif(not INTERPRETED, reason="a compiled kernel keeps the helper it was compiled with; the "
                    "interpreter calls the module's current one")
def test_bit_check_fails_with_tree_row_sums(monkeypatch):
    """The scores pass with tl.sum's row sums (the one-pass kernel's default, whose tree follows the
    layout) in place of the MMA's: within tolerance, other bits. float32: the interpreter's sums of
    16-32 float16 probabilities are mostly exact in float32 whatever their order, so in float16 the
    two agreed (checked: same bits) and the control would show nothing."""
    q, cache, slots, dense_kv, mask = _attention_case(13, 3, 20, 64, 16, 200, 8, 56, torch.float32)
    scale = 80 ** -0.5
    want = one_pass(q, cache, slots, 64, scale, num_splits=3, block_s=16)
    monkeypatch.setattr(mla_prefill, "_online_step", _tree_sum_step)
    got = two_pass(q, cache, slots, 64, scale, num_splits=3, block_s=16)
    assert_close_scaled(got, reference.sparse_attention(q.cpu(), dense_kv, mask, 64, scale), torch.float32)
    with pytest.raises(AssertionError, match="bits differ"):
        assert_bits_equal(got, want, "(tl.sum row sums)")


# ---------------------------------------------------------------- the deployment shape

@gpu
@pytest.mark.parametrize("launch", [dict(), dict(scores_block_h=64, values_block_h=64, block_v=256),
                                    dict(scores_block_h=32, scores_warps=4, values_block_h=64, block_v=128,
                                         values_warps=4),
                                    dict(scores_block_h=16, values_block_h=16, block_v=512, values_warps=4),
                                    dict(scores_warps=8, scores_stages=1, values_block_h=64, block_v=64,
                                         values_stages=3)])
def test_two_pass_keeps_the_deployment_bits_on_the_gpu(launch):
    """bf16, H=64, C=512, R=64, window 128 + top-512 (S=640: 5 chunks of 128, bf16 chunk sums):
    decode rows and a prompt's early rows (fewer slots than S), against the one-pass kernel with MMA
    row sums at the deployment's launch."""
    q, cache, slots, dense_kv, mask = _attention_case(3, 6, 64, 512, 64, 2 * (512 + 128), 128, 512, torch.bfloat16,
                                                      page_size=64)
    slots = slots.clone()
    for row, count in enumerate([640, 640, 129, 300, 384, 1][:slots.shape[0]]):
        kept = slots[row][slots[row] >= 0][:count]
        slots[row] = -1
        slots[row, :len(kept)] = kept
    want = one_pass(q, cache, slots, 512, 0.04)
    got = two_pass(q, cache, slots, 512, 0.04, **launch)
    assert_bits_equal(got, want, f"({launch})")
    # Rows 0 and 1 kept their whole selection (the mask's): the reference's values too.
    assert_close_scaled(got[:2], reference.sparse_attention(q[:2].cpu(), dense_kv, mask[:2], 512, 0.04),
                        torch.bfloat16)


@pytest.mark.skipif(ON_GPU, reason="on a GPU the tests above compile them for real")
@pytest.mark.parametrize("kernel", ["_scores_pass", "_values_pass"])
@pytest.mark.parametrize("tail", [False, True])
def test_two_pass_kernels_compile_for_the_gpu_without_one(kernel, tail):
    """Both passes at the deployment shape (bf16, H=64 tiles, C=512, R=64, BLOCK_S=64, 640 slots),
    with and without skip_tail, through sm_90's compiler: the interpreter accepts code the compiler
    refuses."""
    from tests.kernels.test_indexer_topk import compile_for_sm90

    if kernel == "_scores_pass":
        pointers = dict(q_ptr="*bf16", kv_ptr="*bf16", idx_ptr="*i32", p_ptr="*bf16", alpha_ptr="*fp32",
                        keep_ptr="*fp32", take_ptr="*fp32", sum_ptr="*fp32")
        scalars = ["heads", "selected", "blocks", "blocks_per_chunk", "chunks", "stride_qt", "stride_qh", "stride_kv",
                   "stride_idx"]
        constants = dict(LATENT=512, ROPE=64, PRECISION="tf32", BLOCK_H=64, BLOCK_S=64, BLOCK_C=512, BLOCK_R=64,
                         TAIL=tail, BLOCK_ALL=1024)
        signature = {**pointers, **dict.fromkeys(scalars[:5], "i32"), "sm_scale_log2": "fp32",
                     **dict.fromkeys(scalars[5:], "i32")}
    else:
        pointers = dict(kv_ptr="*bf16", idx_ptr="*i32", p_ptr="*bf16", alpha_ptr="*fp32", keep_ptr="*fp32",
                        take_ptr="*fp32", sum_ptr="*fp32", out_ptr="*bf16")
        scalars = ["heads", "selected", "blocks", "blocks_per_chunk", "chunks", "stride_kv", "stride_idx",
                   "stride_ot", "stride_oh"]
        constants = dict(LATENT=512, PRECISION="tf32", NARROW=True, BLOCK_H=64, BLOCK_S=64, BLOCK_V=128, V_BLOCKS=4,
                         TAIL=tail, BLOCK_ALL=1024)
        signature = {**pointers, **dict.fromkeys(scalars, "i32")}
    done = compile_for_sm90("runtime.kernels.triton.mla_prefill", kernel, signature, constants,
                            num_warps=4, num_stages=2, enable_fp_fusion=False)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


# ---------------------------------------------------------------- the deployment's dispatch

@pytest.mark.parametrize("heads, rows, two_passes", [(64, 5, True), (64, 4, False), (16, 5, False)])
def test_deployment_runs_prefill_passes_of_mma_row_sum_launches_in_two_passes(monkeypatch, heads, rows, two_passes):
    """mla_prefill.sparse_mla: a pass of more than PREFILL_LAUNCH_ROWS rows goes through the two-pass
    form exactly where the deployment's launch takes MMA row sums (H >= 64), and either way it has the
    one-pass kernel's bits (here with the prefill threshold lowered to 4 rows, and no PREFILL_LAUNCH:
    with one, prefill passes run in one pass)."""
    monkeypatch.setattr(attention, "PREFILL_LAUNCH_ROWS", 4)
    monkeypatch.setattr(attention, "PREFILL_LAUNCH", None)
    calls = []
    real = mla_prefill.sparse_mla_two_pass
    monkeypatch.setattr(mla_prefill, "sparse_mla_two_pass", lambda *a, **k: calls.append(1) or real(*a, **k))
    q, cache, slots, _, _ = _attention_case(3, rows, heads, 64, 16, 300, 32, 96, DTYPES[-1])
    scale = 80 ** -0.5
    got = poisoned(rows, heads, 64, dtype=q.dtype)
    mla_prefill.sparse_mla(q, cache, slots, 64, scale, out=got)
    assert bool(calls) == two_passes
    assert attention.default_launch(slots.shape[1], heads)["rowsum_mma"] == (heads >= 64)
    want = poisoned(rows, heads, 64, dtype=q.dtype)
    attention.sparse_mla_decode(q, cache, slots, 64, scale, out=want)  # the deployment's one-pass launch
    assert_bits_equal(got, want, f"(H={heads}, {rows} rows)")


def test_a_prefill_launch_runs_prefill_passes_in_one_pass_with_the_same_bits(monkeypatch):
    """attention.PREFILL_LAUNCH set: an MMA-row-sum deployment's prefill passes run the one-pass
    kernel with that launch (64-head blocks here) in place of the two-pass form, the same bits."""
    monkeypatch.setattr(attention, "PREFILL_LAUNCH_ROWS", 4)
    monkeypatch.setattr(attention, "PREFILL_LAUNCH", None)
    calls = []
    real = mla_prefill.sparse_mla_two_pass
    monkeypatch.setattr(mla_prefill, "sparse_mla_two_pass", lambda *a, **k: calls.append(1) or real(*a, **k))
    q, cache, slots, _, _ = _attention_case(5, 5, 64, 64, 16, 300, 32, 96, DTYPES[-1])
    scale = 80 ** -0.5
    want = poisoned(5, 64, 64, dtype=q.dtype)
    mla_prefill.sparse_mla(q, cache, slots, 64, scale, out=want)
    assert calls, "the control: without PREFILL_LAUNCH the pass runs in two passes"
    calls.clear()
    monkeypatch.setattr(attention, "PREFILL_LAUNCH", dict(block_h=64, num_warps=8))
    got = poisoned(5, 64, 64, dtype=q.dtype)
    mla_prefill.sparse_mla(q, cache, slots, 64, scale, out=got)
    assert not calls, "PREFILL_LAUNCH set, yet the prefill pass ran in two passes"
    assert_bits_equal(got, want, "(one pass with PREFILL_LAUNCH vs two passes)")


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_pass_skipping_empty_trailing_chunks_keeps_the_bits(dtype):
    """skip_tail in both passes against the one-pass kernel's full loop: rows whose last slot is the
    first or last of a chunk, or in the first chunk; chunks of 32 positions (2 blocks of 16)."""
    counts = [1, 31, 32, 33, 64, 65, 97, 100]
    q, cache, slots, latent, scale = _trailing_padding_case(5, counts, 20, 100, dtype)
    numerics = dict(num_splits=4, block_s=16, narrow_partials=dtype != torch.float32)
    want = one_pass(q, cache, slots, latent, scale, block_h=16, skip_tail=False, **numerics)
    for skip in (False, True):
        got = two_pass(q, cache, slots, latent, scale, skip_tail=skip, **numerics)
        assert_bits_equal(got, want, f"(skip_tail={skip})")


def test_two_pass_skip_tail_oracle_fails_when_a_used_chunk_is_dropped():
    """Negative control: rows with their last selected slot dropped (what skipping one chunk too many
    does to a row whose last chunk holds one slot) give other bits than the full selection's."""
    q, cache, slots, latent, scale = _trailing_padding_case(5, [33, 65], 20, 100, DTYPES[0])
    dropped = slots.clone()
    dropped[0, 32] = dropped[1, 64] = -1
    numerics = dict(num_splits=4, block_s=16)
    got = two_pass(q, cache, dropped, latent, scale, **numerics)
    want = one_pass(q, cache, slots, latent, scale, block_h=16, skip_tail=False, **numerics)
    assert not torch.equal(got[0], want[0]) and not torch.equal(got[1], want[1])
