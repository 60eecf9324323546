"""Which tile shapes give the same bits: the question behind every "fixed per deployment" launch knob.

A row's reduction order is set by the K steps (BLOCK_K, in order) and by how the tensor cores add
inside one k16 step. BLOCK_M (the sparse MLA kernel's BLOCK_H, the fused MoE's BLOCK_M) also picks
the instruction: mma.sync m16n8k16 below 64 rows, wgmma m64nNk16 from 64 rows with 4 or 8 warps.
If both add alike, the MMA tile may follow the batch (bigger tiles for prefill and bs 128: each
weight or gathered KV row read once per 64 rows, not per 16), like matmul.config_for already does
between its two wgmma tiles. The row sums that follow a dot (softmax denominators) reduce over a
layout that the warps decide; they are checked too.

For each (BLOCK_M, BLOCK_N, BLOCK_K, warps), on the same random bf16 inputs:
- dot: C = A @ B over K (float32 accumulator chained through tl.dot), compared bit for bit with the
  first shape of the list;
- rowsum: sum over N of exp2(C - rowmax(C)) for a 64-column tile, likewise.
Prints the instruction each shape compiled to (wgmma or mma.sync, from the PTX) and SAME/differ.

    python -m bench.mma_bits --out $OUT/mma_bits.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from runtime.kernels.triton import INTERPRETED


@triton.jit
def _dot_kernel(a_ptr, b_ptr, out_ptr, sums_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    # a: [M, K], b: [N, K] (rows along K, as weights and gathered KV rows are), out: [M, N] float32,
    # sums: [M, N / BLOCK_N] float32.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + offs_m[:, None] * K + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + offs_n[None, :] * K + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])
    # The softmax denominator of this tile, as the attention kernel forms it (max exact, sum ordered
    # by the layout).
    p = tl.exp2(acc - tl.max(acc, axis=1)[:, None])
    tl.store(sums_ptr + offs_m * tl.num_programs(1) + pid_n, tl.sum(p, axis=1), mask=m_ok)


SHAPES = [  # (BLOCK_M, BLOCK_N, BLOCK_K, warps); the first is the reference
    (16, 64, 64, 4), (16, 64, 64, 8), (16, 64, 128, 4), (16, 64, 64, 2), (32, 64, 64, 4), (32, 64, 64, 8),
    (64, 64, 64, 4), (64, 64, 64, 8), (64, 64, 128, 4), (128, 64, 64, 8), (64, 128, 64, 4), (128, 128, 64, 8),
]


def run(a: torch.Tensor, b: torch.Tensor, shape: tuple) -> tuple[torch.Tensor, torch.Tensor, str]:
    block_m, block_n, block_k, warps = shape
    M, K = a.shape
    N = b.shape[0]
    out = torch.full((M, N), float("nan"), device=a.device)
    # The row sums are compared per 64-column tile: every shape's BLOCK_N is a multiple of 64.
    sums = torch.full((M, N // block_n), float("nan"), device=a.device)
    compiled = _dot_kernel[(triton.cdiv(M, block_m), N // block_n)](a, b, out, sums, M, N, K, BLOCK_M=block_m,
                                                                    BLOCK_N=block_n, BLOCK_K=block_k,
                                                                    num_warps=warps, num_stages=2)
    ptx = "" if INTERPRETED else compiled.asm.get("ptx", "")
    mma = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "?"
    return out, sums, mma


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16",
                        help="float16 for the CPU interpreter, which computes bf16 dots wrongly")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    device = "cpu" if INTERPRETED else "cuda"
    gen = torch.Generator().manual_seed(0)
    rows = []
    for K in (576, 4096):
        for scale in (1.0, 30.0):  # 30: scores large enough that exp2 and the sums see every bit
            a = (torch.randn(args.rows, K, generator=gen) * scale / K ** 0.5).to(dtype).to(device)
            b = torch.randn(128, K, generator=gen).to(dtype).to(device)
            ref_out, ref_sums, _ = run(a, b, SHAPES[0])
            ref_sums = ref_sums[:, :1]  # the first 64 columns' sums (every shape's first tile holds them
            for shape in SHAPES:        # only where BLOCK_N == 64; wider tiles are compared on the dot alone)
                try:
                    out, sums, mma = run(a, b, shape)
                    row = dict(K=K, scale=scale, shape=shape, mma=mma, dot_same=bool(torch.equal(out, ref_out)),
                               max_dot_diff=float((out - ref_out).abs().max()),
                               rowsum_same=bool(torch.equal(sums[:, :1], ref_sums)) if shape[1] == 64 else None)
                except Exception as err:  # noqa: BLE001 - a shape this chip or interpreter refuses
                    row = dict(K=K, scale=scale, shape=shape, error=f"{type(err).__name__}: {str(err)[:200]}")
                rows.append(row)
    print("== dot and row-sum bits vs BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, 4 warps")
    for r in rows:
        if "error" in r:
            print(f"K={r['K']} x{r['scale']:g} {r['shape']}: {r['error']}")
            continue
        rowsum = "-" if r["rowsum_same"] is None else "SAME" if r["rowsum_same"] else "differ"
        print(f"K={r['K']:<5} x{r['scale']:<3g} (M,N,K,warps)={str(r['shape']):<20} {r['mma']:<8} "
              f"dot {'SAME' if r['dot_same'] else 'differ'} (max diff {r['max_dot_diff']:.3g}) rowsum {rowsum}")
    if args.out:
        args.out.write_text(json.dumps(dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                                            triton=triton.__version__, rows=rows), indent=1))


if __name__ == "__main__":
    main()
