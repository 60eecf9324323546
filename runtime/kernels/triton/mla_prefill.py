"""Sparse latent-MQA attention for prefill passes in two passes, with the bits of the one-pass kernel.

The one-pass kernel (attention.sparse_mla_decode) runs, per (query, head block), the scores, the
online softmax and the values product together. At prefill sizes that costs it twice: a 16-head
program gathers each selected latent row once per head block (4 times for H=64), and a 64-head
program holds two [64 x C] float32 accumulators (the running chunk and the fold), which spill.
Here the same operations run in two launches:

- scores pass, one program per (query, head block of up to 64 heads): for each BLOCK_S block of
  the query's selected slots the kernel's scores (latent then rope dot into one accumulator), its
  online-softmax step and its MMA row sums (rowsum_mma), and at each chunk end its fold of the
  softmax statistics. It keeps no [H x C] state: it writes the 16-bit probabilities p_v [T, H, S],
  each block's rescale alpha [T, blocks, H], each chunk's fold weights keep and take [T, N, H] and
  the final sum L [T, H].
- values pass, one program per (query, head block, latent-column block BLOCK_V): the kernel's
  acc = p_v @ kv_v + acc * alpha over its own columns only (the rows are gathered once for all
  heads, each column block reads its own columns), the chunk sum's narrow rounding, the fold
  A = A * keep + acc * take at each chunk end, and out = A / L.

Each float operation is the one-pass kernel's with the same inputs, in the same order, so the bits
are those of `sparse_mla_decode(..., rowsum_mma=True)` at the same N, BLOCK_S and narrow partials:
with MMA row sums neither BLOCK_H nor the column split changes a row's bits (an MMA's column
results do not depend on the tile's shape; shown on the H200 for BLOCK_H, warps and V_SPLIT).
Shared formulas are mla_blocks' @triton.jit helpers (`_online_step` with MMA row sums, `_fold_weights`,
`_fold_rows`, `_normalize`), not copies. Only the row sums as an MMA have this form: tl.sum's
tree follows the layout, so a tl.sum deployment's bits could not be kept.

Deployed through `sparse_mla`: the prefill passes (more than attention.PREFILL_LAUNCH_ROWS rows)
of a deployment whose launch takes MMA row sums (default_launch: H >= 64). The intermediate p_v is
T x H x S 16-bit values (335 MB for 4,096 rows x 64 heads x 640 slots), allocated per call.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from runtime.kernels.triton import INTERPRETED, attention
from runtime.kernels.triton.attention import LOG2E, chunk_blocks, default_launch, mma_precision
from runtime.kernels.triton.mla_blocks import (
    _block_scores,
    _fold_rows,
    _fold_weights,
    _gather_block,
    _normalize,
    _online_step,
    _tail_end_block,
)

# Launch shapes of the two passes (no effect on the bits). 64-head scores tiles gather each row once
# for all heads. H200, 4,096 rows (bench.mla_sweep --only-two-pass, docs/results.md "Ninth session"):
# 4 warps a pass 2,771 us, 8 warps 3,239. (Not for spills, as first thought from an unspecialized compile: as a
# launch specializes it the 8-warp scores pass takes 190 registers and spills nothing; bench.kernel_resources.)
SCORES_LAUNCH = dict(block_h=64, num_warps=4, num_stages=2)
VALUES_LAUNCH = dict(block_h=64, block_v=128, num_warps=4, num_stages=2)


@triton.jit
def _scores_pass(q_ptr, kv_ptr, idx_ptr, p_ptr, alpha_ptr, keep_ptr, take_ptr, sum_ptr,
                 heads, selected, blocks, blocks_per_chunk, chunks, sm_scale_log2,
                 stride_qt, stride_qh, stride_kv, stride_idx,
                 LATENT: tl.constexpr, ROPE: tl.constexpr, PRECISION: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, TAIL: tl.constexpr,
                 BLOCK_ALL: tl.constexpr):
    # Head blocks fastest: a query's head blocks gather the same rows side by side (shared in L2).
    pid = tl.program_id(0)
    head_blocks = tl.cdiv(heads, BLOCK_H)
    head_block = pid % head_blocks
    query = (pid // head_blocks).to(tl.int64)
    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < heads
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    c_ok = offs_c < LATENT
    r_ok = offs_r < ROPE
    q_rows = q_ptr + query * stride_qt + offs_h[:, None] * stride_qh
    q_lat = tl.load(q_rows + offs_c[None, :], mask=h_ok[:, None] & c_ok[None, :], other=0.0)
    q_rope = tl.load(q_rows + LATENT + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    # p_v rows are padded to whole blocks (blocks * BLOCK_S): the values pass loads whole tiles.
    p_rows = p_ptr + (query * heads + offs_h)[:, None] * (blocks * BLOCK_S)
    # The folded statistics and the running chunk's; -1e30, finite, as in the one-pass kernel.
    M = tl.full((BLOCK_H,), -1e30, dtype=tl.float32)
    L = tl.zeros((BLOCK_H,), dtype=tl.float32)
    m_i = tl.full((BLOCK_H,), -1e30, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    end_block = blocks
    if TAIL:  # the values pass stops at the same block: skipped chunks' p, alpha, keep, take are never read
        end_block = tl.minimum(blocks, _tail_end_block(idx_ptr, query, stride_idx, selected, blocks_per_chunk,
                                                       BLOCK_S, BLOCK_ALL))
    for block in range(0, end_block):
        offs_s = block * BLOCK_S + tl.arange(0, BLOCK_S)
        valid, _, kv_lat, kv_rope = _gather_block(kv_ptr, idx_ptr, query, block, selected, stride_kv, stride_idx,
                                                  offs_c, c_ok, offs_r, r_ok, LATENT, BLOCK_S)
        scores = _block_scores(q_lat, q_rope, kv_lat, kv_rope, valid, sm_scale_log2, PRECISION)
        # Row sums as an MMA always: this form's numerics are the rowsum_mma deployment's.
        m_i, alpha, p_v, l_i = _online_step(scores, m_i, l_i, kv_lat.dtype, BLOCK_S, PRECISION, True)
        tl.store(p_rows + offs_s[None, :], p_v, mask=h_ok[:, None])
        tl.store(alpha_ptr + (query * blocks + block) * heads + offs_h, alpha, mask=h_ok)
        if ((block + 1) % blocks_per_chunk == 0) | (block + 1 == blocks):  # a chunk ends here
            M, keep, take = _fold_weights(M, m_i)
            L = L * keep + l_i * take
            at = (query * chunks + block // blocks_per_chunk) * heads + offs_h
            tl.store(keep_ptr + at, keep, mask=h_ok)
            tl.store(take_ptr + at, take, mask=h_ok)
            m_i = tl.full((BLOCK_H,), -1e30, dtype=tl.float32)
            l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    tl.store(sum_ptr + query * heads + offs_h, L, mask=h_ok)


@triton.jit
def _values_pass(kv_ptr, idx_ptr, p_ptr, alpha_ptr, keep_ptr, take_ptr, sum_ptr, out_ptr,
                 heads, selected, blocks, blocks_per_chunk, chunks,
                 stride_kv, stride_idx, stride_ot, stride_oh,
                 LATENT: tl.constexpr, PRECISION: tl.constexpr, NARROW: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr, V_BLOCKS: tl.constexpr, TAIL: tl.constexpr,
                 BLOCK_ALL: tl.constexpr):
    # Head blocks fastest, then column blocks: a query's programs share its p_v tiles through L2.
    pid = tl.program_id(0)
    head_blocks = tl.cdiv(heads, BLOCK_H)
    head_block = pid % head_blocks
    v_block = (pid // head_blocks) % V_BLOCKS
    query = (pid // head_blocks // V_BLOCKS).to(tl.int64)
    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < heads
    offs_v = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = offs_v < LATENT
    p_rows = p_ptr + (query * heads + offs_h)[:, None] * (blocks * BLOCK_S)
    A = tl.zeros((BLOCK_H, BLOCK_V), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_V), dtype=tl.float32)
    end_block = blocks
    if TAIL:
        end_block = tl.minimum(blocks, _tail_end_block(idx_ptr, query, stride_idx, selected, blocks_per_chunk,
                                                       BLOCK_S, BLOCK_ALL))
    for block in range(0, end_block):
        offs_s = block * BLOCK_S + tl.arange(0, BLOCK_S)
        slot = tl.load(idx_ptr + query * stride_idx + offs_s, mask=offs_s < selected, other=-1)
        valid = slot >= 0
        kv_v = tl.load(kv_ptr + slot.to(tl.int64)[:, None] * stride_kv + offs_v[None, :],
                       mask=valid[:, None] & v_ok[None, :], other=0.0)
        # Padding heads: p 0, alpha 1 (finite, so their masked-out rows stay harmless).
        p_v = tl.load(p_rows + offs_s[None, :], mask=h_ok[:, None], other=0.0)
        alpha = tl.load(alpha_ptr + (query * blocks + block) * heads + offs_h, mask=h_ok, other=1.0)
        acc = tl.dot(p_v, kv_v, acc * alpha[:, None], input_precision=PRECISION)
        if ((block + 1) % blocks_per_chunk == 0) | (block + 1 == blocks):  # a chunk ends here
            if NARROW:  # the chunk's sum as the one-pass kernel rounds it (its spread mode stores it so)
                acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
            at = (query * chunks + block // blocks_per_chunk) * heads + offs_h
            keep = tl.load(keep_ptr + at, mask=h_ok, other=1.0)
            take = tl.load(take_ptr + at, mask=h_ok, other=1.0)
            A = _fold_rows(A, acc, keep, take)
            acc = tl.zeros((BLOCK_H, BLOCK_V), dtype=tl.float32)
    L = tl.load(sum_ptr + query * heads + offs_h, mask=h_ok, other=1.0)
    out = _normalize(A, L, h_ok)
    tl.store(out_ptr + query * stride_ot + offs_h[:, None] * stride_oh + offs_v[None, :],
             out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & v_ok[None, :])


def _head_block(asked: int, heads: int) -> int:
    # At least 16 rows (the MMA's smallest tile), at most the heads rounded up.
    return max(16, min(asked, triton.next_power_of_2(heads)))


def _warps_stages(warps: int | None, stages: int | None, default: dict) -> tuple[int, int]:
    if INTERPRETED:  # one program at a time in Python: the shape only costs time there
        return 4, 1
    return warps or default["num_warps"], stages or default["num_stages"]


class SoftmaxStats(NamedTuple):
    """What the scores pass hands the values pass: p_v [T, H, blocks x BLOCK_S] (kv's dtype), alpha
    [T, blocks, H], keep and take [T, N, H], the final sums [T, H] (float32), and the chunking."""
    p: torch.Tensor
    alpha: torch.Tensor
    keep: torch.Tensor
    take: torch.Tensor
    row_sum: torch.Tensor
    block_s: int
    blocks_per_chunk: int
    narrow: bool
    skip_tail: bool  # both passes stop after each query's last chunk with a selected slot


def scores_pass(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, latent_dim: int, scale: float,
                num_splits: int | None = None, block_s: int | None = None, narrow_partials: bool | None = None,
                block_h: int | None = None, num_warps: int | None = None,
                num_stages: int | None = None, skip_tail: bool = True) -> SoftmaxStats:
    """The first launch of sparse_mla_two_pass (apart so the bench can time it): the numerics
    knobs as sparse_mla_decode's (default_launch's unless given), the launch shape SCORES_LAUNCH's.
    skip_tail: as sparse_mla_decode's (the same bits; on by default: this form runs prefill passes,
    whose rows near a sequence's start select fewer slots than top-k)."""
    tokens, heads, width = q.shape
    selected = slots.shape[1]
    launch = default_launch(selected, heads)
    block_s = block_s or launch["block_s"]
    blocks_per_chunk, chunks = chunk_blocks(selected, num_splits or launch["num_splits"], block_s)
    blocks = triton.cdiv(selected, block_s)
    narrow = launch["narrow_partials"] if narrow_partials is None else narrow_partials
    dev = q.device
    stats = SoftmaxStats(p=torch.empty(tokens, heads, blocks * block_s, dtype=kv_cache.dtype, device=dev),
                         alpha=torch.empty(tokens, blocks, heads, dtype=torch.float32, device=dev),
                         keep=torch.empty(tokens, chunks, heads, dtype=torch.float32, device=dev),
                         take=torch.empty(tokens, chunks, heads, dtype=torch.float32, device=dev),
                         row_sum=torch.empty(tokens, heads, dtype=torch.float32, device=dev),
                         block_s=block_s, blocks_per_chunk=blocks_per_chunk,
                         # float32 q keeps float32 chunk sums, as in sparse_mla_decode
                         narrow=narrow and q.dtype in (torch.bfloat16, torch.float16),
                         skip_tail=skip_tail and chunks > 1)
    if tokens == 0:
        return stats
    bh = _head_block(block_h or SCORES_LAUNCH["block_h"], heads)
    warps, stages = _warps_stages(num_warps, num_stages, SCORES_LAUNCH)
    rope_dim = width - latent_dim
    # No mul+add contraction: every product and sum must round as the one-pass kernel's do.
    _scores_pass[(triton.cdiv(heads, bh) * tokens,)](
        q, kv_cache, slots, stats.p, stats.alpha, stats.keep, stats.take, stats.row_sum, heads, selected, blocks,
        blocks_per_chunk, chunks, scale * LOG2E, q.stride(0), q.stride(1), kv_cache.stride(0), slots.stride(0),
        LATENT=latent_dim, ROPE=rope_dim, PRECISION=mma_precision(q.dtype), BLOCK_H=bh, BLOCK_S=block_s,
        BLOCK_C=triton.next_power_of_2(latent_dim), BLOCK_R=max(16, triton.next_power_of_2(rope_dim)),
        TAIL=stats.skip_tail, BLOCK_ALL=triton.next_power_of_2(selected), num_warps=warps, num_stages=stages,
        enable_fp_fusion=False)
    return stats


