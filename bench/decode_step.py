"""Decode step time vs batch size, as % of the step's HBM roofline; a 4,096-row prefill pass as % of
the bf16 matmul roofline; what batch invariance costs; the graph's fixed term.

Models: `canary` (the tiny-random dsv4-mini shape) and `dsv4-slice` (2 layers at DSV4-Flash-like
dims, random weights; see SLICE). Modes: eager, graph, graph + multi-stream (the served config), and
graph + multi-stream with cuBLAS projections (`gemm=cublas`: the same step without the invariance
rule, since cuBLAS picks its kernel by batch size). Also the bucket sawtooth (fine vs coarse buckets).

Roofline = max(bytes / read bandwidth, FLOPs / bf16 matmul rate), both measured in this run: bytes =
every non-expert weight + the routed experts the batch touches (E * (1 - (1 - K/E)^bs) per layer) +
the shared expert + the KV rows read (selected latent rows, indexer keys up to each position).
Prints one JSON line per measurement and a summary JSON (also written to --out). Times are
CUDA-event means over --iters runs after warm-up.

    python -m bench.decode_step --model dsv4-slice --out $OUT/decode_slice.json [--prefill-variants]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections.abc import Callable

import torch

from canary.provenance import git_commit
from runtime.config import EngineConfig, ModelConfig
from runtime.graph.decode_model import DecodeInputs, StaticDecodeModel
from runtime.graph.runner import COARSE_BUCKETS, FINE_BUCKETS, GraphRunner
from runtime.kernels.triton import attention, matmul, moe
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
PREFILL_ROWS = 4096


def random_weights(cfg: ModelConfig, small: bool) -> dict[str, torch.Tensor]:
    if small:
        return {k: v.to("cuda", torch.bfloat16) for k, v in init_random(cfg, seed=0).items()}
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for name, shape in weight_shapes(cfg).items():
        t = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        out[name] = 1 + 0.1 * t if name.endswith("norm.weight") else t * (shape[-1] ** -0.5)
    return out


def decode_positions(n: int, context: int) -> torch.Tensor:
    """One decode row for each of n requests, at random positions in the second half of `context`."""
    rng = random.Random(n)
    return torch.tensor([rng.randint(context // 2, context - 1) for _ in range(n)])


def roofline_only(cfg: ModelConfig, sizes: list[int], context: int, read_tb_s: float) -> dict:
    """The step's HBM roofline per batch size and the straight line through it, from the shapes alone
    (no GPU): its intercept is the fixed term a graph step at 100% of roofline would still show, so
    `graph a / eager a` cannot go below roofline a / eager a."""
    weights = {n: torch.empty(shape, dtype=torch.bfloat16, device="meta") for n, shape in weight_shapes(cfg).items()}
    points = []
    for n in sizes:
        pos = decode_positions(n, context)
        points.append((n, step_bytes(cfg, weights, DecodeInputs(pos, pos, pos, pos)) / (read_tb_s * 1e9)))
    return {"read_tb_s": read_tb_s, "roofline_ms": points, **fit(points)}


class Bench:
    def __init__(self, cfg: ModelConfig, weights, pages_per_request: int, max_batch: int, buckets, streams,
                 kernels: dict):
        self.requests = max_batch
        self.vocab_size = cfg.vocab_size
        self.scratch = max_batch * pages_per_request
        ecfg = EngineConfig(page_size=PAGE, num_pages=self.scratch + 1, device="cuda", dtype="bfloat16")
        self.kv = KVCache(cfg, ecfg, torch.bfloat16)
        self.kv.latent.normal_()
        self.kv.index_keys.normal_()
        self.pages = pages_per_request
        self.model = StaticDecodeModel(cfg, weights, page_size=PAGE, max_pages=pages_per_request,
                                       max_batch=max(max_batch, PREFILL_ROWS), **kernels)
        self.runner = GraphRunner(self.model, self.kv, streams, buckets=buckets, scratch_page=self.scratch)

    def inputs(self, n: int, context: int) -> DecodeInputs:
        return self._rows(torch.arange(n, device="cuda"), decode_positions(n, context).cuda())

    def prefill(self, rows: int, context: int) -> DecodeInputs:
        """A prefill chunk: `rows` prompt rows, requests of `context` tokens each, positions 0.."""
        requests = torch.arange(rows, device="cuda") // context
        return self._rows(requests, torch.arange(rows, device="cuda") % context)

    def _rows(self, requests: torch.Tensor, pos: torch.Tensor) -> DecodeInputs:
        table = requests[:, None] * self.pages + torch.arange(self.pages, device="cuda")
        slots = table.gather(1, (pos // PAGE)[:, None])[:, 0] * PAGE + pos % PAGE
        # Distinct random tokens: with one token id for every row, the rows' hidden states barely differ,
        # the router sends them all to the same few experts, and the step reads a fraction of the
        # expert bytes the roofline counts (the figures before 2026-12-01 20:30 were measured so).
        gen = torch.Generator(device="cuda").manual_seed(len(pos))
        tokens = torch.randint(3, self.vocab_size, (len(pos),), device="cuda", generator=gen)
        return DecodeInputs(tokens, pos, slots, table)


def time_ms(fn, *args, iters: int) -> float:
    for _ in range(3):
        fn(*args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def machine_rates() -> dict:
    """HBM read bandwidth (a 4 GiB reduction) and bf16 matmul rate (8192^3), measured here."""
    big = torch.ones(2 * 1024**3, dtype=torch.bfloat16, device="cuda")
    read_ms = time_ms(lambda big=big: big.sum(dtype=torch.float32), iters=10)
    del big
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_ms = time_ms(torch.mm, a, a, iters=10)
    return {"read_tb_s": 4 * 1024**3 / read_ms / 1e9, "matmul_tflop_s": 2 * 8192**3 / mm_ms / 1e9}


def step_bytes(cfg: ModelConfig, weights: dict, inp: DecodeInputs) -> float:
    """Bytes a decode step must read: weights (experts as touched by this many rows) + KV rows."""
    bs = inp.batch_size
    expert_bytes = sum(t.numel() * t.element_size() for n, t in weights.items() if ".experts." in n)
    # The embedding is gathered row by row, unless it doubles as the LM head (read whole).
    rest = sum(t.numel() * t.element_size() for n, t in weights.items() if ".experts." not in n
               and (n != "embed.weight" or cfg.tie_word_embeddings))
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = expert_bytes * (1 - (1 - K / E) ** bs)
    S = cfg.sliding_window + cfg.index_topk
    kv_rows = cfg.num_layers * (bs * S * (cfg.kv_latent_dim + cfg.rope_dim)
                                + float((inp.positions + 1).sum()) * cfg.index_dim) * 2
    return rest + touched + kv_rows


def prefill_flops(cfg: ModelConfig, weights: dict, inp: DecodeInputs) -> float:
    """Matmul FLOPs of one pass over these rows (every row through every projection, K + shared experts,
    attention over its selected slots, the indexer over its context)."""
    rows = inp.batch_size
    dense = sum(t.numel() for n, t in weights.items() if n.endswith(".weight") and t.dim() == 2
                and ".experts." not in n and n != "embed.weight")
    if cfg.tie_word_embeddings:
        dense += weights["embed.weight"].numel()
    expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * cfg.num_experts_per_tok * cfg.num_layers
    selected = torch.clamp(inp.positions + 1, max=cfg.sliding_window + cfg.index_topk).sum().item()
    attention = cfg.num_layers * selected * cfg.num_heads * (2 * cfg.kv_latent_dim + cfg.rope_dim)
    indexer = cfg.num_layers * float((inp.positions + 1).sum()) * cfg.index_heads * cfg.index_dim
    return 2 * (rows * (dense + expert) + attention + indexer)


def interleaved_times(measure: Callable[[int], float], sizes: list[int], rounds: int) -> list[dict[int, float]]:
    """`measure(n)` for every size, `rounds` times over, the sizes' order rotated each round: a host
    whose speed drifts for a while then weighs on every size alike, not on the sizes timed in that while."""
    out = []
    for r in range(rounds):
        order = sizes[r % len(sizes):] + sizes[:r % len(sizes)]
        times = {n: measure(n) for n in order}
        out.append({n: times[n] for n in sizes})
    return out


def fit(points: list[tuple[int, float]]) -> dict:
    bs = torch.tensor([p[0] for p in points], dtype=torch.float64)
    ms = torch.tensor([p[1] for p in points], dtype=torch.float64)
    design = torch.stack([torch.ones_like(bs), bs], 1)
    a, b = torch.linalg.lstsq(design, ms[:, None]).solution[:, 0].tolist()
    return {"a_ms": a, "b_ms_per_req": b}


def prefill_graph(bench, chunk, roofline_ms: float, iters: int) -> dict:
    """The same prefill pass as the engine runs it: a step of that many rows is one replay of its
    STEP_BUCKETS graph (runtime.graph.runner), not an eager pass whose host launches and syncs show
    as gaps between kernels. A runner of one bucket on the same model and cache; its logits must be
    the eager pass's (graph == eager)."""
    runner = GraphRunner(bench.model, bench.kv, bench.runner.streams, buckets=(chunk.batch_size,),
                         scratch_page=bench.scratch)
    eager_logits = bench.runner.eager(chunk).clone()
    runner.capture()
    ms = time_ms(runner.forward, chunk, iters=iters)
    same = bool(torch.equal(runner.forward(chunk), eager_logits))
    del runner
    torch.cuda.empty_cache()
    return {"rows": chunk.batch_size, "ms": ms, "pct_roofline": 100 * roofline_ms / ms, "same_logits": same}


