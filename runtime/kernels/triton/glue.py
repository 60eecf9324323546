"""Fused glue of a decode step: the small row-wise ops between the GEMMs, the attention and the MoE,
each one Triton launch where torch ran a chain of kernels (on the H200 a bs-16 dsv4-slice step spent
~300 of its 1,276 us in ~45 such launches: rope's gathers, multiplies and cat, the cache scatters,
routing's dozen ops, residual adds, slot-id gathers).

- add_rms_norm: residual add + RMSNorm; the sum is rounded to x.dtype before the norm, as the
  unfused `x + delta` then `rms_norm` (same bits as elementwise.rms_norm of that sum).
- embed_rms_norm: the embedding gather and the first layer's RMSNorm (rms_norm's bits).
- rope_: rotate-half RoPE in place on a strided [T, H, R] view (query heads, indexer queries).
- write_cache_rows: a token's cache row from its projection: RMSNorm of the head part (or a copy),
  RoPE of the last R, stored at the token's slot of the paged cache. Its norm is compiled without
  FMA (for the RoPE's sake), so on a GPU its bits may differ from elementwise.rms_norm's (which
  fuses the sum of squares).
- route: noaux_tc routing: sqrt-softplus affinity, bias-corrected group-limited top-k (ties to the
  lower id), weights from the unbiased affinity, renormalised and scaled.
- selected_slots: the cache slot of every selected context position via the page table, -1 where
  unselected (what sparse MLA reads).

Numerics: rope_ and write_cache_rows round after every multiply and add exactly as the torch ops
in x.dtype do (products of two bf16/fp16 values are exact in float32, so rounding them is the
torch result; both kernels are compiled without FMA contraction, see NO_FMA), so they give the torch
path's bits. route uses libdevice exp/log1p and a correctly rounded sqrt, as torch's CUDA kernels do; its
weight sum adds the K weights in rank order (torch's reduction may add them in another order).

One program per row: a row never meets another row's data, so every kernel is batch-invariant.
Torch references: kernels/cuda_torch.py's ops of the same names (the CPU path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from runtime.kernels.triton import INTERPRETED

# Torch's softplus (beta 1) returns x itself above this.
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)

if INTERPRETED:  # the interpreter has no libdevice: Kahan's log1p from log, accurate to float32
    @triton.jit
    def _log1p_exp(x):
        y = tl.exp(x)
        u = 1.0 + y
        exact = u == 1.0
        return tl.where(exact, y, tl.log(u) * (y / tl.where(exact, 1.0, u - 1.0)))
else:  # the CUDA math library's expf and log1pf, which torch's softplus calls
    @triton.jit
    def _log1p_exp(x):
        return libdevice.log1p(libdevice.exp(x))


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, width, eps, stride_x, stride_d, stride_sum,
                         stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < width
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + row * stride_d + offs, mask=ok, other=0.0).to(tl.float32)
    s = (x + d).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * stride_sum + offs, s, mask=ok)
    s = s.to(tl.float32)
    # The formula of elementwise._rms_norm_kernel, so the norm of the stored sum has its bits.
    inv = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / width + eps)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (s * inv * w).to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta: [T, D] (rows contiguous), weight: [D] -> (x + delta, rms_norm(x + delta)), both x.dtype;
    out: optional [T, D] destination of the norm (rows contiguous)."""
    rows, width = x.shape
    total = torch.empty_like(x)
    out = torch.empty_like(x) if out is None else out
    if rows:
        _add_rms_norm_kernel[(rows,)](x, delta, weight, total, out, width, eps, x.stride(0), delta.stride(0),
                                      total.stride(0), out.stride(0), BLOCK=triton.next_power_of_2(width))
    return total, out


@triton.jit
def _embed_rms_norm_kernel(ids_ptr, table_ptr, w_ptr, rows_ptr, out_ptr, width, eps, stride_table, stride_rows,
                           stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    token = tl.load(ids_ptr + row).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < width
    e = tl.load(table_ptr + token * stride_table + offs, mask=ok, other=0.0)
    tl.store(rows_ptr + row * stride_rows + offs, e, mask=ok)
    x = e.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)  # as elementwise._rms_norm_kernel
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (x * inv * w).to(out_ptr.dtype.element_ty), mask=ok)


