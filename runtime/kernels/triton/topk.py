"""The indexer's selection (window U top-k, as cuda_torch.select_slots) as one Triton program per row.

torch.sort of a whole [B, L] score matrix (select_slots' stable descending sort) makes radix passes
over every key of every row to keep 512 of them. Here each row finds its k-th largest score by
selection on an order-preserving 32-bit key of the float instead:
  1. the maximum key of every GROUP consecutive positions (>= k groups); the k-th largest of those
     maxima (a radix select over ~1024 of them) bounds the k-th largest key from below;
  2. the elements at or above the bound (k plus a few, unless scores tie massively) are compacted,
     in position order, into a scratch row;
  3. a radix select (four 8-bit digit histograms) over that row finds the k-th key exactly (the
     bound itself when fewer than k lie above it: ties at the top cost no histogram); every
     candidate above it and the lowest-position ones equal to it are chosen;
  4. the k chosen are sorted in registers by (score descending, position ascending).
Two passes over the row, the rest over ~k elements: tl.histogram lowers to a ballot per bin bit plus
a popcount per bin (about 50 instructions an element at 256 bins, read off its lowering, not
measured), so it never runs over the whole row. Rows with at most k candidates (early
positions) take positions [0, k) directly. The output is select_slots' exactly: the same positions
in the same order, ties to the lower position, non-candidates (positions > p - window) ranked as
-inf, NaN above +inf as torch.sort does, -0.0 equal to +0.0.

Batch invariance is trivial: one program per row, nothing in it depends on other rows or on B.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels.triton import INTERPRETED


@triton.jit
def _order_key(x, cols, last):
    """uint32 with key(a) < key(b) iff a < b as select_slots ranks them (-0.0 == +0.0, NaN highest)."""
    x = tl.where(cols <= last, x, float("-inf"))
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.uint32, bitcast=True)
    key = tl.where(bits >= 0x80000000, ~bits, bits | 0x80000000)
    return tl.where(x != x, 0xFFFFFFFF, key)


@triton.jit
def _packed(key, cols):
    """(key, position) in one int64 whose descending order is key descending, then position ascending."""
    signed = (key ^ 0x80000000).to(tl.int32, bitcast=True).to(tl.int64)
    return (signed << 32) + (4294967295 - cols.to(tl.int64))


@triton.jit
def _pick(hist, need, BINS: tl.constexpr):
    """The digit holding the need-th largest element (1-based) and how many elements lie above it."""
    total = tl.sum(hist, 0)
    at_or_above = total - tl.cumsum(hist, 0) + hist  # non-increasing in the digit
    digit = tl.sum((at_or_above >= need).to(tl.int32), 0) - 1
    above = tl.sum(tl.where(tl.arange(0, BINS) == digit, at_or_above - hist, 0), 0)
    return digit, above


@triton.jit
def _exclusive_cumsum(flags):
    counts = flags.to(tl.int32)
    return tl.cumsum(counts, 0) - counts


@triton.jit
def _radix_select(packed_ptr, n, k, BLOCK: tl.constexpr):
    """The k-th largest key among n packed values (4 digit histograms of 8 bits, most significant
    first), and how many of the values equal to it are among the k largest."""
    bins = tl.arange(0, 256)
    offs = tl.arange(0, BLOCK)
    need = k  # how many to take among the values matching `prefix`
    prefix = n.to(tl.int64) * 0
    for level in tl.static_range(4):
        shift = 24 - 8 * level
        hist = tl.zeros([256], dtype=tl.int32)
        skipped = 0
        for start in range(0, n, BLOCK):
            idx = start + offs
            inside = idx < n
            ukey = (tl.load(packed_ptr + idx, mask=inside, other=0) >> 32) + 2147483648
            match = inside & ((ukey >> (shift + 8)) == prefix)
            hist += tl.histogram(tl.where(match, ((ukey >> shift) & 255).to(tl.int32), 0), 256)
            skipped += tl.sum((~match).to(tl.int32), 0)
        hist -= tl.where(bins == 0, skipped, 0)
        digit, above = _pick(hist, need, 256)
        need -= above
        prefix = prefix * 256 + digit
    return prefix, need


@triton.jit
def _select_kernel(scores_ptr, pos_ptr, out_ptr, ok_ptr, scratch_ptr, maxima_ptr, width,
                   stride_s, stride_out, stride_ok, stride_scratch, stride_maxima,
                   WINDOW: tl.constexpr, WINDOW_P2: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
                   GROUP: tl.constexpr, BLOCK: tl.constexpr, SMALL_BLOCK: tl.constexpr,
                   RANK_ORDER: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    last = pos - WINDOW  # the last candidate position of the top-k part
    offs = tl.arange(0, BLOCK)
    s_row = scores_ptr + row * stride_s
    chosen = out_ptr + row * stride_out + WINDOW  # packed (key, position) of the chosen until the sort
    scratch = scratch_ptr + row * stride_scratch
    maxima = maxima_ptr + row * stride_maxima

    if last + 1 <= TOPK:
        # At most TOPK candidates, all at positions < TOPK: the answer is positions [0, TOPK), ordered.
        for start in range(0, TOPK, BLOCK):
            cols = start + offs
            inside = cols < TOPK
            key = _order_key(tl.load(s_row + cols, mask=inside, other=float("-inf")), cols, last)
            tl.store(chosen + cols, _packed(key, cols), mask=inside)
    else:
        # Pass 1: the maximum key of every GROUP consecutive positions. At least TOPK groups, so the
        # TOPK-th largest maximum is a lower bound of the TOPK-th largest key: TOPK distinct
        # elements (those maxima) reach it. Lanes past the row get key 0, below every element's.
        for start in range(0, width, BLOCK):
            cols = start + offs
            inside = cols < width
            key = _order_key(tl.load(s_row + cols, mask=inside, other=float("-inf")), cols, last)
            group_max = tl.max(tl.reshape(tl.where(inside, key, 0), [BLOCK // GROUP, GROUP]), axis=1)
            g = start // GROUP + tl.arange(0, BLOCK // GROUP)
            tl.store(maxima + g, _packed(group_max, g), mask=g * GROUP < width)
        tl.debug_barrier()  # the maxima are read back by other threads of this program
        bound, _ = _radix_select(maxima, tl.cdiv(width, GROUP), TOPK, SMALL_BLOCK)

        # Pass 2: every element at or above the bound -> scratch, in position order.
        n_cand = 0
        n_above = 0
        for start in range(0, width, BLOCK):
            cols = start + offs
            inside = cols < width
            key = _order_key(tl.load(s_row + cols, mask=inside, other=float("-inf")), cols, last)
            cand = inside & (key >= bound)
            tl.store(scratch + n_cand + _exclusive_cumsum(cand), _packed(key, cols), mask=cand)
            n_cand += tl.sum(cand.to(tl.int32), 0)
            n_above += tl.sum((cand & (key > bound)).to(tl.int32), 0)
        tl.debug_barrier()  # the scratch row is read back by other threads of this program

        if n_above < TOPK:  # the bound is the TOPK-th key itself (many ties at the top): no histograms
            prefix = bound
            need = TOPK - n_above
        else:
            prefix, need = _radix_select(scratch, n_cand, TOPK, SMALL_BLOCK)

        # prefix is now the TOPK-th largest key: take every candidate above it and the first `need`
        # equal to it (the lowest positions: the scratch row is in position order).
        n_chosen = 0
        ties = 0
        for start in range(0, n_cand, SMALL_BLOCK):
            idx = start + tl.arange(0, SMALL_BLOCK)
            inside = idx < n_cand
            packed = tl.load(scratch + idx, mask=inside, other=0)
            ukey = (packed >> 32) + 2147483648
            equal = inside & (ukey == prefix)
            take = (inside & (ukey > prefix)) | (equal & (ties + _exclusive_cumsum(equal) < need))
            tl.store(chosen + n_chosen + _exclusive_cumsum(take), packed, mask=take)
            n_chosen += tl.sum(take.to(tl.int32), 0)
            ties += tl.sum(equal.to(tl.int32), 0)
    tl.debug_barrier()  # the chosen were stored by other threads of this program

    j = tl.arange(0, TOPK_P2)
    packed = tl.load(chosen + j, mask=j < TOPK, other=-9223372036854775808)
    if RANK_ORDER:
        # Each value's rank = how many chosen values exceed it (they are distinct): the same order
        # as the sort, in whole-tensor steps (the interpreter runs tl.sort's swaps one by one).
        rank = tl.zeros([TOPK_P2], dtype=tl.int32)
        for c0 in range(0, TOPK, 32):
            c = c0 + tl.arange(0, 32)
            theirs = tl.load(chosen + c, mask=c < TOPK, other=-9223372036854775808)
            rank += tl.sum((theirs[None, :] > packed[:, None]).to(tl.int32), axis=1)
        tl.debug_barrier()  # every read of the chosen before the first write
        dest = rank
    else:
        packed = tl.sort(packed, descending=True)
        dest = j
    cols = 4294967295 - (packed & 4294967295)
    tl.store(chosen + dest, cols, mask=j < TOPK)
    tl.store(ok_ptr + row * stride_ok + WINDOW + dest, cols <= last, mask=j < TOPK)
    w = tl.arange(0, WINDOW_P2)
    window_pos = last + 1 + w
    tl.store(out_ptr + row * stride_out + w, tl.maximum(window_pos, 0), mask=w < WINDOW)
    tl.store(ok_ptr + row * stride_ok + w, window_pos >= 0, mask=w < WINDOW)


def group_size(width: int, topk: int, group: int | None = None) -> int:
    """Positions per pass-1 maximum: a power of two leaving at least topk groups (the bound needs
    them), by default about max(1024, 2 * topk) groups (few candidates, a cheap select over the maxima)."""
    chosen = min(topk, width)
    if group is None:
        group = triton.next_power_of_2(triton.cdiv(width, max(1024, 2 * triton.next_power_of_2(chosen))))
    while group > 1 and triton.cdiv(width, group) < chosen:
        group //= 2
    return group


def select_slots(scores: torch.Tensor, positions: torch.Tensor, window: int, topk: int, group: int | None = None,
                 block: int | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                 scratch: torch.Tensor | None = None,
                 rank_order: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cuda_torch.select_slots, bit for bit: scores [B, L] float32, positions [B] ->
    (positions [B, S] int64, valid [B, S] bool), S = window + min(topk, L).
    group: positions per pass-1 maximum (group_size); every group and block gives the same output.
    out: (positions, valid) buffers to fill; scratch: [B, L] int64 workspace (tests poison both).
    rank_order: order the chosen by counting instead of tl.sort (the same order; by default under
    the interpreter only, where tl.sort takes seconds a row; on a GPU the sort is cheaper)."""
    rows, width = scores.shape
    chosen = min(topk, width)
    if out is None:
        out = (torch.empty(rows, window + chosen, dtype=torch.int64, device=scores.device),
               torch.empty(rows, window + chosen, dtype=torch.bool, device=scores.device))
    sel, ok = out
    assert sel.shape == ok.shape == (rows, window + chosen) and sel.dtype == torch.int64 and ok.dtype == torch.bool
    if rows == 0:
        return sel, ok
    if chosen == 0:
        window_pos = positions[:, None] - window + 1 + torch.arange(window, device=scores.device)[None, :]
        sel.copy_(window_pos.clamp(min=0))
        ok.copy_(window_pos >= 0)
        return sel, ok
    assert width < 2**31
    scores = scores.contiguous().float()
    group = group_size(width, topk, group)
    if scratch is None:
        scratch = torch.empty(rows, width, dtype=torch.int64, device=scores.device)
    maxima = torch.empty(rows, triton.cdiv(width, group), dtype=torch.int64, device=scores.device)
    block = max(block or (64 if INTERPRETED else 4096), group)
    _select_kernel[(rows,)](
        scores, positions.contiguous(), sel, ok, scratch, maxima, width, scores.stride(0), sel.stride(0),
        ok.stride(0), scratch.stride(0), maxima.stride(0), WINDOW=window,
        WINDOW_P2=triton.next_power_of_2(max(window, 1)), TOPK=chosen, TOPK_P2=max(2, triton.next_power_of_2(chosen)),
        GROUP=group, BLOCK=block,
        SMALL_BLOCK=64 if INTERPRETED else 1024,  # the ~k candidates: a whole 4096-lane histogram would waste 3/4
        RANK_ORDER=INTERPRETED if rank_order is None else rank_order, num_warps=8)
    return sel, ok
