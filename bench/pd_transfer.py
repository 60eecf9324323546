"""KV transfer time of one prompt's pages through the PD transfer engine (issue 16's target: a
2,048-token prompt on loopback), between two registered pools in two Mooncake engines over TCP.

    python -m bench.pd_transfer --tokens 2048 --shape canary --repeats 5 [--out results.json]

`--shape canary` is the canary model's pool (3 layers, 80 + 32 floats per token, float32);
`--shape dsv4` a DeepSeek-V4-sized one (61 layers, 576 + 128 per token, bfloat16). Pages are drawn
scattered (each page its own run of chunks, the worst case) and contiguous (one run per layer).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

import torch

from canary.provenance import git_commit
from runtime.disagg.transfer import KVTransfer, kv_digest

SHAPES = {"canary": (3, 80, 32, torch.float32), "dsv4": (61, 576, 128, torch.bfloat16)}
PAGE_SIZE = 16


def pool(layers: int, slots: int, latent: int, index: int, dtype: torch.dtype) -> KVTransfer:
    return KVTransfer(torch.randn(layers, slots, latent).to(dtype), torch.randn(layers, slots, index).to(dtype),
                      PAGE_SIZE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="canary")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    layers, latent, index, dtype = SHAPES[args.shape]
    pages = -(-args.tokens // PAGE_SIZE)
    slots = 2 * pages * PAGE_SIZE  # room to scatter
    src, dst = pool(layers, slots, latent, index, dtype), pool(layers, slots, latent, index, dtype)
    rng = random.Random(0)
    rows = {}
    for layout in ("scattered", "contiguous"):
        if layout == "scattered":
            src_pages, dst_pages = rng.sample(range(2 * pages), pages), rng.sample(range(2 * pages), pages)
        else:
            src_pages, dst_pages = list(range(pages)), list(range(pages, 2 * pages))
        times, stats = [], None
        for _ in range(args.repeats):
            stats = src.write_pages(dst.descriptor(), src_pages, dst_pages)
            times.append(stats.seconds)
        assert stats is not None
        same = kv_digest(src.latent, src.index_keys, src_pages, PAGE_SIZE, args.tokens) == kv_digest(
            dst.latent, dst.index_keys, dst_pages, PAGE_SIZE, args.tokens)
        median = statistics.median(times)
        rows[layout] = {"bytes": stats.bytes, "chunks": stats.chunks, "median_ms": round(median * 1e3, 2),
                        "min_ms": round(min(times) * 1e3, 2), "mb_per_s": round(stats.bytes / median / 1e6, 1),
                        "intact": same}
        print(f"{args.shape} {args.tokens} tokens {layout}: {stats.bytes / 1e6:.2f} MB in {stats.chunks} chunks, "
              f"median {median * 1e3:.2f} ms ({stats.bytes / median / 1e6:.0f} MB/s), intact={same}")
    report = {"tokens": args.tokens, "shape": args.shape, "page_size": PAGE_SIZE, "repeats": args.repeats,
              "engine": "mooncake tcp loopback", "commit": git_commit(), "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
