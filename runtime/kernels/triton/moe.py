"""Fused MoE for decode: token-expert alignment, gate/up grouped GEMM with SiLU-and-mul, down
projection scaled by the routing weight, and a fixed-order combine (+ shared expert).

T = tokens, K = experts per token, E = experts, D = hidden, I = expert intermediate (shard),
TK = T*K routed rows (row r = token r // K, rank r % K).

Batch invariance: a row's output depends only on its token, its experts and the reduction order
over D (gate/up) and I (down). That order is fixed by BLOCK_K (a constant here, never tuned) and by
tile rows being independent; buckets tune BLOCK_N, warps, stages and, for prefill-sized buckets,
BLOCK_M: a taller tile reads each expert's weights once per 32 or 64 of its rows instead of per 16,
and switches the tensor-core instruction (mma.sync below 64 rows, wgmma from 64), which leaves each
output's k16-step order alone (measured SAME on the H200 by bench/mma_bits.py and bench/moe_tiles.py,
tested across the buckets on the GPU). A bucket may also give gate/up its own launch (its split
partials added in the tile's program, in split order: `gate_up_launch`) and the down projection its
own (column tiles walked per program: `down_launch`); neither touches an output's additions. The
combine sums a token's K expert outputs in rank order, then adds the shared expert.

fp8 path: weights e4m3 with one float32 scale per 128x128 block ([E, N/128, K/128]), activations
quantized per token per 128 channels on the fly (quantize_groups; with split-K gate/up, the launch that adds
the partials quantizes the SiLU-and-mul output itself: FUSED_ACT_QUANT); BLOCK_K is the block size, so
each K step applies one activation scale per row and one weight scale per column.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from runtime.kernels.triton import INTERPRETED
from runtime.kernels.triton.configs import config_file_name, load_table, pick
from runtime.kernels.triton.elementwise import (
    FP8_DTYPE,
    FP8_GROUP,
    FP8_MAX,
    quantize_group,
    quantize_groups,
    quantize_weight_blocks,
)

BLOCK_M = 16  # rows per tile unless a bucket says: decode has ~TK/E <= 3 rows per expert at bs 128, E 256, K 6
BLOCK_K = 128  # reduction step; equal to the fp8 scale block, so one scale per step
ALIGNED, DENSE, PER_ROW = 0, 1, 2  # how a tile finds its rows and expert (see _gate_up_kernel)
# Up to this many routed rows, each row gets its own tile and no alignment launch: a row's bits do
# not change (tile rows are independent, same BLOCK_M/BLOCK_K), only which tile it rides in.
PER_ROW_MAX_ROWS = 16
DEFAULT_CONFIG = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 4}
# A bucket's own "gate_up" / "down" launches (gate_up_launch, down_launch) are followed; False falls
# back to the bucket's plain launch for both (the same bits: bench.decode_step --prefill-variants
# times the prefill pass either way).
BUCKET_LAUNCHES = True
# fp8 with split-K gate/up (I <= 512) and its partials added in their own launch: that launch also quantizes
# the SiLU-and-mul output it computes (rounded to the bfloat16 the act buffer holds, then quantize_groups'
# formula), in place of a quantize_groups launch after it and its bfloat16 round trip through memory: the same
# bits, one launch a pass fewer (two a layer with the shared expert). H100 (thirtieth session, bench.kernels'
# fp8_w8a8_act_quant row, no shared expert): 0.9-2.3 us faster at every batch size at I = 256 and 512, e.g.
# I=256 bs 8 78.6 against 80.6 us, I=512 bs 1 26.5 against 28.3; same bits at every point.
FUSED_ACT_QUANT = True
# Tried and removed (thirty-first session): gate/up quantizing the tokens it loads, each BLOCK_K step's 128 channels
# of its rows in registers by quantize_group's formula, in place of the quantize_groups launch before the MoE. The
# same bits, one launch fewer, but slower wherever the loop is long: the step's row maxima and divisions sit between
# the loads and the MMA of a pipelined loop, and every N-tile program redoes them. H100, fp8, as deployed otherwise:
# I=256 bs 8 82.1 against 76.0 us, bs 128 304.9 against 298.8; I=2048 bs 8 425.0 against 399.9; equal only at bs 1.
# What the fused launch rounds the act to before quantizing it: the act buffer's dtype on the fp8 path.
ACT_ROUNDING = tl.constexpr(tl.bfloat16)


@dataclass(frozen=True)
class PackedMoE:
    """Expert weights in kernel layout. w13: [E, 2I, D] (gate rows, then up rows); w2: [E, D, I].
    Shared expert as a one-expert stack (shared_w13 [1, 2IS, D], shared_w2 [1, D, IS]) or None.
    fp8: the *_scale tensors hold one float32 per 128x128 block, else None."""
    w13: torch.Tensor
    w2: torch.Tensor
    shared_w13: torch.Tensor | None = None
    shared_w2: torch.Tensor | None = None
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    shared_w13_scale: torch.Tensor | None = None
    shared_w2_scale: torch.Tensor | None = None

    @property
    def fp8(self) -> bool:
        return self.w13_scale is not None


def pack_weights(w_gate, w_up, w_down, shared_gate=None, shared_up=None, shared_down=None) -> PackedMoE:
    """From MoEWeights' layout (w_gate/w_up [E, I, D], w_down [E, D, I]) to the kernel layout."""
    shared_w13 = shared_w2 = None
    if shared_gate is not None:
        shared_w13 = torch.cat([shared_gate, shared_up], dim=0)[None].contiguous()
        shared_w2 = shared_down[None].contiguous()
    return PackedMoE(torch.cat([w_gate, w_up], dim=1).contiguous(), w_down.contiguous(), shared_w13, shared_w2)


