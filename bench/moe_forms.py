"""The fused MoE's launch forms beside the deployed table (issue 15: fp8 >= 1.7x bf16 and 85% of the read roofline at
I = 256): the weight tiles by TMA descriptor (the gate/up and down launches' "TMA" knob, moe.weight_boxes) and the down
projection's column walk as one flat loop over (tile, k step) (its "FLAT" knob, with N_TILES column tiles a program).

    python -m bench.moe_forms [--inter 256,512,2048] [--batches 8,32,128] [--json OUT]

bench.kernels' MoE case (E = 256, top-6, D = 4096, the same inputs, CALLS_PER_GRAPH calls a graph replay), bf16 and
fp8, at each shard and batch size: the deployed table's launch, then each form. Each row: time, the read roofline's
share, fp8 over bf16 of the same form, and whether the output has the deployed launch's bits (it must, but for fp8's
64-row tiles: the same values reach the same dot in the same k order).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.kernels import CALLS_PER_GRAPH, _routing, graph_us, measure_ceilings, roofline_us, touched_experts
from runtime.kernels.triton import moe

EXPERTS, TOP_K, HIDDEN = 256, 6, 4096


def variants(config: dict) -> dict[str, dict]:
    """The deployed launch and its forms (the bucket's own "gate_up" / "down" entries kept, the form's knobs set)."""
    gate_up, down = dict(config.get("gate_up", {})), dict(config.get("down", {}))
    forms = {"deployed": config,
             "tma_gate_up": {**config, "gate_up": {**gate_up, "TMA": True}},
             "tma_down": {**config, "down": {**down, "TMA": True}},
             "tma_both": {**config, "gate_up": {**gate_up, "TMA": True}, "down": {**down, "TMA": True}}}
    for block_n, tiles, warps, stages in ((64, 2, 4, 3), (64, 4, 4, 3), (128, 2, 4, 3), (64, 2, 2, 3)):
        forms[f"flat_down_{block_n}x{tiles}_w{warps}s{stages}"] = {**config, "down": dict(
            BLOCK_N=block_n, N_TILES=tiles, FLAT=True, num_warps=warps, num_stages=stages)}
    # Plain down launches the tune does not try (MOE_DOWN_CANDIDATES): 2 warps (ncu on the H100, fp8 I=256 bs 32:
    # the 4-warp launch holds 6 programs an SM, by registers and by shared memory alike, 75% of DRAM bandwidth).
    for block_n, warps, stages in ((64, 2, 3), (64, 2, 4), (128, 2, 3), (64, 4, 4), (128, 4, 4)):
        forms[f"down_{block_n}_w{warps}s{stages}"] = {**config, "down": dict(
            BLOCK_N=block_n, N_TILES=1, num_warps=warps, num_stages=stages)}
    # 64-row tiles: wgmma from 64 rows (moe.py). bf16 keeps its bits (bench.mma_bits); fp8 does not - its 16-row
    # tiles convert each weight to float16 for mma.sync, where wgmma reads the e4m3 tile from shared memory and adds
    # in its own precision - so this row times what an fp8 switch to wgmma would buy, at every bucket or none.
    forms["tiles_64"] = {**config, "BLOCK_M": 64}
    return forms


def bench_shard(inter: int, batches: list[int], ceilings: dict, gen: torch.Generator) -> list[dict]:
    w13 = torch.randn(EXPERTS, 2 * inter, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(EXPERTS, HIDDEN, inter, device="cuda", dtype=torch.bfloat16) * 0.02
    weights = {"bf16": moe.PackedMoE(w13, w2), "fp8_w8a8": moe.quantize_packed(moe.PackedMoE(w13, w2))}
    rows = []
    for batch in batches:
        inputs = [(torch.randn(batch, HIDDEN, generator=gen).to(torch.bfloat16).cuda(),
                   *_routing(gen, batch, EXPERTS, TOP_K)) for _ in range(CALLS_PER_GRAPH)]
        bf16_us: dict[str, float] = {}
        for name, packed in weights.items():
            expert_bytes = 3 * inter * HIDDEN * (1 if packed.fp8 else 2)
            bytes_moved = touched_experts(EXPERTS, TOP_K, batch) * expert_bytes + 2 * batch * HIDDEN * 2
            roof = roofline_us(bytes_moved, 2 * batch * TOP_K * 3 * inter * HIDDEN, ceilings)
            x0, ids0, w0 = inputs[0]
            want = None
            for kind, config in variants(moe.moe_config(EXPERTS, inter, packed.fp8, batch)).items():
                try:
                    got = moe.fused_moe(x0, packed, w0, ids0, config=config).clone()
                except Exception as err:  # noqa: BLE001 - a launch the GPU cannot hold is reported, not fatal
                    print(f"  skip I={inter} bs={batch} {name} {kind}: {err!r}"[:300], flush=True)
                    continue
                want = got if want is None else want
                us = graph_us([lambda x=x, i=i, w=w, c=config: moe.fused_moe(x, packed, w, i, config=c)
                               for x, i, w in inputs])
                if name == "bf16":
                    bf16_us[kind] = us
                row = dict(I=inter, bs=batch, variant=name, kind=kind, us=us, pct_roofline=100 * roof / us,
                           same_bits=bool(torch.equal(got, want)),
                           fp8_over_bf16=bf16_us[kind] / us if name != "bf16" and kind in bf16_us else None,
                           config=config)
                rows.append(row)
                ratio = f"  fp8 {row['fp8_over_bf16']:.2f}x" if row["fp8_over_bf16"] else ""
                print(f"I={inter} bs={batch} {name} {kind}: {us:.1f} us  {row['pct_roofline']:.0f}% roofline"
                      f"{ratio}  same bits {row['same_bits']}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.moe_forms", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inter", default="256,512,2048", help="expert intermediate sizes (shards)")
    parser.add_argument("--batches", default="8,32,128", help="tokens")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (the times are the GPU's)")
    batches = [int(b) for b in args.batches.split(",")]
    if any(b < 1 for b in batches):
        parser.error(f"--batches must be positive token counts, got {args.batches}")
    ceilings = measure_ceilings()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for inter in (int(i) for i in args.inter.split(",")):
        rows += bench_shard(inter, batches, ceilings, gen)
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), ceilings=ceilings, rows=rows),
                                        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
