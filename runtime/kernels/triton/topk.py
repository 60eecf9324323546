"""The indexer's selection (window U top-k, as cuda_torch.select_slots) as one Triton program per row.

torch.sort of a whole [B, L] score matrix (select_slots' stable descending sort) costs radix passes
over every key of every row to keep 512 of them. Here each row finds its k-th largest score by a
radix select on the float's bits instead: histograms of successive digits of an order-preserving
32-bit key, each pass keeping only the elements that can still be the k-th. Pass 1 histograms the
top FIRST_BITS bits of every element; pass 2 writes the elements above that digit straight to the
output, compacts the ones on it (in position order) into a scratch row and histograms their next 8
bits; the last digits and the final pick read only that scratch row. The chosen k are then sorted in
registers by (score descending, position ascending), so the output is select_slots' exactly: the same
positions in the same order, ties to the lower position, non-candidates (positions > p - window, or
past the row's scores) ranked as -inf, NaN above +inf as torch.sort does, -0.0 equal to +0.0.

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
def _select_kernel(scores_ptr, pos_ptr, out_ptr, ok_ptr, scratch_ptr, width,
                   stride_s, stride_out, stride_ok, stride_scratch,
                   WINDOW: tl.constexpr, WINDOW_P2: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
                   FIRST_BITS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    last = pos - WINDOW  # the last candidate position of the top-k part
    offs = tl.arange(0, BLOCK)
    s_row = scores_ptr + row * stride_s
    chosen = out_ptr + row * stride_out + WINDOW  # packed (key, position) of the chosen until the sort
    scratch = scratch_ptr + row * stride_scratch
    FIRST: tl.constexpr = 1 << FIRST_BITS
    SHIFT1: tl.constexpr = 32 - FIRST_BITS
    padded = tl.cdiv(width, BLOCK) * BLOCK
    first_bins = tl.arange(0, FIRST)
    bins = tl.arange(0, 256)

    # Pass 1: top digit of every element. Lanes past the row count in bin 0, taken out after.
    hist1 = tl.zeros([FIRST], dtype=tl.int32)
    for start in range(0, width, BLOCK):
        cols = start + offs
        inside = cols < width
        key = _order_key(tl.load(s_row + cols, mask=inside, other=float("-inf")), cols, last)
        hist1 += tl.histogram(tl.where(inside, (key >> SHIFT1).to(tl.int32), 0), FIRST)
    hist1 -= tl.where(first_bins == 0, padded - width, 0)
    top, above = _pick(hist1, TOPK, FIRST)
    need = TOPK - above

    # Pass 2: above the digit -> chosen; on it -> scratch (position order), histogram of the next 8 bits.
    n_chosen = 0
    n_cand = 0
    hist = tl.zeros([256], dtype=tl.int32)
    for start in range(0, width, BLOCK):
        cols = start + offs
        inside = cols < width
        key = _order_key(tl.load(s_row + cols, mask=inside, other=float("-inf")), cols, last)
        digit = (key >> SHIFT1).to(tl.int32)
        higher = inside & (digit > top)
        cand = inside & (digit == top)
        packed = _packed(key, cols)
        tl.store(chosen + n_chosen + _exclusive_cumsum(higher), packed, mask=higher)
        tl.store(scratch + n_cand + _exclusive_cumsum(cand), packed, mask=cand)
        hist += tl.histogram(tl.where(cand, ((key >> (SHIFT1 - 8)) & 255).to(tl.int32), 0), 256)
        n_chosen += tl.sum(higher.to(tl.int32), 0)
        n_cand += tl.sum(cand.to(tl.int32), 0)
    hist -= tl.where(bins == 0, padded - n_cand, 0)
    digit, above = _pick(hist, need, 256)
    need -= above
    prefix = top.to(tl.int64) * 256 + digit
    tl.debug_barrier()  # the scratch row is read back by other threads of this program

    # Remaining digits over the candidates only (8 bits, then the rest).
    for level in tl.static_range(2):
        shift: tl.constexpr = SHIFT1 - 16 if level == 0 else 0
        nbits: tl.constexpr = 8 if level == 0 else SHIFT1 - 16
        hist = tl.zeros([256], dtype=tl.int32)
        skipped = 0
        for start in range(0, n_cand, BLOCK):
            idx = start + offs
            inside = idx < n_cand
            ukey = (tl.load(scratch + idx, mask=inside, other=0) >> 32) + 2147483648
            match = inside & ((ukey >> (shift + nbits)) == prefix)
            hist += tl.histogram(tl.where(match, ((ukey >> shift) & ((1 << nbits) - 1)).to(tl.int32), 0), 256)
            skipped += tl.sum((~match).to(tl.int32), 0)
        hist -= tl.where(bins == 0, skipped, 0)
        digit, above = _pick(hist, need, 256)
        need -= above
        prefix = prefix * (1 << nbits) + digit

    # prefix is now the k-th largest key: take every candidate above it and the first `need` equal to it.
    ties = 0
    for start in range(0, n_cand, BLOCK):
        idx = start + offs
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
    packed = tl.sort(packed, descending=True)
    cols = 4294967295 - (packed & 4294967295)
    tl.store(chosen + j, cols, mask=j < TOPK)
    tl.store(ok_ptr + row * stride_ok + WINDOW + j, cols <= last, mask=j < TOPK)
    w = tl.arange(0, WINDOW_P2)
    window_pos = last + 1 + w
    tl.store(out_ptr + row * stride_out + w, tl.maximum(window_pos, 0), mask=w < WINDOW)
    tl.store(ok_ptr + row * stride_ok + w, window_pos >= 0, mask=w < WINDOW)


def select_slots(scores: torch.Tensor, positions: torch.Tensor, window: int, topk: int, first_bits: int = 10,
                 block: int | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                 scratch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cuda_torch.select_slots, bit for bit: scores [B, L] float32, positions [B] ->
    (positions [B, S] int64, valid [B, S] bool), S = window + min(topk, L).
    first_bits: width of the first radix digit (8..12); every width gives the same output.
    out: (positions, valid) buffers to fill; scratch: [B, L] int64 workspace (tests poison both)."""
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
    assert 8 <= first_bits <= 12 and width < 2**31
    scores = scores.contiguous().float()
    if scratch is None:
        scratch = torch.empty(rows, width, dtype=torch.int64, device=scores.device)
    block = block or (64 if INTERPRETED else 2048)
    _select_kernel[(rows,)](
        scores, positions.contiguous(), sel, ok, scratch, width, scores.stride(0), sel.stride(0), ok.stride(0),
        scratch.stride(0), WINDOW=window, WINDOW_P2=triton.next_power_of_2(max(window, 1)), TOPK=chosen,
        TOPK_P2=triton.next_power_of_2(chosen), FIRST_BITS=first_bits, BLOCK=block, num_warps=8)
    return sel, ok