def values_pass(stats: SoftmaxStats, kv_cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor,
                block_h: int | None = None, block_v: int | None = None, num_warps: int | None = None,
                num_stages: int | None = None) -> torch.Tensor:
    """The second launch of sparse_mla_two_pass into out [T, H, C] (q's dtype): the launch shape
    VALUES_LAUNCH's unless given; block_v = latent columns per program."""
    tokens, heads, latent_dim = out.shape
    if tokens == 0:
        return out
    selected = slots.shape[1]
    blocks = triton.cdiv(selected, stats.block_s)
    bh = _head_block(block_h or VALUES_LAUNCH["block_h"], heads)
    bv = min(block_v or VALUES_LAUNCH["block_v"], triton.next_power_of_2(latent_dim))
    warps, stages = _warps_stages(num_warps, num_stages, VALUES_LAUNCH)
    v_blocks = triton.cdiv(latent_dim, bv)
    _values_pass[(triton.cdiv(heads, bh) * v_blocks * tokens,)](
        kv_cache, slots, stats.p, stats.alpha, stats.keep, stats.take, stats.row_sum, out, heads, selected, blocks,
        stats.blocks_per_chunk, stats.keep.shape[1], kv_cache.stride(0), slots.stride(0), out.stride(0),
        out.stride(1), LATENT=latent_dim, PRECISION=mma_precision(out.dtype), NARROW=stats.narrow, BLOCK_H=bh,
        BLOCK_S=stats.block_s, BLOCK_V=bv, V_BLOCKS=v_blocks, TAIL=stats.skip_tail,
        BLOCK_ALL=triton.next_power_of_2(selected), num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    return out


def sparse_mla_two_pass(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, latent_dim: int, scale: float,
                        num_splits: int | None = None, block_s: int | None = None,
                        narrow_partials: bool | None = None, scores_block_h: int | None = None,
                        scores_warps: int | None = None, scores_stages: int | None = None,
                        values_block_h: int | None = None, block_v: int | None = None,
                        values_warps: int | None = None, values_stages: int | None = None,
                        skip_tail: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """sparse_mla_decode(q, kv_cache, slots, latent_dim, scale, rowsum_mma=True) in two launches, the
    same bits. q: [T, H, C+R]; kv_cache: [num_slots, C+R]; slots: [T, S] int32, -1 = none (each row
    needs >= 1). Returns [T, H, C] in q.dtype. num_splits, block_s, narrow_partials: the numerics,
    default_launch's unless given (as sparse_mla_decode's). The rest are launch shapes only
    (SCORES_LAUNCH, VALUES_LAUNCH unless given): scores_* for the scores pass, values_* and block_v
    (latent columns per program) for the values pass. skip_tail: both passes stop after each query's
    last chunk with a selected slot (the same bits; see scores_pass)."""
    tokens, heads, _ = q.shape
    if out is None:
        out = torch.empty(tokens, heads, latent_dim, dtype=q.dtype, device=q.device)
    if out.dtype != q.dtype:
        raise ValueError(f"out must be q's dtype ({q.dtype}), not {out.dtype}: the chunk sums' narrow rounding "
                         "reads it")
    stats = scores_pass(q, kv_cache, slots, latent_dim, scale, num_splits, block_s, narrow_partials, scores_block_h,
                        scores_warps, scores_stages, skip_tail)
    return values_pass(stats, kv_cache, slots, out, values_block_h, block_v, values_warps, values_stages)


def sparse_mla(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, latent_dim: int, scale: float,
               num_splits: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The deployment's sparse MLA, as attention.sparse_mla_decode(q, kv_cache, slots, ...): a pass of
    more than PREFILL_LAUNCH_ROWS rows (a prefill chunk) whose deployment takes its row sums as an
    MMA runs the two-pass form, the same bits (1.3 ms less per 4,096-row dsv4-slice pass on the
    H200: 19.0 against 20.3-20.6 ms), unless attention.PREFILL_LAUNCH names a one-pass launch for
    prefill passes; every other pass runs the one-pass kernel."""
    if (q.shape[0] > attention.PREFILL_LAUNCH_ROWS and attention.PREFILL_LAUNCH is None
            and default_launch(slots.shape[1], q.shape[1])["rowsum_mma"]):
        tail = attention.SKIP_TAIL_ROWS is not None and q.shape[0] > attention.SKIP_TAIL_ROWS
        return sparse_mla_two_pass(q, kv_cache, slots, latent_dim, scale, num_splits=num_splits, skip_tail=tail,
                                   out=out)
    return attention.sparse_mla_decode(q, kv_cache, slots, latent_dim, scale, num_splits=num_splits, out=out)
