"""Launch-shape sweep for the sparse MLA decode kernel: one device run picks
attention.default_launch's (BLOCK_H, BLOCK_S, chunk, warps, stages, V_SPLIT, narrow partials)
per head count.

Each candidate is a different numerics (its chunks and blocks fix a row's reduction order), so the
choice is per deployment and must be good at every batch: each is timed at bs 1..128 in all three
launch modes (spread + in-kernel ticket merge, spread + merge launch, gathered folding in
registers or through memory), which give the
same bits (checked here on the GPU, `modes_equal`), and at a 4,096-row prefill pass (gathered).
With --vs-sglang, SGLang's kernel on the same inputs gives the ratio column.

  python -m bench.mla_sweep --json $OUT/mla_sweep.json [--vs-sglang] [--heads 64,16] [--batches 1,8,32,128]
  python -m bench.mla_sweep --json $OUT/mla_free.json --free [--candidates 64:16,64,320,4,2,1,1 ...]
  python -m bench.mla_sweep --json $OUT/mla_free_mma.json --free --rowsum-mma [--only-two-pass]

--free asks which launch knobs the deployment's bits do not depend on (they may then follow the
batch like the mode does): each variant of `default_launch` (warps, stages, BLOCK_H, merge) is
compared bit for bit with the deployment at two batches and the 4,096-row pass, and timed at every
batch. --candidates (H:BLOCK_H,BLOCK_S,chunk,warps,stages,V_SPLIT,narrow) adds whole new deployments.
With --rowsum-mma the two-pass prefill form (mla_prefill) comes right after the deployment's row: its
bits against the rowsum_mma deployment's, its 4,096-row time per launch shape (TWO_PASS_VARIANTS),
and each pass's time; --only-two-pass stops there (the deployment's row, then the two-pass rows).

The summary ends the log: per candidate and batch the best mode's us (and sglang_us / ours), the
worst ratio over batches, and the prefill us.
"""

from __future__ import annotations

import argparse
import json
import signal
from pathlib import Path
from typing import Any

import torch

from bench.kernels import (
    CALLS_PER_GRAPH,
    MLA_CONTEXT,
    MLA_LATENT,
    MLA_ROPE,
    MLA_WINDOW,
    graph_us,
    mla_inputs,
    stop_on_sigterm,
)
from runtime.kernels.triton import attention, mla_prefill

# (BLOCK_H, BLOCK_S, chunk positions, warps, stages, V_SPLIT[, narrow partials]); chunk >= S: one
# chunk (never spread).
CANDIDATES = {  # most likely first: a run cut short by its timeout loses the least
    64: [(16, 64, 128, 4, 2, 1), (16, 64, 64, 4, 2, 1), (16, 64, 128, 4, 2, 2), (16, 64, 64, 4, 2, 2),
         (16, 64, 64, 4, 2, 1, True), (16, 64, 64, 4, 2, 2, True), (16, 64, 128, 4, 2, 1, True),
         (32, 64, 128, 8, 2, 1), (16, 32, 64, 4, 2, 1), (32, 64, 128, 4, 2, 2), (64, 64, 128, 8, 2, 1),
         (64, 64, 320, 8, 2, 1), (64, 64, 4096, 8, 2, 1), (16, 64, 4096, 4, 2, 1), (16, 32, 32, 4, 2, 1),
         (16, 64, 128, 4, 3, 1), (16, 64, 128, 8, 2, 1), (32, 64, 64, 8, 2, 1), (32, 32, 64, 4, 2, 1),
         (64, 32, 64, 8, 2, 1), (64, 64, 128, 16, 2, 1), (64, 64, 128, 8, 2, 2)],
    16: [(16, 64, 128, 4, 2, 1), (16, 64, 64, 4, 2, 1), (16, 32, 32, 4, 2, 1), (16, 64, 128, 4, 2, 2),
         (16, 64, 64, 4, 2, 2), (16, 32, 32, 4, 2, 2), (16, 64, 64, 4, 2, 2, True), (16, 32, 32, 4, 2, 1, True),
         (16, 64, 128, 4, 2, 4), (16, 32, 64, 4, 2, 1), (16, 64, 4096, 4, 2, 1), (16, 64, 128, 4, 3, 1),
         (16, 32, 32, 4, 3, 1), (16, 64, 128, 8, 2, 1), (16, 64, 64, 8, 2, 1), (16, 16, 32, 4, 2, 1)],
}
MODES: dict[str, dict[str, Any]] = {  # sparse_mla_decode's keyword arguments
    "ticket": dict(spread=True, merge="ticket"), "kernel": dict(spread=True, merge="kernel"),
    "gathered": dict(spread=False, merge="registers"), "memory": dict(spread=False, merge="memory")}
