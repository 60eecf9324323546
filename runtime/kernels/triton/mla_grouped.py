"""Sparse MLA decode with the latent split into four column groups (attention.sparse_mla_decode's
`column_groups=4`).

The same operations as attention._sparse_mla_kernel, in the same order: the scores are one MMA
k-chain over the latent then the rope part (here four chained dots of C/4 columns each, which
continue one float32 accumulator through the same k-steps), each output column's weighted sum is
its own k-chain over the block's positions (the column group only picks which columns a dot
computes), and the chunk folds are _fold's. On the H200 a chained tl.dot gave the same bits as one
long dot at every tile tried (bench.mma_bits), so the grouping should leave a row's bits alone: the
GPU tests check it against the ungrouped kernel. The Triton interpreter adds a chain in another
order (numpy), so on the CPU the grouped kernel is its own numerics and only compared with itself.

Why: a [BLOCK_H, C] query and a [BLOCK_S, C] gathered block as one dot operand each hold the whole
latent in registers at once; four [*, C/4] operands are live one at a time, as in SGLang's Triton decode
kernel. (The "~1.9 KB a thread of spills at 4 warps" first given as the reason was an unspecialized compile's
count; compiled as a launch specializes it, the ungrouped kernel spills ~0.2 KB and this one 36 bytes:
bench.kernel_resources, docs/results.md's twenty-sixth session. The grouping stays on its timings: 11-17%
faster at every batch, the same bits.)

Modes (bits alike in both): spread (a program per chunk, its state to memory, folded by the last
program's ticket or by attention._merge_kernel) and gathered (a program per query and head block,
the chunks folded in registers). A third, the fold's A kept in a float32 tile in memory as each chunk
ends (fewer registers), was 1.7-2.5x slower on the H200 and was removed (docs/results.md, "Sixteenth
session").
Latent-column blocks in this kernel (a program scoring over the whole latent and summing half or a quarter of its
values, for H=16 bs 32-64) kept the bits but were 1.6-4x slower on the H100 at H=16 and H=64, bs 32-128, and were
removed (docs/results.md, "Forty-fourth session").
"""

from __future__ import annotations

import triton
import triton.language as tl

from runtime.kernels.triton.mla_blocks import (
    _block_range,
    _block_row_sums,
    _fold_partials,
    _fold_rows,
    _fold_weights,
    _normalize,
    _online_step,
)

GROUPS = 4
# Chunks of one BLOCK_S block (every deployment since the seventeenth session: 64-position chunks) run a loop
# with one accumulator per column group: each block's sum starts from zero and is folded at once, so the
# running chunk's rescaled accumulators (a second [BLOCK_H, C] float32 tile) are never live. The same
# operations less the no-ops (a zero accumulator times alpha, an empty state's sum times alpha): the same
# bits, checked against the general loop (off) and the ungrouped kernel by the tests. Launches of fewer than
# ONE_BLOCK_MIN_WARPS warps keep the general loop: on the H100 (thirty-fifth session, .perf A/B, same bits) the
# one-block loop was 11% faster at H=64 bs 128 (64-head blocks, 8 warps: 90.2 -> 81.5 us) and 1-2% at H=16 (8
# warps), but 4-7% slower at H=64 bs 32-64 (16-head blocks, 4 warps: 40.8 -> 44.0 us at bs 32).
ONE_BLOCK_CHUNKS = True
ONE_BLOCK_MIN_WARPS = 8


def block_g(latent: int) -> int:
    return triton.next_power_of_2(triton.cdiv(latent, GROUPS))


def fits(latent: int) -> bool:
    """Whether a group is wide enough for the compiled kernel's dots (tl.dot needs K >= 16)."""
    return block_g(latent) >= 16


@triton.jit
def _load_groups(base, offs_g, rows_ok, LATENT: tl.constexpr, BLOCK_G: tl.constexpr):
    """Four column groups of `base` rows ([rows, 1] pointers), columns past LATENT as 0."""
    g0 = tl.load(base + offs_g[None, :], mask=rows_ok[:, None] & (offs_g < LATENT)[None, :], other=0.0)
    g1 = tl.load(base + BLOCK_G + offs_g[None, :], mask=rows_ok[:, None] & (BLOCK_G + offs_g < LATENT)[None, :],
                 other=0.0)
    g2 = tl.load(base + 2 * BLOCK_G + offs_g[None, :],
                 mask=rows_ok[:, None] & (2 * BLOCK_G + offs_g < LATENT)[None, :], other=0.0)
    g3 = tl.load(base + 3 * BLOCK_G + offs_g[None, :],
                 mask=rows_ok[:, None] & (3 * BLOCK_G + offs_g < LATENT)[None, :], other=0.0)
    return g0, g1, g2, g3


