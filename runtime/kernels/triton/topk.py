"""The indexer's selection (window U top-k, as cuda_torch.select_slots) in four Triton launches.

torch.sort of a whole [B, L] score matrix (select_slots' stable descending sort) makes radix passes
over every key of every row to keep 512 of them. Here each row finds its k-th largest score by
selection on an order-preserving 32-bit key of the float instead:
  1. (_maxima_kernel) the maximum key of every GROUP consecutive positions (>= k groups);
  2. (_bound_kernel) the k-th largest of those maxima (a radix select over ~1024 of them)
     bounds the k-th largest key from below;
  3. (_candidates_kernel) the elements at or above the bound (k plus a few, unless scores tie
     massively) are compacted, in position order, into a scratch row;
  4. (_finish_kernel) the segments' runs are gathered into one; a row of at most 2k candidates sorts
     them in registers by (score descending, position ascending) and keeps the first k; more (massive
     ties) go through a radix select (four 8-bit digit histograms) that finds the k-th key exactly
     (the bound itself when fewer than k lie above it: ties at the top cost no histogram), every
     candidate above it and the lowest-position ones equal to it are chosen, then sorted.
Steps 1 and 3 read the row and run SEGMENT positions a program, so one row's passes spread over
the GPU (a single program per row left most SMs idle at decode batch sizes and spent its time
streaming the row); 2 and 4 work on ~1024 and ~k elements, one program a row. tl.histogram
lowers to a ballot per bin bit plus a popcount per bin (about 50 instructions an element at 256
bins, read off its lowering, not measured), so it never runs over the whole row. Rows with at most
k candidates (early positions) take positions [0, k) directly. The output is select_slots' exactly:
the same positions in the same order, ties to the lower position, non-candidates (positions
> p - window) ranked as -inf, NaN above +inf as torch.sort does, -0.0 equal to +0.0.

Batch invariance is trivial: every program works on one row, nothing depends on other rows or on B.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from runtime.kernels.triton import INTERPRETED

# Below every packed (key, position) value (pack_key_position): the fill of a masked load of packed values.
LOWEST_PACKED = tl.constexpr(-(2**63))


@triton.jit
def order_key(x, cols, last):
    """uint32 with key(a) < key(b) iff a < b as select_slots ranks them (-0.0 == +0.0, NaN highest)."""
    x = tl.where(cols <= last, x, float("-inf"))
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.uint32, bitcast=True)
    key = tl.where(bits >= 0x80000000, ~bits, bits | 0x80000000)
    return tl.where(x != x, 0xFFFFFFFF, key)


@triton.jit
def pack_key_position(key, cols):
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
def _digit_histogram(packed, inside, prefix, shift):
    """One radix level over packed values: the histogram of the 8-bit digit at `shift` of the `inside` ones
    whose higher digits equal `prefix`, with every other lane counted in bin 0 too, and how many those are
    (the caller takes them out of bin 0)."""
    ukey = (packed >> 32) + 2147483648
    match = inside & ((ukey >> (shift + 8)) == prefix)
    hist = tl.histogram(tl.where(match, ((ukey >> shift) & 255).to(tl.int32), 0), 256)
    return hist, tl.sum((~match).to(tl.int32), 0)


@triton.jit
def _radix_select(packed_ptr, n, k, BLOCK: tl.constexpr, RESIDENT: tl.constexpr = False):
    """The k-th largest key among n packed values (4 digit histograms of 8 bits, most significant
    first), and how many of the values equal to it are among the k largest. RESIDENT (n <= BLOCK): the
    values are loaded once and every level reads them from registers; else each level reloads them, BLOCK
    at a time. The same answer either way."""
    bins = tl.arange(0, 256)
    offs = tl.arange(0, BLOCK)
    need = k  # how many to take among the values matching `prefix`
    # An int64 zero that is a tensor whatever n is: Triton passes an integer argument equal to 1 as a
    # constexpr (a row of one group maximum), and a constexpr has no .to().
    prefix = tl.program_id(0).to(tl.int64) * 0
    if RESIDENT:
        resident = tl.load(packed_ptr + offs, mask=offs < n, other=0)
    for level in tl.static_range(4):
        shift = 24 - 8 * level
        if RESIDENT:
            hist, skipped = _digit_histogram(resident, offs < n, prefix, shift)
        else:
            hist = tl.zeros([256], dtype=tl.int32)
            skipped = 0
            for start in range(0, n, BLOCK):
                idx = start + offs
                inside = idx < n
                level_hist, level_skipped = _digit_histogram(tl.load(packed_ptr + idx, mask=inside, other=0),
                                                             inside, prefix, shift)
                hist += level_hist
                skipped += level_skipped
        hist -= tl.where(bins == 0, skipped, 0)
        digit, above = _pick(hist, need, 256)
        need -= above
        prefix = prefix * 256 + digit
    return prefix, need


@triton.jit
def store_group_maxima(vals, start, last, width, maxima_row, N: tl.constexpr, GROUP: tl.constexpr):
    """Pass 1's output for the groups of the N positions from `start` (a multiple of GROUP) whose scores
    are `vals`: the largest order key of every GROUP positions, lanes past the row's width at key 0
    (below every element's), packed with the group's index. Also the indexer's logits kernel, on the
    logits it holds (indexer.GroupMaxima)."""
    cols = start + tl.arange(0, N)
    key = tl.where(cols < width, order_key(vals, cols, last), 0)
    group_max = tl.max(tl.reshape(key, [N // GROUP, GROUP]), axis=1)
    g = start // GROUP + tl.arange(0, N // GROUP)
    tl.store(maxima_row + g, pack_key_position(group_max, g), mask=g * GROUP < width)


@triton.jit
def _maxima_kernel(scores_ptr, pos_ptr, maxima_ptr, width, stride_s, stride_maxima,
                   WINDOW: tl.constexpr, TOPK: tl.constexpr, GROUP: tl.constexpr, SEGMENT: tl.constexpr):
    """Pass 1, one program per SEGMENT positions of a row: the maximum key of every GROUP positions."""
    row = tl.program_id(0).to(tl.int64)
    last = tl.load(pos_ptr + row).to(tl.int64) - WINDOW
    if last + 1 > TOPK:  # rows with at most TOPK candidates take positions [0, TOPK) (_finish_kernel)
        first = tl.program_id(1) * SEGMENT
        cols = first + tl.arange(0, SEGMENT)
        scores = tl.load(scores_ptr + row * stride_s + cols, mask=cols < width, other=float("-inf"))
        store_group_maxima(scores, first, last, width, maxima_ptr + row * stride_maxima, SEGMENT, GROUP)


@triton.jit
def _bound_kernel(maxima_ptr, pos_ptr, bound_ptr, n_groups, stride_maxima,
                  WINDOW: tl.constexpr, TOPK: tl.constexpr, SMALL_BLOCK: tl.constexpr, RESIDENT: tl.constexpr):
    """The TOPK-th largest group maximum of a row: a lower bound of its TOPK-th largest key (TOPK
    distinct elements, those maxima, reach it; group_size leaves at least TOPK groups). RESIDENT: the
    maxima (at most SMALL_BLOCK) stay in registers across the select's levels."""
    row = tl.program_id(0).to(tl.int64)
    last = tl.load(pos_ptr + row).to(tl.int64) - WINDOW
    if last + 1 > TOPK:
        bound, _ = _radix_select(maxima_ptr + row * stride_maxima, n_groups, TOPK, SMALL_BLOCK, RESIDENT)
        tl.store(bound_ptr + row, bound)


@triton.jit
def _candidates_kernel(scores_ptr, pos_ptr, bound_ptr, scratch_ptr, counts_ptr, width, stride_s, stride_scratch,
                       stride_counts, WINDOW: tl.constexpr, TOPK: tl.constexpr, SEGMENT: tl.constexpr):
    """Pass 2, one program per SEGMENT positions of a row: the elements at or above the row's bound,
    in position order, at the start of the segment's own stretch of the scratch row; how many, and
    how many lie strictly above the bound."""
    row = tl.program_id(0).to(tl.int64)
    segment = tl.program_id(1)
    last = tl.load(pos_ptr + row).to(tl.int64) - WINDOW
    if last + 1 > TOPK:
        bound = tl.load(bound_ptr + row)
        cols = segment * SEGMENT + tl.arange(0, SEGMENT)
        inside = cols < width
        key = order_key(tl.load(scores_ptr + row * stride_s + cols, mask=inside, other=float("-inf")), cols, last)
        cand = inside & (key >= bound)
        scratch = scratch_ptr + row * stride_scratch + segment * SEGMENT
        tl.store(scratch + _exclusive_cumsum(cand), pack_key_position(key, cols), mask=cand)
        counts = counts_ptr + row * stride_counts + 2 * segment
        tl.store(counts, tl.sum(cand.to(tl.int32), 0))
        tl.store(counts + 1, tl.sum((cand & (key > bound)).to(tl.int32), 0))


@triton.jit
def _choose(scratch, chosen, bound_at, n_cand, n_above, TOPK: tl.constexpr, SMALL_BLOCK: tl.constexpr):
    """The TOPK largest of the n_cand candidates of the scratch row (in position order), stored packed
    at `chosen` in position order: the TOPK-th key by radix select (or the bound itself when fewer than
    TOPK lie above it), then every candidate above it and the lowest-position ones equal to it."""
    small = tl.arange(0, SMALL_BLOCK)
    bound = tl.load(bound_at)
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
        idx = start + small
        inside = idx < n_cand
        packed = tl.load(scratch + idx, mask=inside, other=0)
        ukey = (packed >> 32) + 2147483648
        equal = inside & (ukey == prefix)
        take = (inside & (ukey > prefix)) | (equal & (ties + _exclusive_cumsum(equal) < need))
        tl.store(chosen + n_chosen + _exclusive_cumsum(take), packed, mask=take)
        n_chosen += tl.sum(take.to(tl.int32), 0)
        ties += tl.sum(equal.to(tl.int32), 0)


@triton.jit
def _finish_kernel(scores_ptr, pos_ptr, bound_ptr, counts_ptr, scratch_ptr, out_ptr, ok_ptr, n_segments,
                   stride_s, stride_counts, stride_scratch, stride_out, stride_ok,
                   WINDOW: tl.constexpr, WINDOW_P2: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
                   SEGMENT: tl.constexpr, SEGMENTS_P2: tl.constexpr, GATHER: tl.constexpr,
                   SMALL_BLOCK: tl.constexpr, RANK_ORDER: tl.constexpr, SORT_CAP: tl.constexpr):
    """One program per row: the TOPK-th key among the candidates, the chosen, their order, the window.
    SORT_CAP (a power of two >= TOPK, or 0): a row of at most this many candidates sorts them all in
    registers and keeps the first TOPK, in place of the radix select, the choice and the sort of the
    chosen (the same positions in the same order: both rank by the packed (key, position))."""
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    last = pos - WINDOW  # the last candidate position of the top-k part
    s_row = scores_ptr + row * stride_s
    chosen = out_ptr + row * stride_out + WINDOW  # packed (key, position) of the chosen until the sort
    scratch = scratch_ptr + row * stride_scratch
    small = tl.arange(0, SMALL_BLOCK)
    ordered = (row * 0).to(tl.int32)  # 1 once the chosen are stored in their final order (SORT_CAP)

    if last + 1 <= TOPK:
        # At most TOPK candidates, all at positions < TOPK: the answer is positions [0, TOPK), ordered.
        for start in range(0, TOPK, SMALL_BLOCK):
            cols = start + small
            inside = cols < TOPK
            key = order_key(tl.load(s_row + cols, mask=inside, other=float("-inf")), cols, last)
            tl.store(chosen + cols, pack_key_position(key, cols), mask=inside)
    else:
        # The segments' candidates, moved down to one run in position order. Every segment's count
        # is read in one load and its run's start is their exclusive sum, so a chunk of the run finds
        # each element's segment by comparison, in registers: the move is ceil(n_cand / GATHER)
        # chunks, not a dependent count load and a move per segment (16 at 64K positions; on the
        # H200 the change took 53.3 us to 51.1 at B=64: the walk was not the big cost, the
        # candidates pass is, select_launch_us in bench.kernels). In place: an element
        # lands at or below where it lies (every earlier segment holds at most SEGMENT), so no chunk
        # overwrites one not yet read; the barriers keep a chunk's loads before its stores.
        seg = tl.arange(0, SEGMENTS_P2)
        seg_ok = seg < n_segments
        counts = tl.load(counts_ptr + row * stride_counts + 2 * seg, mask=seg_ok, other=0)
        n_cand = tl.sum(counts, 0)
        n_above = tl.sum(tl.load(counts_ptr + row * stride_counts + 2 * seg + 1, mask=seg_ok, other=0), 0)
        # Past the last segment the start is beyond every index, so no element maps there.
        starts = tl.where(seg_ok, _exclusive_cumsum(counts), 2147483647)
        gather = tl.arange(0, GATHER)
        # One segment (rows of at most SEGMENT positions: prefill chunks, short contexts): its run is
        # already in place. Moving it onto itself cost 6% on a 4,096-row prefill chunk (H200).
        moves = tl.where(n_segments > 1, n_cand, 0)
        for start in range(0, moves, GATHER):
            idx = start + gather
            inside = idx < n_cand
            # An element's segment: the last one starting at or before it (an empty segment shares
            # its start with the next, and the later of them holds the element).
            at_or_before = starts[None, :] <= idx[:, None]
            src_seg = tl.sum(at_or_before.to(tl.int32), 1) - 1
            src_start = tl.sum(tl.where(seg[None, :] == src_seg[:, None], starts[None, :], 0), 1)
            moved = tl.load(scratch + src_seg.to(tl.int64) * SEGMENT + (idx - src_start), mask=inside)
            tl.debug_barrier()
            tl.store(scratch + idx, moved, mask=inside)
            tl.debug_barrier()
        tl.debug_barrier()  # the scratch row is read back by other threads of this program

        if SORT_CAP > 0:
            if n_cand <= SORT_CAP:
                c = tl.arange(0, SORT_CAP)
                ranked = tl.sort(tl.load(scratch + c, mask=c < n_cand, other=LOWEST_PACKED), descending=True)
                cols = 4294967295 - (ranked & 4294967295)
                tl.store(chosen + c, cols, mask=c < TOPK)
                tl.store(ok_ptr + row * stride_ok + WINDOW + c, cols <= last, mask=c < TOPK)
                ordered += 1
            else:
                _choose(scratch, chosen, bound_ptr + row, n_cand, n_above, TOPK, SMALL_BLOCK)
        else:
            _choose(scratch, chosen, bound_ptr + row, n_cand, n_above, TOPK, SMALL_BLOCK)
    tl.debug_barrier()  # the chosen were stored by other threads of this program

    if ordered == 0:
        j = tl.arange(0, TOPK_P2)
        packed = tl.load(chosen + j, mask=j < TOPK, other=LOWEST_PACKED)
        if RANK_ORDER:
            # Each value's rank = how many chosen values exceed it (they are distinct): the same order
            # as the sort, in whole-tensor steps (the interpreter runs tl.sort's swaps one by one).
            rank = tl.zeros([TOPK_P2], dtype=tl.int32)
            for c0 in range(0, TOPK, 32):
                c = c0 + tl.arange(0, 32)
                theirs = tl.load(chosen + c, mask=c < TOPK, other=LOWEST_PACKED)
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


# A sort in registers in place of the finish's radix select (same output): a row's candidates (k plus a
# few, unless scores tie) are sorted whole when they are at most SORT_CAP_FACTOR * k (rounded up to a
# power of two), else radix-selected. On the H200 (2026-12-05, B=64, 64K positions, top-512; bench.kernels'
# select_variants_us) 47.8 us against 52.5. (The bound by a sort of the group maxima was tried too:
# 53.7 against the radix select's 52.5, not kept.)
SORT_FINISH = True
SORT_CAP_FACTOR = 2
# Registers a thread of each launch may use (its `maxnreg`; None: ptxas chooses). At the launch deployed until
# the thirtieth session (segments of 4,096 positions, 8 warps), the candidates pass takes 128 uncapped with the
# device's Triton 3.6 and its CUDA 12.8 ptxas (112 with Triton 3.9): an sm_90 compile here of the 64K launch,
# its pointers and integers specialized as a launch does (`.perf/regs_topk.py`, not committed). So 2 programs of
# 256 threads fit an SM, and B=64's 1,024 programs run in 3.9 waves of 264.
# Capped at 80 it spills 72 bytes a thread and 3 fit (2.6 waves); at 64, 80 bytes and 4 fit (1.9 waves).
# Timed and not taken (bench.kernels' `select_variants_us`, twenty-seventh session, B=64, 64K): cap 80 took
# 44.8-45.5 us against 46.8-47.2 uncapped in that loop on the H100 and the H200, but the same uncapped launch
# timed elsewhere in each run took 45.0-45.6: inside the runs' spread. Cap 64: 46.4-47.0. A cap changes no bit.
REGISTER_CAPS: dict[str, int | None] = {"maxima": None, "bound": None, "candidates": None, "finish": None}
# Tried and removed: the bound selected by the last pass-1 program of each row (an atomic ticket a row, as
# sparse MLA's fold does) instead of its own ~7 us launch. Same bits, but no faster at B=64, 64K: the
# selection took 47.6 against 46.9 us on the H100 and 47.3 against 47.1 on the H200 (bench.kernels,
# twenty-eighth and twenty-ninth sessions): in a graph the launch costs little, and the last program of a
# row then selects alone where the bound launch runs every row's select side by side.
# The two passes over the row (pass 1's maxima, pass 2's candidates): `warps` a program and `stages` (None:
# Triton's default); every choice gives the same maxima, stretches and counts. Why: a segment of 4,096 positions
# in 8 warps held 128 registers a thread in the candidates pass (above), so 2 programs shared an SM, each
# reading its 16 KB, then computing, with nothing else in flight: at B=64, 64K it took 20.6 us to read 16.8 MB
# (~4 us of the H200's bandwidth). Timed on the H100 (thirtieth session, B=64, 64K, segments of 2,048,
# bench.kernels' row-pass sweep): the whole selection with the candidates pass in 4 warps 43.2 us against 46.1
# in 8; pass 1 within 0.2 us every way; both in 4 warps 42.9.
# Tried and removed (thirty-first session): each program walking its segment in steps of 512 or 1,024 positions
# (fewer registers a step). It lost or tied on the H100 twice, since 4 warps over the whole segment already let
# more programs share an SM: candidates pass 45.7 us in 1,024-position steps and 43.4 in 512 (2 warps), against
# 41.7 whole; pass 1 42.4 and 43.0 against 41.8.
ROW_PASS_LAUNCHES: dict[str, dict[str, int | None]] = {
    "maxima": {"warps": 4, "stages": None},
    "candidates": {"warps": 4, "stages": None},
}
# The candidates' move finds each element's segment in a [GATHER, segments] comparison: this many cells
# (about 64 a thread at 8 warps) bound the chunk, so long rows (many segments) move in smaller chunks.
GATHER_CELLS = 16384
# The bound's radix select over a row's group maxima (about 1,024 of them: group_size) with the maxima loaded
# once and held in registers across its four levels, where each level reloads them otherwise (from L2, the
# launch before wrote them). The same bound. H100 (thirtieth session, B=64, 64K): the selection 47.4 against 48.2
# us, logits + selection 243.5 against 244.7.
RESIDENT_BOUND = True


# Positions a program of the passes over the row covers on a GPU (the interpreter: 64). The bench's launch sweep
# (group x segment, bench.kernels select_ours_us_by_launch) found 64 / 2,048 the fastest at B=64, 64K on the H200
# (twenty-fourth session: 49.4 against 52.6 us at 64 / 4,096) and the H100 (thirtieth: 45.6 against 47.4) since the
# finish moves the candidates in chunks; 4,096 was the tenth session's choice, when each segment cost the finish a
# dependent walk step. A row of at most SEGMENT positions is one segment (no move in the finish).
SEGMENT = 2048


def row_pass_launch(name: str, given: dict[str, int | None] | None = None) -> dict:
    """The launch keywords of a pass over the row (`ROW_PASS_LAUNCHES[name]` updated by `given`): its warps and,
    if set, its stages."""
    launch = {**ROW_PASS_LAUNCHES[name], **(given or {})}
    unknown = set(launch) - set(ROW_PASS_LAUNCHES[name])
    if unknown:
        raise ValueError(f"{name} pass: unknown launch knobs {sorted(unknown)} (known: warps, stages)")
    stages = {} if launch["stages"] is None else {"num_stages": launch["stages"]}
    return {"num_warps": launch["warps"], **stages}


def segment_size(group: int, segment: int | None = None) -> int:
    """Positions a program of the passes over the row covers: `segment`, by default SEGMENT (the interpreter: 64),
    and never less than a group (a maximum is one program's)."""
    return max(segment or (64 if INTERPRETED else SEGMENT), group)


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
                 segment: int | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                 scratch: torch.Tensor | None = None, rank_order: bool | None = None,
                 sort_finish: bool | None = None, maxima: torch.Tensor | None = None,
                 register_caps: dict[str, int | None] | None = None,
                 row_pass_launches: dict[str, dict[str, int | None]] | None = None,
                 resident_bound: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cuda_torch.select_slots, bit for bit: scores [B, L] float32, positions [B] ->
    (positions [B, S] int64, valid [B, S] bool), S = window + min(topk, L).
    group: positions per pass-1 maximum (group_size); segment: positions per program of the two
    passes over the row (a power of two >= group). Every group and segment gives the same output.
    out: (positions, valid) buffers to fill; scratch: [B, L] int64 workspace (tests poison both).
    rank_order: order the chosen by counting instead of tl.sort (the same order; by default under
    the interpreter only, where tl.sort takes seconds a row; on a GPU the sort is cheaper).
    sort_finish: a row's top-k by one sort of its candidates when they are at most SORT_CAP_FACTOR * k
    (by default `SORT_FINISH` on a GPU, off under the interpreter): the same output either way.
    maxima: pass 1's group maxima [B, ceil(L / group)], already computed (the indexer's logits kernel
    writes them beside the logits: indexer.GroupMaxima): its launch is skipped. `group` must be theirs.
    register_caps: each launch's register cap by name (`REGISTER_CAPS` by default): the same output.
    row_pass_launches: "maxima" and / or "candidates": that pass's warps and stages over
    `ROW_PASS_LAUNCHES`' (missing keys keep theirs): the same output.
    resident_bound: the bound's select holds the maxima in registers (`RESIDENT_BOUND` by default; rows of
    at most its block of maxima): the same output."""
    launches, result = selection_launches(scores, positions, window, topk, group, segment, out, scratch, rank_order,
                                          sort_finish, maxima, register_caps, row_pass_launches, resident_bound)
    for launch in launches.values():
        launch()
    return result


def selection_launches(scores: torch.Tensor, positions: torch.Tensor, window: int, topk: int,
                       group: int | None = None, segment: int | None = None,
                       out: tuple[torch.Tensor, torch.Tensor] | None = None, scratch: torch.Tensor | None = None,
                       rank_order: bool | None = None, sort_finish: bool | None = None,
                       maxima: torch.Tensor | None = None, register_caps: dict[str, int | None] | None = None,
                       row_pass_launches: dict[str, dict[str, int | None]] | None = None,
                       resident_bound: bool | None = None,
                       ) -> tuple[dict[str, Callable[[], None]], tuple[torch.Tensor, torch.Tensor]]:
    """select_slots as its launches, in order, by name (bench/kernels.py times each one alone), and the
    (positions, valid) they fill. The arguments are select_slots'."""
    rows, width = scores.shape
    chosen = min(topk, width)
    if out is None:
        out = (torch.empty(rows, window + chosen, dtype=torch.int64, device=scores.device),
               torch.empty(rows, window + chosen, dtype=torch.bool, device=scores.device))
    sel, ok = out
    assert sel.shape == ok.shape == (rows, window + chosen) and sel.dtype == torch.int64 and ok.dtype == torch.bool
    if rows == 0:
        return {}, out
    if chosen == 0:
        def window_only() -> None:
            window_pos = positions[:, None] - window + 1 + torch.arange(window, device=scores.device)[None, :]
            sel.copy_(window_pos.clamp(min=0))
            ok.copy_(window_pos >= 0)
        return {"window": window_only}, out
    assert width < 2**31
    scores, positions = scores.contiguous().float(), positions.contiguous()
    group = group_size(width, topk, group)
    segment = segment_size(group, segment)
    assert segment & (segment - 1) == 0, f"segment {segment} is not a power of two"
    n_segments = triton.cdiv(width, segment)
    if scratch is None:
        scratch = torch.empty(rows, width, dtype=torch.int64, device=scores.device)
    given = maxima is not None
    if maxima is None:
        maxima = torch.empty(rows, triton.cdiv(width, group), dtype=torch.int64, device=scores.device)
    elif maxima.shape != (rows, triton.cdiv(width, group)) or maxima.dtype != torch.int64 or maxima.stride(-1) != 1:
        raise ValueError(f"maxima of {tuple(maxima.shape)} {maxima.dtype} given, but groups of {group} positions "
                         f"over [{rows}, {width}] scores need int64 [{rows}, {triton.cdiv(width, group)}], unit "
                         f"column stride")
    bound = torch.empty(rows, dtype=torch.int64, device=scores.device)
    counts = torch.empty(rows, 2 * n_segments, dtype=torch.int32, device=scores.device)  # (candidates, above)
    segments_p2 = max(2, triton.next_power_of_2(n_segments))
    small_block = 64 if INTERPRETED else 1024  # the ~k candidates: a whole 4096-lane histogram would waste 3/4
    sort_cap = SORT_CAP_FACTOR * max(2, triton.next_power_of_2(chosen)) \
        if (SORT_FINISH and not INTERPRETED if sort_finish is None else sort_finish) else 0
    caps = {**REGISTER_CAPS, **(register_caps or {})}
    resident = RESIDENT_BOUND if resident_bound is None else resident_bound
    passes = {name: row_pass_launch(name, (row_pass_launches or {}).get(name))
              for name in ROW_PASS_LAUNCHES}
    # The passes over the row run SEGMENT positions a program, so a row is spread over the GPU; the
    # selects over ~1024 maxima and ~k candidates and the sort need the whole row: one program each.
    launches = {} if given else {
        "maxima": lambda: _maxima_kernel[(rows, n_segments)](
            scores, positions, maxima, width, scores.stride(0), maxima.stride(0),
            WINDOW=window, TOPK=chosen, GROUP=group, SEGMENT=segment, maxnreg=caps["maxima"], **passes["maxima"])}
    return {
        **launches,
        "bound": lambda: _bound_kernel[(rows,)](
            maxima, positions, bound, maxima.shape[1], maxima.stride(0), WINDOW=window, TOPK=chosen,
            SMALL_BLOCK=small_block, RESIDENT=resident and maxima.shape[1] <= small_block, num_warps=8,
            maxnreg=caps["bound"]),
        "candidates": lambda: _candidates_kernel[(rows, n_segments)](
            scores, positions, bound, scratch, counts, width, scores.stride(0), scratch.stride(0), counts.stride(0),
            WINDOW=window, TOPK=chosen, SEGMENT=segment, maxnreg=caps["candidates"], **passes["candidates"]),
        "finish": lambda: _finish_kernel[(rows,)](
            scores, positions, bound, counts, scratch, sel, ok, n_segments, scores.stride(0), counts.stride(0),
            scratch.stride(0), sel.stride(0), ok.stride(0), WINDOW=window,
            WINDOW_P2=triton.next_power_of_2(max(window, 1)), TOPK=chosen,
            TOPK_P2=max(2, triton.next_power_of_2(chosen)), SEGMENT=segment, SEGMENTS_P2=segments_p2,
            GATHER=max(16, min(small_block, GATHER_CELLS // segments_p2)), SMALL_BLOCK=small_block,
            RANK_ORDER=INTERPRETED if rank_order is None else rank_order, SORT_CAP=sort_cap, num_warps=8,
            maxnreg=caps["finish"]),
    }, out
