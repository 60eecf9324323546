"""Decode-kernel benchmarks on one GPU: median microseconds per call under CUDA-graph replay, bytes
moved, FLOPs, roofline, speed-up over a capturable torch version of the same op.

Roofline = max(bytes / read bandwidth, FLOPs / bf16 matmul rate), both ceilings measured at the
start of the same run. MoE bytes count the experts a batch touches on average,
E * (1 - (1 - K/E)^bs), times one expert's weight bytes. Each graph holds several calls on
different inputs (other experts, other cache slots), so replays do not re-read a warm L2.

  python -m bench.kernels --json out.json [--tune-out tuned.json] [--only moe,mla,indexer]

--tune-out: sweep MoE launch configs per batch bucket; a candidate counts only if its output is
bit-identical to the default config's (buckets must not break batch invariance). Install the result with
`python -m runtime.kernels.triton.configs install tuned.json` (runtime/kernels/triton/configs.py).

--vs-sglang: SGLang's Triton fused MoE and sparse MLA decode beside ours on the same inputs
(bench/sglang_kernels.py: wheel from scripts/sglang_wheel.sh, device command, what is timed).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton

from runtime.kernels import cuda_torch
from runtime.kernels.triton import attention, elementwise, indexer, moe
from runtime.kernels.triton import topk as triton_topk
from runtime.kernels.triton.configs import config_file_name

BATCHES = [1, 2, 4, 8, 16, 32, 64, 128]
CALLS_PER_GRAPH = 6
# Only BLOCK_N, warps and stages vary (moe.py: BLOCK_M and BLOCK_K fix a row's reduction order).
# Deeper pipelines (5-6 stages) since the thirty-first session: an fp8 step moves half a bf16 step's bytes, so a
# program needs more steps in flight to keep as many bytes on the way (fp8 reached 56-72% of the read roofline at
# bs 8 on the H100, bf16 79-87%).
MOE_CANDIDATES = [dict(BLOCK_N=n, num_warps=w, num_stages=s) for n, w, s in
                  ((16, 4, 4), (32, 4, 4), (32, 4, 2), (32, 2, 4), (64, 4, 4), (64, 4, 3), (64, 8, 3),
                   (128, 4, 3), (128, 8, 3), (128, 8, 4), (256, 8, 3),
                   (32, 4, 6), (32, 2, 6), (64, 4, 5), (64, 4, 6), (128, 4, 4), (128, 4, 5))]

# The tune's second stage, on the aligned path: the down projection's own launch (a bucket's "down" entry) beside the
# gate/up launch the first stage chose. At I = 256 / 512 the down GEMM is 2-4 k steps deep, and the gate/up launch's
# narrow tiles leave it many short programs (bs 8 fp8 I=256 on the H100: 21.9 us for 46 MB, 64% of the read roofline).
MOE_DOWN_CANDIDATES = [dict(BLOCK_N=n, N_TILES=t, num_warps=w, num_stages=s) for n, t, w, s in
                       ((64, 1, 4, 2), (64, 2, 4, 2), (64, 4, 4, 2), (128, 1, 4, 2), (128, 2, 4, 2), (128, 1, 8, 2),
                        (128, 2, 8, 3), (256, 1, 8, 2), (256, 2, 8, 2), (64, 1, 4, 3), (128, 1, 4, 3))]

# The tune's third stage, for a split shard's aligned buckets: the gate/up launch whose program walks the K splits
# itself (a bucket's "gate_up" entry with FUSED_SPLITS: the additions of the split launch, so the same bits), which
# has the one-split launch's programs and no float32 partials or act launch. On the H100 one split was 1-2% faster
# than four at I = 256 / 512 for bs >= 8 (docs/results.md, "Thirty-ninth session"); four stay for bs 1-4 and the bits.
MOE_FUSED_SPLIT_CANDIDATES = [dict(FUSED_SPLITS=True, BLOCK_N=n, num_warps=w, num_stages=s) for n, w, s in
                              ((16, 4, 4), (32, 4, 4), (32, 2, 4), (32, 4, 6), (64, 4, 3), (64, 4, 4), (64, 4, 5),
                               (128, 4, 3))]


def graph_us(calls, reps: int = 15) -> float:
    """Median microseconds per call: all calls captured in one graph, replayed `reps` times."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(calls))
    del graph
    return statistics.median(times)


def measure_ceilings() -> dict:
    big = torch.randn(2**29, device="cuda", dtype=torch.float32)  # 2 GiB, many times the L2
    # The faster of two reductions over the same bytes: the ceiling must not be an underestimate.
    read_us = min(graph_us([lambda big=big: big.sum()], reps=10),
                  graph_us([lambda big=big: big.view(torch.bfloat16).sum()], reps=10),
                  graph_us([lambda big=big: big.amax()], reps=10))
    del big
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    mm_us = graph_us([lambda: a @ b], reps=10)
    return {"read_bytes_per_s": 2**31 / (read_us * 1e-6), "bf16_flops_per_s": 2 * n**3 / (mm_us * 1e-6)}


def roofline_us(bytes_moved: float, flops: float, ceilings: dict) -> float:
    return max(bytes_moved / ceilings["read_bytes_per_s"], flops / ceilings["bf16_flops_per_s"]) * 1e6


