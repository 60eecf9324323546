"""Sparse latent-MQA decode attention over the paged latent cache.

T = queries, H = heads, C = latent dim, R = rope dim, S = selected positions per query (window U
top-k, as slot ids into the cache, -1 = padding), N = chunks.

Numerics: each query's S positions are cut into N chunks of whole BLOCK_S blocks. Each chunk runs
its own online softmax from the empty state, then the chunks' states are folded left to right in
chunk order (`_fold`), and out = A / L. N and the launch shape (BLOCK_H heads per program, BLOCK_S,
warps, V_SPLIT) are a property of the deployment (`default_launch` reads only S and H), never of the batch.
With the row sums as an MMA (rowsum_mma) only N, BLOCK_S and the chunk sums' rounding are: BLOCK_H,
warps, stages, V_SPLIT and the mode gave the same bits on the H200 (a row's reductions are MMA
k-chains and maxima), so a prefill pass may take its own launch (PREFILL_LAUNCH).

Two launch modes compute exactly those operations, so they give the same bits and the mode can
follow the batch (`spreads`):
- spread: one program per (query, chunk, head block, latent-column block) writes its chunk's
  state (float32, or with narrow_partials the sum in q's 16-bit dtype, rounded alike in both
  modes); the last of a query's N programs to finish (an atomic ticket) folds them in chunk
  order, or a second launch does (merge="kernel"). Small batches fill the GPU this way (bs 1,
  H=64: N x H/BLOCK_H x V_SPLIT programs).
- gathered: one program per (query, head block, column block) runs all N chunks and folds them in
  registers (or, merge="memory", writes their states and folds them back like the merge does).
  Large batches (and prefill) fill the GPU already and save the merge launch.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from runtime.kernels.triton import INTERPRETED, mla_grouped
from runtime.kernels.triton.mla_blocks import (
    _block_range,
    _block_scores,
    _fold,
    _fold_partials,
    _gather_block,
    _normalize,
    _online_step,
)
from runtime.kernels.triton.tickets import ticket_counters

LOG2E = 1.4426950408889634
# Programs that fill the device without spreading chunks; the interpreter's small value lets the
# CPU tests cross the mode switch with a few queries.
INTERPRETER_FILL = 8
# Passes of more rows than this (prefill chunks) skip each query's empty trailing chunks (skip_tail);
# None: never. Timed on the H200 (bench.decode_step --prefill-variants, four sessions, same logits
# every time): the slice's 4,096-row pass 0.4-0.6 ms faster with it (19.70 vs 20.32 ms in the twelfth).
SKIP_TAIL_ROWS: int | None = 256
# Passes of more rows than PREFILL_LAUNCH_ROWS (prefill chunks) take these sparse_mla_decode knobs
# in place of default_launch's (a caller's own arguments still win); None: never. Only knobs that
# left a row's bits alone under MMA row sums on the H200 are accepted (docs/results.md, "Seventh
# session"), and the pass must run with rowsum_mma: set it only where the deployment's other
# passes run with rowsum_mma too, or a prompt's bits would follow the size of its prefill chunk.
# 64-head blocks in column groups, one pass (mla_prefill.sparse_mla then skips its two-pass form): the
# slice's 4,096-row pass 16.31 ms against 16.51 in two passes, the same logits (H200, "Seventeenth
# session", bench.decode_step --prefill-variants). 3 stages: 2,093 us against 2,226 for a 4,096-row pass at H=64
# top-512 (H100, thirty-fifth session, bench.mla_sweep --free --rowsum-mma "stages3", the same bits).
PREFILL_LAUNCH: dict | None = dict(block_h=64, num_warps=8, num_stages=3)
PREFILL_LAUNCH_ROWS = 256
# Passes of at most SMALL_BATCH_ROWS rows (decode steps whose few queries leave most SMs idle: bs 1 at
# H=64 is N chunks x 4 head blocks = 20 programs) take these knobs, under PREFILL_LAUNCH's rules; None:
# never. Candidates (more programs per query: latent-column blocks in the spread mode) are timed by
# `bench.mla_sweep --free` ("spread/v4/ticket", "spread/v8/ticket"); none is measured yet.
SMALL_BATCH_LAUNCH: dict | None = None
SMALL_BATCH_ROWS = 8
# Passes of at most MID_BATCH_ROWS rows that the deployment's launch runs in the gathered mode (`spreads`: from
# 17 rows at H=64 on 132 SMs) take these knobs, under the same rules; None: never. 8 warps and 3 stages for
# H=64's 16-head blocks (8 warps run the one-block loop, mla_grouped.ONE_BLOCK_MIN_WARPS): H100, thirty-fifth
# session (.perf/rows_ab.py, the deployment's auto mode, the same bits), top-512 / top-640 us: bs 24 36.9 / 43.2
# against 39.9 / 46.9, bs 32 38.3 / 45.0 against 41.1 / 48.6; but bs 9-16 (the spread mode) 12-42% slower and
# bs 48 38-39% slower (256 programs of 8 warps: two waves), hence the band. The mode, not a row count, bounds
# it below: the switch moves with the GPU's SM count.
MID_BATCH_LAUNCH: dict | None = dict(num_warps=8, num_stages=3)
MID_BATCH_ROWS = 32
# Passes of LARGE_BATCH_ROWS to PREFILL_LAUNCH_ROWS rows (the largest decode buckets) take these knobs,
# under the same rules. 64-head blocks: one program gathers a query's rows for all 64 heads (four
# programs did), which the latent's column groups made fit: H=64, bs 128 85.7 us against 101.8 with
# 16-head blocks, the same bits (H200, bench.mla_sweep --free --rowsum-mma, "Seventeenth session");
# at bs 64 its 64 programs leave half the SMs idle (77.1 against 54.2), hence the band. 3 stages: bs 128
# 76.5 us against 82.5 (H100, thirty-fifth session, "stages3", the same bits).
LARGE_BATCH_LAUNCH: dict | None = dict(block_h=64, num_warps=8, num_stages=3)
LARGE_BATCH_ROWS = 128
# The spread mode's merge launch as a programmatic dependent launch (sm_90+, not the interpreter): its programs
# may become resident while the chunk programs still run (they trigger it as they start) and wait at
# griddepcontrol.wait for the whole grid's stores, so the merge's launch latency hides behind the chunks' work
# (bs <= 16 at H=64 runs spread: 2 launches of a few us each). The same kernels, so the same bits (the GPU bit
# test, eager and under graph replay). H100, thirty-seventh session, bench.mla_sweep --free "spread" against
# "spread+pdl": bs 1 8.4 -> 7.4 us at H=64 and 9.1 -> 7.5 at H=16, bs 16 at H=16 15.4 -> 14.2; one loss, bs 16
# at H=64, 25.8 -> 26.9.
PDL_MERGE = True
# The knobs those launches may set: the ones that left a row's bits alone under MMA row sums.
_FREE_KNOBS = frozenset({"block_h", "num_warps", "num_stages", "spread", "merge", "v_split", "skip_tail",
                         "rowsum_mma", "column_groups"})


def default_launch(num_selected: int, num_heads: int) -> dict:
    """The launch shape of a deployment: N chunks, BLOCK_H, BLOCK_S, warps, stages, V_SPLIT, narrow
    partials (and the merge, which does not change bits). It fixes a row's
    reduction order, so it reads only S and H. Chosen on the H200 by `python -m bench.mla_sweep`."""
    # bench.mla_sweep on the H200 (docs/results.md, "Sparse MLA launch sweep"): 128-position
    # chunks of 16 heads; H=64 keeps its chunk sums in bf16 (2 us less at bs 1-8), H=16 runs 8 warps.
    # H=64 takes its row sums as an MMA: its decode steps cost the same as with tl.sum (H200, twelfth
    # session: 0.567-1.681 ms against 0.558-1.663 at bs 1-128), and its prefill passes may then run
    # the two-pass form (mla_prefill.sparse_mla) with the same bits, 1.3 ms less per 4,096-row pass.
    # Fewer heads (the canary, a TP rank's share) keep tl.sum: their golden stores were recorded so.
    # Every head count runs the latent in four column groups (mla_grouped): the same bits on the H200
    # (GPU test), 11-17% less time at H=64 bs 1-128 (docs/results.md, "Sixteenth session"), 7-10% at
    # H=16 bs 64-128 ("Seventeenth session"). The interpreter adds a chained dot in another order than
    # one long dot (numpy), so there the grouping is its own numerics: CPU runs keep one group and test
    # the grouped kernel where they ask for it.
    # 64-position chunks (one BLOCK_S block each; 128 until the seventeenth session): at bs 1 the spread
    # mode then runs twice the programs, each one gather, and its merge launch folds 10 chunk states:
    # H=64 8.8 us against 10.5 for SGLang (was ~10.5), H=16 8.6 against 10.1; bs 32-128 alike within
    # 1-2%. A deployment's numerics; the canary's 64 selected positions are one chunk either way.
    if num_heads >= 64:
        block_h, block_s, chunk, warps, narrow, mma_sums, groups = 16, 64, 64, 4, True, True, 4
    else:
        block_h, block_s, chunk, warps, narrow, mma_sums, groups = 16, 64, 64, 8, False, False, 4
    return dict(num_splits=max(1, triton.cdiv(num_selected, chunk)), block_h=block_h, block_s=block_s,
                num_warps=warps, num_stages=2, merge="kernel", gathered_fold="registers", v_split=1,
                narrow_partials=narrow, rowsum_mma=mma_sums, column_groups=1 if INTERPRETED else groups)


def chunk_blocks(selected: int, num_splits: int, block_s: int) -> tuple[int, int]:
    """(BLOCK_S blocks per chunk, chunks): whole blocks per chunk, so N asked for may give fewer
    chunks. Part of a row's numerics, shared by every form of the kernel."""
    blocks_per_chunk = triton.cdiv(triton.cdiv(selected, num_splits), block_s)
    return blocks_per_chunk, triton.cdiv(selected, blocks_per_chunk * block_s)


