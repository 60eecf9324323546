"""Lightning-indexer logits over the paged index-key cache, and the window U top-k selection.

T = queries, HI = indexer heads, DI = index dim, P = pages per query, L = P * page_size.
logits[t, j] = key_scale[slot] * sum_h w[t, h] * relu(q[t, h] . key[slot]) for the j-th position of
query t (slot = page_table[t, j // page_size] * page_size + j % page_size), -inf past its length.
fp8 keys: q is fp8 too, its per-(token, head) scale folded into w by the caller (relu commutes
with a positive scale), the per-slot key scale applied after the head sum.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from runtime.kernels import cuda_torch
from runtime.kernels.triton import INTERPRETED, indexer_pages, topk
from runtime.kernels.triton.indexer_pages import query_operands
from runtime.kernels.triton.topk import store_group_maxima

# Positions are cut into blocks of BLOCK_L, up to MAX_BLOCKS of them walked by one program. A step of
# few queries would then run a handful of programs that walk their blocks one after another (bs 1 at
# 2,048 positions: 2 programs, ~15 us a call on the H200, 30 us of the slice's bs-1 step); with fewer
# blocks a program, more programs share the work. Which program computes a block never changes a
# logit's bits (every block runs the same operations on its own positions).
MAX_BLOCKS = 8
SPREAD_PROGRAMS = 256  # fewer blocks a program (down to 1) until a call has at least this many programs

# The logits kernel's launch: positions a block, warps, pipeline stages. A logit is one row of the same
# MMA over the index dim and the same head sum whichever of these runs it, so none is meant to change a
# bit; the GPU test checks each shape the bench times (`LAUNCH_VARIANTS`), and only a shape that keeps the
# bits may be deployed. Why time them: on the H200 the deployed loop reads at 73% of the read ceiling
# where a copy with nothing but its loads reaches 94%, while the H100 runs the same loop at 92%
# (bench.indexer_anatomy, twenty-fourth and twenty-seventh sessions). A loop that waits on latency, not on
# bandwidth, may gain from more bytes in flight: deeper pipelines, taller blocks, more warps.
LAUNCH = dict(block_l=128, num_warps=4, num_stages=3)
# A program walks the same MAX_BLOCKS * 128 positions at most whatever its block (fewer blocks of 256).
LAUNCH_VARIANTS = {  # bench.kernels' `logits_launches`: each beside LAUNCH, same bits asked
    "stages4": dict(num_stages=4), "stages2": dict(num_stages=2), "warps8": dict(num_warps=8),
    "warps8+stages4": dict(num_warps=8, num_stages=4),
    "block256+warps8": dict(block_l=256, num_warps=8),
    "block256+warps8+stages2": dict(block_l=256, num_warps=8, num_stages=2),
    "block64+stages4": dict(block_l=64, num_stages=4), "block64+stages6": dict(block_l=64, num_stages=6)}


# The per-slot key scale loaded before the keys and their MMA, not after the head sum: a plain load
# (Triton's pipeliner prefetches only the loads that feed the MMA), so issued after the MMA its latency
# stands between one block and the next (a copy of the loop without the scale ran 145 us against 159
# with it; bench/indexer_anatomy.py). Issued first it waits beside the MMA. The same product, the same
# bits. Timed on an H100 (twenty-fifth session; bench.kernels, both ways): fp8 keys 202.8 us
# against 208.9, bf16 392.5 against 391.4 (B=64, 64K).
EARLY_SCALE = True

# A program's blocks wholly inside the query's length run without masks (no per-row compare, no masked loads
# or store), and only its last live block, which may end past the length, runs masked, as straight-line code
# after the loop. The same operations on the same values, so the same bits. Why: a copy of the loop with no
# masks and a fixed trip count read at 159 us where the kernel takes 176 on the H200 (bench.indexer_anatomy,
# twenty-fourth session). The earlier try, FULL_FAST (a whole second loop for full programs), pipelined both
# loops and needed 74 KB of shared memory a program against 42: slower on the H100 (227 against 209 us).
# Here the masked block is not a loop, so nothing more is pipelined (41,984 B either way, sm_90 compile).
# By whether the keys are fp8, as timed on the H200 (twenty-seventh session, bench.kernels, B=64, 64K, same
# bits): fp8 keys 163.1 us against 173.4 masked; bf16 keys 337.9 against 332.2, so bf16 keeps the masks.
UNMASKED_FULL_BLOCKS: dict[bool, bool] = {True: True, False: False}
# With UNMASKED_FULL_BLOCKS, each full block's key scales loaded one block ahead (a register a thread). On the
# H200 the scale's load costs 13.7 us of the fp8 loop's time (bench.indexer_anatomy, twenty-seventh session:
# copy 158.8 us, no_scale 145.1) for 3% of its bytes: its latency, not its bandwidth. Timed (bench.kernels'
# `logits_prefetch_scale`, B=64, 64K, fp8 keys, same bits): H200 158.4 us against 162.4 off (twenty-ninth
# session), H100 192.2 against 193.0 (twenty-eighth), where the loop already runs at 93% of its read ceiling.
PREFETCH_SCALE = True


def unmasked_by_default(key_cache: torch.Tensor) -> bool:
    """`UNMASKED_FULL_BLOCKS` for these keys (fp8 or not)."""
    return UNMASKED_FULL_BLOCKS[key_cache.dtype.itemsize == 1]


# The selection's first pass (topk._maxima_kernel: the largest order key of every GROUP positions) done
# by the logits kernel on the logits it holds in registers, so that pass's launch and its read of the
# [B, L] logits go (7.6 us of the selection's 47.6 at B=64, 64K on the H100). Timed and off: the block gains
# a cross-warp max per group and a store, and that costs the logits kernel more than the launch it saves
# (bench.kernels' `fused_maxima`, fp8 keys, logits + selection fused / apart: H100 262.0 / 252.1 us, H200
# 259.3 / 221.3, twenty-seventh session; the fused logits kernel alone 214.7 us on the H200 against 173.4).
# Kept, tested, for a fusion that costs the block less (per-block partial top-k, issue 15 item 4).
FUSED_MAXIMA = False
# Registers a thread may use (the launch's `maxnreg`; None: ptxas chooses), by whether the kernel writes the
# group maxima (sm_90 compiles of the deployment launch here, integers specialized as a launch does:
# `.perf/regs.py`, not committed). With the device's Triton 3.6 (CUDA 12.8 ptxas) the fused kernel takes 117
# and the unfused 107: 4 programs of 128 threads an SM either way. With Triton 3.9 (CUDA 13.4) the fused
# kernel takes 138, and only 3 fit. Capped at 128 it takes 114-116 with no spill on both: 4 programs.
# (Capped at 96 the unfused kernel would fit 5, the shared memory's limit, with 16 bytes of spills a
# thread: `bench.kernels` times that, `logits_register_caps`: mixed, H200 fp8 167.8 against 173.4 us, bf16
# 345.2 against 332.2, H100 fp8 204.1 against 201.7; not taken.) A cap changes no bit, only the allocation.
REGISTER_CAP: dict[bool, int | None] = {False: None, True: 128}
# The logits by indexer_pages' kernel (each 64-position tile's keys copied by TMA from its page) where the call
# fits it (`indexer_pages.fits`: whole tiles a page, TMA-ready caches, no fused maxima), by whether the keys are
# fp8. The same bits (GPU tests). On the H200 (thirty-third session, bench.indexer_pages, 64K positions) fp8 keys
# 138.2 us against 156.8 at B=64 (with the selection 182.5 against 202.4), 45.0 / 44.4 at B=16, 5.8 / 6.3 at B=1;
# bf16 keys 258.0 / 330.6, 69.8 / 87.9, 7.6 / 9.2. The runtime's caches (pages of 16) keep the pointer kernel.
PAGE_TMA: dict[bool, bool] = {True: True, False: True}


class GroupMaxima(NamedTuple):
    """Where and how the logits kernel writes the selection's group maxima (`topk.select_slots`'s
    `maxima`): out [T, ceil(L / group)] int64; positions [T], window and topk (the chosen count,
    min(topk, L)) as the selection gets them; group must divide the kernel's block of positions."""
    out: torch.Tensor
    positions: torch.Tensor
    window: int
    topk: int
    group: int


