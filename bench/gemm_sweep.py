"""Launch configs of the batch-invariant GEMM (kernels/triton/matmul.py) on the dsv4-slice decode
projections, measured on the GPU: per weight shape (N, K) and row count, the device time and read
bandwidth of each candidate tile (BLOCK_M/N/K, warps, stages; for prefill-sized row counts, e.g.
`--rows 4096`, also whether the splits are added in the tile's program), and whether its output is
bit for bit the default config's (a row's reduction order kept, so it may replace the default without a
numerics change). Split-K variants are timed too; they change the bits by design (a split is fixed
per shape, so choosing another is a numerics change, not an invariance break). Prefill row counts
also time the persistent TMA kernel (`tma`), whose bits must equal the default's.

Each candidate runs as a CUDA graph over enough copies of the weight to miss L2 (a decode step
streams every weight once), so host launch cost is not timed.

    python -m bench.gemm_sweep --budget-s 200 --out $OUT/gemm_sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from typing import Any

import torch

from bench.decode_step import SLICE
from canary.provenance import git_commit
from runtime.kernels.triton import matmul as mm

L2_MISS_BYTES = 256 * 1024**2  # several times the H200's 50 MB L2


def decode_shapes(cfg) -> dict[str, tuple[int, int]]:
    heads, qk = cfg.num_heads, cfg.kv_latent_dim + cfg.rope_dim
    index = cfg.index_heads * cfg.index_dim + cfg.index_dim + cfg.index_heads
    return {"attn_q_kv": (heads * qk + qk, cfg.hidden_size), "attn_out": (cfg.hidden_size, heads * cfg.kv_latent_dim),
            "lm_head": (cfg.vocab_size, cfg.hidden_size), "indexer_q_k_w": (index, cfg.hidden_size),
            "router": (cfg.n_routed_experts, cfg.hidden_size)}


def prefill_candidates():
    """Prefill-sized passes: 128-row tiles, the splits added apart (partials + `_split_sum_kernel`)
    or in the tile's program (`fused_splits`, two accumulators: 128 x 256 may spill)."""
    for bn, stages, fused in itertools.product((128, 256), (3, 4), (False, True)):
        yield {"BLOCK_M": 128, "BLOCK_N": bn, "num_warps": 8, "num_stages": stages}, fused


def tma_candidates():
    """The persistent TMA kernel (matmul.PREFILL_TMA), splits apart (partials + `_split_sum_kernel`):
    its tiles, stages and whether the tile loop is flattened (the next tile's loads pipelined under
    this one's store)."""
    for (bn, stages), flatten in itertools.product(((256, 3), (256, 4), (128, 4), (128, 5)), (True, False)):
        yield {"BLOCK_M": 128, "BLOCK_N": bn, "num_warps": 8, "num_stages": stages, "flatten": flatten}


def candidates(rows: int):
    for bm, bn, bk, warps, stages in itertools.product((64, 128) if rows > 64 else (64,), (64, 128, 256), (64, 128),
                                                       (4, 8), (3, 4, 5)):
        if (bm * bk + bn * bk) * 2 * stages > 200 * 1024 or (warps == 8 and bn < 128):
            continue
        yield {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}, bk


def graph_us(fn, copies: int, reps: int = 20) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):  # compile and warm outside the capture
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps / copies


def sweep_shape(name: str, n: int, k: int, rows: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight_bytes = n * k * 2
    copies = max(2, min(64, -(-L2_MISS_BYTES // weight_bytes)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k ** -0.5
               for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    outs = [torch.empty(rows, n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    default = mm.matmul(x, weights[0])
    split = mm.split_for(n, k)

    def measure(label: str, **kw) -> dict:
        try:
            us = graph_us(lambda i: mm.matmul(x, weights[i], out=outs[i], **kw), copies)
        except Exception as e:  # a config the compiler rejects (shared memory, registers)
            return {"config": label, "error": repr(e)[:200]}
        same = bool(torch.equal(mm.matmul(x, weights[0], **kw), default))
        return {"config": label, "us": round(us, 2), "tb_s": round(weight_bytes / us / 1e6, 3),
                "tflop_s": round(2 * rows * n * k / us / 1e6, 1), "same_bits": same}

    results = [measure("default")]
    if rows > mm.PREFILL_ROWS:  # the split is the deployment's: only tiles and where splits are added vary
        for config, fused in prefill_candidates():
            if fused and split == 1:
                continue
            results.append(measure(json.dumps({**config, "fused_splits": fused}), config=config, fused_splits=fused))
        for config in tma_candidates():
            results.append(measure(json.dumps({**config, "tma": True}), config=config, fused_splits=False, tma=True))
        for stages in (3, 4, 5) if split > 1 else ():  # the TMA kernel walking each tile's splits (FUSED_TMA)
            config = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": stages}
            results.append(measure(json.dumps({**config, "tma": True, "fused_splits": True}), config=config,
                                   fused_splits=True, tma=True))
    else:
        for config, bk in candidates(rows):
            results.append(measure(json.dumps({**config, "BLOCK_K": bk}), config=config, block_k=bk))
        for other in sorted({1, 2, 4, 8, 16, 32} - {split}):
            if k // other >= 2 * mm.BLOCK_K:
                results.append(measure(f"split_k={other}", split_k=other))
    ok = [r for r in results if "us" in r]
    best_same = min((r for r in ok if r["same_bits"]), key=lambda r: r["us"])
    best_any = min(ok, key=lambda r: r["us"])
    summary = {"shape": name, "n": n, "k": k, "rows": rows, "default_split": split, "default": results[0],
               "best_same_bits": best_same, "best_any": best_any, "all": results}
    print(json.dumps({key: v for key, v in summary.items() if key != "all"}), flush=True)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="16,128")
    ap.add_argument("--budget-s", type=float, default=0, help="stop starting new shapes after this long (0: no limit)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    report: dict[str, Any] = {"commit": git_commit(), "device": torch.cuda.get_device_name(), "shapes": []}
    start = time.monotonic()
    # Biggest weights first: they decide most of a step's GEMM time.
    for name, (n, k) in decode_shapes(SLICE).items():
        for rows in (int(r) for r in args.rows.split(",")):
            if args.budget_s and time.monotonic() - start > args.budget_s:
                print(f"budget spent: skipping {name} rows={rows}", flush=True)
                continue
            report["shapes"].append(sweep_shape(name, n, k, rows))
            if args.out:  # after every shape, so a cut-off run keeps what it measured
                with open(args.out, "w") as f:
                    json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