def prefill_launches(bench, chunk, roofline_ms: float, plain_logits: torch.Tensor, iters: int) -> dict:
    """The prefill pass with other sparse MLA launches of the deployment's numerics: `prefill_one_pass`
    = the one-pass kernel in default_launch's shape (no row-count launch table: not PREFILL_LAUNCH's,
    not LARGE_BATCH_LAUNCH's, whose band would otherwise take the pass): its logits must equal the
    plain pass's."""
    runs = {}
    saved = attention.PREFILL_LAUNCH_ROWS, attention.LARGE_BATCH_LAUNCH
    try:
        attention.PREFILL_LAUNCH_ROWS = chunk.batch_size  # no pass is a prefill pass: sparse_mla keeps one pass
        attention.LARGE_BATCH_LAUNCH = None
        ms = time_ms(bench.runner.eager, chunk, iters=iters)
        runs["prefill_one_pass"] = ms, bench.runner.eager(chunk).clone()
    finally:
        attention.PREFILL_LAUNCH_ROWS, attention.LARGE_BATCH_LAUNCH = saved
    out = {name: {"ms": ms, "pct_roofline": 100 * roofline_ms / ms, "same_logits_as_plain": bool(
        torch.equal(logits, plain_logits))} for name, (ms, logits) in runs.items()}
    print(json.dumps({"prefill_launches": out}), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["canary", "dsv4-slice"], default="canary")
    ap.add_argument("--batch-sizes", default="1,8,16,32,48,64,96,128")
    ap.add_argument("--moe-kernel", choices=["triton", "torch"], default="triton")
    ap.add_argument("--attention-kernel", choices=["triton", "torch"], default="triton")
    ap.add_argument("--sawtooth", default="", help="batch sizes for the fine vs coarse bucket sweep")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3,
                    help="times each mode's batch sizes are timed, interleaved; each point is the median")
    ap.add_argument("--prefill-iters", type=int, default=0,
                    help="timed repeats of each 4,096-row prefill pass (default: iters / 4, at least 3)")
    ap.add_argument("--prefill-variants", action="store_true",
                    help="also time the prefill pass with skip_tail the other way, with the other GEMM kernel "
                         "(pointer or TMA) and with the one-pass sparse MLA where the deployment runs two (each pass's "
                         "logits checked against the plain pass's)")
    ap.add_argument("--out", default="")
    ap.add_argument("--roofline-only", type=float, default=0.0, metavar="TB_S",
                    help="no GPU: print the roofline per batch size at this read bandwidth and its linear fit")
    args = ap.parse_args()
    small = args.model == "canary"
    cfg = ModelConfig() if small else SLICE
    pages, context = (24, 320) if small else (128, 2048)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    if args.roofline_only:
        print(json.dumps({"model": args.model, **roofline_only(cfg, sizes, context, args.roofline_only)}))
        return
    prefill_iters = args.prefill_iters or max(3, args.iters // 4)
    weights = random_weights(cfg, small)
    kernels = {"moe_kernel": args.moe_kernel, "attention_kernel": args.attention_kernel}
    rates = machine_rates()
    results: dict = {"model": args.model, "device": torch.cuda.get_device_name(), "commit": git_commit(),
                     "torch": torch.__version__, "context": context, "kernels": kernels, "rates": rates, "modes": {}}
    print(json.dumps({"rates": rates}), flush=True)
    modes = (("eager", InOrderExecutor, "invariant"), ("graph", InOrderExecutor, "invariant"),
             ("graph+multistream", CudaStreamExecutor, "invariant"),
             ("graph+multistream+cublas", CudaStreamExecutor, "cublas"))
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    for mode, streams, gemm in modes:
        held = torch.cuda.memory_allocated()
        bench = Bench(cfg, weights, pages, max(sizes), FINE_BUCKETS, streams(), {**kernels, "gemm": gemm})
        if mode == "eager":  # what building a model adds beside the weights the caller holds (KV cache included)
            kv_bytes = bench.kv.latent.nbytes + bench.kv.index_keys.nbytes
            results["memory_gb"] = {"weights": weight_bytes / 1e9, "kv_cache": kv_bytes / 1e9,
                                    "model_build_added": (torch.cuda.memory_allocated() - held) / 1e9}
            print(json.dumps({"memory_gb": results["memory_gb"]}), flush=True)
        if mode != "eager":
            bench.runner.capture()
        fn = bench.runner.eager if mode == "eager" else bench.runner.forward
        inputs = {n: bench.inputs(n, context) for n in sizes}
        by_round = interleaved_times(lambda n: time_ms(fn, inputs[n], iters=args.iters), sizes, args.rounds)
        points = [(n, statistics.median(r[n] for r in by_round)) for n in sizes]
        for n, ms in points:
            roofline_ms = step_bytes(cfg, weights, inputs[n]) / (rates["read_tb_s"] * 1e9)
            print(json.dumps({"model": args.model, "mode": mode, "bs": n, "ms": round(ms, 4),
                              "ms_rounds": [round(r[n], 4) for r in by_round],
                              "roofline_ms": round(roofline_ms, 4), "pct_roofline": round(100 * roofline_ms / ms, 1)}),
                  flush=True)
        # The fixed term of each round's own points beside the medians' (the eager step is host-bound, and its
        # a moved 2.5-5.4 ms between runs of one tree: the spread says how far one figure can be trusted).
        results["modes"][mode] = {"points": points, **fit(points),
                                  "a_ms_rounds": [fit([(n, r[n]) for n in sizes])["a_ms"] for r in by_round]}
        if mode == "graph+multistream":
            chunk = bench.prefill(PREFILL_ROWS, min(context, PREFILL_ROWS))
            ms = time_ms(bench.runner.eager, chunk, iters=prefill_iters)
            roofline_ms = max(prefill_flops(cfg, weights, chunk) / (rates["matmul_tflop_s"] * 1e9),
                              step_bytes(cfg, weights, chunk) / (rates["read_tb_s"] * 1e9))
            results["prefill"] = {"rows": PREFILL_ROWS, "ms": ms, "roofline_ms": roofline_ms,
                                  "pct_roofline": 100 * roofline_ms / ms}
            print(json.dumps({"model": args.model, "prefill": results["prefill"]}), flush=True)
            results["prefill_graph"] = prefill_graph(bench, chunk, roofline_ms, prefill_iters)
            print(json.dumps({"model": args.model, "prefill_graph": results["prefill_graph"]}), flush=True)
            if args.prefill_variants:  # the same pass with other sparse MLA launches (a default run times it once)
                # The same pass with one deployed prefill choice undone at a time (each must keep the
                # logits' bits): the sparse MLA's skip_tail (each row's empty trailing chunks skipped),
                # the projections' GEMM kernel (pointer where the deployment runs the persistent TMA
                # one), the TMA kernel's splits added in the tile's program (FUSED_TMA) and the MoE's
                # bucket launches.
                logits = bench.runner.eager(chunk).clone()
                toggles = (("prefill_other_tail", attention, "SKIP_TAIL_ROWS",
                            256 if attention.SKIP_TAIL_ROWS is None else None, "skip_tail"),
                           ("prefill_other_gemm", matmul, "PREFILL_TMA", not matmul.PREFILL_TMA, "tma"),
                           ("prefill_other_fused_tma", matmul, "FUSED_TMA", not matmul.FUSED_TMA, "fused_tma"),
                           ("prefill_other_moe_launch", moe, "BUCKET_LAUNCHES", not moe.BUCKET_LAUNCHES,
                            "moe_bucket_launches"),
                           # The one-pass sparse MLA in 64-head blocks for prefill passes (the column groups
                           # made it fit; the same bits), in place of the two-pass form.
                           ("prefill_other_launch", attention, "PREFILL_LAUNCH",
                            dict(block_h=64, num_warps=8) if attention.PREFILL_LAUNCH is None else None,
                            "one_pass_launch"),
                           # The sparse MLA's chunks of 128 positions (the deployment's until the seventeenth
                           # session, now 64): another numerics, so other logits; its time is the question.
                           ("prefill_other_chunk", bench.model, "attention_splits",
                            -(-(cfg.sliding_window + cfg.index_topk) // 128), "splits"))
                for key, module, name, value, label in toggles:
                    saved = getattr(module, name)
                    setattr(module, name, value)
                    try:
                        other_ms = time_ms(bench.runner.eager, chunk, iters=prefill_iters)
                        same = bool(torch.equal(bench.runner.eager(chunk), logits))
                    finally:
                        setattr(module, name, saved)
                    shown = value if key in ("prefill_other_chunk", "prefill_other_launch") else \
                        value is not None and value is not False
                    results[key] = {label: shown, "ms": other_ms,
                                    "pct_roofline": 100 * roofline_ms / other_ms, "same_logits": same}
                    print(json.dumps({"model": args.model, key: results[key]}), flush=True)
                results.update(prefill_launches(bench, chunk, roofline_ms, logits, prefill_iters))
        del bench
        torch.cuda.empty_cache()
    if args.sawtooth:
        saw = [int(s) for s in args.sawtooth.split(",")]
        for name, buckets in (("fine", FINE_BUCKETS), ("coarse", COARSE_BUCKETS)):
            bench = Bench(cfg, weights, pages, max(saw), buckets, CudaStreamExecutor(), kernels)
            bench.runner.capture()
            points = [(n, time_ms(bench.runner.forward, bench.inputs(n, context), iters=args.iters)) for n in saw]
            results[f"sawtooth_{name}"] = points
            print(json.dumps({"model": args.model, "sawtooth": name, "points": points}), flush=True)
            del bench
            torch.cuda.empty_cache()
    served = dict(results["modes"]["graph+multistream"]["points"])
    cublas = dict(results["modes"]["graph+multistream+cublas"]["points"])
    eager_a, graph_a = results["modes"]["eager"]["a_ms"], results["modes"]["graph"]["a_ms"]
    results["graph_a_over_eager_a"] = graph_a / eager_a
    # The same ratio for a step at 100% of roofline: the floor of graph_a_over_eager_a.
    results["roofline"] = roofline_only(cfg, sizes, context, rates["read_tb_s"])
    results["roofline_a_over_eager_a"] = results["roofline"]["a_ms"] / eager_a
    results["invariance_cost"] = {n: served[n] / cublas[n] - 1 for n in sizes}
    if 16 in served and 128 in served:
        results["step128_over_step16"] = served[128] / served[16]
    print(json.dumps({"summary": {m: {k: v for k, v in r.items() if k != "points"}
                                  for m, r in results["modes"].items()},
                      "graph_a_over_eager_a": results["graph_a_over_eager_a"],
                      "roofline_a_over_eager_a": results["roofline_a_over_eager_a"],
                      "invariance_cost": results["invariance_cost"],
                      "step128_over_step16": results.get("step128_over_step16"),
                      "prefill": results.get("prefill"), "prefill_graph": results.get("prefill_graph"),
                      "prefill_other_tail": results.get("prefill_other_tail"),
                      "prefill_other_gemm": results.get("prefill_other_gemm"),
                      "prefill_other_fused_tma": results.get("prefill_other_fused_tma"),
                      "prefill_other_moe_launch": results.get("prefill_other_moe_launch"),
                      "prefill_one_pass": results.get("prefill_one_pass"),
                      "prefill_other_chunk": results.get("prefill_other_chunk"),
                      "prefill_other_launch": results.get("prefill_other_launch")}),
          flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
