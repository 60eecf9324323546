"""The pieces every sparse MLA kernel shares (attention's one-pass kernel, mla_grouped's column-
grouped one, mla_prefill's two passes): a block's gather and scores, the softmax states' fold in
chunk order, the MMA row sums, and which blocks a program runs. In one place, so the kernels'
operations, and so their bits, cannot drift apart. Numerics: attention.py's docstring.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _fold_weights(M, m):
    """The folded max and the weights of the folded state (keep) and of the chunk's (take), apart
    from their use so the two-pass prefill form (mla_prefill) can compute them in one pass and
    apply them in another. A side that holds the max gets weight 1 exactly, not exp2(0) of an
    approximate exp2."""
    M_new = tl.maximum(M, m)
    keep = tl.where(M == M_new, 1.0, tl.exp2(M - M_new))
    take = tl.where(m == M_new, 1.0, tl.exp2(m - M_new))
    return M_new, keep, take


@triton.jit
def _fold_rows(A, acc, keep, take):
    return A * keep[:, None] + acc * take[:, None]


@triton.jit
def _fold(M, L, A, m, l, acc):
    """The softmax state (M, L, A) followed by a chunk's (m, l, acc): the one merge formula of both
    modes. From the empty state (-1e30, 0, 0) it must return the chunk's state bit for bit (the
    spread mode folds each chunk into it twice): `_fold_weights` gives the max's side weight 1."""
    M_new, keep, take = _fold_weights(M, m)
    return M_new, L * keep + l * take, _fold_rows(A, acc, keep, take)


@triton.jit
def _gather_block(kv_ptr, idx_ptr, query, block, selected, stride_kv, stride_idx, offs_c, c_ok, offs_r, r_ok,
                  LATENT: tl.constexpr, BLOCK_S: tl.constexpr):
    """One BLOCK_S block of a query's selected cache rows: (valid, row pointers, latent, rope)."""
    offs_s = block * BLOCK_S + tl.arange(0, BLOCK_S)
    slot = tl.load(idx_ptr + query * stride_idx + offs_s, mask=offs_s < selected, other=-1)
    valid = slot >= 0
    rows = kv_ptr + slot.to(tl.int64)[:, None] * stride_kv
    # Masked: -1 slots may point at never-written (NaN-poisoned) rows, and 0 * NaN = NaN.
    kv_lat = tl.load(rows + offs_c[None, :], mask=valid[:, None] & c_ok[None, :], other=0.0)
    kv_rope = tl.load(rows + LATENT + offs_r[None, :], mask=valid[:, None] & r_ok[None, :], other=0.0)
    return valid, rows, kv_lat, kv_rope


@triton.jit
def _block_scores(q_lat, q_rope, kv_lat, kv_rope, valid, sm_scale_log2, PRECISION: tl.constexpr):
    """A block's scaled log2 scores [heads, BLOCK_S]: the latent then the rope part chained in one
    MMA k-chain (the order every form of the kernel shares), -inf at unselected slots."""
    scores = tl.dot(q_lat, tl.trans(kv_lat), input_precision=PRECISION)
    scores = tl.dot(q_rope, tl.trans(kv_rope), scores, input_precision=PRECISION)
    return tl.where(valid[None, :], scores * sm_scale_log2, float("-inf"))


@triton.jit
def _row_sums_mma(p_v, BLOCK_S: tl.constexpr, PRECISION: tl.constexpr):
    """The row sums of the 16-bit p as an MMA (p @ ones, every column equal; max picks one exactly):
    its order is the MMA's k order, which no tile shape, warp count or MMA kind changes
    (bench/mma_bits.py), where tl.sum's tree follows the layout."""
    ones = tl.full((BLOCK_S, 16), 1.0, dtype=p_v.dtype)
    return tl.max(tl.dot(p_v, ones, input_precision=PRECISION), axis=1)


@triton.jit
def _block_row_sums(p, p_v, BLOCK_S: tl.constexpr, PRECISION: tl.constexpr, ROWSUM_MMA: tl.constexpr):
    """A block's softmax row sums: of the 16-bit p_v as an MMA (ROWSUM_MMA), else tl.sum of the float32 p."""
    if ROWSUM_MMA:
        return _row_sums_mma(p_v, BLOCK_S, PRECISION)
    return tl.sum(p, axis=1)


