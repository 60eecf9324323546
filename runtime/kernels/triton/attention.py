"""Sparse latent-MQA decode attention over the paged latent cache.

T = queries, H = heads, C = latent dim, R = rope dim, S = selected positions per query (window U
top-k, as slot ids into the cache, -1 = padding), N = splits.

Each query's S positions are cut into N equal chunks (split-KV), one program per (query, chunk,
head block), so a single query still spreads over many SMs; a second kernel merges the chunks'
partial softmax states in chunk order. N is a property of the deployment (default_num_splits
reads only S and H), never of the batch: the same chunks, in the same order, whatever the batch,
so a row's bits do not change with the batch. With N = 1 the first kernel writes the output itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels.triton import INTERPRETED

LOG2E = 1.4426950408889634


def default_num_splits(num_selected: int, num_heads: int) -> int:
    # Partial states cost 2 * H * C * 4 bytes per chunk against S * (C+R) * 2 bytes of cache read:
    # many heads -> fewer, longer chunks.
    return max(1, triton.cdiv(num_selected, 128 if num_heads <= 16 else 384))


@triton.jit
def _sparse_mla_kernel(q_ptr, kv_ptr, idx_ptr, out_ptr, part_ptr, stats_ptr,
                       heads, selected, chunk, sm_scale_log2,
                       stride_qt, stride_qh, stride_kv, stride_idx, stride_ot, stride_oh,
                       LATENT: tl.constexpr, ROPE: tl.constexpr, SPLIT: tl.constexpr,
                       PRECISION: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
                       BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    query = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    offs_h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < heads
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    c_ok = offs_c < LATENT
    r_ok = offs_r < ROPE
    q_rows = q_ptr + query * stride_qt + offs_h[:, None] * stride_qh
    q_lat = tl.load(q_rows + offs_c[None, :], mask=h_ok[:, None] & c_ok[None, :], other=0.0)
    q_rope = tl.load(q_rows + LATENT + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    m_i = tl.full((BLOCK_H,), -1e30, dtype=tl.float32)  # finite: an empty block must not give inf - inf
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_C), dtype=tl.float32)
    start = split * chunk
    end = tl.minimum(start + chunk, selected)
    for s0 in range(start, end, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        slot = tl.load(idx_ptr + query * stride_idx + offs_s, mask=offs_s < end, other=-1)
        valid = slot >= 0
        rows = kv_ptr + slot.to(tl.int64)[:, None] * stride_kv
        kv_lat = tl.load(rows + offs_c[None, :], mask=valid[:, None] & c_ok[None, :], other=0.0)
        kv_rope = tl.load(rows + LATENT + offs_r[None, :], mask=valid[:, None] & r_ok[None, :], other=0.0)
        scores = tl.dot(q_lat, tl.trans(kv_lat), input_precision=PRECISION)
        scores = tl.dot(q_rope, tl.trans(kv_rope), scores, input_precision=PRECISION)
        scores = tl.where(valid[None, :], scores * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(kv_lat.dtype), kv_lat, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    if SPLIT:
        base = (query * tl.num_programs(1) + split) * heads + offs_h
        tl.store(part_ptr + base[:, None] * LATENT + offs_c[None, :], acc, mask=h_ok[:, None] & c_ok[None, :])
        tl.store(stats_ptr + base * 2, m_i, mask=h_ok)
        tl.store(stats_ptr + base * 2 + 1, l_i, mask=h_ok)
    else:
        out = acc / l_i[:, None]
        tl.store(out_ptr + query * stride_ot + offs_h[:, None] * stride_oh + offs_c[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & c_ok[None, :])


@triton.jit
def _merge_kernel(part_ptr, stats_ptr, out_ptr, heads, splits, stride_ot, stride_oh,
                  LATENT: tl.constexpr, BLOCK_C: tl.constexpr):
    # Chunks merged in chunk order: out = sum_s acc_s 2^(m_s - m) / sum_s l_s 2^(m_s - m)
    query = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_c = tl.arange(0, BLOCK_C)
    c_ok = offs_c < LATENT
    m = -1e30
    for s in range(0, splits):
        m = tl.maximum(m, tl.load(stats_ptr + ((query * splits + s) * heads + head) * 2))
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    total = 0.0
    for s in range(0, splits):
        base = (query * splits + s) * heads + head
        weight = tl.exp2(tl.load(stats_ptr + base * 2) - m)
        total += tl.load(stats_ptr + base * 2 + 1) * weight
        acc += tl.load(part_ptr + base * LATENT + offs_c, mask=c_ok, other=0.0) * weight
    tl.store(out_ptr + query * stride_ot + head * stride_oh + offs_c, (acc / total).to(out_ptr.dtype.element_ty),
             mask=c_ok)


def sparse_mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, latent_dim: int, scale: float,
                      num_splits: int | None = None, block_h: int | None = None, block_s: int = 32,
                      num_warps: int | None = None, num_stages: int = 2,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, C+R]; kv_cache: [num_slots, C+R] (one layer); slots: [T, S] int32 slot ids of the
    selected positions, -1 = none (each row needs >= 1). Returns [T, H, C] in q.dtype.
    num_splits: chunks per query (default default_num_splits; fix it per deployment, not per batch);
    block_h, block_s, num_warps, num_stages: launch shape (heads per program, positions per step)."""
    tokens, heads, width = q.shape
    selected = slots.shape[1]
    if out is None:
        out = torch.empty(tokens, heads, latent_dim, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    splits = num_splits or default_num_splits(selected, heads)
    if block_h is None:  # the fastest measured on the H200 (docs/results.md): all 64 heads in one program
        block_h, block_s, num_warps = (64, 64, 8) if heads >= 64 else (16, 32, 4)
    chunk = triton.cdiv(triton.cdiv(selected, splits), block_s) * block_s
    splits = triton.cdiv(selected, chunk)
    rope_dim = width - latent_dim
    warps, stages = (4, 1) if INTERPRETED else (num_warps or (8 if block_h >= 32 else 4), num_stages)
    part = stats = out  # unused when not split
    if splits > 1:
        part = torch.empty(tokens, splits, heads, latent_dim, dtype=torch.float32, device=q.device)
        stats = torch.empty(tokens, splits, heads, 2, dtype=torch.float32, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _sparse_mla_kernel[(tokens, splits, triton.cdiv(heads, block_h))](
        q, kv_cache, slots, out, part, stats, heads, selected, chunk, scale * LOG2E,
        q.stride(0), q.stride(1), kv_cache.stride(0), slots.stride(0), out.stride(0), out.stride(1),
        LATENT=latent_dim, ROPE=rope_dim, SPLIT=splits > 1, PRECISION=precision, BLOCK_H=block_h,
        BLOCK_S=block_s, BLOCK_C=triton.next_power_of_2(latent_dim),
        BLOCK_R=max(16, triton.next_power_of_2(rope_dim)), num_warps=warps, num_stages=stages)
    if splits > 1:
        _merge_kernel[(tokens, heads)](part, stats, out, heads, splits, out.stride(0), out.stride(1),
                                       LATENT=latent_dim, BLOCK_C=triton.next_power_of_2(latent_dim))
    return out