def touched_experts(experts: int, top_k: int, batch: int) -> float:
    return experts * (1 - (1 - top_k / experts) ** batch)


# ---------------------------------------------------------------- MoE

def _routing(gen, batch, experts, top_k):
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(batch)]).to(torch.int32)
    return ids.cuda(), (torch.rand(batch, top_k, generator=gen) + 0.1).cuda()


def _torch_moe(x, w13, w2, ids, weights):
    """Capturable torch MoE: every expert over every token (dense), then the routing mask."""
    experts, inter = w2.shape[0], w2.shape[2]
    h = torch.einsum("td,end->etn", x, w13)
    act = F.silu(h[..., :inter]) * h[..., inter:]
    y = torch.einsum("eti,edi->etd", act, w2)  # [E, T, D]
    dense_w = torch.zeros(x.shape[0], experts, device=x.device, dtype=torch.float32)
    dense_w.scatter_(1, ids.long(), weights)
    return torch.einsum("te,etd->td", dense_w.to(x.dtype), y)


def parse_moe_splits(spec: str) -> tuple[set[int], bool]:
    """`--moe-splits`' split-K counts (a comma list of positive integers and "default") as (the counts, whether
    the shape's own is asked for); anything else is refused by name."""
    counts, own = set(), False
    for part in (p.strip() for p in spec.split(",")):
        if part == "default":
            own = True
        elif part.isdigit() and int(part) >= 1:
            counts.add(int(part))
        else:
            raise ValueError(f"--moe-splits: {part!r} is neither a positive split count nor 'default' (in {spec!r})")
    return counts, own


def moe_splits(spec: str, hidden: int, inter: int) -> list[int]:
    """The split-K counts `--moe-splits` names for one shard, sorted, each once; "default" is moe.gate_up_splits'
    count at this shape (the deployment's)."""
    counts, own = parse_moe_splits(spec)
    return sorted(counts | ({moe.gate_up_splits(hidden, inter)} if own else set()))


def bench_moe(ceilings, tune: bool, rows: list, tuned: dict, vs=None, splits: str = "1,default") -> None:
    """splits: the gate/up split-K counts timed at each point (`moe_splits`); the tune and the fp8 switch rows run
    at the deployment's only. With `vs`, SGLang is timed beside every split's row (the same inputs): a split other
    than the deployment's is a question for the rule (moe.gate_up_splits), which holds one count per shape."""
    experts, top_k, hidden = 256, 6, 4096
    gen = torch.Generator().manual_seed(0)
    for inter in (256, 512, 2048):
        w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
        w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.02
        fp8 = moe.quantize_packed(moe.PackedMoE(w13, w2))
        # name: (weights, moe switches set for the row). bf16 and fp8_w8a8 run as deployed; the act_launch row
        # (the deployment's split only) puts the SiLU-and-mul output's quantize launch back (moe.FUSED_ACT_QUANT
        # off), checked for the fp8_w8a8 row's bits.
        variants = {"bf16": (moe.PackedMoE(w13, w2), {}), "fp8_w8a8": (fp8, {}),
                    "fp8_w8a8_act_launch": (fp8, {"FUSED_ACT_QUANT": False})}
        for batch in BATCHES:
            inputs = [(torch.randn(batch, hidden, generator=gen).to(torch.bfloat16).cuda(),
                       *_routing(gen, batch, experts, top_k))
                      for _ in range(CALLS_PER_GRAPH)]
            bf16_us, fp8_out = {}, {}
            default_split = moe.gate_up_splits(hidden, inter)
            for (name, (packed, switches)), split in [(v, sp) for v in variants.items()
                                                      for sp in moe_splits(splits, hidden, inter)]:
                if switches and split != default_split:
                    continue
                expert_bytes = 3 * inter * hidden * (1 if packed.fp8 else 2)
                if packed.fp8:
                    expert_bytes += 3 * inter * hidden // (128 * 128) * 4
                bytes_moved = touched_experts(experts, top_k, batch) * expert_bytes + 2 * batch * hidden * 2
                flops = 2 * batch * top_k * 3 * inter * hidden
                best_cfg, best_us = moe.moe_config(experts, inter, packed.fp8, batch), None
                run = lambda x, i, w, c, split=split, packed=packed, switches=switches: _fused_moe_with(  # noqa: E731
                    switches, x, packed, w, i, config=c, split_k=split)
                same_bits = None
                if packed.fp8:  # the other fp8 rows run after the fp8_w8a8 row of their split: its bits they must give
                    x0, ids0, w0 = inputs[0]
                    out0 = run(x0, ids0, w0, best_cfg).clone()
                    if switches:
                        same_bits = bool(torch.equal(out0, fp8_out[split]))
                    else:
                        fp8_out[split] = out0
                if tune and not switches and split == default_split:  # the deployment's split only: it is what
                    x0, ids0, w0 = inputs[0]                                # the config file serves
                    want = run(x0, ids0, w0, moe.DEFAULT_CONFIG)
                    where = f"I={inter} bs={batch} {name}"
                    best_cfg, best_us = _fastest_keeping_bits(run, inputs, want, MOE_CANDIDATES, best_cfg, None, where)
                    if batch * top_k > moe.PER_ROW_MAX_ROWS:  # the per-row path keeps one column tile a program
                        best_cfg, best_us = _fastest_keeping_bits(
                            run, inputs, want, [{**best_cfg, "down": down} for down in MOE_DOWN_CANDIDATES], best_cfg,
                            best_us, where)
                        if split > 1:  # and never fuses splits (moe.gate_up_launch)
                            best_cfg, best_us = _fastest_keeping_bits(
                                run, inputs, want, [{**best_cfg, "gate_up": fused} for fused in
                                                    MOE_FUSED_SPLIT_CANDIDATES], best_cfg, best_us, where)
                    tuned.setdefault(config_file_name("fused_moe", experts, inter, name), {})[str(batch)] = best_cfg
                us = graph_us([lambda x=x, i=i, w=w: run(x, i, w, best_cfg) for x, i, w in inputs])
                torch_us = None
                if name == "bf16":
                    bf16_us[split] = us
                    torch_us = graph_us([lambda x=x, i=i, w=w, w13=w13, w2=w2: _torch_moe(x, w13, w2, i, w)
                                         for x, i, w in inputs[:2]], reps=5)
                roof = roofline_us(bytes_moved, flops, ceilings)
                rows.append(dict(kernel="fused_moe", variant=name, I=inter, bs=batch, split_k=split, us=us,
                                 roofline_us=roof, pct_roofline=100 * roof / us, torch_us=torch_us,
                                 speedup_vs_torch=torch_us / us if torch_us else None,
                                 speedup_vs_bf16=bf16_us[split] / us if name != "bf16" else None, config=best_cfg,
                                 same_bits_as_fp8=same_bits))
                if vs is not None and not switches:  # the deployment's launch at this split, same inputs
                    vs.moe(rows[-1], packed, inputs, best_cfg, split, reference=(
                        lambda x, i, w, w13=w13, w2=w2: _torch_moe(x, w13, w2, i, w)) if name == "bf16" else None)
                print(json.dumps(rows[-1]), flush=True)
        del variants, fp8, w13, w2
        torch.cuda.empty_cache()