@triton.jit
def _online_step(scores, m_i, l_i, dtype: tl.constexpr, BLOCK_S: tl.constexpr, PRECISION: tl.constexpr,
                 ROWSUM_MMA: tl.constexpr):
    """A block's step of the running chunk state: the new max, the old state's rescale (alpha), the 16-bit
    weights the values are summed with, and the new row sum. The caller rescales its accumulator(s) by alpha
    and adds p_v @ values (one tile, or one column group at a time in mla_grouped)."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    p_v = p.to(dtype)
    # With ROWSUM_MMA the row sum of the same 16-bit p the values are weighted by, as an MMA: BLOCK_H
    # and warps then stop being part of a deployment's numerics.
    return m_new, alpha, p_v, l_i * alpha + _block_row_sums(p, p_v, BLOCK_S, PRECISION, ROWSUM_MMA)


@triton.jit
def _normalize(A, L, h_ok):
    return A / tl.where(h_ok, L, 1.0)[:, None]  # padding heads (L = 0) divide by 1, not 0


@triton.jit
def _fold_partials(part_ptr, stats_ptr, query, heads, offs_h, h_ok, offs_c, ok, used,
                   SPLITS: tl.constexpr, LATENT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr):
    """The spread mode's chunk states [T, N, H, C] (+ [T, N, H, 2] max and sum), folded in chunk order
    from the empty state: the same operations as the gathered mode's fold in registers. `.cg`: read
    at L2, not a possibly stale L1 line (other programs of this launch wrote them). Chunks from
    `used` on were skipped (never written): they fold as the empty state, the identity."""
    M = tl.full((BLOCK_H,), -1e30, dtype=tl.float32)
    L = tl.zeros((BLOCK_H,), dtype=tl.float32)
    A = tl.zeros((BLOCK_H, BLOCK_C), dtype=tl.float32)
    for s in tl.static_range(SPLITS):  # unrolled: the N loads need not wait for each other's folds
        base = (query * SPLITS + s) * heads + offs_h
        live = h_ok & (offs_h * 0 + s < used)
        m = tl.load(stats_ptr + base * 2, mask=live, other=-1e30, cache_modifier=".cg")
        l_s = tl.load(stats_ptr + base * 2 + 1, mask=live, other=0.0, cache_modifier=".cg")
        acc = tl.load(part_ptr + base[:, None] * LATENT + offs_c[None, :], mask=ok & live[:, None], other=0.0,
                      cache_modifier=".cg").to(tl.float32)
        M, L, A = _fold(M, L, A, m, l_s, acc)
    return _normalize(A, L, h_ok)


@triton.jit
def _tail_end_block(idx_ptr, query, stride_idx, selected, blocks_per_chunk, BLOCK_S: tl.constexpr,
                    BLOCK_ALL: tl.constexpr):
    """skip_tail's bound: the block after the query's last chunk that holds a selected slot (-1 to
    the end: a prompt row near the start of its sequence has fewer candidates than top-k). The whole
    chunks past it hold the empty state, whose fold is the identity exactly (keep = 1 by the where,
    take = exp2(-1e30 - M) = 0), so skipping them keeps the full loop's bits. Shared by the one-pass
    kernel and both passes of mla_prefill's form."""
    offs_all = tl.arange(0, BLOCK_ALL)
    all_slots = tl.load(idx_ptr + query * stride_idx + offs_all, mask=offs_all < selected, other=-1)
    last = tl.max(tl.where(all_slots >= 0, offs_all, -1), axis=0)
    chunk_len = blocks_per_chunk * BLOCK_S
    return (last + chunk_len) // chunk_len * blocks_per_chunk


@triton.jit
def _block_range(idx_ptr, query, chunk, stride_idx, selected, blocks_per_chunk, SPREAD: tl.constexpr,
                 TAIL: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_ALL: tl.constexpr):
    """The BLOCK_S blocks a program runs: its chunk's (spread) or every chunk of the query, up to the
    tail's bound (skip_tail). Shared by this module's kernel and mla_grouped's."""
    if SPREAD:  # this program's chunk only
        first_block = chunk * blocks_per_chunk
        end_block = tl.minimum(first_block + blocks_per_chunk, tl.cdiv(selected, BLOCK_S))
    else:  # every chunk of the query
        first_block = 0
        end_block = tl.cdiv(selected, BLOCK_S)
    if TAIL:
        end_block = tl.minimum(end_block, _tail_end_block(idx_ptr, query, stride_idx, selected, blocks_per_chunk,
                                                          BLOCK_S, BLOCK_ALL))
    return first_block, end_block
