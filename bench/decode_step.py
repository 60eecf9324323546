"""Decode step time vs batch size for eager, graph, and graph + multi-stream; fits a + b*bs.

Models: `canary` (the tiny-random dsv4-mini shape) and `dsv4-slice` (2 layers at DSV4-Flash-like
dims, random weights; see SLICE). Also the bucket sawtooth: graph step time over consecutive batch
sizes with fine vs coarse buckets. Prints one JSON line per measurement and a summary JSON at the
end (written to --out). Times are CUDA-event means over --iters replays after warm-up.

    python -m bench.decode_step --model canary --out $OUT/decode_canary.json
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from canary.provenance import git_commit
from runtime.config import EngineConfig, ModelConfig
from runtime.graph.decode_model import DecodeInputs, StaticDecodeModel
from runtime.graph.runner import COARSE_BUCKETS, FINE_BUCKETS, GraphRunner
from runtime.kvcache.kv_cache import KVCache
from runtime.models.weights import init_random, weight_shapes
from runtime.streams.cuda import CudaStreamExecutor
from runtime.streams.tasks import InOrderExecutor

PAGE = 16
# DSV4-Flash-like per-layer dims (hidden 4096, latent 512 + rope 64, 64 heads, indexer 64 x 128,
# window 128 + top-512, 256 experts top-6 with a TP8-sized expert shard I=256); vocab cut to 4096.
SLICE = ModelConfig(vocab_size=4096, hidden_size=4096, num_layers=2, num_heads=64, kv_latent_dim=512,
                    rope_dim=64, index_heads=64, index_dim=128, index_topk=512, sliding_window=128,
                    n_routed_experts=256, num_experts_per_tok=6, n_shared_experts=1, moe_intermediate_size=256,
                    n_group=8, topk_group=4, bos_token_id=1, eos_token_id=2, pad_token_id=3)


def random_weights(cfg: ModelConfig, small: bool) -> dict[str, torch.Tensor]:
    if small:
        return {k: v.to("cuda", torch.bfloat16) for k, v in init_random(cfg, seed=0).items()}
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for name, shape in weight_shapes(cfg).items():
        t = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        out[name] = 1 + 0.1 * t if name.endswith("norm.weight") else t * (shape[-1] ** -0.5)
    return out


class Bench:
    def __init__(self, cfg: ModelConfig, weights, pages_per_request: int, max_batch: int, buckets, streams):
        self.scratch = max_batch * pages_per_request
        ecfg = EngineConfig(page_size=PAGE, num_pages=self.scratch + 1, device="cuda", dtype="bfloat16")
        self.kv = KVCache(cfg, ecfg, torch.bfloat16)
        self.kv.latent.normal_()
        self.kv.index_keys.normal_()
        self.pages = pages_per_request
        self.model = StaticDecodeModel(cfg, weights, page_size=PAGE, max_pages=pages_per_request,
                                       max_batch=max_batch)
        self.runner = GraphRunner(self.model, self.kv, streams, buckets=buckets, scratch_page=self.scratch)

    def inputs(self, n: int, context: int) -> DecodeInputs:
        rng = random.Random(n)
        pos = torch.tensor([rng.randint(context // 2, context - 1) for _ in range(n)], device="cuda")
        table = (torch.arange(n)[:, None] * self.pages + torch.arange(self.pages)).cuda()
        slots = table.gather(1, (pos // PAGE)[:, None])[:, 0] * PAGE + pos % PAGE
        return DecodeInputs(torch.zeros(n, dtype=torch.long, device="cuda"), pos, slots, table)

    def time(self, fn, inp: DecodeInputs, iters: int) -> float:
        for _ in range(3):
            fn(inp)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn(inp)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters


def fit(points: list[tuple[int, float]]) -> dict:
    bs = torch.tensor([p[0] for p in points], dtype=torch.float64)
    ms = torch.tensor([p[1] for p in points], dtype=torch.float64)
    design = torch.stack([torch.ones_like(bs), bs], 1)
    a, b = torch.linalg.lstsq(design, ms[:, None]).solution[:, 0].tolist()
    return {"a_ms": a, "b_ms_per_req": b}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["canary", "dsv4-slice"], default="canary")
    ap.add_argument("--batch-sizes", default="1,8,16,32,48,64,96,128")
    ap.add_argument("--sawtooth", default="", help="batch sizes for the fine vs coarse bucket sweep")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    small = args.model == "canary"
    cfg = ModelConfig() if small else SLICE
    weights = random_weights(cfg, small)
    pages, context = (24, 320) if small else (128, 2048)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    max_batch = max(sizes)
    results: dict = {"model": args.model, "device": torch.cuda.get_device_name(), "commit": git_commit(),
                     "torch": torch.__version__, "context": context, "modes": {}}
    for mode, streams in (("eager", InOrderExecutor()), ("graph", InOrderExecutor()),
                          ("graph+multistream", CudaStreamExecutor())):
        bench = Bench(cfg, weights, pages, max_batch, FINE_BUCKETS, streams)
        if mode != "eager":
            bench.runner.capture()
        fn = bench.runner.eager if mode == "eager" else bench.runner.forward
        points = [(n, bench.time(fn, bench.inputs(n, context), args.iters)) for n in sizes]
        for n, ms in points:
            print(json.dumps({"model": args.model, "mode": mode, "bs": n, "ms": round(ms, 4)}), flush=True)
        results["modes"][mode] = {"points": points, **fit(points)}
        del bench
        torch.cuda.empty_cache()
    if args.sawtooth:
        saw = [int(s) for s in args.sawtooth.split(",")]
        for name, buckets in (("fine", FINE_BUCKETS), ("coarse", COARSE_BUCKETS)):
            bench = Bench(cfg, weights, pages, max(saw), buckets, CudaStreamExecutor())
            bench.runner.capture()
            points = [(n, bench.time(bench.runner.forward, bench.inputs(n, context), args.iters)) for n in saw]
            results[f"sawtooth_{name}"] = points
            print(json.dumps({"model": args.model, "sawtooth": name, "points": points}), flush=True)
            del bench
            torch.cuda.empty_cache()
    eager_a, graph_a = results["modes"]["eager"]["a_ms"], results["modes"]["graph"]["a_ms"]
    results["graph_a_over_eager_a"] = graph_a / eager_a
    print(json.dumps({"summary": {m: {k: v for k, v in r.items() if k != "points"}
                                  for m, r in results["modes"].items()},
                      "graph_a_over_eager_a": results["graph_a_over_eager_a"]}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
