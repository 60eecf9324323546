"""KV transfer time of one prompt's pages through the PD transfer engine (issue 16's target: a
2,048-token prompt on loopback), between two pools in two Mooncake engines over TCP.

    python -m bench.pd_transfer --tokens 2048 --shape canary --repeats 5 [--device cpu|cuda]
        [--mode direct|staged] [--out results.json]

`--shape canary` is the canary model's pool (3 layers, 80 + 32 floats per token, float32);
`--shape dsv4` a DeepSeek-V4-sized one (61 layers, 576 + 128 per token, bfloat16). Pages are drawn
scattered (each page its own run of chunks, the worst case for `direct`) and contiguous (one run per
layer). `--mode staged` (runtime/disagg/staging.py) also reports its gather (sender pages into its
send slot), write (slot to slot, one engine write) and scatter (receive slot into the receiver's
pages) apart; its total is the three together. `--device cuda` puts both pools on the GPU (staged
only: the engine registers host memory only).
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


def pool(layers: int, slots: int, latent: int, index: int, dtype: torch.dtype, device: str, mode: str) -> KVTransfer:
    return KVTransfer(torch.randn(layers, slots, latent, device=device).to(dtype),
                      torch.randn(layers, slots, index, device=device).to(dtype), PAGE_SIZE, mode=mode)


def ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1e3, 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="canary")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--mode", choices=["direct", "staged"], default="direct")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    layers, latent, index, dtype = SHAPES[args.shape]
    pages = -(-args.tokens // PAGE_SIZE)
    slots = 2 * pages * PAGE_SIZE  # room to scatter
    src, dst = (pool(layers, slots, latent, index, dtype, args.device, args.mode) for _ in range(2))
    rng = random.Random(0)
    rows = {}
    for layout in ("scattered", "contiguous"):
        if layout == "scattered":
            src_pages, dst_pages = rng.sample(range(2 * pages), pages), rng.sample(range(2 * pages), pages)
        else:
            src_pages, dst_pages = list(range(pages)), list(range(pages, 2 * pages))
        totals, gathers, writes, scatters, stats = [], [], [], [], None
        # The receive slot, as the decode side reserves one per request (the arena holds the pool's KV)
        staging = dst.staging  # None in direct mode
        offset = staging.allocate(dst.staged_bytes(pages)) if staging else None
        for _ in range(args.repeats):
            stats = src.write_pages(dst.descriptor(), src_pages, dst_pages, staging_offset=offset)
            scatter = dst.receive_staged(offset, dst_pages) if offset is not None else 0.0
            totals.append(stats.seconds + scatter)
            gathers.append(stats.gather_seconds)
            writes.append(stats.seconds - stats.gather_seconds)
            scatters.append(scatter)
        assert stats is not None
        if staging is not None and offset is not None:
            staging.free(offset)
        same = kv_digest(src.latent, src.index_keys, src_pages, PAGE_SIZE, args.tokens) == kv_digest(
            dst.latent, dst.index_keys, dst_pages, PAGE_SIZE, args.tokens)
        median = statistics.median(totals)
        rows[layout] = {"bytes": stats.bytes, "chunks": stats.chunks, "median_ms": ms(totals),
                        "min_ms": round(min(totals) * 1e3, 2), "mb_per_s": round(stats.bytes / median / 1e6, 1),
                        "gather_ms": ms(gathers), "write_ms": ms(writes), "scatter_ms": ms(scatters),
                        "intact": same}
        split = (f" = gather {ms(gathers)} + write {ms(writes)} + scatter {ms(scatters)} ms"
                 if args.mode == "staged" else "")
        print(f"{args.shape} {args.tokens} tokens {args.device} {args.mode} {layout}: {stats.bytes / 1e6:.2f} MB in "
              f"{stats.chunks} chunks, median {median * 1e3:.2f} ms ({stats.bytes / median / 1e6:.0f} MB/s){split}, "
              f"intact={same}", flush=True)
    report = {"tokens": args.tokens, "shape": args.shape, "page_size": PAGE_SIZE, "repeats": args.repeats,
              "device": args.device, "mode": args.mode, "engine": "mooncake tcp loopback", "commit": git_commit(),
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
