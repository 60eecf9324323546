"""The page-tile indexer (runtime/kernels/triton/indexer_pages.py) beside the pointer kernel (issue 15).

    python -m bench.indexer_pages --json OUT.json [--batches 64,16,1]

bench.kernels' indexer case (64K positions a row over shuffled pages of 64, fp8 keys with their scale, then
bf16 keys), each kernel timed as a CUDA-graph replay, at each batch size:
- `pointer_us` / `pages_us`: the deployed pointer kernel and the page kernel at its defaults, and whether the
  page kernel gives the pointer kernel's bits (`same_bits`), with the read roofline's share of each;
- at the first batch size, each of indexer_pages.LAUNCH_VARIANTS (time and same bits), and logits + the
  selection (top-512 after a 128-position window, the selection's defaults) with either kernel: issue 15's
  figure, whose target is 200 us at B=64 on the H200.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

from bench.kernels import SELECT_WINDOW, _indexer_case, graph_us, measure_ceilings, roofline_us, stop_on_sigterm
from runtime.kernels.triton import indexer, indexer_pages
from runtime.kernels.triton import topk as triton_topk

PAGE_SIZE, TOPK, CONTEXT = 64, 512, 65536


def bench_batch(batch: int, case, ceilings: dict, variants: bool, page_size: int = PAGE_SIZE) -> list[dict]:
    """One row per key dtype at `batch` rows (the first `batch` of the case's, bench.kernels._indexer_case's form)."""
    page_table, lens, positions, w, key_variants = case
    table, lens, positions, w = (t[:batch].contiguous() for t in (page_table, lens, positions, w))
    context = table.shape[1] * page_size
    rows = []
    for name, q, keys, scale, key_bytes in key_variants:
        q = q[:batch].contiguous()
        assert indexer_pages.fits(keys, scale, page_size), "the bench's caches must fit the page kernel"
        pointer = lambda: indexer.indexer_logits(q, w, keys, table, lens, page_size, key_scale=scale,  # noqa: E731
                                                 page_tma=False)
        out = torch.empty(batch, context, device=q.device)

        def pages(**knobs) -> torch.Tensor:  # the page kernel with page_logits' tiles / launch / scale_ahead
            indexer_pages.page_logits(q, w, keys, table, lens, page_size, out, scale,
                                      indexer.key_block(q.shape[2], q.dtype),
                                      knobs.pop("tiles", None) or indexer.page_tiles(batch, context), **knobs)
            return out

        want = pointer().clone()
        out.fill_(float("nan"))
        same = torch.equal(pages(), want)
        roof = roofline_us(batch * context * (key_bytes + 4), 2 * batch * q.shape[1] * q.shape[2] * context, ceilings)
        row: dict[str, Any] = dict(kernel="indexer_pages", keys=name, B=batch, context=context,
                                   pointer_us=graph_us([pointer] * 3), pages_us=graph_us([pages] * 3), same_bits=same,
                                   roofline_us=roof,
                                   defaults=dict(indexer_pages.LAUNCH, tiles=indexer.page_tiles(batch, context),
                                                 scale_ahead=indexer_pages.SCALE_AHEAD))
        row["pct_roofline_pointer"] = 100 * roof / row["pointer_us"]
        row["pct_roofline_pages"] = 100 * roof / row["pages_us"]
        if variants:
            row["launches"] = _launches(pages, want)
            select = lambda logits: triton_topk.select_slots(logits, positions, SELECT_WINDOW, TOPK)  # noqa: E731
            row["plus_select_pointer_us"] = graph_us([lambda: select(pointer())] * 3)
            row["plus_select_pages_us"] = graph_us([lambda: select(pages())] * 3)
            row["plus_select_same"] = all(torch.equal(a, b) for a, b in zip(select(pointer()), select(pages())))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _launches(pages, want: torch.Tensor) -> dict:
    """Each of LAUNCH_VARIANTS: time and same bits, or why the chip could not run it."""
    timed: dict[str, dict[str, Any]] = {}
    for name, knobs in indexer_pages.LAUNCH_VARIANTS.items():
        try:
            same = torch.equal(pages(**knobs), want)
            timed[name] = dict(us=graph_us([lambda knobs=knobs: pages(**knobs)] * 3), same_bits=same)
        except Exception as err:  # noqa: BLE001 - shared memory or registers a launch cannot have
            timed[name] = dict(error=f"{type(err).__name__}: {str(err)[:200]}")
    return timed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.indexer_pages", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--batches", default="64,16,1", help="rows a call (at most 64); the first gets the variants")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if not batches or not all(1 <= b <= 64 for b in batches):
        parser.error(f"--batches must be 1..64 each, got {args.batches}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (TMA copies; run it on the device machine)")
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    ceilings = measure_ceilings()
    rows: list[dict] = []
    try:
        case = _indexer_case(context=CONTEXT, page_size=PAGE_SIZE)
        for i, batch in enumerate(batches):
            rows += bench_batch(batch, case, ceilings, variants=i == 0)
    finally:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, commit=os.environ.get("COMMIT"),
                    command="python -m bench.indexer_pages " + " ".join(sys.argv[1:] if argv is None else argv),
                    ceilings=ceilings)
        args.json.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
