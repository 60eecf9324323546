"""Taller MoE tiles: same bits, less weight traffic? (issue 14's prefill target)

The fused MoE reads an expert's weights once per BLOCK_M-row tile of its rows. BLOCK_M is 16
(decode has ~3 rows per expert at bs 128), so a 4,096-token prefill chunk (~96 rows per expert at
E=256, top-6) reads every expert 6-7 times. A taller tile would read it once or twice, but it also
switches the tensor-core instruction (mma.sync below 64 rows, wgmma from 64): it may follow the
batch only if a row's bits stay the same. This measures both, on the dsv4-slice's MoE shape
(E=256, top-6, H=4096, I=256, shared expert), bf16, CUDA-graph replay:

    python -m bench.moe_tiles --out $OUT/moe_tiles.json

Prints per token count and BLOCK_M: SAME/differ against BLOCK_M=16, and us per call.
`--prefill-sweep` instead times a 4,096-token chunk over the knobs that leave bits alone (BLOCK_M,
BLOCK_N, warps, stages), each checked SAME against the deployment's bucket:

    python -m bench.moe_tiles --prefill-sweep --out $OUT/moe_prefill.json

`--launch-sweep` keeps the deployment's bucket and sweeps, at 4,096 tokens, the down projection's own
launch (`moe.down_launch`: BLOCK_N, column tiles per program, warps, stages) and the gate/up launch
with its splits added in the tile's program (`moe.gate_up_launch`), each checked the same way:

    python -m bench.moe_tiles --launch-sweep --out $OUT/moe_launch.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from bench.kernels import CALLS_PER_GRAPH, _routing, graph_us
from runtime.kernels.triton import moe

EXPERTS, TOP_K, HIDDEN, INTER = 256, 6, 4096, 256
TOKENS = (16, 64, 128, 1024, 4096)
BLOCK_MS = (16, 32, 64, 128)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--prefill-sweep", action="store_true",
                        help="4,096 tokens over BLOCK_M x BLOCK_N x warps x stages instead of BLOCK_M alone")
    parser.add_argument("--launch-sweep", action="store_true",
                        help="the bucket (4,096 tokens unless --tokens) over the down projection's and the fused "
                             "gate/up launches")
    parser.add_argument("--tokens", default="4096",
                        help="comma-separated token counts for --prefill-sweep / --launch-sweep (each its bucket)")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) * 0.02
    shared13 = torch.randn(1, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    shared2 = torch.randn(1, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) * 0.02
    packed = moe.PackedMoE(w13, w2, shared13, shared2)
    rows = []
    sweep_tokens = tuple(int(t) for t in args.tokens.split(","))
    for tokens in sweep_tokens if args.prefill_sweep or args.launch_sweep else TOKENS:
        inputs = [(torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16).cuda(),
                   *_routing(gen, tokens, EXPERTS, TOP_K)) for _ in range(CALLS_PER_GRAPH)]
        base = moe.moe_config(EXPERTS, INTER, False, tokens)
        x0, ids0, w0 = inputs[0]
        want = moe.fused_moe(x0, packed, w0, ids0, config=base)
        if args.prefill_sweep:  # the deployment's bucket first, then every candidate against it
            configs = [base] + [{"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": st}
                                for bm, bn, (w, st) in itertools.product((64, 128), (32, 64, 128),
                                                                         ((4, 2), (4, 3), (8, 2), (8, 3)))]
        elif args.launch_sweep:  # the bucket as deployed, then other down launches, then fused gate/up ones
            configs = [base] + [{**base, "down": {"BLOCK_N": bn, "N_TILES": nt, "num_warps": w, "num_stages": st}}
                                for bn, nt, (w, st) in itertools.product((128, 256), (1, 4, 16),
                                                                         ((4, 3), (8, 2), (8, 4)))]
            configs += [{**base, "gate_up": {"FUSED_SPLITS": True, "BLOCK_N": bn, "num_warps": w, "num_stages": st}}
                        for bn, (w, st) in itertools.product((32, 64), ((4, 2), (4, 3), (8, 2), (8, 3)))]
        else:
            configs = [{**base, "BLOCK_M": block_m} for block_m in BLOCK_MS]
        for config in configs:
            block_m = config.get("BLOCK_M", moe.BLOCK_M)
            row = dict(tokens=tokens, block_m=block_m, config=config)
            try:
                row["same_bits"] = bool(torch.equal(moe.fused_moe(x0, packed, w0, ids0, config=config), want))
                row["us"] = graph_us([lambda x=x, i=i, w=w: moe.fused_moe(x, packed, w, i, config=config)
                                      for x, i, w in inputs], reps=8)
            except Exception as err:  # noqa: BLE001 - a tile the chip cannot hold
                row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
    print("== fused MoE (E=256 top-6 H=4096 I=256 + shared), bf16: BLOCK_M vs 16, us per call")
    for r in rows:
        verdict = r.get("error") or f"{'SAME' if r['same_bits'] else 'differ'} {r['us']:8.1f} us"
        print(f"tokens {r['tokens']:>5} {json.dumps(r['config'])}: {verdict}")
    if args.out:
        args.out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
