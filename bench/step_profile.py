"""Where a dsv4-slice step's device time goes, kernel by kernel: decode steps at a few batch sizes
and one 4,096-row prefill pass, each run eagerly under torch.profiler (a graph replay runs the same
kernels; eager keeps their names apart). Prints, per pass, the kernels sorted by total CUDA time with
their share, calls and mean time, and writes the same as JSON (--out).

    python -m bench.step_profile --batch-sizes 16,128 --out $OUT/step_profile.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from bench.decode_step import PAGE, PREFILL_ROWS, SLICE, Bench, random_weights, time_ms
from canary.provenance import git_commit
from runtime.graph.runner import FINE_BUCKETS
from runtime.streams.tasks import InOrderExecutor


def kernel_table(fn, inp, iters: int) -> list[dict]:
    for _ in range(2):
        fn(inp)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn(inp)
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals[event.name[:90]]
            entry[0] += event.device_time_total / iters
            entry[1] += 1 / iters
    whole = sum(us for us, _ in totals.values()) or 1.0
    return [{"kernel": name, "us": round(us, 1), "share": round(us / whole, 3), "calls": round(calls, 1)}
            for name, (us, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0])]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="16,128")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    weights = random_weights(SLICE, small=False)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    pages, context = 128, 2048
    bench = Bench(SLICE, weights, pages, max(sizes), FINE_BUCKETS, InOrderExecutor(),
                  {"moe_kernel": "triton", "attention_kernel": "triton"})
    passes = {f"decode_bs{n}": bench.inputs(n, context) for n in sizes}
    passes[f"prefill_{PREFILL_ROWS}"] = bench.prefill(PREFILL_ROWS, min(context, PREFILL_ROWS))
    report: dict[str, Any] = {"commit": git_commit(), "device": torch.cuda.get_device_name(), "page": PAGE,
                              "passes": {}}
    for name, inp in passes.items():
        table = kernel_table(bench.runner.eager, inp, args.iters)
        # The pass's wall time outside the profiler beside its kernels' sum: the difference is the
        # device idling between kernels (host launches, syncs), which a graph replay would not show.
        wall_us = 1e3 * time_ms(bench.runner.eager, inp, iters=args.iters)
        device_us = sum(row["us"] for row in table)
        report["passes"][name] = {"device_us": round(device_us, 1), "eager_wall_us": round(wall_us, 1),
                                  "kernels": table}
        print(f"== {name}: {device_us:.0f} us of kernels per pass, {wall_us:.0f} us eager wall "
              f"({len(table)} distinct kernels)")
        for row in table[:args.top]:
            print(f"  {row['us']:9.1f} us {100 * row['share']:5.1f}%  x{row['calls']:<5} {row['kernel']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
