"""Where the indexer logits' time goes (issue 15 item 4): the deployed kernel's work taken apart.

The logits kernel (runtime/kernels/triton/indexer.py) reads 64 x 64K fp8 keys at ~73% of the HBM read
ceiling, and no launch (block, blocks a program, warps, stages) moved it. This times the same loop with
one piece of work changed at a time, on the same inputs and under CUDA-graph replay, so the piece that
costs the missing ~25% shows itself:
  deployed   the kernel itself (indexer_logits)
  copy       this file's kernel with every piece on: should time as `deployed`
  rows       keys read as consecutive slots, no page table (is the gather through pages the cost?)
  no_scale   the per-slot key scale not read
  no_mma     the keys summed over their dimension instead of multiplied by q (is the MMA or its
             epilogue the cost?)
  no_head    the head sum of relu(scores) * w replaced by one head's score
  read_only  only the keys' loads and a sum of them (the bandwidth this loop's loads alone reach)
Numbers only: the variants compute other things than logits.

  python -m bench.indexer_anatomy --out anatomy.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from bench.kernels import graph_us, measure_ceilings
from runtime.kernels.triton import elementwise, indexer

VARIANTS = {  # name: (PAGED, SCALE, MMA, HEAD_SUM)
    "copy": (True, True, True, True),
    "rows": (False, True, True, True),
    "no_scale": (True, False, True, True),
    "no_mma": (True, True, False, True),
    "no_head": (True, True, True, False),
    "read_only": (False, False, False, False),
}


@triton.jit
def _anatomy_kernel(q_ptr, w_ptr, key_ptr, key_scale_ptr, table_ptr, out_ptr, dim, page_size, width,
                    stride_qt, stride_qh, stride_key, stride_table, stride_out,
                    PAGED: tl.constexpr, SCALE: tl.constexpr, MMA: tl.constexpr, HEAD_SUM: tl.constexpr,
                    BLOCKS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    query = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    q_t = tl.trans(tl.load(q_ptr + query * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]))
    w = tl.load(w_ptr + query * BLOCK_H + offs_h)
    first = tl.program_id(1) * BLOCKS * BLOCK_L
    for block in range(0, BLOCKS):
        offs_l = first + block * BLOCK_L + tl.arange(0, BLOCK_L)
        if PAGED:
            page = tl.load(table_ptr + query * stride_table + offs_l // page_size).to(tl.int64)
            slot = page * page_size + offs_l % page_size
        else:
            slot = query * width + offs_l
        if SCALE:  # ahead of the keys and the MMA, as the deployed kernel loads it (indexer.EARLY_SCALE)
            key_scale = tl.load(key_scale_ptr + slot)
        keys = tl.load(key_ptr + slot[:, None] * stride_key + offs_d[None, :], mask=offs_d[None, :] < dim,
                       other=0.0)
        if MMA:
            scores = tl.maximum(tl.dot(keys, q_t), 0.0)
            if HEAD_SUM:
                logits = tl.sum(scores * w[None, :], axis=1)
            else:
                logits = tl.sum(tl.where(offs_h[None, :] == 0, scores, 0.0), axis=1)
        else:
            logits = tl.sum(keys.to(tl.float32), axis=1)
        if SCALE:
            logits = logits * key_scale
        tl.store(out_ptr + query * stride_out + offs_l, logits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    batch, heads, dim, context, page_size = 64, 64, 128, 65536, 64  # bench.kernels' indexer shape
    gen = torch.Generator().manual_seed(2)
    pages = context // page_size
    table = torch.stack([torch.randperm(pages * batch, generator=gen)[:pages] for _ in range(batch)])
    table = table.to(torch.int32).cuda()
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    keys, scale = elementwise.quantize_groups(torch.randn(pages * batch * page_size, dim, device="cuda",
                                                          dtype=torch.bfloat16))
    scale = scale[:, 0].contiguous()
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    w = torch.rand(batch, heads, device="cuda")
    out = torch.empty(batch, context, device="cuda")
    block_l = 128
    blocks = indexer.blocks_per_program(batch, context, block_l)
    ceilings = measure_ceilings()
    read_bytes = batch * context * (dim + 4 + 4)  # keys, their scales, the logits written
    results = {"shape": dict(batch=batch, heads=heads, dim=dim, context=context, page_size=page_size, blocks=blocks),
               "read_bytes_per_s": ceilings["read_bytes_per_s"], "us": {}}

    def deployed():
        indexer.indexer_logits(q, w, keys, table, lens, page_size, key_scale=scale, out=out)

    def variant(flags):
        paged, with_scale, mma, head_sum = flags
        return lambda: _anatomy_kernel[(batch, triton.cdiv(context, block_l * blocks))](
            q, w, keys, scale, table, out, dim, page_size, context, q.stride(0), q.stride(1), keys.stride(0),
            table.stride(0), out.stride(0), PAGED=paged, SCALE=with_scale, MMA=mma, HEAD_SUM=head_sum,
            BLOCKS=blocks, BLOCK_H=heads, BLOCK_D=dim, BLOCK_L=block_l, num_warps=4, num_stages=3)

    for name, fn in [("deployed", deployed)] + [(name, variant(flags)) for name, flags in VARIANTS.items()]:
        us = graph_us([fn] * 3)
        results["us"][name] = us
        pct = 100 * read_bytes / (us * 1e-6) / ceilings["read_bytes_per_s"]
        print(json.dumps({"variant": name, "us": round(us, 1), "pct_of_read_ceiling": round(pct, 1)}), flush=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