def embed_rms_norm(token_ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float,
                   out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """token_ids: [T], table: [V, D] (rows contiguous) -> (table[token_ids], rms_norm(table[token_ids]));
    out: optional [T, D] destination of the norm (rows contiguous)."""
    rows = torch.empty(token_ids.shape[0], table.shape[1], dtype=table.dtype, device=table.device)
    out = torch.empty_like(rows) if out is None else out
    if rows.shape[0]:
        _embed_rms_norm_kernel[(rows.shape[0],)](token_ids, table, weight, rows, out, table.shape[1], eps,
                                                 table.stride(0), rows.stride(0), out.stride(0),
                                                 BLOCK=triton.next_power_of_2(table.shape[1]))
    return rows, out


@triton.jit
def _rotate(x1, x2, cos, sin, dtype: tl.constexpr):
    # x1 * c - x2 * s and x2 * c + x1 * s, each product and sum rounded to `dtype` as torch does.
    a = (x1 * cos).to(dtype).to(tl.float32)
    b = (x2 * sin).to(dtype).to(tl.float32)
    c = (x2 * cos).to(dtype).to(tl.float32)
    d = (x1 * sin).to(dtype).to(tl.float32)
    return (a - b).to(dtype), (c + d).to(dtype)


@triton.jit
def _rope_inplace_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, heads, half, stride_xt, stride_xh, stride_tab,
                         BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < half
    ok = (offs_h[:, None] < heads) & r_ok[None, :]
    cos = tl.load(cos_ptr + pos * stride_tab + offs_r, mask=r_ok, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_tab + offs_r, mask=r_ok, other=0.0).to(tl.float32)[None, :]
    base = x_ptr + token * stride_xt + offs_h[:, None].to(tl.int64) * stride_xh + offs_r[None, :]
    # Each program reads its whole row before writing it, and no other program touches that row.
    x1 = tl.load(base, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + half, mask=ok, other=0.0).to(tl.float32)
    y1, y2 = _rotate(x1, x2, cos, sin, x_ptr.dtype.element_ty)
    tl.store(base, y1, mask=ok)
    tl.store(base + half, y2, mask=ok)


# Compiled without FMA contraction: a fused multiply-add skips the product's rounding. Explicit
# casts do not stop it: for bf16 the compiler shrinks `(a * b).to(bf16)` to a bf16 multiply and then
# fuses it into the subtraction (seen in the sm_90 PTX: fma.rn.bf16 with fusion on, mul.rn.bf16 +
# sub.rn.bf16 with it off).
NO_FMA = {"enable_fp_fusion": False}


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x: [T, H, R] in place (any strides in T, H; last dim contiguous);
    positions: [T]; cos/sin: [max_pos, R/2] tables (rows contiguous). Returns x."""
    tokens, heads, width = x.shape
    assert x.stride(2) == 1 and cos.stride(1) == 1 and sin.stride() == cos.stride()
    if tokens:
        _rope_inplace_kernel[(tokens,)](x, positions, cos, sin, heads, width // 2, x.stride(0), x.stride(1),
                                        cos.stride(0), BLOCK_H=triton.next_power_of_2(heads),
                                        BLOCK_R=triton.next_power_of_2(width // 2), **NO_FMA)
    return x


@triton.jit
def _write_cache_rows_kernel(src_ptr, pos_ptr, slot_ptr, norm_ptr, cos_ptr, sin_ptr, cache_ptr, head, half, eps,
                             stride_src, stride_tab, stride_cache, NORM: tl.constexpr, BLOCK_C: tl.constexpr,
                             BLOCK_R: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    src = src_ptr + row * stride_src
    dst = cache_ptr + slot * stride_cache
    offs_c = tl.arange(0, BLOCK_C)
    c_ok = offs_c < head
    x = tl.load(src + offs_c, mask=c_ok, other=0.0)
    if NORM:  # as elementwise._rms_norm_kernel
        xf = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / head + eps)
        w = tl.load(norm_ptr + offs_c, mask=c_ok, other=0.0).to(tl.float32)
        x = xf * inv * w
    tl.store(dst + offs_c, x.to(cache_ptr.dtype.element_ty), mask=c_ok)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < half
    cos = tl.load(cos_ptr + pos * stride_tab + offs_r, mask=r_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_tab + offs_r, mask=r_ok, other=0.0).to(tl.float32)
    x1 = tl.load(src + head + offs_r, mask=r_ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + head + half + offs_r, mask=r_ok, other=0.0).to(tl.float32)
    y1, y2 = _rotate(x1, x2, cos, sin, src_ptr.dtype.element_ty)
    tl.store(dst + head + offs_r, y1.to(cache_ptr.dtype.element_ty), mask=r_ok)
    tl.store(dst + head + half + offs_r, y2.to(cache_ptr.dtype.element_ty), mask=r_ok)


def write_cache_rows(src: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, cache: torch.Tensor, rope_dim: int, norm_weight: torch.Tensor | None = None,
                     eps: float = 0.0) -> None:
    """cache[slots[t]] = [rms_norm(src[t, :W-R]) (or src[t, :W-R] without norm_weight), rope(src[t, W-R:])].
    src: [T, W] (rows contiguous along W), positions, slots: [T], cache: [num_slots, W]."""
    tokens, width = src.shape
    head = width - rope_dim
    assert cache.shape[1] == width and src.stride(1) == 1 and cache.stride(1) == 1 and cos.stride(1) == 1
    assert head > 0 or norm_weight is None, "nothing to normalise"
    if tokens:
        _write_cache_rows_kernel[(tokens,)](
            src, positions, slots, norm_weight if norm_weight is not None else src, cos, sin, cache, head,
            rope_dim // 2, eps, src.stride(0), cos.stride(0), cache.stride(0), NORM=norm_weight is not None,
            BLOCK_C=triton.next_power_of_2(max(head, 1)), BLOCK_R=triton.next_power_of_2(rope_dim // 2),
            **NO_FMA)


@triton.jit
def _first_max(values, index, size: tl.constexpr):
    # The largest value and its lowest index (a stable descending sort's first element).
    top = tl.max(values, axis=0)
    return top, tl.min(tl.where(values == top, index, size), axis=0)


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_l, stride_w, stride_i, scaling,
                  N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                  NORMALIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    group = tl.arange(0, BLOCK_G)
    member = tl.arange(0, BLOCK_E)
    ok = (group[:, None] < N_GROUP) & (member[None, :] < GROUP_SIZE)
    expert = group[:, None] * GROUP_SIZE + member[None, :]  # [BLOCK_G, BLOCK_E]
    logit = tl.load(logits_ptr + row * stride_l + expert, mask=ok, other=0.0).to(tl.float32)
    soft = tl.where(logit > SOFTPLUS_THRESHOLD, logit, _log1p_exp(tl.minimum(logit, SOFTPLUS_THRESHOLD)))
    affinity = tl.sqrt_rn(soft)
    choice = affinity + tl.load(bias_ptr + expert, mask=ok, other=0.0).to(tl.float32)
    choice = tl.where(ok, choice, float("-inf"))
    if N_GROUP > 1:
        # A group's score is the sum of its two best biased affinities; the TOPK_GROUP best groups
        # (ties to the lower group) keep their experts, the others are masked out.
        best = tl.max(choice, axis=1)
        if GROUP_SIZE > 1:
            first = tl.min(tl.where(choice == best[:, None], member[None, :], BLOCK_E), axis=1)
            best = best + tl.max(tl.where(member[None, :] == first[:, None], float("-inf"), choice), axis=1)
        score = tl.where(group < N_GROUP, best, float("-inf"))
        allowed = group < 0
        for _ in tl.static_range(TOPK_GROUP):
            _top, pick = _first_max(score, group, BLOCK_G)
            allowed = allowed | (group == pick)
            score = tl.where(group == pick, float("-inf"), score)
        choice = tl.where(allowed[:, None], choice, float("-inf"))
    flat_choice = tl.reshape(choice, (BLOCK_G * BLOCK_E,))
    flat_affinity = tl.reshape(affinity, (BLOCK_G * BLOCK_E,))
    flat_expert = tl.reshape(expert, (BLOCK_G * BLOCK_E,))
    rank = tl.arange(0, BLOCK_K)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    total = tl.sum(tl.zeros((1,), dtype=tl.float32), axis=0)
    for slot in tl.static_range(TOP_K):  # rank order: the sum below adds the weights in it
        _top, pick = _first_max(flat_choice, flat_expert, BLOCK_G * BLOCK_E)
        weight = tl.max(tl.where(flat_expert == pick, flat_affinity, float("-inf")), axis=0)
        flat_choice = tl.where(flat_expert == pick, float("-inf"), flat_choice)
        ids = tl.where(rank == slot, pick.to(tl.int64), ids)
        weights = tl.where(rank == slot, weight, weights)
        total = total + weight
    if NORMALIZE:
        weights = weights / total
    k_ok = rank < TOP_K
    tl.store(weights_ptr + row * stride_w + rank, weights * scaling, mask=k_ok)
    tl.store(ids_ptr + row * stride_i + rank, ids, mask=k_ok)


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int, scaling: float,
          normalize: bool, out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] router outputs (rows contiguous), bias: [E] -> (weights [T, K] float32, ids [T, K]
    int64), as cpu.route (sqrt-softplus affinity, noaux_tc selection, group-limited); `out`: optional
    destinations of the same shapes."""
    tokens, experts = logits.shape
    group_size = experts // n_group
    assert group_size * n_group == experts and logits.stride(1) == 1
    assert topk_group * group_size >= top_k, "fewer allowed experts than top_k"
    weights, ids = out if out is not None else (
        torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device),
        torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device))
    if tokens:
        _route_kernel[(tokens,)](logits, bias, weights, ids, logits.stride(0), weights.stride(0), ids.stride(0),
                                 float(scaling), N_GROUP=n_group, GROUP_SIZE=group_size, TOPK_GROUP=topk_group,
                                 TOP_K=top_k, NORMALIZE=normalize, BLOCK_G=triton.next_power_of_2(n_group),
                                 BLOCK_E=triton.next_power_of_2(group_size), BLOCK_K=triton.next_power_of_2(top_k),
                                 num_warps=2, **NO_FMA)
    return weights, ids