def quantize_packed(packed: PackedMoE, experts_per_step: int = 32) -> PackedMoE:
    """`packed`'s fp8 copy: every weight e4m3 with one float32 scale per 128x128 block (quantize_weight_blocks),
    the routed experts `experts_per_step` at a time (the float32 staging stays small; a block's scale is its own,
    so the steps give the same bits as one call)."""
    def blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [quantize_weight_blocks(w[e:e + experts_per_step]) for e in range(0, w.shape[0], experts_per_step)]
        return torch.cat([q for q, _ in parts]), torch.cat([scale for _, scale in parts])

    w13, w13_scale = blocks(packed.w13)
    w2, w2_scale = blocks(packed.w2)
    shared = {}
    if packed.shared_w13 is not None and packed.shared_w2 is not None:
        (s13, s13_scale), (s2, s2_scale) = blocks(packed.shared_w13), blocks(packed.shared_w2)
        shared = dict(shared_w13=s13, shared_w2=s2, shared_w13_scale=s13_scale, shared_w2_scale=s2_scale)
    return PackedMoE(w13, w2, w13_scale=w13_scale, w2_scale=w2_scale, **shared)


@triton.jit
def _tile_rows(pid_m, tile_expert_ptr, sorted_rows_ptr, num_rows, ROUTING: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, rows) of tile pid_m. ROUTING 1 = DENSE (the shared expert, rows in order), 2 = PER_ROW
    (routed row pid_m alone; other lanes padded with num_rows), else ALIGNED (from align_tokens;
    expert -1 marks an empty tile). Shared by the gate/up and down kernels so both read tiles alike."""
    if ROUTING == 1:
        expert = tl.zeros((), dtype=tl.int64)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    elif ROUTING == 2:
        expert = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
        rows = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_rows)
    else:
        expert = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
        # In bounds for empty tiles too: align_tokens sizes sorted_rows to every tile, padded with num_rows.
        rows = tl.load(sorted_rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, rows


@triton.jit(do_not_specialize=["num_rows", "num_tiles"])
def _align_sort_kernel(ids_ptr, sorted_rows_ptr, tile_expert_ptr, num_rows, num_experts, num_tiles,
                       BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr, FILL: tl.constexpr):
    # One program, every routed row at once (BLOCK >= rows): the rows sorted by (expert, row) in
    # registers, so row order within an expert: the library sort's stable layout. A row's place is
    # its expert's padded start + its rank among the expert's rows; an expert's tiles are where its
    # ranks 0, BLOCK_M, 2 BLOCK_M, ... land.
    offs = tl.arange(0, BLOCK)
    real = offs < num_rows
    ids = tl.where(real, tl.load(ids_ptr + offs, mask=real, other=0).to(tl.int32), num_experts)  # padding last
    keys = tl.sort(ids * BLOCK + offs)
    expert = keys // BLOCK
    counts = tl.histogram(ids, BINS)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    rank = offs - tl.gather(tl.cumsum(counts, axis=0) - counts, expert, axis=0)
    dest = tl.gather(tl.cumsum(padded, axis=0) - padded, expert, axis=0) + rank
    for p0 in range(0, num_tiles * BLOCK_M, FILL):
        fill = p0 + tl.arange(0, FILL)
        tl.store(sorted_rows_ptr + fill, tl.full((FILL,), 0, tl.int32) + num_rows, mask=fill < num_tiles * BLOCK_M)
        tl.store(tile_expert_ptr + fill, tl.full((FILL,), -1, tl.int32), mask=fill < num_tiles)
    tl.debug_barrier()
    placed = expert < num_experts
    tl.store(sorted_rows_ptr + dest, keys % BLOCK, mask=placed)
    tl.store(tile_expert_ptr + dest // BLOCK_M, expert, mask=placed & (rank % BLOCK_M == 0))


# Routed rows up to ALIGN_SORT_KERNEL_MAX_ROWS: _align_sort_kernel, one launch where the library path takes
# a dozen. Above: library sort + scans, which scale. Both build one layout (tests/kernels/test_moe_align.py), so
# which one runs never changes a bit. A one-program counting kernel (an [E, 32] compare per 32 rows, serial over
# the rows) served up to 256 rows until the thirty-second session: `python -m bench.moe_align` on the H100 gave it
# 8.0 / 12.8 / 31.6 / 41.3 us at 18 / 48 / 192 / 256 rows (bs 3 / 8 / 32 / 43 at top-6) against the register
# sort's 6.1 / 6.1 / 5.6 / 5.7 (and 56.9 against 6.7 at 384 rows), once per MoE layer of every decode step.
ALIGN_SORT_KERNEL_MAX_ROWS = 2048


# align_tokens' implementations, for a caller that picks one (bench.moe_align, tests/kernels/test_moe_align.py).
ALIGN_PATHS = ("register_sort", "library_sort")


def align_tokens(topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M,
                 path: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Group routed rows by expert into BLOCK_M-row tiles (block_m: bench/moe_tiles.py only), with no
    host sync (capturable).

    Returns sorted_rows [NB*BLOCK_M] (routed row ids in row order within each expert; TK marks
    padding) and tile_expert [NB] (-1: unused tile). NB is a static bound: sum_e ceil(count_e /
    BLOCK_M) <= ceil((TK + min(E, TK) * (BLOCK_M - 1)) / BLOCK_M). Both implementations build this
    one layout exactly (tests/kernels/test_moe_align.py), so which one runs never changes a bit.
    path: one of ALIGN_PATHS; None: the register sort up to ALIGN_SORT_KERNEL_MAX_ROWS rows, the library sort above."""
    if path not in (None, *ALIGN_PATHS):
        raise ValueError(f"alignment path {path!r}: one of {ALIGN_PATHS} or None")
    flat = topk_ids.reshape(-1)
    rows = flat.numel()
    num_tiles = triton.cdiv(rows + min(num_experts, rows) * (block_m - 1), block_m)
    if path == "library_sort" or (path is None and rows > ALIGN_SORT_KERNEL_MAX_ROWS):
        return _align_with_sort(flat, num_experts, num_tiles, block_m)
    sorted_rows = torch.empty(num_tiles * block_m, dtype=torch.int32, device=flat.device)
    tile_expert = torch.empty(num_tiles, dtype=torch.int32, device=flat.device)
    if rows:
        _align_sort_kernel[(1,)](flat, sorted_rows, tile_expert, rows, num_experts, num_tiles, BLOCK_M=block_m,
                                 BLOCK=max(16, triton.next_power_of_2(rows)),
                                 BINS=triton.next_power_of_2(num_experts + 1), FILL=512, num_warps=8)
    return sorted_rows, tile_expert


