"""The fused MoE taken apart: each launch's GPU time per call (x quantize, alignment, gate/up, act, down, combine), bf16
and fp8, at the deployed tables, so a launch that takes more than its share shows by name (the thirty-second session
found the alignment's counting kernel this way: 31 of 196 us at bs 32, fp8 I=256, on the H100).

    python -m bench.moe_anatomy [--inter 256,512] [--batches 8,32,128] [--calls 20] [--json OUT]

bench.step_profile's `kernel_table` (torch.profiler over `--calls` eager calls after a warm-up; each kernel's device
time per call, largest first). Eager launches, not a graph replay: the per-kernel times are the same, the gaps between
them are not measured (bench.kernels times the whole under a graph)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.kernels import _routing
from bench.step_profile import kernel_table
from runtime.kernels.triton import moe

EXPERTS, TOP_K, HIDDEN = 256, 6, 4096


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.moe_anatomy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inter", default="256,512", help="expert intermediate sizes (shards)")
    parser.add_argument("--batches", default="8,32,128", help="tokens")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (the times are the GPU's)")
    if args.calls < 1:
        parser.error(f"--calls must be at least 1, got {args.calls}")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for inter in (int(i) for i in args.inter.split(",")):
        w13 = torch.randn(EXPERTS, 2 * inter, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
        w2 = torch.randn(EXPERTS, HIDDEN, inter, device="cuda", dtype=torch.bfloat16) * 0.02
        variants = {"bf16": moe.PackedMoE(w13, w2), "fp8_w8a8": moe.quantize_packed(moe.PackedMoE(w13, w2))}
        for batch in (int(b) for b in args.batches.split(",")):
            x = torch.randn(batch, HIDDEN, generator=gen).to(torch.bfloat16).cuda()
            ids, weights = _routing(gen, batch, EXPERTS, TOP_K)
            for name, packed in variants.items():
                kernels = kernel_table(lambda _, packed=packed: moe.fused_moe(x, packed, weights, ids), None,
                                       args.calls)
                row = dict(I=inter, bs=batch, variant=name, total_us=sum(k["us"] for k in kernels), kernels=kernels,
                           config=moe.moe_config(EXPERTS, inter, packed.fp8, batch))
                rows.append(row)
                print(f"I={inter} bs={batch} {name}: {row['total_us']:.1f} us  "
                      + "  ".join(f"{k['kernel'].split('(')[0]} {k['us']:.1f}" for k in kernels), flush=True)
        del variants, w13, w2
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
