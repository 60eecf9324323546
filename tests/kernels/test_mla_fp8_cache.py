"""The fp8 latent cache (runtime/kvcache/latent_fp8.py) and the sparse MLA kernel reading it (mla_grouped's FP8).

The kernel's oracle is exact: it dequantizes a block (e4m3 times a power-of-two scale, no rounding) and then runs
the 16-bit kernel's operations, so its output must equal the 16-bit grouped kernel's on `dequantize_rows(cache)` bit
for bit, in every launch mode, and stay within the dtype's tolerance of the readable torch reference on those rows.
The quantizer's oracle is e4m3's own error bound against the unquantized rows. On the CPU the kernels run under the
Triton interpreter (float32 / float16); on a GPU in bfloat16 and float16.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from runtime.kernels import reference
from runtime.kernels.triton import attention, mla_grouped, mla_prefill
from runtime.kvcache import latent_fp8
from tests.kernels.test_triton_kernels import (
    DEVICE,
    DTYPES,
    ON_GPU,
    SEEDS,
    _attention_case,
    _eager_graph_and_side_stream,
    assert_close_scaled,
    assert_prefix_invariant,
    assert_same_bits,
    gpu,
    poisoned,
)

GROUPED_MODES = [(True, "ticket"), (True, "kernel"), (False, "registers")]


def _rows(seed: int, tokens: int, latent: int, rope: int, dtype: torch.dtype, spread_exponents: int = 0):
    """Random rows, never zero, each latent column group scaled by 2^k (k up to `spread_exponents` either way):
    groups of one row with very different magnitudes, which a per-row scale would not survive."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(tokens, latent + rope, generator=gen)
    rows = torch.where(rows == 0, torch.full_like(rows, 1e-3), rows)
    if spread_exponents:
        cols = latent_fp8.group_columns(latent)
        k = torch.randint(-spread_exponents, spread_exponents + 1, (tokens, latent_fp8.GROUPS), generator=gen)
        rows[:, :latent] *= torch.exp2(k.float()).repeat_interleave(cols, dim=1)[:, :latent]
    return rows.to(dtype)


# ---------------------------------------------------------------- the layout and the quantizer

def _within_e4m3(x: torch.Tensor, y: torch.Tensor, latent: int) -> bool:
    """Whether each dequantized value y is within e4m3's half ulp of x: 2^-4 relative, or 2^-10 of its column
    group's own scale (the power of two that brings the group's largest magnitude under 448, computed here from x,
    not read from the cache) where x is near zero."""
    cols = latent_fp8.group_columns(latent)
    amax = torch.nn.functional.pad(x.abs(), (0, 4 * cols - latent)).view(x.shape[0], 4, cols).amax(-1)
    ideal = torch.exp2(torch.ceil(torch.log2(amax / 448)).clamp(min=latent_fp8.MIN_SCALE_EXP))
    per_column = ideal.repeat_interleave(cols, dim=1)[:, :latent]
    return bool((y - x).abs().le(x.abs() * 2.0**-4 + per_column * 2.0**-10).all())


def test_layout_agrees_with_the_kernel():
    """The scales' count and place, and the columns each covers, are the grouped kernel's."""
    assert latent_fp8.GROUPS == mla_grouped.GROUPS
    assert latent_fp8.SCALE_BYTES == mla_grouped.FP8_SCALE_BYTES.value
    for latent in (16, 48, 64, 192, 512, 576, 1024):
        assert latent_fp8.group_columns(latent) == mla_grouped.block_g(latent), latent
    assert latent_fp8.row_bytes(512, 64, torch.bfloat16) == 656  # FlashMLA's fp8 row for DeepSeek's latent