def _align_with_sort(flat: torch.Tensor, num_experts: int, num_tiles: int,
                     block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """align_tokens' layout from a stable sort: expert e's rows go, in row order, to its padded span
    [padded_start[e], padded_start[e] + count[e]); the rest of the span stays TK (padding)."""
    rows, dev = flat.numel(), flat.device
    ids = flat.long()
    order = torch.sort(ids, stable=True).indices  # [TK] row ids, grouped by expert, row order within
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    expert_of = ids[order]
    rank = torch.arange(rows, device=dev) - (counts.cumsum(0) - counts)[expert_of]  # index within its expert
    sorted_rows = torch.full((num_tiles * block_m,), rows, dtype=torch.int32, device=dev)
    sorted_rows[(padded_ends - padded)[expert_of] + rank] = order.to(torch.int32)
    # tile t belongs to the first expert whose padded span ends after t * BLOCK_M; none: unused (-1)
    owner = torch.searchsorted(padded_ends, torch.arange(num_tiles, device=dev) * block_m, right=True)
    tile_expert = torch.where(owner < num_experts, owner, -1).to(torch.int32)
    return sorted_rows, tile_expert


@triton.jit(do_not_specialize=["num_rows"])  # as matmul.py: no variant per row count
def _gate_up_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, act_ptr, sorted_rows_ptr, tile_expert_ptr,
                    num_rows, top_k, hidden, inter,
                    stride_x, stride_xs, stride_we, stride_wn, stride_wse, stride_wsn, stride_act,
                    part_ptr, k_chunk,
                    FP8: tl.constexpr, ROUTING: tl.constexpr, SPLIT_K: tl.constexpr, FUSED_SPLITS: tl.constexpr,
                    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # act[r, n] = silu(x[tok] . w[e, n]) * (x[tok] . w[e, I + n]) for the rows r of this tile.
    # ROUTING: ALIGNED (tiles from align_tokens), DENSE (one expert, the shared one, for every row in
    # order) or PER_ROW (tile m = routed row m alone, expert ids[m]: small batches skip the alignment).
    # SPLIT_K > 1: this program sums D over [pid_k * k_chunk, +k_chunk) and writes float32 partials
    # part[pid_k, r, :2I]; _split_act_kernel adds them in split order and applies SiLU-and-mul.
    # FUSED_SPLITS (a prefill bucket's gate/up launch): one program walks the splits in order and adds
    # each split's partials to running totals, the additions _split_act_kernel makes (0 + p0 + p1 ...),
    # then applies SiLU-and-mul itself: no partials through memory, no second launch.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    expert, rows = _tile_rows(pid_m, tile_expert_ptr, sorted_rows_ptr, num_rows, ROUTING, BLOCK_M)
    if expert < 0:  # an empty tile of the aligned layout
        return
    row_ok = rows < num_rows
    tokens = (rows // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    ok = row_ok[:, None] & n_ok[None, :]
    if FUSED_SPLITS:
        total_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        total_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for split in range(0, SPLIT_K):
            acc_gate, acc_up = _gate_up_range(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, expert, tokens, row_ok,
                                              offs_n, n_ok, split * k_chunk,
                                              tl.minimum(hidden, (split + 1) * k_chunk), inter, stride_x,
                                              stride_xs, stride_we, stride_wn, stride_wse, stride_wsn, FP8,
                                              PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
            total_gate += acc_gate
            total_up += acc_up
        act = total_gate * tl.sigmoid(total_gate) * total_up
        out = act_ptr + rows[:, None].to(tl.int64) * stride_act + offs_n[None, :]
        tl.store(out, act.to(act_ptr.dtype.element_ty), mask=ok)
        return
    acc_gate, acc_up = _gate_up_range(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, expert, tokens, row_ok, offs_n, n_ok,
                                      pid_k * k_chunk, tl.minimum(hidden, (pid_k + 1) * k_chunk), inter, stride_x,
                                      stride_xs, stride_we, stride_wn, stride_wse, stride_wsn, FP8, PRECISION,
                                      BLOCK_M, BLOCK_N, BLOCK_K)
    if SPLIT_K == 1:
        act = acc_gate * tl.sigmoid(acc_gate) * acc_up
        out = act_ptr + rows[:, None].to(tl.int64) * stride_act + offs_n[None, :]
        tl.store(out, act.to(act_ptr.dtype.element_ty), mask=ok)
    else:
        part = part_ptr + (pid_k * num_rows + rows[:, None].to(tl.int64)) * 2 * inter + offs_n[None, :]
        tl.store(part, acc_gate, mask=ok)
        tl.store(part + inter, acc_up, mask=ok)


@triton.jit
def _gate_up_range(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, expert, tokens, row_ok, offs_n, n_ok, k_start, k_end,
                   inter, stride_x, stride_xs, stride_we, stride_wn, stride_wse, stride_wsn, FP8: tl.constexpr,
                   PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The gate and up float32 sums of a tile's rows over D in [k_start, k_end), from zero, in BLOCK_K steps."""
    w_gate = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
    w_up = w_gate + inter * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        a = tl.load(x_ptr + tokens[:, None] * stride_x + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b_mask = k_ok[:, None] & n_ok[None, :]
        b_gate = tl.load(w_gate + offs_k[:, None], mask=b_mask, other=0.0)
        b_up = tl.load(w_up + offs_k[:, None], mask=b_mask, other=0.0)
        if FP8:
            a_s = tl.load(x_scale_ptr + tokens * stride_xs + k0 // BLOCK_K, mask=row_ok, other=0.0)
            s_base = w_scale_ptr + expert * stride_wse + k0 // BLOCK_K
            s_gate = tl.load(s_base + (offs_n // BLOCK_K) * stride_wsn, mask=n_ok, other=0.0)
            s_up = tl.load(s_base + ((offs_n + inter) // BLOCK_K) * stride_wsn, mask=n_ok, other=0.0)
            acc_gate += tl.dot(a, b_gate) * a_s[:, None] * s_gate[None, :]
            acc_up += tl.dot(a, b_up) * a_s[:, None] * s_up[None, :]
        else:
            acc_gate = tl.dot(a, b_gate, acc_gate, input_precision=PRECISION)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
    return acc_gate, acc_up


@triton.jit
def _split_silu_mul(part_ptr, row, offs, ok, num_rows, inter, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """SiLU(gate) * up of one row's channels `offs`, its gate and up the sums of the split-K partials in
    split order (float32)."""
    gate = tl.zeros((BLOCK,), dtype=tl.float32)
    up = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in range(0, SPLIT_K):
        base = part_ptr + (split * num_rows + row) * 2 * inter + offs
        gate += tl.load(base, mask=ok, other=0.0)
        up += tl.load(base + inter, mask=ok, other=0.0)
    return gate * tl.sigmoid(gate) * up


@triton.jit(do_not_specialize=["num_rows"])  # as matmul.py: no variant per row count
def _split_act_kernel(part_ptr, act_ptr, num_rows, inter, stride_act, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < inter
    act = _split_silu_mul(part_ptr, row, offs, ok, num_rows, inter, SPLIT_K, BLOCK)
    tl.store(act_ptr + row * stride_act + offs, act.to(act_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["num_rows"])  # as matmul.py: no variant per row count
def _split_act_quant_kernel(part_ptr, q_ptr, scale_ptr, num_rows, inter, stride_q, stride_s, SPLIT_K: tl.constexpr,
                            GROUP: tl.constexpr, FP8_MAX: tl.constexpr):
    """_split_act_kernel then quantize_groups in one program per row and 128-channel group: the act rounded
    to bfloat16 (the buffer _split_act_kernel stores it in), zeros past the width (quantize_groups' masked
    loads), quantize_group's formula."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    offs = group * GROUP + tl.arange(0, GROUP)
    ok = offs < inter
    act = _split_silu_mul(part_ptr, row, offs, ok, num_rows, inter, SPLIT_K, GROUP)
    act = tl.where(ok, act.to(ACT_ROUNDING).to(tl.float32), 0.0)
    q, scale = quantize_group(act, FP8_MAX)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(scale_ptr + row * stride_s + group, scale)


@triton.jit(do_not_specialize=["num_rows"])  # as matmul.py: no variant per row count
def _down_kernel(act_ptr, act_scale_ptr, w_ptr, w_scale_ptr, out_ptr, sorted_rows_ptr, tile_expert_ptr,
                 route_w_ptr, num_rows, hidden, inter,
                 stride_act, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_out,
                 FP8: tl.constexpr, ROUTING: tl.constexpr, WEIGHTED: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, N_TILES: tl.constexpr):
    # out[r, n] = route_w[r] * (act[r] . w2[e, n]), float32. A program writes N_TILES column tiles of
    # its rows, one after the other (`down_launch`): at prefill sizes the down GEMM is I = 256 deep,
    # two k steps, so a program per column tile is all prologue and epilogue; walking the columns in
    # one flattened loop keeps the weight loads of the next tile in flight under this one's MMAs.
    # Which program computes a column never changes its bits: each output's k steps are the same.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert, rows = _tile_rows(pid_m, tile_expert_ptr, sorted_rows_ptr, num_rows, ROUTING, BLOCK_M)
    if expert < 0:  # an empty tile of the aligned layout
        return
    row_ok = rows < num_rows
    rows64 = rows.to(tl.int64)
    if N_TILES == 1:
        _down_tile(act_ptr, act_scale_ptr, w_ptr, w_scale_ptr, out_ptr, route_w_ptr, expert, rows64, row_ok,
                   pid_n * BLOCK_N, hidden, inter, stride_act, stride_as, stride_we, stride_wn, stride_wse,
                   stride_wsn, stride_out, FP8, WEIGHTED, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        for tile in tl.range(0, N_TILES, flatten=True):
            _down_tile(act_ptr, act_scale_ptr, w_ptr, w_scale_ptr, out_ptr, route_w_ptr, expert, rows64, row_ok,
                       (pid_n * N_TILES + tile) * BLOCK_N, hidden, inter, stride_act, stride_as, stride_we,
                       stride_wn, stride_wse, stride_wsn, stride_out, FP8, WEIGHTED, PRECISION, BLOCK_M, BLOCK_N,
                       BLOCK_K)


@triton.jit
def _down_tile(act_ptr, act_scale_ptr, w_ptr, w_scale_ptr, out_ptr, route_w_ptr, expert, rows64, row_ok, n_start,
               hidden, inter, stride_act, stride_as, stride_we, stride_wn, stride_wse, stride_wsn, stride_out,
               FP8: tl.constexpr, WEIGHTED: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One BLOCK_M x BLOCK_N output tile of the down projection, I summed from zero in BLOCK_K steps."""
    offs_n = n_start + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    w_rows = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < inter
        a = tl.load(act_ptr + rows64[:, None] * stride_act + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(w_rows + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if FP8:
            a_s = tl.load(act_scale_ptr + rows64 * stride_as + k0 // BLOCK_K, mask=row_ok, other=0.0)
            b_s = tl.load(w_scale_ptr + expert * stride_wse + (offs_n // BLOCK_K) * stride_wsn + k0 // BLOCK_K,
                          mask=n_ok, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if WEIGHTED:
        acc = acc * tl.load(route_w_ptr + rows64, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rows64[:, None] * stride_out + offs_n[None, :], acc, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _combine_kernel(routed_ptr, shared_ptr, out_ptr, top_k, hidden, HAS_SHARED: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    # out[t] = sum_k routed[t*K + k] (rank order) + shared[t]
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = offs < hidden
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in range(0, top_k):
        acc += tl.load(routed_ptr + (token * top_k + k) * hidden + offs, mask=ok, other=0.0)
    if HAS_SHARED:
        acc += tl.load(shared_ptr + token * hidden + offs, mask=ok, other=0.0)
    tl.store(out_ptr + token * hidden + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def gate_up_splits(hidden: int, inter: int) -> int:
    """Split-K of the gate/up GEMM: a property of the shape, never of the batch (bits depend on it).
    Narrow shards give few output tiles at bs 1, so D is split to put more SMs on the weights; the
    float32 partials (TK * 2I * 4 bytes per split) are tiny next to the expert weights. From 4 rows the
    tables' buckets may walk the splits in one program (FUSED_SPLITS: these bits at the one-split launch's
    speed, where one split had been 1-2% faster at bs >= 8). H100, one run (fortieth session,
    docs/results.md): I=512 at four splits with such buckets, beside one split, fp8 bs 1 25.8 against 29.3
    us and bs 8 117.9 against 126.6, bf16 bs 1 35.6 against 34.6; level or ahead of SGLang everywhere
    (1.003-1.32). At I=256 four splits save 5-10 us of fp8 at bs 1."""
    return 4 if inter <= 512 and hidden >= 4 * BLOCK_K else 1


def moe_config(num_experts: int, inter: int, fp8: bool, tokens: int) -> dict:
    name = config_file_name("fused_moe", num_experts, inter, "fp8_w8a8" if fp8 else "bf16")
    return pick(load_table(name), tokens) or DEFAULT_CONFIG


def gate_up_launch(config: dict, routing: int = ALIGNED, split_k: int = 1) -> dict:
    """The gate/up GEMM's launch: BLOCK_N, warps, stages and FUSED_SPLITS (the tile's program adds
    its split partials itself: same additions as _split_act_kernel, so the same bits). A bucket's
    "gate_up" entry overrides the bucket's own; the per-row path and unsplit shapes never fuse."""
    launch = {"BLOCK_N": config["BLOCK_N"], "num_warps": config["num_warps"], "num_stages": config["num_stages"],
              "FUSED_SPLITS": False}
    if routing != PER_ROW and BUCKET_LAUNCHES:
        launch.update(config.get("gate_up", {}))
    launch["FUSED_SPLITS"] = bool(launch["FUSED_SPLITS"]) and split_k > 1
    return launch


def down_launch(config: dict, routing: int = ALIGNED) -> dict:
    """The down projection's launch: BLOCK_N (at least 64), N_TILES column tiles per program, warps
    and stages. A bucket's "down" entry overrides the gate/up launch it otherwise follows; none of
    these knobs reaches a row's bits (each output's k steps are fixed by BLOCK_K). The per-row path
    (one row a tile) keeps one column tile per program: its tiles are already many and short."""
    down = {"BLOCK_N": max(config["BLOCK_N"], 64), "N_TILES": 1, "num_warps": config["num_warps"],
            "num_stages": config["num_stages"]}
    if routing != PER_ROW and BUCKET_LAUNCHES:
        down.update(config.get("down", {}))
    return down


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _expert_pass(x, x_scale, w13, w13_scale, w2, w2_scale, routing, sorted_rows, tile_expert, route_w, top_k,
                 num_rows, config, split_k, out):
    """gate/up + SiLU-and-mul, then down (weighted when route_w is given) into out [num_rows, D].
    routing: ALIGNED (sorted_rows, tile_expert from align_tokens), DENSE (every row through expert 0,
    the shared expert) or PER_ROW (tile_expert = the flat expert ids, one row per tile)."""
    hidden, inter = x.shape[1], w2.shape[2]
    fp8 = w13_scale is not None
    # BLOCK_M from a prefill-sized bucket (or bench/moe_tiles.py); one-row tiles stay one-row.
    block_m = config.get("BLOCK_M", BLOCK_M) if routing != PER_ROW else BLOCK_M
    num_tiles = {ALIGNED: tile_expert.numel() if routing == ALIGNED else 0,
                 DENSE: triton.cdiv(num_rows, block_m), PER_ROW: num_rows}[routing]
    sorted_rows = out if sorted_rows is None else sorted_rows  # never read outside ALIGNED
    tile_expert = out if tile_expert is None else tile_expert  # never read in DENSE
    gate_up = gate_up_launch(config, routing, split_k)
    block_n, warps, stages = gate_up["BLOCK_N"], gate_up["num_warps"], gate_up["num_stages"]
    fused = gate_up["FUSED_SPLITS"]
    if INTERPRETED:
        warps, stages = 4, 1
    quantize_partials = split_k > 1 and not fused and fp8 and FUSED_ACT_QUANT
    precision = _precision(x.dtype)
    dummy = x_scale if fp8 else x  # never read when FP8 is off
    k_chunk = triton.cdiv(triton.cdiv(hidden, split_k), BLOCK_K) * BLOCK_K
    # Split partials in their own launch: gate/up writes float32 partials, not the act. With the fused act quantize
    # that launch writes the fp8 act itself, so no bfloat16 act is stored at all: gate/up is handed the partials for
    # the act pointer it never writes. Without partials, `part` is never read (the act stands in).
    part = torch.empty(split_k, num_rows, 2 * inter, dtype=torch.float32, device=x.device) \
        if split_k > 1 and not fused else None
    act = part if quantize_partials and part is not None else \
        torch.empty(num_rows, inter, dtype=torch.bfloat16 if fp8 else x.dtype, device=x.device)
    part = act if part is None else part
    _gate_up_kernel[(num_tiles, triton.cdiv(inter, block_n), 1 if fused else split_k)](
        x, dummy, w13, w13_scale if fp8 else w13, act, sorted_rows, tile_expert,
        num_rows, top_k, hidden, inter,
        x.stride(0), x_scale.stride(0) if fp8 else 0, w13.stride(0), w13.stride(1),
        w13_scale.stride(0) if fp8 else 0, w13_scale.stride(1) if fp8 else 0, act.stride(0), part, k_chunk,
        FP8=fp8, ROUTING=routing, SPLIT_K=split_k, FUSED_SPLITS=fused, PRECISION=precision, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=BLOCK_K, num_warps=warps, num_stages=stages)
    act_scale = None
    if quantize_partials:
        act = torch.empty(num_rows, inter, dtype=FP8_DTYPE, device=x.device)
        act_scale = torch.empty(num_rows, triton.cdiv(inter, FP8_GROUP), dtype=torch.float32, device=x.device)
        _split_act_quant_kernel[(num_rows, act_scale.shape[1])](
            part, act, act_scale, num_rows, inter, act.stride(0), act_scale.stride(0), SPLIT_K=split_k,
            GROUP=FP8_GROUP, FP8_MAX=FP8_MAX)
    elif split_k > 1 and not fused:
        _split_act_kernel[(num_rows, triton.cdiv(inter, 512))](part, act, num_rows, inter, act.stride(0),
                                                               SPLIT_K=split_k, BLOCK=512)
    if fp8 and act_scale is None:
        act, act_scale = quantize_groups(act)
    down = down_launch(config, routing)
    if INTERPRETED:
        down["num_warps"], down["num_stages"] = 4, 1
    _down_kernel[(num_tiles, triton.cdiv(hidden, down["BLOCK_N"] * down["N_TILES"]))](
        act, act_scale if fp8 else act, w2, w2_scale if fp8 else w2, out, sorted_rows, tile_expert,
        route_w if route_w is not None else out, num_rows, hidden, inter,
        act.stride(0), act_scale.stride(0) if fp8 else 0, w2.stride(0), w2.stride(1),
        w2_scale.stride(0) if fp8 else 0, w2_scale.stride(1) if fp8 else 0, out.stride(0),
        FP8=fp8, ROUTING=routing, WEIGHTED=route_w is not None, PRECISION=precision, BLOCK_M=block_m,
        BLOCK_K=BLOCK_K, **down)


def fused_moe(x: torch.Tensor, weights: PackedMoE, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              config: dict | None = None, out: torch.Tensor | None = None, split_k: int | None = None,
              alignment: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Routed experts (+ shared expert) for decode. x: [T, D]; topk_weights: [T, K] (already scaled
    by routed_scaling_factor); topk_ids: [T, K] int; out: optional [T, D] x.dtype destination;
    split_k: gate/up split over D (default gate_up_splits; fix it per deployment, not per batch);
    alignment: `align_tokens(topk_ids, E, config's BLOCK_M)`, computed beforehand, for a batch on
    the aligned path (T * K > PER_ROW_MAX_ROWS); None: computed here. bench/sglang_kernels.py
    passes it to time the expert passes without the alignment launch.
    Returns [T, D] in x.dtype."""
    num_tokens, hidden = x.shape
    num_experts, inter = weights.w2.shape[0], weights.w2.shape[2]
    top_k = topk_ids.shape[1]
    out = torch.empty_like(x) if out is None else out
    if num_tokens == 0:
        return out
    config = config or moe_config(num_experts, inter, weights.fp8, num_tokens)
    split_k = split_k or gate_up_splits(hidden, inter)
    x_in, x_scale = quantize_groups(x) if weights.fp8 else (x, None)
    if num_tokens * top_k <= PER_ROW_MAX_ROWS:
        if alignment is not None:
            raise ValueError(f"alignment given for {num_tokens * top_k} routed rows: the per-row path "
                             f"(<= PER_ROW_MAX_ROWS = {PER_ROW_MAX_ROWS}) has no alignment")
        routing, sorted_rows, tile_expert = PER_ROW, None, topk_ids.reshape(-1)
    else:
        block_m = config.get("BLOCK_M", BLOCK_M)
        if alignment is None:
            alignment = align_tokens(topk_ids, num_experts, block_m)
        routing, (sorted_rows, tile_expert) = ALIGNED, alignment
        if sorted_rows.numel() != tile_expert.numel() * block_m:  # shapes only: no host sync
            raise ValueError(f"alignment of {tile_expert.numel()} tiles and {sorted_rows.numel()} rows "
                             f"is not align_tokens' layout for BLOCK_M = {block_m}")
    routed = torch.empty(num_tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    _expert_pass(x_in, x_scale, weights.w13, weights.w13_scale, weights.w2, weights.w2_scale, routing, sorted_rows,
                 tile_expert, topk_weights.reshape(-1).to(torch.float32).contiguous(), top_k,
                 num_tokens * top_k, config, split_k, routed)
    shared = None
    if weights.shared_w13 is not None:
        shared = torch.empty(num_tokens, hidden, dtype=torch.float32, device=x.device)
        _expert_pass(x_in, x_scale, weights.shared_w13, weights.shared_w13_scale, weights.shared_w2,
                     weights.shared_w2_scale, DENSE, None, None, None, 1, num_tokens, config, split_k, shared)
    block_d = 1024
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block_d))](
        routed, shared if shared is not None else routed, out, top_k, hidden,
        HAS_SHARED=shared is not None, BLOCK_D=block_d)
    return out