@triton.jit
def _store_groups(base, ok_rows, offs_g, a0, a1, a2, a3, LATENT: tl.constexpr, BLOCK_G: tl.constexpr):
    dtype = base.dtype.element_ty
    tl.store(base + offs_g[None, :], a0.to(dtype), mask=ok_rows[:, None] & (offs_g < LATENT)[None, :])
    tl.store(base + BLOCK_G + offs_g[None, :], a1.to(dtype),
             mask=ok_rows[:, None] & (BLOCK_G + offs_g < LATENT)[None, :])
    tl.store(base + 2 * BLOCK_G + offs_g[None, :], a2.to(dtype),
             mask=ok_rows[:, None] & (2 * BLOCK_G + offs_g < LATENT)[None, :])
    tl.store(base + 3 * BLOCK_G + offs_g[None, :], a3.to(dtype),
             mask=ok_rows[:, None] & (3 * BLOCK_G + offs_g < LATENT)[None, :])


@triton.jit
def _zero_groups(BLOCK_H: tl.constexpr, BLOCK_G: tl.constexpr):
    z = tl.zeros((BLOCK_H, BLOCK_G), dtype=tl.float32)
    return z, z, z, z


@triton.jit
def _round_trip(x, dtype):
    """A chunk's sum as the spread mode stores it (NARROW: in q's 16-bit dtype), in every mode."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _block_chunk_sum(p_v, kv, BLOCK_H: tl.constexpr, BLOCK_G: tl.constexpr, PRECISION: tl.constexpr,
                     NARROW: tl.constexpr, dtype: tl.constexpr):
    """One column group of a one-block chunk's weighted sum: the general loop's dot onto its zeroed accumulator
    (zero x alpha is +0), rounded as a chunk's sum is."""
    acc = tl.dot(p_v, kv, tl.zeros((BLOCK_H, BLOCK_G), dtype=tl.float32), input_precision=PRECISION)
    if NARROW:
        acc = _round_trip(acc, dtype)
    return acc


@triton.jit
def _fold_block_chunk(scores, kv0, kv1, kv2, kv3, M, L, A0, A1, A2, A3, dtype: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr, PRECISION: tl.constexpr, NARROW: tl.constexpr,
                      ROWSUM_MMA: tl.constexpr):
    """A chunk of one block, from the empty state (m -1e30, l 0, acc 0) and folded into (M, L, A): the general
    loop's operations without the empty state's terms (max(-1e30, x); 0 x alpha + s = s; a zero accumulator)."""
    m = tl.maximum(tl.full((BLOCK_H,), -1e30, dtype=tl.float32), tl.max(scores, axis=1))
    p = tl.exp2(scores - m[:, None])
    p_v = p.to(kv0.dtype)
    M_new, keep, take = _fold_weights(M, m)
    L = L * keep + _block_row_sums(p, p_v, BLOCK_S, PRECISION, ROWSUM_MMA) * take
    A0 = _fold_rows(A0, _block_chunk_sum(p_v, kv0, BLOCK_H, BLOCK_G, PRECISION, NARROW, dtype), keep, take)
    A1 = _fold_rows(A1, _block_chunk_sum(p_v, kv1, BLOCK_H, BLOCK_G, PRECISION, NARROW, dtype), keep, take)
    A2 = _fold_rows(A2, _block_chunk_sum(p_v, kv2, BLOCK_H, BLOCK_G, PRECISION, NARROW, dtype), keep, take)
    A3 = _fold_rows(A3, _block_chunk_sum(p_v, kv3, BLOCK_H, BLOCK_G, PRECISION, NARROW, dtype), keep, take)
    return M_new, L, A0, A1, A2, A3