@settings(max_examples=25)
@given(seed=SEEDS, tokens=st.integers(1, 9), latent=st.sampled_from([16, 64, 192, 512]),
       rope=st.sampled_from([0, 16, 64]), spread=st.sampled_from([0, 3, 20]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
@example(seed=0, tokens=3, latent=512, rope=64, spread=20, dtype=torch.bfloat16)
def test_quantized_rows_are_within_e4m3s_error_and_requantize_to_themselves(seed, tokens, latent, rope, spread,
                                                                              dtype):
    """Each value within e4m3's half ulp (2^-4 relative; 2^-10 of the scale near zero) of the row's; scales powers of
    two that put each group's largest magnitude in (224, 448]; the rope part stored as is; and quantizing the
    dequantized rows gives them back (nothing rounds twice; the bytes may differ: a largest value that rounded down
    to 224 takes the next scale down)."""
    if dtype == torch.float16 and spread > 3:
        spread = 3  # float16 holds 2^+-20 x randn only with subnormal rounding: its range, not the quantizer's
    rows = _rows(seed, tokens, latent, rope, dtype, spread)
    cache = latent_fp8.quantize_rows(rows, latent)
    assert cache.dtype == torch.uint8 and cache.shape == (tokens, latent_fp8.row_bytes(latent, rope, dtype))
    scales = latent_fp8.scales_of(cache, latent)
    assert torch.equal(torch.exp2(torch.log2(scales).round()), scales), "a scale is no power of two"
    cols = latent_fp8.group_columns(latent)
    back = latent_fp8.dequantize_rows(cache, latent, dtype)
    x, y = rows[:, :latent].float(), back[:, :latent].float()
    assert _within_e4m3(x, y, latent), f"worst error {float((y - x).abs().max())}"
    grouped_max = torch.nn.functional.pad(x.abs(), (0, 4 * cols - latent)).view(tokens, 4, cols).amax(-1)
    live = grouped_max > 0
    ratio = grouped_max[live] / scales[live]
    assert ratio.gt(224).all() and ratio.le(448).all(), "a group's scale does not fit its largest value"
    assert torch.equal(back[:, latent:], rows[:, latent:]), "the rope part changed"
    again = latent_fp8.dequantize_rows(latent_fp8.quantize_rows(back, latent), latent, dtype)
    assert torch.equal(again, back), "requantizing the dequantized rows changed them"


def test_a_zero_group_stores_zeros_and_the_smallest_scale():
    rows = _rows(1, 2, 64, 16, torch.bfloat16)
    rows[0, 16:32] = 0  # group 1 of row 0 (16 columns a group)
    cache = latent_fp8.quantize_rows(rows, 64)
    assert latent_fp8.scales_of(cache, 64)[0, 1] == 2.0**latent_fp8.MIN_SCALE_EXP
    back = latent_fp8.dequantize_rows(cache, 64, torch.bfloat16)
    assert torch.equal(back[0, 16:32], rows[0, 16:32]) and not back[0, :16].eq(0).any()


def test_the_layout_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="multiple of 16"):
        latent_fp8.row_bytes(40, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16, float16 or float32"):
        latent_fp8.quantize_rows(torch.ones(2, 80, dtype=torch.float64), 64)
    with pytest.raises(ValueError, match="no fp8 latent cache row"):
        latent_fp8.rope_of(64 + 16 + 3, 64, torch.bfloat16)
    with pytest.raises(ValueError, match=r"\[T, C\+R\]"):
        latent_fp8.quantize_rows(torch.ones(2, 32), 64)
    with pytest.raises(ValueError, match="uint8"):
        latent_fp8.dequantize_rows(torch.ones(2, 112), 64, torch.float32)


def test_quantizer_oracle_fails_on_a_per_row_scale():
    """Negative control: one scale for the whole row (what the per-group scales exist to avoid) puts a small-
    magnitude group's values below e4m3's range, and the error bound sees it."""
    rows = _rows(2, 4, 512, 64, torch.bfloat16, spread_exponents=20)
    x = rows[:, :512].float()
    scale = torch.exp2(torch.ceil(torch.log2(x.abs().amax(1, keepdim=True) / 448)))
    y = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    assert not _within_e4m3(x, y, 512)
    assert _within_e4m3(x, latent_fp8.dequantize_rows(latent_fp8.quantize_rows(rows, 512), 512, torch.bfloat16)
                        [:, :512].float(), 512), "the control's rows are fine under per-group scales"


# ---------------------------------------------------------------- the kernel

def _fp8_case(seed, queries, heads, latent, rope, topk, dtype, window=12, page_size=16):
    """_attention_case's paged cache quantized, its dequantized rows (what the kernel must compute on) and the
    reference's dense rows, dequantized alike (the quantizer works row by row, so a row's bytes do not depend on
    where it sits)."""
    q, cache, slots, dense, mask = _attention_case(seed, queries, heads, latent, rope, 3 * (window + topk), window,
                                                   topk, dtype, page_size)
    cache8 = latent_fp8.quantize_rows(cache, latent)
    dense_deq = latent_fp8.dequantize_rows(latent_fp8.quantize_rows(dense, latent), latent, dtype)
    return q, cache8, latent_fp8.dequantize_rows(cache8, latent, dtype), slots, dense_deq, mask


def _decode(q, cache, slots, latent, scale, spread, merge, **launch):
    out = poisoned(q.shape[0], q.shape[1], latent, dtype=q.dtype)
    return attention.sparse_mla_decode(q, cache, slots, latent, scale, spread=spread, merge=merge, out=out,
                                       column_groups=4, **launch)


@settings(max_examples=6 if ON_GPU else 3)
@given(seed=SEEDS, queries=st.sampled_from([1, 3]), heads=st.sampled_from([16, 20, 64]),
       latent=st.sampled_from([64, 192, 512]), topk=st.sampled_from([40, 100]), splits=st.sampled_from([1, 3, 5]),
       rowsum_mma=st.booleans(), narrow=st.booleans(), dtype=st.sampled_from(DTYPES))
@example(seed=5, queries=3, heads=20, latent=192, topk=100, splits=5, rowsum_mma=True, narrow=True,
         dtype=torch.float16)
def test_fp8_cache_gives_the_16_bit_kernels_bits_on_its_dequantized_rows(seed, queries, heads, latent, topk, splits,
                                                                         rowsum_mma, narrow, dtype):
    """In every launch mode: the 16-bit grouped kernel's bits on the dequantized cache, the reference's values on
    it, rows permuted give rows permuted, and a prefix of the batch its own rows (f(x)[:k] == f(x[:k]))."""
    rope = 16
    q, cache8, deq, slots, dense, mask = _fp8_case(seed, queries, heads, latent, rope, topk, dtype)
    scale = (latent + rope) ** -0.5
    launch = dict(num_splits=splits, block_h=16, block_s=16, narrow_partials=narrow, rowsum_mma=rowsum_mma)
    want = _decode(q, deq, slots, latent, scale, *GROUPED_MODES[0], **launch)
    outs = {mode: _decode(q, cache8, slots, latent, scale, *mode, **launch) for mode in GROUPED_MODES}
    assert_same_bits({"16-bit kernel, dequantized cache": want, **outs})
    assert_close_scaled(want, reference.sparse_attention(q.cpu(), dense, mask, latent, scale), dtype)
    perm = torch.randperm(queries, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    assert torch.equal(_decode(q[perm], cache8, slots[perm], latent, scale, *GROUPED_MODES[2], **launch), want[perm])
    assert_prefix_invariant(want, lambda k: _decode(q[:k], cache8, slots[:k], latent, scale, None, None, **launch),
                            queries)


def test_kernel_oracle_fails_when_a_group_takes_another_groups_scale():
    """Negative control: the kernel reading group 0 under group 1's scale (planted as the two scales swapped in
    every row) no longer gives the dequantized cache's result."""
    dtype = DTYPES[0]
    q, cache8, deq, slots, _, _ = _fp8_case(3, 2, 16, 64, 16, 40, dtype)
    swapped = cache8.clone()
    scales = latent_fp8.scales_of(cache8, 64)
    scales[:, [0, 1]] = scales[:, [1, 0]] * torch.tensor([2.0, 0.5])  # never equal, even where both were
    swapped[:, 64:64 + latent_fp8.SCALE_BYTES] = scales.contiguous().view(torch.uint8)
    launch = dict(num_splits=3, block_h=16, block_s=16)
    want = _decode(q, deq, slots, 64, 0.1, True, "ticket", **launch)
    with pytest.raises(AssertionError, match="differs"):
        assert_same_bits({"dequantized": want, "swapped scales": _decode(q, swapped, slots, 64, 0.1, True, "ticket",
                                                                         **launch)})


def test_the_fp8_cache_refuses_launches_that_cannot_read_it():
    dtype = DTYPES[0]
    q, cache8, _, slots, _, _ = _fp8_case(0, 1, 16, 64, 16, 40, dtype)
    for launch in (dict(column_groups=1), dict(v_split=2), dict(spread=False, merge="memory")):
        with pytest.raises(ValueError, match="column"):
            attention.sparse_mla_decode(q, cache8, slots, 64, 0.1, num_splits=3, block_s=16, **launch)
    with pytest.raises(ValueError, match="bytes"):
        attention.sparse_mla_decode(q, cache8[:, :-2], slots, 64, 0.1, num_splits=3, block_s=16)
    with pytest.raises(ValueError, match="fp8 latent cache"):
        mla_prefill.sparse_mla_two_pass(q, cache8, slots, 64, 0.1, num_splits=3)


def test_the_deployments_default_reads_the_fp8_cache_in_column_groups():
    """No launch knob given (the interpreter's default is one column group): an fp8 cache still runs the grouped
    kernel, and gives what column_groups=4 gives."""
    dtype = DTYPES[0]
    q, cache8, _, slots, _, _ = _fp8_case(1, 3, 16, 64, 16, 40, dtype)
    out = poisoned(3, 16, 64, dtype=dtype)
    attention.sparse_mla_decode(q, cache8, slots, 64, 0.1, num_splits=3, block_s=16, out=out)
    assert torch.equal(out, _decode(q, cache8, slots, 64, 0.1, None, None, num_splits=3, block_s=16))


@gpu
@pytest.mark.parametrize("heads,topk", [(64, 512), (16, 512), (64, 640)])
def test_fp8_cache_at_the_deployment_shape_on_the_gpu(heads, topk):
    """C=512, R=64, window 128, bf16, the deployment's launch (no knob given) at bs 1, 5 and 130 (the large-batch
    launch: 64-head blocks): the 16-bit kernel's bits on the dequantized cache, and batch-invariant."""
    for queries in (1, 5, 130):
        q, cache, slots, _, _ = _attention_case(queries, queries, heads, 512, 64, 2 * (topk + 128), 128, topk,
                                                torch.bfloat16, page_size=64)
        cache8 = latent_fp8.quantize_rows(cache, 512)
        deq = latent_fp8.dequantize_rows(cache8, 512, torch.bfloat16)

        def run(q, cache, slots):
            out = poisoned(q.shape[0], heads, 512, dtype=torch.bfloat16)
            return attention.sparse_mla_decode(q, cache, slots, 512, 0.04, out=out)
        want = run(q, deq, slots)
        got = run(q, cache8, slots)
        assert torch.equal(got, want), f"fp8 cache differs from the dequantized cache at bs {queries}"
        assert_prefix_invariant(got, lambda k, q=q, c=cache8, s=slots: run(q[:k], c, s[:k]), queries)


@gpu
@pytest.mark.parametrize("queries,splits", [(1, 4), (9, 3), (200, 3)])
def test_fp8_cache_under_graph_replay_and_side_stream(queries, splits):
    def make(seed):
        q, cache, slots, _, _ = _attention_case(seed, queries, 16, 512, 64, 300, 16, 128, torch.bfloat16)
        return q, latent_fp8.quantize_rows(cache, 512), slots
    eager, replayed, side = _eager_graph_and_side_stream(
        make, lambda q, c, s: attention.sparse_mla_decode(q, c, s, 512, 0.04, num_splits=splits))
    assert torch.equal(replayed, eager), "graph replay differs from eager"
    assert torch.equal(side, eager), "side stream differs from eager"


@pytest.mark.skipif(ON_GPU, reason="on a GPU the tests above compile it for real")
@pytest.mark.parametrize("spread, ticket", [(False, False), (True, True)])
@pytest.mark.parametrize("block_h, warps", [(16, 4), (64, 8)])
def test_fp8_grouped_kernel_compiles_for_the_gpu_without_one(spread, ticket, block_h, warps):
    """The FP8 form through sm_90's compiler at H=64's launches (16-head blocks at 4 warps, the large-batch and
    prefill launch's 64-head blocks at 8): the interpreter runs pointer casts the compiler may refuse."""
    from tests.kernels.test_indexer_topk import compile_for_sm90

    pointers = dict(q_ptr="*bf16", kv_ptr="*u8", idx_ptr="*i32", out_ptr="*bf16", part_ptr="*bf16",
                    stats_ptr="*fp32", ticket_ptr="*i32")
    scalars = dict.fromkeys(["heads", "selected", "blocks_per_chunk", "stride_qt", "stride_qh", "stride_kv",
                             "stride_idx", "stride_ot", "stride_oh"], "i32")
    constants = dict(LATENT=512, ROPE=64, SPREAD=spread, TICKET=ticket, PRECISION="tf32", BLOCK_H=block_h,
                     BLOCK_S=64, BLOCK_G=128, BLOCK_R=64, NARROW=True, SPLITS=10, TAIL=False, BLOCK_ALL=1024,
                     ROWSUM_MMA=True, FP8=True)
    done = compile_for_sm90("runtime.kernels.triton.mla_grouped", "_sparse_mla_grouped_kernel",
                            {**pointers, **scalars, "sm_scale_log2": "fp32"}, constants, num_warps=warps, num_stages=2,
                            enable_fp_fusion=False)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
