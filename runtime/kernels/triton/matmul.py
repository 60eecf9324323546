"""Batch-invariant dense GEMM: `out = x @ w.T` for every projection of a step (attention, indexer,
router, LM head), decode rows and prefill chunks alike.

M = rows (tokens), N = output features, K = input features; x: [M, K], w: [N, K] (nn.Linear layout).

Batch invariance: a row's output is the sum over K in BLOCK_K steps, in order, accumulated in
float32, and (when SPLIT_K > 1) the float32 partials of fixed K ranges added in split order: by
`_split_sum_kernel` after one program per split (decode), or by the tile's own program walking the
splits in order (`FUSED_SPLITS`, prefill: the same additions, no partials in memory). BLOCK_K and
SPLIT_K come from (N, K) alone (`split_for`), never from M, so `matmul(x)[:k] == matmul(x[:k])` bit
for bit. The output tile (BLOCK_M x BLOCK_N), warps and stages follow M (`config_for`: small tiles
that stream weights for decode, large ones for prefill chunks): they decide which program computes
an output and which MMA shape it issues, both of which leave each output's k16-step order alone.
tests/kernels/test_triton_kernels.py checks it on the GPU across the switch. cuBLAS, by contrast,
picks kernels and split-K by M, which is why `torch.mm` is not batch-invariant.

Decode steps are memory-bound: SPLIT_K puts enough programs on the weights when N is narrow (the
attention output and the router have few N tiles) so every SM streams a share of them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor  # Triton >= 3.4

BLOCK_K = 64
# SPLIT_K grows (powers of two) until the N tiles times the splits reach this many programs, while
# each split keeps at least MIN_SPLIT_STEPS K steps. A constant, not the device's SM count: the bits
# of a deployment must not depend on which GPU model it landed on.
TARGET_PROGRAMS = 256
MIN_SPLIT_STEPS = 4
DECODE_BLOCK_N = 128
# Above this many rows a pass is compute-bound (a prefill chunk): larger tiles reuse each load more.
PREFILL_ROWS = 256
# A prefill pass adds its splits in the tile's program when each split is this short or shorter:
# then the partials' round trip through memory outweighs the compute (H200, 4,096 rows,
# `bench.gemm_sweep --rows 4096`: lm_head K 4,096 / 8 splits 306 us fused vs 474 apart; the router
# and the indexer projection alike or better), while long splits keep the 128 x 256 tile that a
# second accumulator does not fit (attention output, K 32,768 / 8: 1,921 us apart vs 2,088 fused).
# 1,024: the indexer projection's 2,048-long splits run apart on the TMA kernel (493 us) faster than
# fused (517-534 us); lm_head's and the router's (512, 256) stay fused (306 vs 480 us apart).
FUSE_MAX_SPLIT_K = 1024
# Prefill passes of 16-bit weights whose splits are not fused run the persistent TMA kernel
# (`_matmul_tma_kernel`): the same tiles, k order and partials, loaded by the Tensor Memory
# Accelerator, one program per SM walking the tiles. H200, 4,096 rows, same bits (bench.gemm_sweep
# --rows 4096, twelfth session): attention q/kv 2,216 -> 1,611 us (780 TFLOP/s), attention output
# 1,897 -> 1,659, indexer projection 517 -> 493; the slice's prefill pass 20.3 -> 19.0 ms.
PREFILL_TMA = True
# 16-bit prefill passes of split weights run the TMA kernel with the splits added in the tile's
# program (a program per 128 x 128 tile walks its splits with two accumulators), long splits too: no
# partials through memory, no `_split_sum_kernel`. H200, 4,096 rows, same bits (bench.gemm_sweep
# --rows 4096, fifteenth session), us: attention output 1,714 (apart, 128 x 256) -> 1,587, indexer
# projection 500 -> 457, lm_head 358 (pointer, fused) -> 287, router 49 -> 45.
FUSED_TMA = True


# The row count is never specialized on (Triton would compile a variant per M % 16 class): an eager
# prefill pass of any length reuses the kernels the graph capture compiled, instead of compiling on
# the serving path.
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(x_ptr, w_ptr, out_ptr, part_ptr, M, N, K, k_chunk, stride_xm, stride_wn, stride_om,
                   SPLIT_K: tl.constexpr, FUSED_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Axis 0 walks M fastest, so the programs that share one weight tile run together (L2 reuse).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    ok = m_ok[:, None] & n_ok[None, :]
    if FUSED_SPLITS:
        # One program walks every split of its tile in split order and adds each split's float32
        # partial to a running total, exactly what the split programs and _split_sum_kernel compute
        # together (0 + p0 + p1 + ...), without the partials' round trip through memory: a prefill
        # pass has enough tiles to fill the GPU without splitting K.
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for split in range(0, SPLIT_K):
            total += _k_range(x_rows, w_rows, m_ok, n_ok, split * k_chunk, tl.minimum(K, (split + 1) * k_chunk),
                              PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out, total.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        acc = _k_range(x_rows, w_rows, m_ok, n_ok, pid_k * k_chunk, tl.minimum(K, (pid_k + 1) * k_chunk),
                       PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        _store_tile(acc, out_ptr, part_ptr, offs_m, offs_n, ok, pid_k, M, N, stride_om, SPLIT_K)


@triton.jit
def _store_tile(acc, out_ptr, part_ptr, offs_m, offs_n, ok, pid_k, M, N, stride_om, SPLIT_K: tl.constexpr):
    """A tile's float32 result: the output itself (in its dtype) or, split, this split's partial."""
    if SPLIT_K == 1:
        out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        part = part_ptr + (pid_k * M + offs_m[:, None].to(tl.int64)) * N + offs_n[None, :]
        tl.store(part, acc, mask=ok)


@triton.jit
def _k_range(x_rows, w_rows, m_ok, n_ok, k_start, k_end, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """x @ w.T over K in [k_start, k_end), from zero, in BLOCK_K steps: one split's float32 partial."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_end
        a = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_rows + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