PREFILL_ROWS = 4096
TWO_PASS = "two-pass"  # --variants' name for the two-pass prefill rows of --rowsum-mma


def launch_of(candidate: tuple, selected: int) -> dict[str, Any]:
    """A candidate's sparse_mla_decode knobs. Its optional 8th element is the latent's column groups
    (mla_grouped: 1 or 4; 0 or absent: default_launch's for the head count)."""
    block_h, block_s, chunk, warps, stages, v_split, *rest = candidate
    narrow, groups = (list(rest) + [0, 0])[:2]
    return dict(num_splits=max(1, -(-selected // chunk)), block_h=block_h, block_s=block_s, num_warps=warps,
                num_stages=stages, v_split=v_split, narrow_partials=bool(narrow), column_groups=groups or None)


def prepare(heads: int, topk: int, batches: list, cache: torch.Tensor, vs) -> dict:
    """One head count's inputs (every batch + the prefill rows) and SGLang's times on them."""
    gen = torch.Generator().manual_seed(heads)
    scale = (MLA_LATENT + MLA_ROPE) ** -0.5
    inputs = {b: mla_inputs(b, heads, topk, gen, cache.shape[0]) for b in batches + [PREFILL_ROWS]}
    sgl_us = {}
    if vs is not None:
        for b in batches:
            try:
                sgl_us[b] = vs.graph_us([lambda q=q, s=s: vs.sgl.sparse_mla(q, cache, s, MLA_LATENT, scale,
                                                                            vs.mla_workspace) for q, s in inputs[b]])
            except Exception as err:  # noqa: BLE001 - one failing SGLang call must not lose the sweep
                print(f"  sglang H={heads} bs={b}: {type(err).__name__}: {str(err)[:200]}", flush=True)
    return dict(inputs=inputs, sglang_us=sgl_us)


def time_candidate(heads: int, topk: int, candidate: tuple, batches: list, cache: torch.Tensor, prepared: dict) -> dict:
    inputs, scale = prepared["inputs"], (MLA_LATENT + MLA_ROPE) ** -0.5
    launch = launch_of(candidate, MLA_WINDOW + topk)
    row = dict(kernel="sparse_mla_sweep", H=heads, topk=topk, candidate=candidate, launch=launch, us={},
               sglang_us=prepared["sglang_us"])
    try:
        q, s = inputs[8][0] if 8 in inputs else inputs[batches[0]][0]
        # The grouped kernel (column_groups=4) has no fold through memory.
        modes = {name: mode for name, mode in MODES.items() if not (name == "memory" and launch["column_groups"] == 4)}
        outs = [attention.sparse_mla_decode(q, cache, s, MLA_LATENT, scale, **launch, **mode)
                for mode in modes.values()]
        row["modes_equal"] = all(torch.equal(outs[0], o) for o in outs[1:])
        for b in batches:
            for name, mode in modes.items():
                if name != "gathered" and launch["num_splits"] == 1:  # one chunk: every mode is this one
                    continue
                row["us"][f"{b}/{name}"] = graph_us([lambda q=q, s=s: attention.sparse_mla_decode(
                    q, cache, s, MLA_LATENT, scale, **launch, **mode) for q, s in inputs[b]], reps=10)
        row["us"][f"{PREFILL_ROWS}/gathered"] = graph_us([lambda q=q, s=s: attention.sparse_mla_decode(
            q, cache, s, MLA_LATENT, scale, **launch, **MODES["gathered"]) for q, s in inputs[PREFILL_ROWS][:2]],
            reps=3)
    except Exception as err:  # noqa: BLE001 - a shape the chip cannot hold (shared memory, registers)
        row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
    print(json.dumps(row), flush=True)
    print("  " + summary_line(row, batches), flush=True)
    return row


# Knobs of the deployment launch that might not touch a row's reduction order: warps and stages
# (the dots' k-steps run in order either way; the row sums' trees may not), BLOCK_H (mma m16 vs
# wgmma m64 tiles), and the gathered mode's fold (registers or memory). Each is checked, not assumed.
# Left out: what the H200 could not hold at the deployment's 2 stages (docs/results.md, "Seventh
# session": 256-290 KB of 227 KB shared memory): BLOCK_H 64 through memory, at 4 or 8 warps, and
# BLOCK_H 64 with 2 column blocks loaded a third time ("bh64/w8/v2+stages1" is its 1-stage form),
# and with 4 column blocks (251 KB, "Eighth session").
# The newest question first: a run cut short by its timeout still answers it.
FREE_VARIANTS: dict[str, dict[str, Any]] = {
    # The spread mode (deployed at bs <= 16 for H=64) with its merge as a programmatic dependent launch
    # (attention.PDL_MERGE; issue 15, 1.5x at bs <= 8): the merge's launch latency behind the chunks' work.
    "spread": dict(spread=True, merge="kernel"), "spread+pdl": dict(spread=True, merge="kernel", pdl=True),
    # A spread program runs one 64-position chunk, one block: stages beyond one buy no overlap and hold
    # shared memory, and 8 warps take mla_grouped's one-block loop (no second accumulator). At bs 8, H=64
    # the deployment's 320 four-warp programs are more than two a SM (SMALL_BATCH_LAUNCH's candidates).
    "spread/stages1": dict(spread=True, merge="kernel", num_stages=1),
    "spread/w8": dict(spread=True, merge="kernel", num_warps=8),
    "spread/w8+stages1": dict(spread=True, merge="kernel", num_warps=8, num_stages=1),
    "spread/w2+stages1": dict(spread=True, merge="kernel", num_warps=2, num_stages=1),
    # Registers (issue 15, bs 32-128 at H=64, where SGLang's one-accumulator kernel was 16-20% faster):
    # the latent in four column groups (mla_grouped; deployed at H=64 since the sixteenth session),
    # with 8 warps or 3 stages, the spread mode of each, and the ungrouped kernel (column_groups=1).
    "groups1": dict(column_groups=1), "groups4": dict(column_groups=4),
    "groups4+w8": dict(column_groups=4, num_warps=8), "groups4+stages3": dict(column_groups=4, num_stages=3),
    "spread/ticket": dict(spread=True, merge="ticket", column_groups=1),
    "spread/groups4/ticket": dict(spread=True, merge="ticket", column_groups=4),
    # Taller head blocks in groups (seventeenth session, H=64 bs 32-128 still 11-15% behind SGLang): a
    # query's rows gathered by 2 or 1 programs instead of 4 (free of bits with MMA row sums).
    "groups4+bh32/w8": dict(column_groups=4, block_h=32, num_warps=8),
    "groups4+bh64/w8": dict(column_groups=4, block_h=64, num_warps=8),
    "groups4+bh32/w4": dict(column_groups=4, block_h=32, num_warps=4),
    # ... and with the chunks spread (bs 32-64: a chunk's 64 rows gathered once for all heads, its state
    # through memory).
    "spread/groups4+bh64/w8": dict(spread=True, merge="kernel", column_groups=4, block_h=64, num_warps=8),
    "spread/groups4+bh32/w8": dict(spread=True, merge="kernel", column_groups=4, block_h=32, num_warps=8),
    "spread/groups4+bh64/w4": dict(spread=True, merge="kernel", column_groups=4, block_h=64, num_warps=4),
    # Small batches (issue 15 item 2): bs 1 at H=64 runs N chunks x 4 head blocks = 20 programs; latent
    # column blocks multiply them (each program scores its chunk over the whole latent, averages its
    # columns), free of bits with rowsum_mma, so a decode step with few rows could take them.
    "spread/v4/ticket": dict(spread=True, merge="ticket", v_split=4),
    "spread/v8/ticket": dict(spread=True, merge="ticket", v_split=8),
    "spread/bh32/v4/ticket": dict(spread=True, merge="ticket", block_h=32, num_warps=8, v_split=4),
    "bh64/w8": dict(block_h=64, num_warps=8),
    "memory": dict(merge="memory"), "stages1": dict(num_stages=1), "stages3": dict(num_stages=3),
    "memory+stages1": dict(merge="memory", num_stages=1), "warps8": dict(num_warps=8),
    "warps8+stages1": dict(num_warps=8, num_stages=1), "warps2": dict(num_warps=2),
    "warps8+memory": dict(num_warps=8, merge="memory"),
    "warps8+memory+stages1": dict(num_warps=8, merge="memory", num_stages=1),
    "bh32/w8": dict(block_h=32, num_warps=8), "bh32/w8+memory": dict(block_h=32, num_warps=8, merge="memory"),
    # Latent-column splits: each program scores over the whole latent but averages only its columns,
    # so a 64-head tile's two accumulators fit in registers (free only if the row sums are).
    "v2": dict(v_split=2), "bh32/w8/v2": dict(block_h=32, num_warps=8, v_split=2),
    "bh64/w8/v2+stages1": dict(block_h=64, num_warps=8, v_split=2, num_stages=1),
    # One program per chunk (the spread mode) at every batch: one accumulator, no fold in registers,
    # the chunks' states through memory; with 64-head tiles a chunk's rows are gathered once.
    "spread/bh32/w8": dict(spread=True, merge="kernel", block_h=32, num_warps=8),
    "spread/bh64/w8": dict(spread=True, merge="kernel", block_h=64, num_warps=8),
    "spread/bh64/w8/ticket": dict(spread=True, merge="ticket", block_h=64, num_warps=8),
    "spread/bh64/w4": dict(spread=True, merge="kernel", block_h=64, num_warps=4),
}


# The two-pass prefill form (runtime/kernels/triton/mla_prefill.py): the rowsum_mma deployment's
# bits by construction, timed at 4,096 rows only (a prefill form). Its launch shapes: scores pass
# (BLOCK_H, warps, stages) / values pass (BLOCK_H x BLOCK_V columns, warps, stages).
TWO_PASS_VARIANTS: dict[str, dict[str, Any]] = {
    # The first H200 sweep (docs/results.md, "Ninth session"): 4 warps a pass beat 8 (2,771 vs 3,239 us),
    # 32-head score programs gather each row twice (3,571). Around the 4-warp launch now:
    "two-pass/s64w4/v64x128w4": dict(scores_block_h=64, scores_warps=4, values_block_h=64, block_v=128,
                                     values_warps=4),
    "two-pass/s64w4/v64x64w4": dict(scores_block_h=64, scores_warps=4, values_block_h=64, block_v=64,
                                    values_warps=4),
    "two-pass/s64w4/v64x256w8": dict(scores_block_h=64, scores_warps=4, values_block_h=64, block_v=256,
                                     values_warps=8),
    "two-pass/s64w4/v64x128w8": dict(scores_block_h=64, scores_warps=4, values_block_h=64, block_v=128,
                                     values_warps=8),
    "two-pass/s64w4s3/v64x128w4s3": dict(scores_block_h=64, scores_warps=4, scores_stages=3, values_block_h=64,
                                         block_v=128, values_warps=4, values_stages=3),
    "two-pass/s64w4s1/v64x128w4": dict(scores_block_h=64, scores_warps=4, scores_stages=1, values_block_h=64,
                                       block_v=128, values_warps=4),
    "two-pass/s64w8/v64x128w8": dict(scores_block_h=64, scores_warps=8, values_block_h=64, block_v=128,
                                     values_warps=8),
}


def two_pass_rows(heads: int, topk: int, cache: torch.Tensor, prepared: dict, checks: list, want: list) -> list:
    """Each TWO_PASS_VARIANTS entry: the same bits as the rowsum_mma deployment on `checks` (`want`),
    its time on the prefill rows, and each pass's time apart (where the time goes)."""
    inputs, scale = prepared["inputs"][PREFILL_ROWS][:2], (MLA_LATENT + MLA_ROPE) ** -0.5
    rows = []
    for name, knobs in TWO_PASS_VARIANTS.items():
        row: dict[str, Any] = dict(kernel="sparse_mla_free", H=heads, topk=topk, variant=name, knobs=knobs, us={},
                                   sglang_us=prepared["sglang_us"])
        try:
            row["same_bits"] = all(torch.equal(mla_prefill.sparse_mla_two_pass(q, cache, s, MLA_LATENT, scale, **knobs),
                                               w) for (q, s), w in zip(checks, want))
            row["us"][str(PREFILL_ROWS)] = graph_us([lambda q=q, s=s: mla_prefill.sparse_mla_two_pass(
                q, cache, s, MLA_LATENT, scale, **knobs) for q, s in inputs], reps=3)
            scores = dict(block_h=knobs["scores_block_h"], num_warps=knobs["scores_warps"])  # stages: the default's
            stats = [mla_prefill.scores_pass(q, cache, s, MLA_LATENT, scale, **scores) for q, s in inputs]
            row["scores_pass_us"] = graph_us([lambda q=q, s=s: mla_prefill.scores_pass(
                q, cache, s, MLA_LATENT, scale, **scores) for q, s in inputs], reps=3)
            outs = [torch.empty(q.shape[0], heads, MLA_LATENT, dtype=q.dtype, device=q.device) for q, _ in inputs]
            row["values_pass_us"] = graph_us([lambda st=st, s=s, o=o: mla_prefill.values_pass(
                st, cache, s, o, block_h=knobs["values_block_h"], block_v=knobs["block_v"],
                num_warps=knobs["values_warps"]) for st, (_, s), o in zip(stats, inputs, outs)], reps=3)
            del stats, outs
        except Exception as err:  # noqa: BLE001 - a shape the chip cannot hold (shared memory, registers)
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def free_knobs(heads: int, topk: int, batches: list, cache: torch.Tensor, prepared: dict,
               rowsum_mma: bool = False, only_two_pass: bool = False, variants: list | None = None) -> list:
    """Each FREE_VARIANTS entry against the deployment (gathered, in registers): same bits at the
    smallest and largest batch and on 2 x 256 prefill rows, and its time at every batch. rowsum_mma:
    the same knobs around the deployment with its row sums as an MMA (`--rowsum-mma`). variants: only
    these FREE_VARIANTS names (None: all)."""
    inputs, scale = prepared["inputs"], (MLA_LATENT + MLA_ROPE) ** -0.5
    base = dict(spread=False, merge="registers", rowsum_mma=rowsum_mma)  # the rest: default_launch's
    checks = [inputs[b][0] for b in (batches[0], batches[-1])] + [
        (q[:256], s[:256]) for q, s in inputs[PREFILL_ROWS][:2]]

    def run(q, s, **kw) -> torch.Tensor:
        return attention.sparse_mla_decode(q, cache, s, MLA_LATENT, scale, **{**base, **kw})
    want = [run(q, s) for q, s in checks]
    free = {name: knobs for name, knobs in FREE_VARIANTS.items() if variants is None or name in variants}
    rows = []
    order: list[tuple[str, dict[str, Any] | None]]  # None: the two-pass rows
    if rowsum_mma:  # the newest question first (after the deployment's own row, its time the yardstick)
        # --variants without "two-pass" leaves the prefill form out (a decode-knob question only).
        two_pass = [("two-pass", None)] if variants is None or TWO_PASS in variants else []
        order = [("deployment", {}), *two_pass, *([] if only_two_pass else free.items())]
    else:
        order = [("deployment", {}), *free.items()]
    for name, knobs in order:
        if knobs is None:
            rows += two_pass_rows(heads, topk, cache, prepared, checks, want)
            continue
        row: dict[str, Any] = dict(kernel="sparse_mla_free", H=heads, topk=topk, variant=name, knobs=knobs, us={},
                                   sglang_us=prepared["sglang_us"])
        try:
            row["same_bits"] = all(torch.equal(run(q, s, **knobs), w) for (q, s), w in zip(checks, want))
            for b in batches:
                row["us"][str(b)] = graph_us([lambda q=q, s=s: run(q, s, **knobs) for q, s in inputs[b]], reps=10)
            row["us"][str(PREFILL_ROWS)] = graph_us([lambda q=q, s=s: run(q, s, **knobs)
                                                     for q, s in inputs[PREFILL_ROWS][:2]], reps=3)
        except Exception as err:  # noqa: BLE001 - a shape the chip cannot hold (shared memory, registers)
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def free_summary(rows: list, batches: list) -> str:
    out = ["== sparse MLA knobs vs the deployment launch (gathered): same bits?, us per batch, prefill us"]
    for r in rows:
        head = f"H={r['H']} {r['variant']:<20}"
        if "error" in r:
            out.append(f"{head} {r['error'][:140]}")
            continue
        cells = " | ".join(f"bs{b} {r['us'][str(b)]:.1f}{_vs(r, b)}" for b in batches if str(b) in r["us"])
        cells = cells or "prefill only"
        passes = (f" (scores {r['scores_pass_us']:.0f} + values {r['values_pass_us']:.0f})"
                  if "scores_pass_us" in r else "")
        out.append(f"{head} bits {'SAME' if r['same_bits'] else 'differ'} | {cells} | "
                   f"prefill {r['us'].get(str(PREFILL_ROWS), float('nan')):.0f}{passes}")
    return "\n".join(out)


def _vs(row: dict, batch: int) -> str:
    """ " (SGLang's us / ours)" where --vs-sglang timed SGLang at this batch, else nothing."""
    sgl = row.get("sglang_us", {}).get(batch)
    return "" if sgl is None else f" ({sgl / row['us'][str(batch)]:.2f})"


def summary_line(r: dict, batches: list) -> str:
    head = f"H={r['H']} top-{r['topk']} {tuple(r['candidate'])}"
    if "error" in r:
        return f"{head}: {r['error'][:160]}"
    cells, ratios = [], []
    for b in batches:
        us, mode = min((us, key.split("/")[1]) for key, us in r["us"].items() if key.startswith(f"{b}/"))
        ratio = r["sglang_us"].get(b, float("nan")) / us
        ratios.append(ratio)
        cells.append(f"bs{b} {us:.1f} {mode[0]} ({ratio:.2f})")
    bits = "same" if r["modes_equal"] else "DIFFER"
    return (f"{head:<47} " + " | ".join(cells) + f" | worst {min(ratios):.2f}"
            f" | prefill {r['us'][f'{PREFILL_ROWS}/gathered']:.0f} | modes' bits {bits}")


def summary(rows: list, batches: list) -> str:
    head = "== sparse MLA sweep: best mode (t/k/g/m) us per batch (sglang_us / ours), worst ratio, prefill us"
    return "\n".join([head] + [summary_line(r, batches) for r in rows])


def _vs_sglang():
    """SGLang beside ours, its wheel in .whl-sglang/ here or in a folder above (a tree exported
    under another checkout); without it the sweep still runs, ours only."""
    from bench import sglang_kernels

    try:
        for folder in [sglang_kernels.WHEEL_DIR, *(d / ".whl-sglang" for d in sglang_kernels.ROOT.parents)]:
            wheel = sglang_kernels.find_wheel(folder)
            if wheel is not None:
                sglang_kernels._LOADED = sglang_kernels._LOADED or sglang_kernels.SGLang(wheel)
                break
        vs = sglang_kernels.VsSGLang(graph_us)
    except (SystemExit, Exception) as err:  # noqa: BLE001 - the sweep of ours is still worth its run
        print(f"no SGLang beside ours: {type(err).__name__}: {str(err)[:300]}", flush=True)
        return None
    print(vs.header(), flush=True)
    return vs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--heads", default="64,16")
    parser.add_argument("--topk", type=int, default=512)
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--vs-sglang", action="store_true")
    parser.add_argument("--free", action="store_true", help="which deployment knobs keep its bits (see above)")
    parser.add_argument("--rowsum-mma", action="store_true", help="--free around the deployment with MMA row sums")
    parser.add_argument("--only-two-pass", action="store_true",
                        help="--free --rowsum-mma with the deployment and the two-pass form only")
    parser.add_argument("--variants", default=None,
                        help=f"--free: only these FREE_VARIANTS names (comma list; {TWO_PASS!r}: the two-pass rows)")
    parser.add_argument("--candidates", nargs="*", default=None,
                        help="H:BLOCK_H,BLOCK_S,chunk,warps,stages,V_SPLIT[,narrow[,column groups]] instead of "
                             "CANDIDATES")
    args = parser.parse_args()
    if args.only_two_pass:
        args.free = args.rowsum_mma = True
    variants = None if args.variants is None else args.variants.split(",")
    unknown = sorted(set(variants or ()) - set(FREE_VARIANTS) - {TWO_PASS})
    if unknown:
        parser.error(f"--variants: unknown {unknown}; known: {sorted(FREE_VARIANTS)}")
    vs = None
    if args.vs_sglang:
        vs = _vs_sglang()
    batches = [int(b) for b in args.batches.split(",")]
    cache = torch.randn(max(batches) * MLA_CONTEXT, MLA_LATENT + MLA_ROPE, device="cuda", dtype=torch.bfloat16)
    rows: list = []
    free: list = []
    # `timeout` ends a long run with SIGTERM: still print the summary and write the JSON.
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        heads = [int(h) for h in args.heads.split(",")]
        prepared = {h: prepare(h, args.topk, batches, cache, vs) for h in heads}
        if args.free:
            for h in heads:
                free += free_knobs(h, args.topk, batches, cache, prepared[h], args.rowsum_mma, args.only_two_pass,
                                   variants)
        if args.only_two_pass:
            order = []
        elif args.candidates is not None:
            order = [(int(c.split(":")[0]), tuple(int(x) for x in c.split(":")[1].split(","))) for c in args.candidates]
        else:  # head counts interleaved, each list most-likely first: a run cut short keeps the best of both
            order = [(h, CANDIDATES[h][i]) for i in range(max(len(CANDIDATES[h]) for h in heads)) for h in heads
                     if i < len(CANDIDATES[h])]
        for h, candidate in order:
            rows.append(time_candidate(h, args.topk, candidate, batches, cache, prepared[h]))
    finally:
        if free:
            print(free_summary(free, batches), flush=True)
        print(summary(rows, batches), flush=True)
        args.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), calls_per_graph=CALLS_PER_GRAPH,
                                             rows=rows, free=free), indent=1))


if __name__ == "__main__":
    main()