def blocks_per_program(tokens: int, length: int, block_l: int, max_blocks: int = MAX_BLOCKS) -> int:
    blocks = max_blocks
    while blocks > 1 and tokens * triton.cdiv(length, block_l * blocks) < SPREAD_PROGRAMS:
        blocks //= 2
    return blocks


def page_tiles(tokens: int, length: int) -> int:
    """Tiles a program of indexer_pages' kernel walks: `blocks_per_program`'s rule over its tiles (at most
    MAX_POSITIONS positions a program, fewer for a small step)."""
    return blocks_per_program(tokens, length, indexer_pages.TILE, indexer_pages.MAX_POSITIONS // indexer_pages.TILE)


def key_block(dim: int, dtype: torch.dtype) -> int:
    """BLOCK_D for keys of `dim` in `dtype`: at least the MMA's smallest K, 16 for 16- and 32-bit
    operands and 32 for fp8 (sm_90 refuses an fp8 dot of K 16 at compile time: seen on the H100 with
    16-wide test keys). Lanes past dim load zeros."""
    return max(32 if dtype.itemsize == 1 else 16, triton.next_power_of_2(dim))


@triton.jit
def _block_logits(q_t, w, key_ptr, key_scale_ptr, table_row, out_row, offs_l, offs_d, length, dim, page_size,
                  width, stride_key, KEY_SCALE: tl.constexpr, PRECISION: tl.constexpr, EARLY_SCALE: tl.constexpr,
                  MASKED: tl.constexpr = True, given_scale=None, SCALE_GIVEN: tl.constexpr = False):
    """The logits of one block of positions offs_l, stored at out_row and returned; -inf past the query's
    length, nothing stored past the row's width. EARLY_SCALE: the key scale's load comes first.
    MASKED=False: the caller knows every position is below the length and the width (no masks).
    SCALE_GIVEN: the caller loaded this block's key scales (given_scale), as the early load would."""
    valid = offs_l < length
    if MASKED:
        page = tl.load(table_row + offs_l // page_size, mask=valid, other=0).to(tl.int64)
        key_ok = valid[:, None] & (offs_d < dim)[None, :]
    else:
        page = tl.load(table_row + offs_l // page_size).to(tl.int64)
        key_ok = (offs_d < dim)[None, :]
    slot = page * page_size + offs_l % page_size
    if KEY_SCALE and SCALE_GIVEN:
        key_scale = given_scale
    elif KEY_SCALE and EARLY_SCALE:
        key_scale = tl.load(key_scale_ptr + slot, mask=valid if MASKED else None, other=1.0 if MASKED else None)
    keys = tl.load(key_ptr + slot[:, None] * stride_key + offs_d[None, :], mask=key_ok, other=0.0)  # [BLOCK_L, BLOCK_D]
    scores = tl.maximum(tl.dot(keys, q_t, input_precision=PRECISION), 0.0)  # [BLOCK_L, BLOCK_H]
    logits = tl.sum(scores * w[None, :], axis=1)
    if KEY_SCALE and (EARLY_SCALE or SCALE_GIVEN):
        logits = logits * key_scale
    elif KEY_SCALE:
        logits = logits * tl.load(key_scale_ptr + slot, mask=valid if MASKED else None, other=1.0 if MASKED else None)
    if MASKED:
        logits = tl.where(valid, logits, float("-inf"))
        tl.store(out_row + offs_l, logits, mask=offs_l < width)
    else:
        tl.store(out_row + offs_l, logits)
    return logits


@triton.jit
def _group_maxima_of(logits, start, last, width, maxima_row, MAXIMA: tl.constexpr, TOPK: tl.constexpr,
                     BLOCK_L: tl.constexpr, GROUP: tl.constexpr):
    """With MAXIMA, the selection's group maxima of a block starting at `start`, for a row the selection
    runs pass 1 on (more than TOPK candidates: its last candidate position `last` at or past TOPK)."""
    if MAXIMA:
        if last + 1 > TOPK:
            store_group_maxima(logits, start, last, width, maxima_row, BLOCK_L, GROUP)


@triton.jit
def _indexer_kernel(q_ptr, w_ptr, key_ptr, key_scale_ptr, table_ptr, lens_ptr, out_ptr, pos_ptr, maxima_ptr,
                    heads, dim, page_size, width, stride_qt, stride_qh, stride_w, stride_key, stride_table, stride_out,
                    stride_maxima, KEY_SCALE: tl.constexpr, PRECISION: tl.constexpr, BLOCKS: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, EARLY_SCALE: tl.constexpr,
                    MAXIMA: tl.constexpr, WINDOW: tl.constexpr, TOPK: tl.constexpr, GROUP: tl.constexpr,
                    UNMASKED_FULL: tl.constexpr, PREFETCH_SCALE: tl.constexpr):
    # One program: BLOCKS consecutive blocks of BLOCK_L positions of one query, q held throughout.
    # Scores as keys @ q^T ([positions, heads]): the head sum then stays inside a warp.
    # MAXIMA: the selection's group maxima too (GroupMaxima), for rows it runs pass 1 on (more than
    # TOPK candidates, as topk._maxima_kernel).
    query = tl.program_id(0).to(tl.int64)
    length = tl.load(lens_ptr + query)
    last = query * 0 - 1  # the query's last top-k candidate position (MAXIMA only)
    if MAXIMA:
        last = tl.load(pos_ptr + query).to(tl.int64) - WINDOW
    maxima_row = maxima_ptr + query * stride_maxima
    offs_d = tl.arange(0, BLOCK_D)
    q_t, w = query_operands(q_ptr, w_ptr, query, heads, dim, stride_qt, stride_qh, stride_w, BLOCK_H, BLOCK_D)
    out_row = out_ptr + query * stride_out
    table_row = table_ptr + query * stride_table
    first = tl.program_id(1) * BLOCKS * BLOCK_L
    # Blocks wholly past the query's length hold no key: they get their -inf without loads or an MMA.
    # In a prefill chunk a query's length is its position + 1, so on average half of every row (the
    # causal triangle) is such blocks; a valid position's logit is computed exactly as before.
    live = tl.minimum(BLOCKS, tl.maximum(0, tl.cdiv(length - first, BLOCK_L)))
    for block in range(live, BLOCKS):
        offs_l = first + block * BLOCK_L + tl.arange(0, BLOCK_L)
        dead = tl.full((BLOCK_L,), float("-inf"), tl.float32)
        tl.store(out_row + offs_l, dead, mask=offs_l < width)
        _group_maxima_of(dead, first + block * BLOCK_L, last, width, maxima_row, MAXIMA, TOPK, BLOCK_L, GROUP)
    if UNMASKED_FULL:
        # Blocks [0, masked_from), wholly below the length (and the row's width), run unmasked; at most one
        # block, the last live one, ends past the length.
        masked_from = tl.minimum(live, tl.maximum(0, (tl.minimum(length, width) - first) // BLOCK_L))
        if PREFETCH_SCALE and KEY_SCALE:
            # Each block's key scales are loaded during the block before (the first block's before the
            # loop): that load is no operand of the MMA, so Triton's pipeliner does not prefetch it, and
            # its latency stood between one block and the next. The same values, multiplied the same way.
            offs_l = first + tl.arange(0, BLOCK_L)
            ok = offs_l < tl.minimum(length, width)
            page = tl.load(table_row + offs_l // page_size, mask=ok, other=0).to(tl.int64)
            next_scale = tl.load(key_scale_ptr + page * page_size + offs_l % page_size, mask=ok, other=1.0)
            for block in range(0, masked_from):
                key_scale = next_scale
                # The next block is a full one, so no mask (the last block reloads its own scales).
                ahead = first + tl.minimum(block + 1, masked_from - 1) * BLOCK_L + tl.arange(0, BLOCK_L)
                page = tl.load(table_row + ahead // page_size).to(tl.int64)
                next_scale = tl.load(key_scale_ptr + page * page_size + ahead % page_size)
                offs_l = first + block * BLOCK_L + tl.arange(0, BLOCK_L)
                logits = _block_logits(q_t, w, key_ptr, key_scale_ptr, table_row, out_row, offs_l, offs_d, length,
                                       dim, page_size, width, stride_key, KEY_SCALE, PRECISION, EARLY_SCALE, False,
                                       key_scale, True)
                _group_maxima_of(logits, first + block * BLOCK_L, last, width, maxima_row, MAXIMA, TOPK, BLOCK_L, GROUP)
        else:
            for block in range(0, masked_from):
                offs_l = first + block * BLOCK_L + tl.arange(0, BLOCK_L)
                logits = _block_logits(q_t, w, key_ptr, key_scale_ptr, table_row, out_row, offs_l, offs_d, length,
                                       dim, page_size, width, stride_key, KEY_SCALE, PRECISION, EARLY_SCALE, False)
                _group_maxima_of(logits, first + block * BLOCK_L, last, width, maxima_row, MAXIMA, TOPK, BLOCK_L, GROUP)
        if masked_from < live:  # straight-line code, not a second pipelined loop
            offs_l = first + masked_from * BLOCK_L + tl.arange(0, BLOCK_L)
            logits = _block_logits(q_t, w, key_ptr, key_scale_ptr, table_row, out_row, offs_l, offs_d, length, dim,
                                   page_size, width, stride_key, KEY_SCALE, PRECISION, EARLY_SCALE)
            _group_maxima_of(logits, first + masked_from * BLOCK_L, last, width, maxima_row, MAXIMA, TOPK, BLOCK_L,
                             GROUP)
    else:
        for block in range(0, live):
            offs_l = first + block * BLOCK_L + tl.arange(0, BLOCK_L)
            logits = _block_logits(q_t, w, key_ptr, key_scale_ptr, table_row, out_row, offs_l, offs_d, length, dim,
                                   page_size, width, stride_key, KEY_SCALE, PRECISION, EARLY_SCALE)
            _group_maxima_of(logits, first + block * BLOCK_L, last, width, maxima_row, MAXIMA, TOPK, BLOCK_L, GROUP)


def indexer_logits(q: torch.Tensor, head_weights: torch.Tensor, key_cache: torch.Tensor, page_table: torch.Tensor,
                   seq_lens: torch.Tensor, page_size: int, key_scale: torch.Tensor | None = None,
                   out: torch.Tensor | None = None, blocks: int | None = None,
                   early_scale: bool | None = None, maxima: GroupMaxima | None = None,
                   register_cap: int | None = None, launch: dict | None = None,
                   unmasked_full_blocks: bool | None = None, prefetch_scale: bool | None = None,
                   page_tma: bool | None = None) -> torch.Tensor:
    """q: [T, HI, DI] (key_cache's dtype); head_weights: [T, HI] float32; key_cache: [num_slots, DI];
    page_table: [T, P] int32; seq_lens: [T] int32 (keys per query); key_scale: [num_slots] float32 for
    fp8 keys. Returns float32 [T, P * page_size], -inf past each query's length. blocks: position
    blocks a program walks (tests and benches; `blocks_per_program` by default): the same bits.
    early_scale: the key scale loaded before the keys (`EARLY_SCALE` by default): the same bits.
    maxima: also write the selection's group maxima (GroupMaxima; `logits_and_selection` passes them on).
    register_cap: registers a thread may use (`REGISTER_CAP` by default; 0: none): the same bits.
    launch: block_l / num_warps / num_stages over `LAUNCH`'s (tests and benches).
    unmasked_full_blocks: `UNMASKED_FULL_BLOCKS` for the keys' dtype by default: the same bits.
    prefetch_scale: `PREFETCH_SCALE` by default (only with unmasked full blocks and a key scale): the same bits.
    page_tma: indexer_pages' kernel where the call fits it (`PAGE_TMA` for the keys' dtype by default, unless a
    knob of the pointer kernel above is given: tests and benches that turn one compare pointer launches): the
    same bits. True with a pointer knob is refused."""
    tokens, heads, dim = q.shape
    length = page_table.shape[1] * page_size
    if out is None:
        out = torch.empty(tokens, length, dtype=torch.float32, device=q.device)
    if tokens == 0 or length == 0:
        return out
    block_d = key_block(dim, q.dtype)
    pointer_knobs = [name for name, value in (("blocks", blocks), ("early_scale", early_scale),
                                              ("register_cap", register_cap), ("launch", launch),
                                              ("unmasked_full_blocks", unmasked_full_blocks),
                                              ("prefetch_scale", prefetch_scale)) if value is not None]
    if page_tma and pointer_knobs:
        raise ValueError(f"page_tma=True runs the page kernel, which has none of the pointer kernel's knobs "
                         f"{pointer_knobs}")
    if page_tma is None:
        page_tma = PAGE_TMA[key_cache.dtype.itemsize == 1] and not pointer_knobs
    if page_tma and maxima is None and indexer_pages.fits(key_cache, key_scale, page_size):
        indexer_pages.page_logits(q, head_weights, key_cache, page_table, seq_lens, page_size, out, key_scale,
                                  block_d, page_tiles(tokens, length))
        return out
    shape = launch_shape(launch)
    block_l = shape["block_l"]
    max_blocks = 2 if INTERPRETED else max(1, MAX_BLOCKS * 128 // block_l)
    blocks = blocks or blocks_per_program(tokens, length, block_l, max_blocks)
    block_h = max(16, triton.next_power_of_2(heads))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if maxima is not None:
        _check_maxima(maxima, tokens, length, block_l)
    # Without maxima their pointers are any tensor's (never read or written).
    pos, maxima_out = (maxima.positions.contiguous(), maxima.out) if maxima is not None else (seq_lens, out)
    _indexer_kernel[(tokens, triton.cdiv(length, block_l * blocks))](
        q, head_weights, key_cache, key_scale if key_scale is not None else head_weights, page_table, seq_lens, out,
        pos, maxima_out, heads, dim, page_size, length, q.stride(0), q.stride(1), head_weights.stride(0),
        key_cache.stride(0), page_table.stride(0), out.stride(0), maxima_out.stride(0),
        KEY_SCALE=key_scale is not None, PRECISION=precision, BLOCKS=blocks, BLOCK_H=block_h, BLOCK_D=block_d,
        BLOCK_L=block_l, EARLY_SCALE=EARLY_SCALE if early_scale is None else early_scale,
        MAXIMA=maxima is not None, WINDOW=maxima.window if maxima else 0, TOPK=maxima.topk if maxima else 0,
        GROUP=maxima.group if maxima else 1,
        UNMASKED_FULL=unmasked_by_default(key_cache) if unmasked_full_blocks is None else unmasked_full_blocks,
        PREFETCH_SCALE=PREFETCH_SCALE if prefetch_scale is None else prefetch_scale,
        num_warps=shape["num_warps"], num_stages=shape["num_stages"],
        maxnreg=(REGISTER_CAP[maxima is not None] if register_cap is None else register_cap) or None)
    return out


def launch_shape(launch: dict | None = None) -> dict:
    """`LAUNCH` with `launch`'s keys over it. The interpreter runs blocks of 32 positions (its time grows
    with the block) and one stage, unless a caller names its own block."""
    unknown = set(launch or ()) - set(LAUNCH)
    if unknown:
        raise ValueError(f"indexer launch knobs {sorted(unknown)} unknown; known: {sorted(LAUNCH)}")
    shape = {**LAUNCH, **(dict(block_l=32, num_stages=1) if INTERPRETED else {}), **(launch or {})}
    if shape["block_l"] < 16 or shape["block_l"] & (shape["block_l"] - 1):
        raise ValueError(f"indexer block_l must be a power of two >= 16 (an MMA's M), got {shape['block_l']}")
    return shape


def block_positions() -> int:
    """Positions per block of the deployed logits kernel (a group of the fused maxima must divide it)."""
    return launch_shape()["block_l"]


def _check_maxima(maxima: GroupMaxima, tokens: int, length: int, block_l: int) -> None:
    if block_l % maxima.group:
        raise ValueError(f"group maxima of {maxima.group} positions do not tile the logits kernel's blocks of "
                         f"{block_l}: the selection's own pass 1 must compute them")
    want = (tokens, triton.cdiv(length, maxima.group))
    if maxima.out.shape != want or maxima.out.dtype != torch.int64 or maxima.out.stride(-1) != 1 or \
            maxima.positions.shape != (tokens,) or maxima.out.device != maxima.positions.device:
        raise ValueError(f"group maxima need out int64 {list(want)} with unit column stride and positions "
                         f"[{tokens}] on its device, got {maxima.out.dtype} {list(maxima.out.shape)} (strides "
                         f"{maxima.out.stride()}) on {maxima.out.device} and {list(maxima.positions.shape)} on "
                         f"{maxima.positions.device}")


def logits_and_selection(q: torch.Tensor, head_weights: torch.Tensor, key_cache: torch.Tensor,
                         page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, positions: torch.Tensor,
                         window: int, k: int, key_scale: torch.Tensor | None = None, fused: bool | None = None,
                         ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """`indexer_logits`, then the window U top-k selection of each query (cuda_torch.select_slots):
    (logits, (positions, valid)). fused (`FUSED_MAXIMA` by default): the logits kernel writes the
    selection's group maxima and its first pass is skipped, where the group tiles the kernel's block
    (`fuses`); the same selection either way. A Triton build that cannot compile the selection sorts,
    as cuda_torch.select_slots does."""
    length = page_table.shape[1] * page_size
    if fuses(length, k, fused) and not cuda_torch._TRITON_SELECT_FAILED:
        group = topk.group_size(length, k)
        maxima = torch.empty(q.shape[0], triton.cdiv(length, group), dtype=torch.int64, device=q.device)
        logits = indexer_logits(q, head_weights, key_cache, page_table, seq_lens, page_size, key_scale=key_scale,
                                maxima=GroupMaxima(maxima, positions, window, min(k, length), group))
        try:
            return logits, topk.select_slots(logits, positions, window, k, group=group, maxima=maxima)
        except cuda_torch.triton_compile_errors() as err:
            cuda_torch.triton_select_failed(err)
            return logits, cuda_torch.select_slots_by_sort(logits, positions, window, k)
    logits = indexer_logits(q, head_weights, key_cache, page_table, seq_lens, page_size, key_scale=key_scale)
    return logits, cuda_torch.select_slots(logits, positions, window, k)


def fuses(length: int, k: int, fused: bool | None = None) -> bool:
    """Whether `logits_and_selection` takes the fused path for rows of `length` positions and top-`k`:
    asked for (`FUSED_MAXIMA` by default), a top-k part at all, and the selection's group dividing the
    kernel's block of positions (at 64K and top-512 the group is 64, the block 128)."""
    if not (FUSED_MAXIMA if fused is None else fused) or min(k, length) == 0:
        return False
    return block_positions() % topk.group_size(length, k) == 0


def select_positions(logits: torch.Tensor, positions: torch.Tensor, window: int, topk: int) -> torch.Tensor:
    """Window (p-window, p] plus the top-k positions <= p - window by logit: [T, window + topk] int32
    positions, -1 where fewer exist. Ties may go either way (compare tie-aware)."""
    tokens, length = logits.shape
    cols = torch.arange(length, device=logits.device)[None, :]
    pos = positions[:, None].to(torch.int64)
    width = min(topk, length)
    ranked = torch.where(cols <= pos - window, logits, torch.full_like(logits, float("-inf")))
    best = torch.topk(ranked, width, dim=-1, sorted=False)
    chosen = torch.where(best.values > float("-inf"), best.indices, -1)
    window_pos = pos - torch.arange(window, device=logits.device)[None, :]
    window_pos = torch.where(window_pos >= 0, window_pos, -1)
    return torch.cat([window_pos, chosen], dim=1).to(torch.int32)


def positions_to_slots(selected: torch.Tensor, page_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """[T, S] positions (-1 = none) -> [T, S] cache slots (-1 = none), through each query's pages."""
    safe = selected.clamp(min=0).to(torch.int64)
    pages = torch.gather(page_table.to(torch.int64), 1, safe // page_size)
    return torch.where(selected >= 0, pages * page_size + safe % page_size, -1).to(torch.int32)