def mma_precision(dtype: torch.dtype) -> str:
    """float32 inputs (the canary model on a GPU) keep full float32 products, as the CPU does."""
    return "ieee" if dtype == torch.float32 else "tf32"


def default_num_splits(num_selected: int, num_heads: int) -> int:
    return default_launch(num_selected, num_heads)["num_splits"]


@functools.cache
def _fill_programs(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def spreads(tokens: int, programs_per_query: int, splits: int, device: torch.device) -> bool:
    """The automatic mode: spread the chunks exactly when the gathered mode's programs (per query:
    head blocks x column blocks) would leave most SMs idle (below half of them: measured, spread
    wins at 32 programs and loses at 128). Free to follow the batch: both modes give the same bits."""
    fill = INTERPRETER_FILL if INTERPRETED else _fill_programs(device.index or 0) // 2
    return splits > 1 and tokens * programs_per_query < fill



def _runs_spread(asked: bool | None, tokens: int, head_blocks: int, v_split: int, splits: int,
                 device: torch.device) -> bool:
    """The mode a pass runs: the caller's (spreading only more than one chunk), else the automatic one."""
    if asked is None:
        return spreads(tokens, head_blocks * v_split, splits, device)
    return asked and splits > 1


@triton.jit
def _sparse_mla_kernel(q_ptr, kv_ptr, idx_ptr, out_ptr, part_ptr, stats_ptr, ticket_ptr,
                       heads, selected, blocks_per_chunk, sm_scale_log2,
                       stride_qt, stride_qh, stride_kv, stride_idx, stride_ot, stride_oh,
                       LATENT: tl.constexpr, ROPE: tl.constexpr, SPREAD: tl.constexpr, TICKET: tl.constexpr,
                       PRECISION: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
                       BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, V_SPLIT: tl.constexpr,
                       NARROW: tl.constexpr, SPLITS: tl.constexpr, STREAM: tl.constexpr, TAIL: tl.constexpr,
                       BLOCK_ALL: tl.constexpr, ROWSUM_MMA: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # the merge launch may start now: it waits for this whole grid at griddepcontrol.wait
        tl.extra.cuda.gdc_launch_dependents()
    # Flat grid, head blocks fastest: the programs that gather the same cache rows (one query's
    # head blocks and latent-column blocks) run side by side and share them through L2. With
    # V_SPLIT > 1 each program scores over the whole latent but averages only its BLOCK_C / V_SPLIT
    # output columns (more, smaller programs and partial states at small batch).
    pid = tl.program_id(0)
    head_blocks = tl.cdiv(heads, BLOCK_H)
    head_block = pid % head_blocks
    v_block = (pid // head_blocks) % V_SPLIT
    rest = pid // head_blocks // V_SPLIT
    if SPREAD:
        chunk = rest % SPLITS
        query = (rest // SPLITS).to(tl.int64)
    else:
        chunk = 0
        query = rest.to(tl.int64)
    BLOCK_V: tl.constexpr = BLOCK_C // V_SPLIT
    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < heads
    offs_c = tl.arange(0, BLOCK_C)
    offs_v = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_r = tl.arange(0, BLOCK_R)
    c_ok = offs_c < LATENT
    v_ok = offs_v < LATENT
    r_ok = offs_r < ROPE
    ok = h_ok[:, None] & v_ok[None, :]
    q_rows = q_ptr + query * stride_qt + offs_h[:, None] * stride_qh
    q_lat = tl.load(q_rows + offs_c[None, :], mask=h_ok[:, None] & c_ok[None, :], other=0.0)
    q_rope = tl.load(q_rows + LATENT + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    first_block, end_block = _block_range(idx_ptr, query, chunk, stride_idx, selected, blocks_per_chunk, SPREAD, TAIL,
                                          BLOCK_S, BLOCK_ALL)
    # Folded state and the running chunk's state. -1e30, finite: an empty chunk must not give inf - inf.
    M = tl.full((BLOCK_H,), -1e30, dtype=tl.float32)
    L = tl.zeros((BLOCK_H,), dtype=tl.float32)
    A = tl.zeros((BLOCK_H, BLOCK_V), dtype=tl.float32)
    m_i = tl.full((BLOCK_H,), -1e30, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_V), dtype=tl.float32)
    # One flat loop over blocks (chunk ends inside it), so the gathered loads pipeline across chunks.
    for block in range(first_block, end_block):
        valid, rows, kv_lat, kv_rope = _gather_block(kv_ptr, idx_ptr, query, block, selected, stride_kv, stride_idx,
                                                     offs_c, c_ok, offs_r, r_ok, LATENT, BLOCK_S)
        if V_SPLIT == 1:
            kv_v = kv_lat
        else:  # this program's columns again (an L1 hit)
            kv_v = tl.load(rows + offs_v[None, :], mask=valid[:, None] & v_ok[None, :], other=0.0)
        scores = _block_scores(q_lat, q_rope, kv_lat, kv_rope, valid, sm_scale_log2, PRECISION)
        m_i, alpha, p_v, l_i = _online_step(scores, m_i, l_i, kv_v.dtype, BLOCK_S, PRECISION, ROWSUM_MMA)
        acc = tl.dot(p_v, kv_v, acc * alpha[:, None], input_precision=PRECISION)
        if ((block + 1) % blocks_per_chunk == 0) | (block + 1 == end_block):  # a chunk ends here
            if NARROW:  # the chunk's sum as the spread mode stores it, in every mode
                acc = acc.to(q_ptr.dtype.element_ty).to(tl.float32)
            if STREAM:  # the chunk's state to memory, as a spread program would write it
                at = (query * SPLITS + block // blocks_per_chunk) * heads + offs_h
                tl.store(part_ptr + at[:, None] * LATENT + offs_v[None, :], acc.to(part_ptr.dtype.element_ty),
                         mask=ok)
                tl.store(stats_ptr + at * 2, m_i, mask=h_ok)
                tl.store(stats_ptr + at * 2 + 1, l_i, mask=h_ok)
            else:
                M, L, A = _fold(M, L, A, m_i, l_i, acc)
            m_i = tl.full((BLOCK_H,), -1e30, dtype=tl.float32)
            l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
            acc = tl.zeros((BLOCK_H, BLOCK_V), dtype=tl.float32)
    out_ptrs = out_ptr + query * stride_ot + offs_h[:, None] * stride_oh + offs_v[None, :]
    if SPREAD:
        base = (query * SPLITS + chunk) * heads + offs_h
        tl.store(part_ptr + base[:, None] * LATENT + offs_v[None, :], A.to(part_ptr.dtype.element_ty), mask=ok)
        # Every column block stores the same (M, L): its own ticket then covers the (M, L) it reads.
        tl.store(stats_ptr + base * 2, M, mask=h_ok)
        tl.store(stats_ptr + base * 2 + 1, L, mask=h_ok)
        if TICKET:
            # The last of a (query, head block)'s N programs to finish folds all N states (in chunk
            # order, whichever program it is) and re-arms the counter for the next launch. The
            # barrier + release/acquire ticket make every program's stores visible to it.
            tl.debug_barrier()
            counter = ticket_ptr + (query * head_blocks + head_block) * V_SPLIT + v_block
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == SPLITS - 1:
                tl.debug_barrier()
                out = _fold_partials(part_ptr, stats_ptr, query, heads, offs_h, h_ok, offs_v, ok, SPLITS,
                                     SPLITS, LATENT, BLOCK_H, BLOCK_V)
                tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=ok)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    elif STREAM:  # this program's own chunk states, folded from memory like the spread mode's
        tl.debug_barrier()
        out = _fold_partials(part_ptr, stats_ptr, query, heads, offs_h, h_ok, offs_v, ok,
                             tl.cdiv(end_block, blocks_per_chunk), SPLITS, LATENT, BLOCK_H, BLOCK_V)
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        out = _normalize(A, L, h_ok)
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _merge_kernel(part_ptr, stats_ptr, out_ptr, heads, stride_ot, stride_oh,
                  SPLITS: tl.constexpr, LATENT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
                  PDL: tl.constexpr = False):
    # Small [BLOCK_H, BLOCK_C] tiles: at bs 1 the merge's reads spread over many SMs.
    if PDL:  # launched before the chunk programs end: nothing is read before their grid is done and flushed
        tl.extra.cuda.gdc_wait()
    query = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < heads
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = h_ok[:, None] & (offs_c < LATENT)[None, :]
    out = _fold_partials(part_ptr, stats_ptr, query, heads, offs_h, h_ok, offs_c, ok, SPLITS, SPLITS, LATENT,
                         BLOCK_H, BLOCK_C)
    tl.store(out_ptr + query * stride_ot + offs_h[:, None] * stride_oh + offs_c[None, :],
             out.to(out_ptr.dtype.element_ty), mask=ok)


def _rows_launch(tokens: int, gathered: bool) -> tuple[str, dict] | None:
    """The launch table a pass of `tokens` rows takes over default_launch's, with its name, if any.
    gathered: whether the pass runs the gathered mode before any table's knobs (MID_BATCH_LAUNCH's bound)."""
    if PREFILL_LAUNCH is not None and tokens > PREFILL_LAUNCH_ROWS:
        return "PREFILL_LAUNCH", PREFILL_LAUNCH
    if SMALL_BATCH_LAUNCH is not None and tokens <= SMALL_BATCH_ROWS:
        return "SMALL_BATCH_LAUNCH", SMALL_BATCH_LAUNCH
    if MID_BATCH_LAUNCH is not None and gathered and tokens <= MID_BATCH_ROWS:
        return "MID_BATCH_LAUNCH", MID_BATCH_LAUNCH
    if LARGE_BATCH_LAUNCH is not None and LARGE_BATCH_ROWS <= tokens <= PREFILL_LAUNCH_ROWS:
        return "LARGE_BATCH_LAUNCH", LARGE_BATCH_LAUNCH
    return None


def _free_knobs(name: str, table: dict, given: dict, deployment_mma: bool) -> dict | None:
    """A row-count launch table (`name`) under the caller's own (non-None) arguments, checked; None
    where it does not apply: a deployment with tl.sum's row sums (its launch shape is part of its
    numerics) when neither the table nor the caller asks for MMA row sums, or when the caller asks for tl.sum's
    (a table's launch would change those bits; mla_sweep --free runs such passes at every batch)."""
    if given.get("rowsum_mma") is False:
        return None
    other = set(table) - _FREE_KNOBS
    if other:
        raise ValueError(f"{name} sets {sorted(other)}: they change a row's reduction order, so a row's bits "
                         "would follow the size of its pass")
    knobs = {**dict.fromkeys(_FREE_KNOBS), **table, **{k: v for k, v in given.items() if v is not None}}
    if knobs["rowsum_mma"] is None:
        if not deployment_mma:
            return None
        knobs["rowsum_mma"] = True
    if not knobs["rowsum_mma"]:
        raise ValueError(f"{name} needs rowsum_mma=True: with tl.sum's row sums the launch shape changes a row's "
                         "bits")
    return knobs


def sparse_mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, latent_dim: int, scale: float,
                      num_splits: int | None = None, block_h: int | None = None, block_s: int | None = None,
                      num_warps: int | None = None, num_stages: int | None = None, spread: bool | None = None,
                      merge: str | None = None, v_split: int | None = None, narrow_partials: bool | None = None,
                      skip_tail: bool | None = None, rowsum_mma: bool | None = None, column_groups: int | None = None,
                      pdl: bool | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, C+R]; kv_cache: [num_slots, C+R] (one layer); slots: [T, S] int32 slot ids of the
    selected positions, -1 = none (each row needs >= 1). Returns [T, H, C] in q.dtype.
    num_splits, block_h, block_s, num_warps, num_stages, v_split (latent-column blocks per head
    block): default_launch's unless given (fix them per deployment, not per batch: they set a
    row's reduction order). narrow_partials: each chunk's unnormalized sum rounded to q's
    16-bit dtype (half the partial-state bytes; float32 q keeps float32).
    spread: one program per chunk (True) or per query (False); the same bits either way. None:
    spread exactly when T x H/BLOCK_H x v_split programs would leave most SMs idle (`spreads`).
    merge: spread: "ticket" = the last program of each query folds the chunks, else a second launch
    does; not spread: "memory" = the program writes each chunk's state and folds them back from
    memory (no second accumulator in registers), else it folds in registers. The same bits in
    every case. skip_tail: skip each query's whole chunks after its last selected slot (the same
    bits; the rows of a prompt's first window + top-k positions select fewer); None: for passes of
    more than SKIP_TAIL_ROWS rows (prefill), where such rows are common. column_groups: 4 runs
    mla_grouped's kernel (the latent in four column groups: fewer registers; one column block, not
    merge="memory"), 1 this module's; None: default_launch's where the grouped kernel runs the
    launch. pdl: the spread mode's merge launch as a programmatic dependent launch (`pdl_launch`; None:
    PDL_MERGE), the same bits. rowsum_mma: the softmax row sums as an MMA over the 16-bit probabilities (other bits
    than tl.sum's, the same for every BLOCK_H and warp count; default_launch's: on for H >= 64).
    Passes of more than PREFILL_LAUNCH_ROWS rows take PREFILL_LAUNCH's knobs where it is set, passes
    of at most SMALL_BATCH_ROWS rows SMALL_BATCH_LAUNCH's, gathered passes of at most MID_BATCH_ROWS
    rows MID_BATCH_LAUNCH's, passes of LARGE_BATCH_ROWS to PREFILL_LAUNCH_ROWS rows LARGE_BATCH_LAUNCH's (each
    only where the deployment, or the table, takes MMA row sums)."""
    tokens, heads, width = q.shape
    selected = slots.shape[1]
    if out is None:
        out = torch.empty(tokens, heads, latent_dim, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    launch = default_launch(selected, heads)
    # The mode of the launch before any table (the caller's knobs, else the deployment's): MID_BATCH_LAUNCH's bound.
    _, chunks = chunk_blocks(selected, num_splits or launch["num_splits"], block_s or launch["block_s"])
    gathered = not _runs_spread(spread, tokens, triton.cdiv(heads, block_h or launch["block_h"]),
                                v_split or launch["v_split"], chunks, q.device)
    rows_launch = _rows_launch(tokens, gathered)
    p = None if rows_launch is None else _free_knobs(
        *rows_launch, dict(block_h=block_h, num_warps=num_warps, num_stages=num_stages, spread=spread, merge=merge,
                           v_split=v_split, skip_tail=skip_tail, rowsum_mma=rowsum_mma, column_groups=column_groups),
        launch["rowsum_mma"])
    if p is not None:
        block_h, num_warps, num_stages, spread = p["block_h"], p["num_warps"], p["num_stages"], p["spread"]
        merge, v_split, skip_tail, rowsum_mma = p["merge"], p["v_split"], p["skip_tail"], p["rowsum_mma"]
        column_groups = p["column_groups"]
    splits = num_splits or launch["num_splits"]
    block_h = block_h or launch["block_h"]
    block_s = block_s or launch["block_s"]
    v_split = v_split or launch["v_split"]
    narrow = launch["narrow_partials"] if narrow_partials is None else narrow_partials
    part_dtype = q.dtype if narrow and q.dtype in (torch.bfloat16, torch.float16) else torch.float32
    blocks_per_chunk, splits = chunk_blocks(selected, splits, block_s)
    head_blocks = triton.cdiv(heads, block_h)
    spread = _runs_spread(spread, tokens, head_blocks, v_split, splits, q.device)
    merge = merge or launch["merge" if spread else "gathered_fold"]
    ticket = spread and merge == "ticket"
    pdl = spread and not ticket and pdl_launch(pdl, q.device)
    stream = not spread and merge == "memory" and splits > 1
    rope_dim = width - latent_dim
    warps, stages = ((4, 1) if INTERPRETED else
                     (num_warps or launch["num_warps"], num_stages or launch["num_stages"]))
    part = stats = tickets = out  # unused unless spread
    if spread or stream:
        part = torch.empty(tokens, splits, heads, latent_dim, dtype=part_dtype, device=q.device)
        stats = torch.empty(tokens, splits, heads, 2, dtype=torch.float32, device=q.device)
    if ticket:
        tickets = ticket_counters(q.device, tokens * head_blocks * v_split)
    rowsum_mma = launch["rowsum_mma"] if rowsum_mma is None else rowsum_mma
    if skip_tail is None:
        skip_tail = SKIP_TAIL_ROWS is not None and tokens > SKIP_TAIL_ROWS
    skip_tail = skip_tail and splits > 1
    precision = mma_precision(q.dtype)
    if column_groups not in (None, 1, mla_grouped.GROUPS):
        raise ValueError(f"column_groups={column_groups}: 1 or {mla_grouped.GROUPS}")
    runs_grouped = v_split == 1 and not stream and mla_grouped.fits(latent_dim)
    if column_groups == mla_grouped.GROUPS and not runs_grouped:
        raise ValueError("column_groups=4 runs one column block, not merge='memory', and groups of >= 16 latent "
                         f"columns (latent {latent_dim})")
    # A launch the grouped kernel does not run takes the ungrouped one: the same bits on the GPU.
    groups = column_groups or (launch["column_groups"] if runs_grouped else 1)
    if groups == mla_grouped.GROUPS:
        mla_grouped.launch(head_blocks * (splits if spread else 1) * tokens, q, kv_cache, slots, out, part, stats,
                           tickets, heads, selected, blocks_per_chunk, scale * LOG2E, latent=latent_dim,
                           rope=rope_dim, spread=spread, ticket=ticket, precision=precision, block_h=block_h,
                           block_s=block_s, narrow=part_dtype != torch.float32, splits=splits, tail=skip_tail,
                           rowsum_mma=rowsum_mma, warps=warps, stages=stages, pdl=pdl)
        if spread and not ticket:
            _merge(part, stats, out, tokens, heads, latent_dim, splits, pdl)
        return out
    block_c = triton.next_power_of_2(latent_dim)
    # No mul+add contraction: the fold must round alike in registers and from memory.
    _sparse_mla_kernel[(head_blocks * v_split * (splits if spread else 1) * tokens,)](
        q, kv_cache, slots, out, part, stats, tickets, heads, selected, blocks_per_chunk, scale * LOG2E,
        q.stride(0), q.stride(1), kv_cache.stride(0), slots.stride(0), out.stride(0), out.stride(1),
        LATENT=latent_dim, ROPE=rope_dim, SPREAD=spread, TICKET=ticket, PRECISION=precision, BLOCK_H=block_h,
        BLOCK_S=block_s, BLOCK_C=block_c, BLOCK_R=max(16, triton.next_power_of_2(rope_dim)), V_SPLIT=v_split,
        NARROW=part_dtype != torch.float32, SPLITS=splits, STREAM=stream, TAIL=skip_tail,
        BLOCK_ALL=triton.next_power_of_2(selected), ROWSUM_MMA=rowsum_mma, PDL=pdl, num_warps=warps,
        num_stages=stages, enable_fp_fusion=False)
    if spread and not ticket:
        _merge(part, stats, out, tokens, heads, latent_dim, splits, pdl)
    return out


def _merge(part, stats, out, tokens: int, heads: int, latent_dim: int, splits: int, pdl: bool = False) -> None:
    """The spread mode's second launch: each query's chunk states folded in chunk order. pdl: as a programmatic
    dependent launch of the chunk programs' (which then ran with PDL=True: `pdl_launch`)."""
    merge_h, merge_c = min(8, triton.next_power_of_2(heads)), min(128, triton.next_power_of_2(latent_dim))
    _merge_kernel[(tokens, triton.cdiv(heads, merge_h), triton.cdiv(latent_dim, merge_c))](
        part, stats, out, heads, out.stride(0), out.stride(1), SPLITS=splits,
        LATENT=latent_dim, BLOCK_H=merge_h, BLOCK_C=merge_c, PDL=pdl, num_warps=4, enable_fp_fusion=False,
        **({"launch_pdl": True} if pdl else {}))


def pdl_launch(asked: bool | None, device: torch.device) -> bool:
    """Whether a spread pass's merge runs as a programmatic dependent launch: asked (None: PDL_MERGE) and the
    device has it (sm_90+; the interpreter runs launches one after the other, and has no griddepcontrol)."""
    asked = PDL_MERGE if asked is None else asked
    return asked and not INTERPRETED and device.type == "cuda" and _capability(device.index or 0)[0] >= 9


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)