# Why TMA for prefill: the pointer kernel's 128 x 256 tiles reach ~71% of cuBLAS's rate on the
# slice's projections (bench.gemm_sweep --rows 4096); its loads go through registers and cp.async
# address arithmetic, where TMA copies a whole [BLOCK, BLOCK_K] box per instruction. Persistent: a
# program per SM takes tiles in turn (which program computes a tile never changes its bits), so the
# next tile's loads start while the last one's result is stored.
@triton.jit(do_not_specialize=["M"])
def _matmul_tma_kernel(x_desc, w_desc, out_ptr, part_ptr, M, N, K, k_chunk, stride_om,
                       SPLIT_K: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PROGRAMS: tl.constexpr,
                       FLATTEN: tl.constexpr, FUSED: tl.constexpr = False):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    if FUSED:
        # A program per output tile adds its splits in split order itself, as the pointer kernel's
        # FUSED_SPLITS (0 + p0 + p1 ...: the additions of _split_sum_kernel), with TMA loads.
        for tile in tl.range(tl.program_id(0), num_m * num_n, PROGRAMS):
            pid_m = tile % num_m
            pid_n = tile // num_m
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for split in range(0, SPLIT_K):
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for k0 in range(split * k_chunk, tl.minimum(K, (split + 1) * k_chunk), BLOCK_K):
                    a = x_desc.load([pid_m * BLOCK_M, k0])
                    b = w_desc.load([pid_n * BLOCK_N, k0])
                    acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
                total += acc
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            ok = (offs_m < M)[:, None] & (offs_n < N)[None, :]
            tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                     total.to(out_ptr.dtype.element_ty), mask=ok)
        return
    tiles = num_m * num_n * SPLIT_K
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=FLATTEN):
        # M fastest, as the pointer kernel's grid: programs running together share a weight tile.
        pid_m = tile % num_m
        pid_n = (tile // num_m) % num_n
        pid_k = tile // (num_m * num_n)
        k_start = pid_k * k_chunk
        k_end = tl.minimum(K, k_start + k_chunk)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # The same k steps from zero as _k_range: the box past K (and past M, N) reads zeros, as
        # the pointer kernel's masked loads do, and a split's range is a whole number of steps.
        for k0 in range(k_start, k_end, BLOCK_K):
            a = x_desc.load([pid_m * BLOCK_M, k0])
            b = w_desc.load([pid_n * BLOCK_N, k0])
            acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        _store_tile(acc, out_ptr, part_ptr, offs_m, offs_n, ok, pid_k, M, N, stride_om, SPLIT_K)


@triton.jit(do_not_specialize=["M"])
def _split_sum_kernel(part_ptr, out_ptr, M, N, stride_om, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in range(0, SPLIT_K):  # split order: the same for every row and every batch
        acc += tl.load(part_ptr + (split * M + row) * N + offs, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def split_for(n: int, k: int) -> int:
    """The fixed K split of an (N, K) weight: enough programs for a decode step to stream it."""
    n_tiles = triton.cdiv(n, DECODE_BLOCK_N)
    split = 1
    while n_tiles * split * 2 <= TARGET_PROGRAMS and k // (split * 2) >= MIN_SPLIT_STEPS * BLOCK_K:
        split *= 2
    return split


def fuses_splits(m: int, k: int, split: int, element_size: int = 4) -> bool:
    """Whether an M-row pass over a K-long weight cut in `split` adds the splits in the tile's program:
    on the pointer kernel for short splits (FUSE_MAX_SPLIT_K), on the TMA kernel (16-bit prefill
    passes with FUSED_TMA) for every split."""
    if split <= 1 or m <= PREFILL_ROWS:
        return False
    return k // split <= FUSE_MAX_SPLIT_K or (FUSED_TMA and uses_tma(m, element_size, fused=True))


def config_for(m: int, element_size: int, fused: bool = False) -> dict:
    """Tile, warps and stages for an M-row pass. Stages: float32 tiles (the canary model on a GPU)
    take twice the shared memory of bf16 ones. A prefill pass of a split weight adds its splits in
    the program (`fused_splits`), which holds a second accumulator: 128 x 128 tiles keep both in
    registers where 128 x 256 would spill."""
    if m <= PREFILL_ROWS:  # decode: 64 rows is wgmma's smallest tile; many programs stream the weights
        return {"BLOCK_M": 64, "BLOCK_N": DECODE_BLOCK_N, "num_warps": 4, "num_stages": 4 if element_size == 2 else 2}
    if fused:
        return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 4 if element_size == 2 else 2}
    return {"BLOCK_M": 128, "BLOCK_N": 256, "num_warps": 8, "num_stages": 3 if element_size == 2 else 2}


def _precision(dtype: torch.dtype) -> str:
    # float32 weights (the canary model on a GPU) keep full float32 products, as the CPU does.
    return "ieee" if dtype == torch.float32 else "tf32"


def uses_tma(m: int, element_size: int, fused: bool) -> bool:
    """Whether an M-row pass runs the persistent TMA kernel (PREFILL_TMA: prefill passes of 16-bit
    weights, those whose splits are fused only with FUSED_TMA; float32 keeps the pointer kernel and
    the canary's bits)."""
    return PREFILL_TMA and m > PREFILL_ROWS and element_size == 2 and (FUSED_TMA or not fused)


def tma_loadable(t: torch.Tensor) -> bool:
    """TMA copies boxes from a 16-byte-aligned base with 16-byte-aligned row strides."""
    return t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def _programs(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _launch_tma(x, w, out, part, split, k_chunk, config, block_k, fused: bool = False) -> None:
    M, K = x.shape
    N = w.shape[0]
    config = dict(config)
    flatten = config.pop("flatten", True) and not fused  # fused: three nested loops, not flattened
    x_desc = TensorDescriptor.from_tensor(x, [config["BLOCK_M"], block_k])
    w_desc = TensorDescriptor.from_tensor(w, [config["BLOCK_N"], block_k])
    out_tiles = triton.cdiv(M, config["BLOCK_M"]) * triton.cdiv(N, config["BLOCK_N"])
    programs = min(out_tiles * (1 if fused else split), _programs(x.device))
    _matmul_tma_kernel[(programs,)](x_desc, w_desc, out, part, M, N, K, k_chunk, out.stride(0),
                                    SPLIT_K=split, PRECISION=_precision(x.dtype), BLOCK_K=block_k,
                                    PROGRAMS=programs, FLATTEN=flatten, FUSED=fused, **config)


def matmul(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
           split_k: int | None = None, config: dict | None = None, block_k: int = BLOCK_K,
           fused_splits: bool | None = None, tma: bool | None = None) -> torch.Tensor:
    """x: [M, K], w: [N, K] -> [M, N] in x.dtype. `split_k` overrides split_for (tests only: a
    deployment's split must never follow the batch); `config`, `block_k` and `fused_splits`
    override config_for, BLOCK_K and the prefill rule (bench/gemm_sweep.py and tests only).
    fused_splits: each program adds its tile's splits itself (same bits as the split programs plus
    `_split_sum_kernel`), the default above PREFILL_ROWS rows as `fuses_splits` says.
    tma: the persistent TMA kernel (same bits, fused splits or not; `uses_tma` decides by default;
    `config` may then carry "flatten", the tile loop's flattening)."""
    M, K = x.shape
    N = w.shape[0]
    assert w.shape[1] == K and x.dtype == w.dtype, f"x {tuple(x.shape)} {x.dtype} vs w {tuple(w.shape)} {w.dtype}"
    assert x.stride(1) == 1 and w.stride(1) == 1, "rows must be contiguous along K"
    out = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out
    if M == 0:
        return out
    split = split_k or split_for(N, K)
    fused = split > 1 and (fuses_splits(M, K, split, x.element_size()) if fused_splits is None else fused_splits)
    k_chunk = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    part = torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1 and not fused else out
    tma = uses_tma(M, x.element_size(), fused) if tma is None else tma
    tma = tma and tma_loadable(x) and tma_loadable(w)
    config = config or config_for(M, x.element_size(), fused)
    if tma:
        _launch_tma(x, w, out, part, split, k_chunk, config, block_k, fused)
    else:
        grid = (triton.cdiv(M, config["BLOCK_M"]), triton.cdiv(N, config["BLOCK_N"]), 1 if fused else split)
        _matmul_kernel[grid](x, w, out, part, M, N, K, k_chunk, x.stride(0), w.stride(0), out.stride(0),
                             SPLIT_K=split, FUSED_SPLITS=fused, PRECISION=_precision(x.dtype), BLOCK_K=block_k,
                             **config)
    if split > 1 and not fused:
        _split_sum_kernel[(M, triton.cdiv(N, 256))](part, out, M, N, out.stride(0), SPLIT_K=split, BLOCK=256)
    return out
