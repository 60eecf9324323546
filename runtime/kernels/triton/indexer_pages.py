"""The indexer's logits with each tile of keys (and its key scales) copied by TMA from one page.

The same logits as `indexer._indexer_kernel`, bit for bit: a logit is one row of the same MMA over the
index dim, the same relu, the same head sum, the same scale product, -inf past the query's length.
What differs is how the keys arrive. The pointer kernel gathers each position's row through its page
(a page-table load and an address a row, then cp.async), and loads the key scales with plain loads that
Triton's pipeliner does not prefetch. On the H200 that loop reads at ~80% of the read ceiling where a
copy of it with nothing but its loads reaches ~92% (bench.indexer_anatomy; the scale's load alone cost
~14 us of 171, twenty-seventh session). Here a tile is TILE positions inside one page, so its keys are
one [TILE, D] box at row page * page_size + offset of the key cache: one TMA copy, which the pipeliner
issues stages ahead, one scalar page-table load, no per-row address; the tile's scales are one contiguous
load of TILE floats. On the H200 (thirty-third session, bench.indexer_pages, B=64, 64K, same bits) the
fp8 logits take 138.2 us against the pointer kernel's 156.8, and with the selection 182.5 against 202.4
(issue 15's 200 us target); bf16 keys 258.0 against 330.6.

Needs page_size % TILE == 0 (a tile never straddles pages) and TMA-loadable caches (16-byte-aligned
base and row stride, unit stride along the dim); `fits` says whether a call qualifies, and the indexer
keeps its pointer kernel for the rest. TILE is 64 on a GPU: sm_90's wgmma takes 64 rows at least (below
it the MMA is another instruction, with other bits).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor  # Triton >= 3.4

from runtime.kernels.triton import INTERPRETED
from runtime.kernels.triton.matmul import tma_loadable

TILE = 16 if INTERPRETED else 64  # the interpreter's time grows with the tile
# Positions a program walks at most (as the pointer kernel's 8 blocks of 128), fewer for small steps.
MAX_POSITIONS = 1024
# Warps and pipeline stages of the launch. The page-table load ahead of each copy takes a stage of its own: 4
# stages hold 2 tiles of keys in shared memory, 5 and 6 hold 3 (sm_90 compiles, Triton 3.6 and 3.9). On the H200
# (B=64, 64K, fp8 keys, same bits) 3 / 4 / 5 / 6 stages took 150.2 / 150.3 / 138.2 / 138.3 us: with one tile in
# flight a program waits on its copy; with two the loop runs near the read ceiling. 8 warps (two warpgroups
# splitting the tile's MMA) gave other bits on the GPU test and in the bench: never deployed, no longer timed.
LAUNCH = dict(num_warps=4, num_stages=5)
# Each full tile's key scales loaded during the tile before (a loop-carried register block, `SCALE_AHEAD`) or
# before the tile's MMA (False: a plain load, whose latency runs beside the MMA). The ahead form holds 91 registers
# a thread against 75 (sm_90, Triton 3.6), so fewer programs share an SM: on the H200 (fp8, B=64, 64K) 142.2 us
# against 138.2 at 5 stages, 161.5 against 150.3 at 4. Kept as a timed variant.
SCALE_AHEAD = False
# What bench.indexer_pages times beside the defaults (page_logits' keyword arguments), each asked for the same
# bits by the GPU test.
LAUNCH_VARIANTS: dict[str, dict[str, Any]] = {
    "stages3": dict(launch=dict(num_stages=3)),
    "stages4": dict(launch=dict(num_stages=4)), "stages6": dict(launch=dict(num_stages=6)),
    "scale_ahead": dict(scale_ahead=True), "scale_ahead+stages4": dict(scale_ahead=True, launch=dict(num_stages=4)),
    "tiles8": dict(tiles=8), "tiles32": dict(tiles=32)}


@triton.jit
def query_operands(q_ptr, w_ptr, query, heads, dim, stride_qt, stride_qh, stride_w, BLOCK_H: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """A query's MMA operand q^T [BLOCK_D, BLOCK_H] (zeros past the heads and the dim) and its head weights
    [BLOCK_H] in float32 (zeros past the heads): held by a program of either indexer kernel throughout."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < heads
    q = tl.load(q_ptr + query * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & (offs_d < dim)[None, :], other=0.0)
    w = tl.load(w_ptr + query * stride_w + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    return tl.trans(q), w


@triton.jit
def _tile_row(table_row, start, page_size):
    """The key cache row of position `start`'s slot (a tile's first: the tile's rows follow it in its page)."""
    return tl.load(table_row + start // page_size) * page_size + start % page_size


@triton.jit
def _tile_logits(q_t, w, key_desc, scale_ptr, table_row, out_row, start, length, page_size, given_scale,
                 KEY_SCALE: tl.constexpr, SCALE_GIVEN: tl.constexpr, PRECISION: tl.constexpr, TILE: tl.constexpr,
                 MASKED: tl.constexpr):
    """The logits of the TILE positions from `start` (a live tile: start < length, so its page is one of the
    query's), stored at out_row. MASKED: positions at or past the length get -inf (their keys are whatever the
    page holds there: each logit is its own row's, so they touch no other). SCALE_GIVEN: the caller loaded the
    tile's key scales (given_scale); else they are loaded here, before the MMA, so their latency runs beside it."""
    row = _tile_row(table_row, start, page_size)
    if KEY_SCALE:
        if SCALE_GIVEN:
            key_scale = given_scale
        else:
            key_scale = tl.load(scale_ptr + row + tl.arange(0, TILE))
    keys = key_desc.load([row, 0])  # [TILE, BLOCK_D]; lanes past the dim come as zeros
    scores = tl.maximum(tl.dot(keys, q_t, input_precision=PRECISION), 0.0)  # [TILE, BLOCK_H]
    logits = tl.sum(scores * w[None, :], axis=1)
    if KEY_SCALE:
        logits = logits * key_scale
    offs_l = start + tl.arange(0, TILE)
    if MASKED:
        logits = tl.where(offs_l < length, logits, float("-inf"))
    tl.store(out_row + offs_l, logits)


@triton.jit
def _indexer_pages_kernel(q_ptr, w_ptr, key_desc, scale_ptr, table_ptr, lens_ptr, out_ptr, heads, dim, page_size,
                          width, stride_qt, stride_qh, stride_w, stride_table, stride_out,
                          KEY_SCALE: tl.constexpr, PRECISION: tl.constexpr, TILES: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
                          SCALE_AHEAD: tl.constexpr):
    # One program: TILES consecutive tiles of one query, q held throughout (as the pointer kernel).
    query = tl.program_id(0).to(tl.int64)
    length = tl.minimum(tl.load(lens_ptr + query), width)  # nothing is stored past the row's width
    q_t, w = query_operands(q_ptr, w_ptr, query, heads, dim, stride_qt, stride_qh, stride_w, BLOCK_H, BLOCK_D)
    out_row = out_ptr + query * stride_out
    table_row = table_ptr + query * stride_table
    first = tl.program_id(1) * TILES * TILE
    # Tiles wholly past the length get their -inf without loads (the width is whole tiles: page_size is).
    live = tl.minimum(TILES, tl.maximum(0, tl.cdiv(length - first, TILE)))
    for tile in range(live, TILES):
        offs_l = first + tile * TILE + tl.arange(0, TILE)
        tl.store(out_row + offs_l, tl.full((TILE,), float("-inf"), tl.float32), mask=offs_l < width)
    # Tiles wholly below the length run unmasked in the pipelined loop; at most the last live one is
    # partial, and runs after it as straight-line code.
    full = tl.minimum(live, tl.maximum(0, (length - first) // TILE))
    if KEY_SCALE and SCALE_AHEAD:
        # The key scales are no operand of the MMA, so the pipeliner leaves their load where it stands (a TMA
        # copy of them was waited for at once). Here each full tile's scales are loaded during the tile before,
        # from a page loaded the tile before that: neither load's latency stands between tiles. The last tiles
        # reload their own (no mask). The same values, multiplied the same way.
        # A program with no full tile reads page 0's scales here, never the page its first entry names: the
        # entries past a query's length are no pages of its (a runtime may leave anything there).
        last = tl.maximum(full - 1, 0)
        first_page = tl.where(full > 0, tl.load(table_row + first // page_size), 0)
        next_scale = tl.load(scale_ptr + first_page * page_size + first % page_size + tl.arange(0, TILE))
        next_page = tl.load(table_row + (first + tl.minimum(1, last) * TILE) // page_size)  # used only if full > 0
        for tile in range(0, full):
            key_scale = next_scale
            ahead = first + tl.minimum(tile + 1, last) * TILE
            next_scale = tl.load(scale_ptr + next_page * page_size + ahead % page_size + tl.arange(0, TILE))
            next_page = tl.load(table_row + (first + tl.minimum(tile + 2, last) * TILE) // page_size)
            _tile_logits(q_t, w, key_desc, scale_ptr, table_row, out_row, first + tile * TILE, length, page_size,
                         key_scale, KEY_SCALE, True, PRECISION, TILE, False)
    else:
        for tile in range(0, full):
            _tile_logits(q_t, w, key_desc, scale_ptr, table_row, out_row, first + tile * TILE, length, page_size,
                         None, KEY_SCALE, False, PRECISION, TILE, False)
    if full < live:
        _tile_logits(q_t, w, key_desc, scale_ptr, table_row, out_row, first + full * TILE, length, page_size,
                     None, KEY_SCALE, False, PRECISION, TILE, True)


def fits(key_cache: torch.Tensor, key_scale: torch.Tensor | None, page_size: int) -> bool:
    """Whether the page-tile kernel can run these caches: whole tiles in a page, a TMA-ready 2-D key cache,
    and a key scale vector of unit stride (a tile's scales are one contiguous load)."""
    return page_size % TILE == 0 and key_cache.dim() == 2 and key_cache.stride(1) == 1 and \
        tma_loadable(key_cache) and \
        (key_scale is None or (key_scale.dim() == 1 and key_scale.stride(0) == 1))


def page_logits(q: torch.Tensor, head_weights: torch.Tensor, key_cache: torch.Tensor, page_table: torch.Tensor,
                seq_lens: torch.Tensor, page_size: int, out: torch.Tensor, key_scale: torch.Tensor | None,
                block_d: int, tiles: int, launch: dict | None = None, scale_ahead: bool | None = None) -> None:
    """indexer.indexer_logits' logits into `out` [T, P * page_size] (the caller checked `fits` and allocated
    out). block_d: the MMA's K (indexer.key_block); tiles: tiles a program walks (indexer.page_tiles, the
    pointer kernel's spreading rule, by default); launch: num_warps / num_stages over LAUNCH's; scale_ahead:
    SCALE_AHEAD by default. Every tiling, launch and scale load gives the same bits."""
    tokens, heads, _ = q.shape
    length = page_table.shape[1] * page_size
    unknown = set(launch or ()) - set(LAUNCH)
    if unknown:
        raise ValueError(f"page-tile indexer launch knobs {sorted(unknown)} unknown; known: {sorted(LAUNCH)}")
    shape = {**LAUNCH, **(dict(num_stages=1) if INTERPRETED else {}), **(launch or {})}
    key_desc = TensorDescriptor.from_tensor(key_cache, [TILE, block_d])
    _indexer_pages_kernel[(tokens, triton.cdiv(length, TILE * tiles))](
        q, head_weights, key_desc, key_scale if key_scale is not None else head_weights, page_table, seq_lens, out,
        heads, q.shape[2], page_size, length,
        q.stride(0), q.stride(1), head_weights.stride(0), page_table.stride(0), out.stride(0),
        KEY_SCALE=key_scale is not None, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", TILES=tiles,
        BLOCK_H=max(16, triton.next_power_of_2(heads)), BLOCK_D=block_d, TILE=TILE,
        SCALE_AHEAD=SCALE_AHEAD if scale_ahead is None else scale_ahead, **shape)
