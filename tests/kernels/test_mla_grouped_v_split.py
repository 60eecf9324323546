"""The grouped sparse MLA kernel's latent-column blocks (`v_split` 2 and 4 with `column_groups=4`, issue 15: H=16
at bs 32-64 leaves SMs idle in the gathered mode, and the spread mode pays for its partial states there).

Each program scores over the whole latent but sums the values of only its column groups, so every output column's
sum is the same k-chain as in the one-block program: the bits of `v_split=1`, in every grouped mode (spread with
the ticket or the merge launch, gathered), with the one-block loop and the general one, and the reference's
values. The control plants a column block that sums the wrong groups' values.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import example, given, settings
from hypothesis import strategies as st

from runtime.kernels import reference
from runtime.kernels.triton import INTERPRETED, attention, mla_grouped
from tests.kernels.test_triton_kernels import (
    DTYPES,
    ON_GPU,
    SEEDS,
    _attention_case,
    assert_close_scaled,
    assert_same_bits,
    gpu,
    poisoned,
)

pytestmark = pytest.mark.kernels

GROUPED_MODES = [(True, "ticket"), (True, "kernel"), (False, "registers")]


def run_grouped(q, cache, slots, latent, scale, splits, spread, merge, v_split, **launch):
    out = poisoned(q.shape[0], q.shape[1], latent, dtype=q.dtype)
    return attention.sparse_mla_decode(q, cache, slots, latent, scale, num_splits=splits, block_h=16, block_s=16,
                                       spread=spread, merge=merge, column_groups=4, v_split=v_split, out=out,
                                       **launch)


@settings(max_examples=6 if ON_GPU else 3)
@given(seed=SEEDS, queries=st.sampled_from([1, 3]), heads=st.sampled_from([16, 20]),
       latent=st.sampled_from([64, 192]), topk=st.sampled_from([40, 100]), splits=st.sampled_from([1, 3, 7]),
       v_split=st.sampled_from([2, 4]), one_block=st.booleans(), rowsum_mma=st.booleans(), narrow=st.booleans(),
       dtype=st.sampled_from(DTYPES))
@example(seed=3, queries=3, heads=20, latent=192, topk=100, splits=7, v_split=2, one_block=True, rowsum_mma=False,
         narrow=True, dtype=torch.float16)
@example(seed=5, queries=1, heads=16, latent=64, topk=40, splits=3, v_split=4, one_block=False, rowsum_mma=True,
         narrow=False, dtype=DTYPES[0])
def test_latent_column_blocks_keep_the_one_block_programs_bits(seed, queries, heads, latent, topk, splits, v_split,
                                                               one_block, rowsum_mma, narrow, dtype):
    """v_split 2 / 4 against v_split 1, the grouped kernel in every mode: the same bits (latents that four groups
    do not divide into powers of two, heads not a multiple of the block, one chunk and several), and the
    reference's values."""
    rope_dim, window = 16, 12
    q, cache, slots, dense_kv, mask = _attention_case(seed, queries, heads, latent, rope_dim, 3 * (window + topk),
                                                      window, topk, dtype)
    scale = (latent + rope_dim) ** -0.5
    outs = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mla_grouped, "ONE_BLOCK_CHUNKS", one_block)
        patch.setattr(mla_grouped, "ONE_BLOCK_MIN_WARPS", 1)  # the interpreter's launches are 4 warps
        for split in (1, v_split):
            for spread, merge in GROUPED_MODES:
                outs[split, spread, merge] = run_grouped(q, cache, slots, latent, scale, splits, spread, merge, split,
                                                         narrow_partials=narrow, rowsum_mma=rowsum_mma)
    assert_same_bits(outs)
    assert_close_scaled(outs[v_split, False, "registers"],
                        reference.sparse_attention(q.cpu(), dense_kv, mask, latent, scale), dtype)


def test_latent_column_blocks_outside_the_grouped_kernels_are_refused():
    q, cache, slots, _, _ = _attention_case(0, 1, 16, 64, 16, 300, 8, 100, DTYPES[0])
    with pytest.raises(ValueError, match="v_split in"):
        attention.sparse_mla_decode(q, cache, slots, 64, 0.1, num_splits=3, block_s=16, column_groups=4, v_split=8)
    with pytest.raises(ValueError, match="grouped kernel runs"):
        mla_grouped.launch(1, q, cache, slots, q, q, q, q, 16, 100, 1, 0.1, latent=64, rope=16, spread=False,
                           ticket=False, precision="ieee", block_h=16, block_s=16, narrow=False, splits=1, tail=False,
                           rowsum_mma=False, warps=4, stages=1, v_split=3)


_VALUE_GROUPS = mla_grouped._value_groups


