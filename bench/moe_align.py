"""The MoE alignment's two implementations timed at each routed-row count (moe.align_tokens picks one by its threshold,
ALIGN_SORT_KERNEL_MAX_ROWS, or as `path=` says): the one-program register sort and the library sort + scans. Each
point checks that the two build one layout (as tests/kernels/test_moe_align.py does), then times each, and
align_tokens as deployed, as CUDA-graph replays (bench.kernels.graph_us). (A third, a one-program counting kernel,
served up to 256 rows until this bench timed it: runtime/kernels/triton/moe.py keeps its figures.)

    python -m bench.moe_align [--rows 48,96,192,...] [--experts 256] [--top-k 6] [--json OUT]

The decode step runs the alignment once per MoE layer (fused_moe's aligned path: more than moe.PER_ROW_MAX_ROWS routed
rows), so its time at bs 3-42 (17-256 routed rows at top-6) is on every such step's critical path."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.kernels import graph_us
from runtime.kernels.triton import moe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.moe_align", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="18,48,96,192,256,384,768,2048,4096",
                        help="routed rows (tokens x top-k; the register sort holds at most 4,096 in one program)")
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (the timings are CUDA-graph replays)")
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    for rows in (int(r) for r in args.rows.split(",")):
        if not 0 < rows <= 4096:
            parser.error(f"--rows: {rows} is not in 1..4096")
        tokens = -(-rows // args.top_k)
        ids = torch.stack([torch.randperm(args.experts, generator=gen)[:args.top_k] for _ in range(tokens)])
        ids = ids.reshape(-1)[:rows].to(torch.int32).cuda()
        layouts = {path: moe.align_tokens(ids, args.experts, path=path) for path in moe.ALIGN_PATHS}
        first = next(iter(layouts.values()))
        same = all(torch.equal(a, b) for layout in layouts.values() for a, b in zip(layout, first))
        row: dict[str, object] = {"rows": rows, "same_layout": same,
                                  "sort_kernel_max_rows": moe.ALIGN_SORT_KERNEL_MAX_ROWS}
        for path in moe.ALIGN_PATHS:
            run = lambda path=path, ids=ids: moe.align_tokens(ids, args.experts, path=path)  # noqa: E731
            row[f"{path}_us"] = graph_us([run] * 3)
        row["deployed_us"] = graph_us([lambda ids=ids: moe.align_tokens(ids, args.experts)] * 3)
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows_out), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