def _fastest_keeping_bits(run, inputs, want, candidates: list[dict], best: dict, best_us: float | None,
                          where: str) -> tuple[dict, float | None]:
    """The fastest of `candidates` that gives `want` (the default config's bits), if faster than `best_us` (None:
    any), else (`best`, `best_us`). A candidate the GPU cannot hold (a wide tile's stages in less shared memory) is
    skipped. The tune's two stages: the bucket's launch, then its down projection's own launch beside it."""
    x0, ids0, w0 = inputs[0]
    for cfg in candidates:
        try:
            got = run(x0, ids0, w0, cfg)
        except triton.runtime.errors.OutOfResources as err:
            print(f"  skip {cfg} ({where}): {err}", flush=True)
            continue
        if not torch.equal(got, want):
            print(f"  reject {cfg} ({where}): bits differ from the default", flush=True)
            continue
        us = graph_us([lambda x=x, i=i, w=w, c=cfg: run(x, i, w, c) for x, i, w in inputs], reps=8)
        if best_us is None or us < best_us:
            best, best_us = cfg, us
    return best, best_us


def _fused_moe_with(switches: dict[str, bool], *args, **kwargs) -> torch.Tensor:
    """moe.fused_moe with moe's `switches` (e.g. FUSED_ACT_QUANT) set for this call (a graph captures the launches
    it makes)."""
    saved = {name: getattr(moe, name) for name in switches}
    for name, value in switches.items():
        setattr(moe, name, value)
    try:
        return moe.fused_moe(*args, **kwargs)
    finally:
        for name, value in saved.items():
            setattr(moe, name, value)


# ---------------------------------------------------------------- sparse MLA decode

def _torch_mla(q, cache, slots, latent, scale):
    kv = cache[slots.clamp(min=0).long()]  # [T, S, C+R]
    scores = torch.einsum("thd,tsd->ths", q.float(), kv.float()) * scale
    scores = scores.masked_fill((slots < 0)[:, None, :], float("-inf"))
    return torch.einsum("ths,tsc->thc", torch.softmax(scores, -1), kv[..., :latent].float()).to(q.dtype)


MLA_LATENT, MLA_ROPE, MLA_CONTEXT, MLA_WINDOW = 512, 64, 65536, 128


def mla_cache(max_batch: int) -> torch.Tensor:
    """One 64K-position region of latent rows per request of the largest batch (bf16)."""
    return torch.randn(max_batch * MLA_CONTEXT, MLA_LATENT + MLA_ROPE, device="cuda", dtype=torch.bfloat16)


def mla_inputs(batch: int, heads: int, topk: int, gen: torch.Generator, cache_rows: int) -> list:
    """CALLS_PER_GRAPH (q, slots) pairs: each request selects its last 128 positions + top-k random
    earlier ones of its own region (or, past the cache's regions, of any region: prefill rows)."""
    calls_in = []
    regions = cache_rows // MLA_CONTEXT
    for _ in range(CALLS_PER_GRAPH):
        base = ((torch.arange(batch) % regions) * MLA_CONTEXT)[:, None]
        earlier = torch.rand(batch, MLA_CONTEXT - MLA_WINDOW, device="cuda").argsort(dim=1)[:, :topk].cpu()
        recent = torch.arange(MLA_CONTEXT - MLA_WINDOW, MLA_CONTEXT)[None, :].expand(batch, -1)
        slots = (base + torch.cat([recent, earlier], 1)).to(torch.int32).cuda()
        q = torch.randn(batch, heads, MLA_LATENT + MLA_ROPE, generator=gen).to(torch.bfloat16).cuda()
        calls_in.append((q, slots))
    return calls_in