@triton.jit
def _selected_slots_kernel(table_ptr, pos_ptr, ok_ptr, out_ptr, selected, page_size, stride_table, stride_pos,
                           stride_ok, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = offs < selected
    valid = tl.load(ok_ptr + row * stride_ok + offs, mask=in_row, other=0) != 0
    pos = tl.load(pos_ptr + row * stride_pos + offs, mask=in_row & valid, other=0).to(tl.int64)
    page = tl.load(table_ptr + row * stride_table + pos // page_size, mask=in_row & valid, other=0).to(tl.int64)
    slot = tl.where(valid, page * page_size + pos % page_size, -1)
    tl.store(out_ptr + row * stride_out + offs, slot.to(tl.int32), mask=in_row)


def selected_slots(page_table: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, page_size: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """page_table: [T, P], positions: [T, S] context positions, valid: [T, S] bool -> int32 [T, S]
    cache slots (page_table[t, p // page] * page + p % page), -1 where not valid."""
    tokens, selected = positions.shape
    if out is None:
        out = torch.empty(tokens, selected, dtype=torch.int32, device=positions.device)
    if tokens and selected:
        block = min(1024, triton.next_power_of_2(selected))
        _selected_slots_kernel[(tokens, triton.cdiv(selected, block))](
            page_table, positions, valid.view(torch.uint8), out, selected, page_size, page_table.stride(0),
            positions.stride(0), valid.stride(0), out.stride(0), BLOCK=block)
    return out