@triton.jit
def _value_groups_of_the_first_block(kv0, kv1, kv2, kv3, v_block, V_SPLIT: tl.constexpr):
    """A planted slip: every column block sums the first block's values (its own columns stored, wrong)."""
    return _VALUE_GROUPS(kv0, kv1, kv2, kv3, v_block * 0, V_SPLIT)


@pytest.mark.skipif(not INTERPRETED, reason="a planted jit helper is swapped in by name: the interpreter only")
def test_latent_column_blocks_control_a_block_summing_another_blocks_values_is_caught(monkeypatch):
    """Negative control for the equality above: with the second column block summing the first block's values,
    the bits leave v_split=1's (which also shows the split launch is what ran)."""
    q, cache, slots, _, _ = _attention_case(6, 3, 20, 64, 16, 3 * (12 + 100), 12, 100, torch.float16)
    want = run_grouped(q, cache, slots, 64, 0.1, 7, False, "registers", 1)
    assert torch.equal(run_grouped(q, cache, slots, 64, 0.1, 7, False, "registers", 2), want)
    monkeypatch.setattr(mla_grouped, "_value_groups", _value_groups_of_the_first_block)
    bug = run_grouped(q, cache, slots, 64, 0.1, 7, False, "registers", 2)
    assert not torch.equal(bug, want), "the planted slip left the bits alone: the equality shows nothing"


@gpu
@pytest.mark.parametrize("heads,latent,rope,window,topk,dtype,rowsum_mma", [
    (16, 512, 64, 128, 512, torch.bfloat16, False), (64, 512, 64, 128, 512, torch.bfloat16, True),
    (16, 512, 64, 128, 512, torch.float32, False),
])
def test_latent_column_blocks_keep_the_deployments_bits_on_the_gpu(heads, latent, rope, window, topk, dtype,
                                                                   rowsum_mma):
    """At the deployment shapes (C=512, R=64, window 128, top-512; H=16 with tl.sum's row sums, H=64 with the
    MMA's), bs 1 and 6: v_split 2 and 4 give the deployment launch's bits in every grouped mode."""
    for queries in (1, 6):
        q, cache, slots, _, _ = _attention_case(queries, queries, heads, latent, rope, 2 * (topk + window), window,
                                                topk, dtype, page_size=64)

        def run(q=q, cache=cache, slots=slots, **launch):
            out = poisoned(q.shape[0], heads, latent, dtype=dtype)
            return attention.sparse_mla_decode(q, cache, slots, latent, 0.04, rowsum_mma=rowsum_mma, out=out,
                                               **launch)
        want = run(spread=False, merge="registers", column_groups=4)
        for v_split in (2, 4):
            for spread, merge in GROUPED_MODES:
                got = run(spread=spread, merge=merge, column_groups=4, v_split=v_split)
                assert torch.equal(got, want), f"bits changed: {v_split=}, {spread=}, {merge=}"



@pytest.mark.skipif(ON_GPU, reason="on a GPU the bit test above compiles them for real")
@pytest.mark.parametrize("v_split, spread, one_block", [(2, False, True), (4, False, False), (2, True, True)])
def test_latent_column_blocks_compile_for_the_gpu_without_one(v_split, spread, one_block):
    """The split launches through sm_90's compiler at H=16's deployment launch (16-head blocks, 8 warps, tl.sum's
    row sums, float32 partials): gathered in both loops, and spread with the ticket's fold of its columns."""
    from tests.kernels.test_indexer_topk import compile_for_sm90

    pointers = dict(q_ptr="*bf16", kv_ptr="*bf16", idx_ptr="*i32", out_ptr="*bf16", part_ptr="*fp32",
                    stats_ptr="*fp32", ticket_ptr="*i32")
    scalars = dict.fromkeys(["heads", "selected", "blocks_per_chunk", "stride_qt", "stride_qh", "stride_kv",
                             "stride_idx", "stride_ot", "stride_oh"], "i32")
    constants = dict(LATENT=512, ROPE=64, SPREAD=spread, TICKET=spread, PRECISION="tf32", BLOCK_H=16, BLOCK_S=64,
                     BLOCK_G=128, BLOCK_R=64, NARROW=False, SPLITS=10, TAIL=False, BLOCK_ALL=1024, ROWSUM_MMA=False,
                     ONE_BLOCK=one_block, PDL=False, V_SPLIT=v_split)
    done = compile_for_sm90("runtime.kernels.triton.mla_grouped", "_sparse_mla_grouped_kernel",
                            {**pointers, **scalars, "sm_scale_log2": "fp32"}, constants, num_warps=8, num_stages=2,
                            enable_fp_fusion=False)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