def mla_bytes_flops(batch: int, heads: int, selected: int) -> tuple[int, int]:
    width = MLA_LATENT + MLA_ROPE
    return (batch * (selected * width * 2 + heads * (MLA_LATENT + width) * 2),
            2 * batch * heads * selected * (MLA_LATENT + width))


def bench_mla(ceilings, rows: list, vs=None) -> None:
    """The deployment's launch (attention.default_launch; spread or gathered as the batch asks)."""
    gen = torch.Generator().manual_seed(1)
    cache = mla_cache(max(BATCHES))
    latent, scale = MLA_LATENT, (MLA_LATENT + MLA_ROPE) ** -0.5
    for heads in (64, 16):
        for topk in (512, 640):
            selected = MLA_WINDOW + topk
            launch = attention.default_launch(selected, heads)
            for batch in sorted(BATCHES, reverse=True):
                calls_in = mla_inputs(batch, heads, topk, gen, cache.shape[0])
                bytes_moved, flops = mla_bytes_flops(batch, heads, selected)
                roof = roofline_us(bytes_moved, flops, ceilings)
                torch_us = graph_us([lambda q=q, s=s, c=cache: _torch_mla(q, c, s, latent, scale)
                                     for q, s in calls_in[:2]], reps=5)
                us = graph_us([lambda q=q, s=s, c=cache: attention.sparse_mla_decode(q, c, s, latent, scale)
                               for q, s in calls_in])
                spread = attention.spreads(batch, -(-heads // launch["block_h"]) * launch["v_split"],
                                           launch["num_splits"], cache.device)
                # Every launch mode (same bits) of the same launch, for choosing the switch and folds.
                modes_us = {}
                for spread_, merge in ((True, "ticket"), (True, "kernel"), (False, "registers"), (False, "memory")):
                    try:
                        modes_us[f"{'spread' if spread_ else 'gathered'}/{merge}"] = graph_us(
                            [lambda q=q, s=s, sp=spread_, m=merge, c=cache: attention.sparse_mla_decode(
                                q, c, s, latent, scale, spread=sp, merge=m) for q, s in calls_in], reps=8)
                    except Exception as err:  # noqa: BLE001 - one mode failing must not lose the row
                        print(f"  mla mode spread={spread_} merge={merge}: {type(err).__name__}: {str(err)[:200]}")
                rows.append(dict(kernel="sparse_mla", H=heads, topk=topk, selected=selected, bs=batch,
                                 splits=launch["num_splits"], mode="spread" if spread else "gathered",
                                 us=us, roofline_us=roof, pct_roofline=100 * roof / us, torch_us=torch_us,
                                 speedup_vs_torch=torch_us / us, launch=launch, modes_us=modes_us))
                if vs is not None:
                    vs.mla(rows[-1], calls_in, cache, latent, scale,
                           reference=lambda q, s, c=cache: _torch_mla(q, c, s, latent, scale))
                print(json.dumps(rows[-1]), flush=True)
                print(f"  mla H={heads} top-{topk} bs={batch} modes us: "
                      + " ".join(f"{k} {v:.1f}" for k, v in modes_us.items()), flush=True)
    del cache
    torch.cuda.empty_cache()


# ---------------------------------------------------------------- indexer

SELECT_WINDOW = 128


def _bench_selection(logits: torch.Tensor, positions: torch.Tensor, topk: int, row_passes: bool = True) -> dict:
    """The decode step's selection (window U top-k, sorted, ties to the lower position): select_slots'
    torch stable sort vs the Triton radix select at each (group, segment) launch, at B = all rows,
    16 and 1, plus rows where every score ties (the radix select's worst case: no digit prunes
    anything). Every launch gives the same output; `select_same_as_sort` checks the fastest."""
    def ours(x, p, launch):
        return triton_topk.select_slots(x, p, SELECT_WINDOW, topk, group=launch[0], segment=launch[1])

    def by_sort(x, p):
        return cuda_torch.select_slots_by_sort(x, p, SELECT_WINDOW, topk)

    by_launch = {}
    for launch in [(group, segment) for group in (16, 32, 64, 128) for segment in (1024, 2048, 4096)]:
        try:
            by_launch[launch] = graph_us([lambda launch=launch: ours(logits, positions, launch)] * 3)
        except Exception as err:  # a launch the compiler cannot lower: report, keep the others
            print(f"  select {launch}: {type(err).__name__}: {str(err)[:200]}", flush=True)
    if not by_launch:
        return dict(select_error="no launch compiled (see the lines above)")
    launch = min(by_launch, key=by_launch.__getitem__)
    tied = torch.zeros_like(logits)
    same = all(torch.equal(a, b) for x in (logits, tied) for a, b in zip(ours(x, positions, launch),
                                                                          by_sort(x, positions)))
    out = dict(select_launch=launch, select_ours_us_by_launch={f"{b}/{n}": us for (b, n), us in by_launch.items()},
               select_same_as_sort=same,
               select_all_tied_ours_us=graph_us([lambda: ours(tied, positions, launch)] * 3),
               select_all_tied_sort_us=graph_us([lambda: by_sort(tied, positions)] * 3))
    for rows in sorted({logits.shape[0], 16, 1}, reverse=True):
        x, p = logits[:rows].contiguous(), positions[:rows].contiguous()
        out[f"select_ours_us_B{rows}"] = graph_us([lambda x=x, p=p: ours(x, p, launch)] * 3)
        out[f"select_sort_us_B{rows}"] = graph_us([lambda x=x, p=p: by_sort(x, p)] * 3)
    # Where the time goes: the same rows cut to narrower contexts. The passes over the row scale with
    # the width; the selects over ~1024 group maxima and ~k candidates and the final sort do not
    # (group_size keeps ~1024 groups), so the intercept of time vs width is the fixed per-row part.
    by_width = {}
    for width in (4096, 16384, logits.shape[1]):
        x = logits[:, :width].contiguous()
        p = torch.full_like(positions, width - 1)
        by_width[width] = graph_us([lambda x=x, p=p: triton_topk.select_slots(x, p, SELECT_WINDOW, topk)] * 3)
    out["select_default_us_by_width"] = by_width
    # A prefill chunk's selection: 4,096 rows, row t sees t + 1 positions (one segment a row).
    chunk = torch.randn(4096, 4096, device=logits.device)
    chunk_positions = torch.arange(4096, device=logits.device)
    out["select_prefill_chunk_4096_us"] = graph_us(
        [lambda: triton_topk.select_slots(chunk, chunk_positions, SELECT_WINDOW, topk)] * 3)
    out["select_launch_us"] = _selection_launch_us(logits, positions, topk)
    out["select_launch_us_candidates_cap64"] = _selection_launch_us(logits, positions, topk, {"candidates": 64})
    # The finish's radix select against a sort in registers (triton_topk.SORT_FINISH), the candidates pass at
    # register caps of 80 and 64 (triton_topk.REGISTER_CAPS: more programs an SM), and the bound's
    # maxima held in registers or not (triton_topk.RESIDENT_BOUND), same output.
    variants = {}
    for name, kwargs in (("finish_radix", dict(sort_finish=False)), ("finish_sort", dict(sort_finish=True)),
                         ("candidates_cap80", dict(register_caps={"candidates": 80})),
                         ("candidates_cap64", dict(register_caps={"candidates": 64})),
                         ("candidates_uncapped", dict(register_caps={"candidates": None})),
                         # the bound's select with its maxima held in registers, and reloaded each level
                         ("bound_resident", dict(resident_bound=True)), ("bound_reloaded", dict(resident_bound=False))):
        def run(x=logits, p=positions, kwargs=kwargs):
            return triton_topk.select_slots(x, p, SELECT_WINDOW, topk, **kwargs)
        same_as_sort = all(torch.equal(a, b) for a, b in zip(run(), by_sort(logits, positions)))
        variants[name] = (graph_us([run] * 3), same_as_sort)
    out["select_variants_us"] = {name: us for name, (us, _) in variants.items()}
    out["select_variants_same_as_sort"] = all(same for _, same in variants.values())
    if row_passes:  # the passes' launch sweep (~16 compiles): once a run, on the deployment's fp8 keys
        out.update(_bench_row_pass_launches(logits, positions, topk, launch))
    return out


# Launches of the passes over the row, the deployed one (triton_topk.ROW_PASS_LAUNCHES) first: warps a program, and
# pipelining stages (unset: Triton's).
ROW_PASS_VARIANTS: tuple[dict[str, int | None], ...] = (
    {"warps": 4}, {"warps": 8}, {"warps": 2}, {"warps": 4, "stages": 1}, {"warps": 8, "stages": 1})


def _bench_row_pass_launches(logits: torch.Tensor, positions: torch.Tensor, topk: int, launch: tuple) -> dict:
    """The whole selection at the timed (group, segment) launch with each pass over the row (maxima,
    candidates) launched each way of ROW_PASS_VARIANTS, the other as deployed; then both at their fastest,
    with each launch's share (`_selection_launch_us`). Every launch must keep the output."""
    want = triton_topk.select_slots(logits, positions, SELECT_WINDOW, topk, group=launch[0], segment=launch[1])
    same, out, best = True, {}, {}
    for row_pass in triton_topk.ROW_PASS_LAUNCHES:
        by_name = {}
        for variant in ROW_PASS_VARIANTS:
            name = "/".join(f"{key}{value}" for key, value in variant.items())

            def run(variant=variant, row_pass=row_pass):
                return triton_topk.select_slots(logits, positions, SELECT_WINDOW, topk, group=launch[0],
                                                segment=launch[1], row_pass_launches={row_pass: variant})
            try:
                same = all(torch.equal(a, b) for a, b in zip(run(), want)) and same
                by_name[name] = (graph_us([run] * 3), variant)
            except Exception as err:  # a launch the compiler cannot lower: report, keep the others
                print(f"  {row_pass} {name}: {type(err).__name__}: {str(err)[:200]}", flush=True)
        out[f"select_{row_pass}_launches_us"] = {name: us for name, (us, _) in by_name.items()}
        if by_name:
            best[row_pass] = min(by_name.values(), key=lambda timed: timed[0])[1]

    def both() -> tuple:
        return triton_topk.select_slots(logits, positions, SELECT_WINDOW, topk, group=launch[0], segment=launch[1],
                                        row_pass_launches=best)
    same = all(torch.equal(a, b) for a, b in zip(both(), want)) and same
    return dict(**out, select_row_pass_same=same, select_row_pass_best=best,
                select_row_pass_best_us=graph_us([both] * 3),
                select_row_pass_best_launch_us=_selection_launch_us(logits, positions, topk,
                                                                    row_pass_launches=best))


def _selection_launch_us(logits: torch.Tensor, positions: torch.Tensor, topk: int,
                         register_caps: dict[str, int | None] | None = None,
                         row_pass_launches: dict[str, dict[str, int | None]] | None = None) -> dict:
    """Each of the default selection's launches, as the difference between graphs of its first n and n - 1
    launches (each launch alone would not do: the finish moves the candidates in place, so replaying it
    without the candidates pass reads a row it already moved). register_caps, row_pass_launches: as
    select_slots'."""
    launches, _ = triton_topk.selection_launches(logits, positions, SELECT_WINDOW, topk,
                                                 register_caps=register_caps,
                                                 row_pass_launches=row_pass_launches)
    names = list(launches)
    prefix_us = [0.0] + [graph_us([lambda n=n: [launches[name]() for name in names[:n]]] * 3)
                         for n in range(1, len(names) + 1)]
    return {name: prefix_us[n + 1] - prefix_us[n] for n, name in enumerate(names)}


def _bench_fused_maxima(q, w, keys, scale, page_table, lens, page_size: int, positions, topk: int) -> dict:
    """The selection's pass 1 in the logits kernel (indexer.FUSED_MAXIMA) both ways, through the entry
    point the decode step calls (logits + selection, default launches): each time, whether both give
    the same logits and selection, and the fused logits kernel alone (what it adds to `logits_us`)."""
    def entry(fused: bool):
        return indexer.logits_and_selection(q, w, keys, page_table, lens, page_size, positions, SELECT_WINDOW, topk,
                                            key_scale=scale, fused=fused)
    on, off = entry(True), entry(False)
    same = torch.equal(on[0], off[0]) and all(torch.equal(a, b) for a, b in zip(on[1], off[1]))
    width = page_table.shape[1] * page_size
    group = triton_topk.group_size(width, topk)
    maxima = torch.empty(q.shape[0], -(-width // group), dtype=torch.int64, device=q.device)
    spec = indexer.GroupMaxima(maxima, positions, SELECT_WINDOW, min(topk, width), group)
    def fused_logits(cap: int | None):
        return indexer.indexer_logits(q, w, keys, page_table, lens, page_size, key_scale=scale, maxima=spec,
                                      register_cap=cap)
    fused = indexer.fuses(width, topk, True)  # else entry(True) is the unfused path: say so, time no kernel alone
    return dict(default=indexer.FUSED_MAXIMA, fused=fused,
                on_us=graph_us([lambda: entry(True)] * 3), off_us=graph_us([lambda: entry(False)] * 3),
                same_selection=same, group=group, register_cap=indexer.REGISTER_CAP[True],
                fused_logits_alone_us=graph_us([lambda: fused_logits(None)] * 3) if fused else None,
                fused_logits_uncapped_us=graph_us([lambda: fused_logits(0)] * 3) if fused else None)


def _logits_variant(logits_fn, logits: torch.Tensor, **knobs) -> dict:
    """The logits kernel with `knobs` (indexer_logits' keyword arguments): its time, and whether it gives
    the deployed kernel's bits (`logits`)."""
    return dict(us=graph_us([lambda: logits_fn(**knobs)] * 3), same_bits=torch.equal(logits_fn(**knobs), logits))


def _bench_register_caps(logits_fn, logits: torch.Tensor) -> dict:
    """The unfused logits kernel at register caps (indexer.REGISTER_CAP): 96 fits 5 programs an SM (the
    shared memory's limit) with a few spills, 128 changes nothing expected. Each: time, same bits."""
    return {cap: _logits_variant(logits_fn, logits, register_cap=cap) for cap in (96, 128)}


def _bench_launches(logits_fn, logits: torch.Tensor) -> dict:
    """The logits kernel at each of indexer.LAUNCH_VARIANTS' launch shapes: time and same bits as the
    deployed launch's (a shape the chip cannot hold says why instead)."""
    shapes: dict[str, dict[str, Any]] = {}
    for name, knobs in indexer.LAUNCH_VARIANTS.items():
        try:
            shapes[name] = _logits_variant(logits_fn, logits, launch=knobs)
        except Exception as err:  # noqa: BLE001 - shared memory or registers a shape cannot have
            shapes[name] = dict(error=f"{type(err).__name__}: {str(err)[:200]}")
        torch.cuda.empty_cache()
    return dict(deployed=indexer.launch_shape(), **shapes)


def _indexer_case(batch: int = 64, heads: int = 64, dim: int = 128, context: int = 65536, page_size: int = 64):
    """The indexer bench's inputs: every row at `context` positions over shuffled pages; queries, head weights,
    and the keys in bf16 and fp8 (with their per-key scale). Returns (page_table, lens, positions, w, variants),
    variants: (name, q, keys, key_scale or None, key bytes) for fp8 then bf16."""
    gen = torch.Generator().manual_seed(2)
    pages = context // page_size
    page_table = torch.stack([torch.randperm(pages * batch, generator=gen)[:pages] for _ in range(batch)])
    page_table = page_table.to(torch.int32).cuda()
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    positions = (lens - 1).long()
    keys16 = torch.randn(pages * batch * page_size, dim, device="cuda", dtype=torch.bfloat16)
    keys8, key_scale = elementwise.quantize_groups(keys16)
    key_scale = key_scale[:, 0].contiguous()
    q16 = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    q8 = q16.to(torch.float8_e4m3fn)
    w = torch.rand(batch, heads, device="cuda")
    variants = (("fp8", q8, keys8, key_scale, dim + 4), ("bf16", q16, keys16, None, 2 * dim))
    return page_table, lens, positions, w, variants


# The selection's launch before the thirtieth session's defaults (segments of 4,096, both passes over the row in 8
# warps, the bound's maxima reloaded each level), for `bench_select_defaults`.
SELECT_BEFORE = dict(segment=4096, resident_bound=False,
                     row_pass_launches=dict.fromkeys(("maxima", "candidates"), {"warps": 8}))


def bench_select_defaults(rows: list) -> None:
    """The selection's defaults against SELECT_BEFORE on the same inputs, each with the same output (issue 15): the
    fp8 indexer's logits at B=64, 64K alone and with the logits kernel in one graph (the issue's figure), B=16 and
    1, narrower rows, and a 4,096-row prefill chunk (row t sees t + 1 positions)."""
    page_table, lens, positions, w, variants = _indexer_case()
    _, q, keys, scale, _ = variants[0]
    logits_fn = lambda: indexer.indexer_logits(q, w, keys, page_table, lens, 64, key_scale=scale)  # noqa: E731
    logits = logits_fn()
    chunk = torch.randn(4096, 4096, device="cuda")
    cases = {"B64_64K": (logits, positions), "B16_64K": (logits[:16].contiguous(), positions[:16].contiguous()),
             "B1_64K": (logits[:1].contiguous(), positions[:1].contiguous()),
             "B64_16K": (logits[:, :16384].contiguous(), torch.full_like(positions, 16383)),
             "B64_4K": (logits[:, :4096].contiguous(), torch.full_like(positions, 4095)),
             "prefill_chunk_4096": (chunk, torch.arange(4096, device="cuda"))}
    for case, (x, p) in cases.items():
        row: dict = dict(kernel="select_defaults", case=case)
        outputs = {}
        for name, kwargs in (("defaults", {}), ("before", SELECT_BEFORE)):
            def run(x=x, p=p, kwargs=kwargs):
                return triton_topk.select_slots(x, p, SELECT_WINDOW, 512, **kwargs)
            outputs[name] = run()
            row[f"{name}_us"] = graph_us([run] * 3)
        row["same_output"] = all(torch.equal(a, b) for a, b in zip(*outputs.values()))
        if case == "B64_64K":
            for name, kwargs in (("defaults", {}), ("before", SELECT_BEFORE)):
                row[f"logits_plus_{name}_us"] = graph_us(
                    [lambda kwargs=kwargs: triton_topk.select_slots(logits_fn(), positions, SELECT_WINDOW, 512,
                                                                    **kwargs)] * 3)
            row["logits_us"] = graph_us([logits_fn] * 3)
        rows.append(row)
        print(json.dumps(row), flush=True)


def bench_indexer(ceilings, rows: list) -> None:
    topk, context = 512, 65536
    page_table, lens, positions, w, variants = _indexer_case(context=context)
    page_size, batch, (heads, dim) = 64, positions.shape[0], variants[1][1].shape[1:]
    for name, q, keys, scale, key_bytes in variants:
        logits_fn = lambda q=q, keys=keys, scale=scale, **kw: indexer.indexer_logits(  # noqa: E731
            q, w, keys, page_table, lens, page_size, key_scale=scale, **kw)
        logits = logits_fn()
        logits_us = graph_us([logits_fn] * 3)
        # The default is the page-tile kernel where the caches fit it (indexer.PAGE_TMA); the variants below are the
        # pointer kernel's (a pointer knob keeps it), each asked for the default's bits.
        pointer = _logits_variant(logits_fn, logits, page_tma=False)
        # The logits kernel's speed switches the other way, each beside the deployed kernel: the key scale
        # loaded before the keys (indexer.EARLY_SCALE), full blocks without masks (UNMASKED_FULL_BLOCKS, by key
        # dtype), and, keys with a scale only, the scales loaded one block ahead (PREFETCH_SCALE, with
        # unmasked full blocks, against unmasked full blocks without it). Each must keep the bits.
        logits_other_early_scale = dict(early_scale=not indexer.EARLY_SCALE, **_logits_variant(
            logits_fn, logits, early_scale=not indexer.EARLY_SCALE))
        other_unmasked = not indexer.unmasked_by_default(keys)
        logits_unmasked_full_blocks = dict(unmasked=other_unmasked, **_logits_variant(
            logits_fn, logits, unmasked_full_blocks=other_unmasked))
        logits_prefetch_scale = None
        if scale is not None:
            on, off = (_logits_variant(logits_fn, logits, unmasked_full_blocks=True, prefetch_scale=prefetch)
                       for prefetch in (True, False))
            logits_prefetch_scale = dict(default=indexer.PREFETCH_SCALE, on_us=on["us"], off_us=off["us"],
                                         same_bits=on["same_bits"] and off["same_bits"])
        topk_us = graph_us([lambda: torch.topk(logits, topk, dim=-1, sorted=False)] * 3)
        both_us = graph_us([lambda: torch.topk(logits_fn(), topk, dim=-1, sorted=False)] * 3)
        selection = _bench_selection(logits, positions, topk, row_passes=name == "fp8")
        group, block = selection.get("select_launch", (None, None))

        def plus_select_us(row_pass_launches=None, resident_bound=None, **knobs) -> float:
            """Issue 15's figure: the logits kernel (with `knobs`) and our selection at its timed launch."""
            return graph_us([lambda: triton_topk.select_slots(logits_fn(**knobs), positions, SELECT_WINDOW, topk,
                                                              group=group, segment=block,
                                                              row_pass_launches=row_pass_launches,
                                                              resident_bound=resident_bound)] * 3)

        ours_both_us = plus_select_us() if "select_launch" in selection else None
        if "select_row_pass_best" in selection:  # and with the fastest launches of the passes over the row
            selection["plus_select_best_row_passes_us"] = plus_select_us(selection["select_row_pass_best"])
            selection["plus_select_best_row_passes_resident_bound_us"] = plus_select_us(
                selection["select_row_pass_best"], resident_bound=True)
        if logits_prefetch_scale is not None and ours_both_us is not None:  # beside it, the prefetch the other way
            logits_prefetch_scale["plus_select_other_us"] = plus_select_us(
                unmasked_full_blocks=True, prefetch_scale=not indexer.PREFETCH_SCALE)
        fused_maxima = _bench_fused_maxima(q, w, keys, scale, page_table, lens, page_size, positions, topk)
        logits_register_caps = _bench_register_caps(logits_fn, logits)
        logits_launches = _bench_launches(logits_fn, logits)
        bytes_moved = batch * context * (key_bytes + 4)
        flops = 2 * batch * heads * dim * context
        roof = roofline_us(bytes_moved, flops, ceilings)
        rows.append(dict(kernel="indexer", keys=name, B=batch, context=context, logits_us=logits_us,
                         logits_pointer_kernel=pointer, topk_us=topk_us,
                         logits_plus_topk_us=both_us, logits_plus_select_ours_us=ours_both_us, **selection,
                         logits_other_early_scale=logits_other_early_scale,
                         logits_unmasked_full_blocks=logits_unmasked_full_blocks,
                         logits_prefetch_scale=logits_prefetch_scale, fused_maxima=fused_maxima,
                         logits_register_caps=logits_register_caps, logits_launches=logits_launches,
                         roofline_us=roof,
                         pct_roofline=100 * roof / logits_us))
        print(json.dumps(rows[-1]), flush=True)


def stop_on_sigterm(signum, frame):
    """SIGTERM as KeyboardInterrupt: `timeout` (gpu_suite's sections) ends a long run with SIGTERM, which would kill
    the process before its `finally` writes what it measured (a cut-off tune lost all of its buckets)."""
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--tune-out", type=Path, default=None)
    parser.add_argument("--only", default="moe,mla,indexer")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="batch sizes (MoE and MLA)")
    parser.add_argument("--vs-sglang", action="store_true", help="time SGLang's Triton kernels beside ours")
    parser.add_argument("--moe-splits", default="1,default",
                        help="gate/up split-K counts timed at each MoE point: integers and 'default' (the shape's own)")
    args = parser.parse_args()
    try:
        _, own_split = parse_moe_splits(args.moe_splits)
    except ValueError as err:
        parser.error(str(err))
    if args.tune_out is not None and not own_split:  # the tune runs at the deployment's split only
        parser.error(f"--tune-out tunes each shape at its own split count: --moe-splits {args.moe_splits!r} must name "
                     "'default'")
    vs = None
    if args.vs_sglang:  # before any GPU work: a missing wheel fails at once, with what to do
        from bench.sglang_kernels import VsSGLang
        vs = VsSGLang(graph_us)
        print(vs.header(), flush=True)
    BATCHES[:] = [int(b) for b in args.batches.split(",")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() \
        or os.environ.get("COMMIT", "unknown")  # the device copy of the tree has no .git
    ceilings = measure_ceilings()
    print(json.dumps(ceilings), flush=True)
    rows: list = []
    tuned: dict = {}
    only = args.only.split(",")
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        if "select" in only:
            bench_select_defaults(rows)
        if "indexer" in only:
            bench_indexer(ceilings, rows)
        if "mla" in only:
            bench_mla(ceilings, rows, vs)
        if "moe" in only:
            bench_moe(ceilings, args.tune_out is not None, rows, tuned, vs, args.moe_splits)
    finally:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, commit=commit,
                    command=" ".join(sys.argv), ceilings=ceilings)
        if vs is not None:
            meta["sglang"] = vs.meta()
            print(vs.table(rows), flush=True)
        args.json.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        if args.tune_out:
            args.tune_out.write_text(json.dumps(tuned, indent=1))


if __name__ == "__main__":
    main()