@triton.jit
def _sparse_mla_grouped_kernel(q_ptr, kv_ptr, idx_ptr, out_ptr, part_ptr, stats_ptr, ticket_ptr,
                               heads, selected, blocks_per_chunk, sm_scale_log2,
                               stride_qt, stride_qh, stride_kv, stride_idx, stride_ot, stride_oh,
                               LATENT: tl.constexpr, ROPE: tl.constexpr, SPREAD: tl.constexpr,
                               TICKET: tl.constexpr, PRECISION: tl.constexpr, BLOCK_H: tl.constexpr,
                               BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr,
                               NARROW: tl.constexpr, SPLITS: tl.constexpr, TAIL: tl.constexpr,
                               BLOCK_ALL: tl.constexpr, ROWSUM_MMA: tl.constexpr, ONE_BLOCK: tl.constexpr,
                               PDL: tl.constexpr = False):
    if PDL:  # the merge launch may start now (attention.PDL_MERGE): it waits for this whole grid
        tl.extra.cuda.gdc_launch_dependents()
    # The grid of attention._sparse_mla_kernel with one column block: head blocks fastest.
    pid = tl.program_id(0)
    head_blocks = tl.cdiv(heads, BLOCK_H)
    head_block = pid % head_blocks
    rest = pid // head_blocks
    if SPREAD:
        chunk = rest % SPLITS
        query = (rest // SPLITS).to(tl.int64)
    else:
        chunk = 0
        query = rest.to(tl.int64)
    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < heads
    offs_g = tl.arange(0, BLOCK_G)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < ROPE
    q_rows = q_ptr + query * stride_qt + offs_h[:, None] * stride_qh
    q0, q1, q2, q3 = _load_groups(q_rows, offs_g, h_ok, LATENT, BLOCK_G)
    q_rope = tl.load(q_rows + LATENT + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    first_block, end_block = _block_range(idx_ptr, query, chunk, stride_idx, selected, blocks_per_chunk, SPREAD, TAIL,
                                          BLOCK_S, BLOCK_ALL)
    # Folded state and the running chunk's state, a column group each (attention._sparse_mla_kernel's).
    M = tl.full((BLOCK_H,), -1e30, dtype=tl.float32)
    L = tl.zeros((BLOCK_H,), dtype=tl.float32)
    A0, A1, A2, A3 = _zero_groups(BLOCK_H, BLOCK_G)
    m_i = tl.full((BLOCK_H,), -1e30, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc0, acc1, acc2, acc3 = _zero_groups(BLOCK_H, BLOCK_G)
    for block in range(first_block, end_block):
        offs_s = block * BLOCK_S + tl.arange(0, BLOCK_S)
        slot = tl.load(idx_ptr + query * stride_idx + offs_s, mask=offs_s < selected, other=-1)
        valid = slot >= 0
        rows = kv_ptr + slot.to(tl.int64)[:, None] * stride_kv
        # Masked: -1 slots may point at never-written (NaN-poisoned) rows, and 0 * NaN = NaN.
        kv0, kv1, kv2, kv3 = _load_groups(rows, offs_g, valid, LATENT, BLOCK_G)
        kv_rope = tl.load(rows + LATENT + offs_r[None, :], mask=valid[:, None] & r_ok[None, :], other=0.0)
        # mla_blocks._block_scores's k-chain, a column group at a time.
        scores = tl.dot(q0, tl.trans(kv0), input_precision=PRECISION)
        scores = tl.dot(q1, tl.trans(kv1), scores, input_precision=PRECISION)
        scores = tl.dot(q2, tl.trans(kv2), scores, input_precision=PRECISION)
        scores = tl.dot(q3, tl.trans(kv3), scores, input_precision=PRECISION)
        scores = tl.dot(q_rope, tl.trans(kv_rope), scores, input_precision=PRECISION)
        scores = tl.where(valid[None, :], scores * sm_scale_log2, float("-inf"))
        if ONE_BLOCK:  # this block is a whole chunk: its state from the empty one, folded at once
            M, L, A0, A1, A2, A3 = _fold_block_chunk(scores, kv0, kv1, kv2, kv3, M, L, A0, A1, A2, A3,
                                                     q_ptr.dtype.element_ty, BLOCK_H, BLOCK_S, BLOCK_G, PRECISION,
                                                     NARROW, ROWSUM_MMA)
        else:
            m_i, alpha, p_v, l_i = _online_step(scores, m_i, l_i, kv0.dtype, BLOCK_S, PRECISION, ROWSUM_MMA)
            acc0 = tl.dot(p_v, kv0, acc0 * alpha[:, None], input_precision=PRECISION)
            acc1 = tl.dot(p_v, kv1, acc1 * alpha[:, None], input_precision=PRECISION)
            acc2 = tl.dot(p_v, kv2, acc2 * alpha[:, None], input_precision=PRECISION)
            acc3 = tl.dot(p_v, kv3, acc3 * alpha[:, None], input_precision=PRECISION)
            if ((block + 1) % blocks_per_chunk == 0) | (block + 1 == end_block):  # a chunk ends here
                if NARROW:
                    acc0 = _round_trip(acc0, q_ptr.dtype.element_ty)
                    acc1 = _round_trip(acc1, q_ptr.dtype.element_ty)
                    acc2 = _round_trip(acc2, q_ptr.dtype.element_ty)
                    acc3 = _round_trip(acc3, q_ptr.dtype.element_ty)
                M_new, keep, take = _fold_weights(M, m_i)  # mla_blocks._fold, a column group at a time
                L = L * keep + l_i * take
                M = M_new
                A0 = _fold_rows(A0, acc0, keep, take)
                A1 = _fold_rows(A1, acc1, keep, take)
                A2 = _fold_rows(A2, acc2, keep, take)
                A3 = _fold_rows(A3, acc3, keep, take)
                m_i = tl.full((BLOCK_H,), -1e30, dtype=tl.float32)
                l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
                acc0, acc1, acc2, acc3 = _zero_groups(BLOCK_H, BLOCK_G)
    out_rows = out_ptr + query * stride_ot + offs_h[:, None] * stride_oh
    if SPREAD:  # this chunk's state, as attention._sparse_mla_kernel's spread programs store it
        base = (query * SPLITS + chunk) * heads + offs_h
        _store_groups(part_ptr + base[:, None] * LATENT, h_ok, offs_g, A0, A1, A2, A3, LATENT, BLOCK_G)
        tl.store(stats_ptr + base * 2, M, mask=h_ok)
        tl.store(stats_ptr + base * 2 + 1, L, mask=h_ok)
        if TICKET:
            tl.debug_barrier()
            counter = ticket_ptr + query * head_blocks + head_block
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == SPLITS - 1:
                tl.debug_barrier()
                offs_c = tl.arange(0, 4 * BLOCK_G)
                ok = h_ok[:, None] & (offs_c < LATENT)[None, :]
                out = _fold_partials(part_ptr, stats_ptr, query, heads, offs_h, h_ok, offs_c, ok, SPLITS, SPLITS,
                                     LATENT, BLOCK_H, 4 * BLOCK_G)
                tl.store(out_rows + offs_c[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    else:
        _store_groups(out_rows, h_ok, offs_g, _normalize(A0, L, h_ok), _normalize(A1, L, h_ok),
                      _normalize(A2, L, h_ok), _normalize(A3, L, h_ok), LATENT, BLOCK_G)


def one_block_loop(blocks_per_chunk: int, warps: int) -> bool:
    """Whether a launch runs the one-block chunks' loop (ONE_BLOCK_CHUNKS, ONE_BLOCK_MIN_WARPS)."""
    return ONE_BLOCK_CHUNKS and blocks_per_chunk == 1 and warps >= ONE_BLOCK_MIN_WARPS


def launch(grid: int, q, kv_cache, slots, out, part, stats, tickets, heads: int, selected: int, blocks_per_chunk: int,
           sm_scale_log2: float, *, latent: int, rope: int, spread: bool, ticket: bool, precision: str, block_h: int,
           block_s: int, narrow: bool, splits: int, tail: bool, rowsum_mma: bool, warps: int, stages: int,
           pdl: bool = False) -> None:
    """One launch over `grid` programs (attention.sparse_mla_decode's grid with one column block). pdl: trigger
    the merge's programmatic dependent launch as the programs start (spread mode, attention.pdl_launch)."""
    _sparse_mla_grouped_kernel[(grid,)](
        q, kv_cache, slots, out, part, stats, tickets, heads, selected, blocks_per_chunk, sm_scale_log2,
        q.stride(0), q.stride(1), kv_cache.stride(0), slots.stride(0), out.stride(0), out.stride(1),
        LATENT=latent, ROPE=rope, SPREAD=spread, TICKET=ticket, PRECISION=precision, BLOCK_H=block_h, BLOCK_S=block_s,
        BLOCK_G=block_g(latent),
        BLOCK_R=max(16, triton.next_power_of_2(rope)), NARROW=narrow, SPLITS=splits, TAIL=tail,
        BLOCK_ALL=triton.next_power_of_2(selected), ROWSUM_MMA=rowsum_mma,
        ONE_BLOCK=one_block_loop(blocks_per_chunk, warps), PDL=pdl, num_warps=warps, num_stages=stages,
        enable_fp_fusion=False)
