"""`StaticModelRunner`: executes a `StepPlan` on a CUDA device with the capturable decode model.

Every new token is one row of `StaticDecodeModel`: a prefill of 300 tokens is 300 rows at
positions start..start+299 sharing one page table, a decode is one row. One code path for prefill
and decode, and batch-invariant ops, mean a request's logits do not depend on how its tokens were
batched or chunked (batch invariance, and preemption recompute is exact).

A step's rows (prompt rows of its prefills, then one row per decoding request) run as one pass:
a CUDA-graph replay at the smallest bucket that holds them (`GraphRunner`, STEP_BUCKETS up to 4,096
rows), or above that, eager passes of at most `max_rows` rows (the prefill chunk: varlen over
requests, in row order, so a prompt split across passes reads its prefix from the paged cache).
The indexer runs on a side stream (`CudaStreamExecutor`) unless multi-stream is switched off. The KV
cache has one page more than the pool hands out: the scratch page that padded rows write and read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import torch

from runtime.config import EngineConfig, ModelConfig
from runtime.engine.device_sampler import sample_on_device
from runtime.engine.future import FutureTokens
from runtime.engine.model_runner import checked_input_ids
from runtime.engine.plan import Extend, StepPlan
from runtime.engine.request import Request
from runtime.engine.sampler import SampleOutput
from runtime.env import Env
from runtime.faults import NO_FAULTS, FaultSet
from runtime.graph.decode_model import DecodeInputs, StaticDecodeModel
from runtime.graph.runner import STEP_BUCKETS, GraphRunner
from runtime.kvcache.kv_cache import KVCache
from runtime.kvcache.page_pool import PagePool
from runtime.streams.cuda import CudaStreamExecutor
from runtime.streams.tasks import InOrderExecutor


class StepTimeline:
    """CUDA events at the start and end of each executed step's device work, to measure how long
    the GPU sat idle between steps (the overlap loop's figure of merit)."""

    def __init__(self) -> None:
        self.marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def begin(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def end(self, begin: torch.cuda.Event) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.marks.append((begin, event))

    def summary(self, skip: int = 0) -> dict[str, float]:
        """Busy and idle milliseconds over the recorded steps (after `skip` warm-up steps)."""
        torch.cuda.synchronize()
        marks = self.marks[skip:]
        busy = sum(b.elapsed_time(e) for b, e in marks)
        idle = sum(max(0.0, prev_end.elapsed_time(b)) for (_, prev_end), (b, _) in zip(marks, marks[1:]))
        return {"steps": len(marks), "busy_ms": busy, "idle_ms": idle,
                "idle_fraction": idle / (busy + idle) if busy + idle else 0.0}


class StaticModelRunner:
    def __init__(self, model_cfg: ModelConfig, weights: dict[str, torch.Tensor], cfg: EngineConfig, pool: PagePool,
                 faults: FaultSet = NO_FAULTS, env: Env | None = None, *, all_reduce=None) -> None:
        env = env or Env.load()
        self.device = torch.device(cfg.device)
        self.pool, self.faults = pool, faults
        self.page_size = cfg.page_size
        self.max_pages = -(-cfg.max_model_len // cfg.page_size)
        self.scratch_page = cfg.num_pages  # one past the pool's pages: no request ever owns it
        dtype = next(iter(weights.values())).dtype
        self.kv = KVCache(model_cfg, dataclasses.replace(cfg, num_pages=cfg.num_pages + 1), dtype)
        on_gpu = self.device.type == "cuda"
        side_streams = cfg.multi_stream and on_gpu
        self.streams = CudaStreamExecutor(env.stream_jitter_cycles) if side_streams else InOrderExecutor()
        buckets = tuple(env.graph_buckets or STEP_BUCKETS)
        self.max_rows = cfg.prefill_chunk  # rows per eager pass
        workspace_rows = max(self.max_rows, max(buckets))
        self.model = StaticDecodeModel(model_cfg, weights, page_size=self.page_size, max_pages=self.max_pages,
                                       max_batch=workspace_rows, faults=faults, all_reduce=all_reduce,
                                       moe_kernel=cfg.moe_kernel, attention_kernel=cfg.attention_kernel)
        self.graphs = GraphRunner(self.model, self.kv, self.streams, buckets=buckets,
                                  scratch_page=self.scratch_page, faults=faults, env=env)
        if cfg.cuda_graphs and on_gpu:
            self.graphs.capture()
        self.future: FutureTokens | None = None  # set by build_runner for the overlap loop
        self.timeline: StepTimeline | None = None  # set by benchmarks

    # ---- building the rows ---------------------------------------------------------------------
    def build_inputs(self, extends: tuple[Extend, ...], requests: dict[str, Request],
                     decode: bool) -> tuple[DecodeInputs, list[int]]:
        """The rows of these extends on the device, and the row of each extend's last token.

        Built with numpy in a few array operations, not per-row torch calls: in the overlap loop
        this host work must fit inside one GPU step (about 1 ms for the canary model at bs 16)."""
        tokens: list[int] = []
        future_rows, future_rids = [], []
        counts = np.fromiter((ext.num_new for ext in extends), dtype=np.int64, count=len(extends))
        table = np.full((len(extends), self.max_pages), self.scratch_page, dtype=np.int64)
        row = 0
        for i, ext in enumerate(extends):
            if len(ext.pages) > self.max_pages:
                raise RuntimeError(f"{len(ext.pages)} pages exceed max_model_len ({self.max_pages} pages)")
            ids = checked_input_ids(ext, requests[ext.rid], self.pool, self.page_size,
                                    decode and self.future is not None, self.faults)
            table[i, :len(ext.pages)] = ext.pages
            if ids is None:
                tokens.append(0)  # filled from the device-side future buffer below
                future_rows.append(row)
                future_rids.append(ext.rid)
            else:
                tokens.extend(ids)
            row += ext.num_new
        starts = np.fromiter((ext.start for ext in extends), dtype=np.int64, count=len(extends))
        owner = np.repeat(np.arange(len(extends)), counts)  # [rows] which extend each row belongs to
        first_row = np.cumsum(counts) - counts
        positions = starts[owner] + (np.arange(row) - first_row[owner])
        slots = table[owner, positions // self.page_size] * self.page_size + positions % self.page_size

        def dev(a) -> torch.Tensor:
            return torch.as_tensor(a, dtype=torch.long).to(self.device, non_blocking=True)

        token_ids = dev(tokens)
        if future_rows:
            assert self.future is not None  # rows come from it only in the overlap loop
            token_ids[dev(future_rows)] = self.future.read(future_rids)
        inp = DecodeInputs(token_ids, dev(positions), dev(slots), dev(table[owner]))
        return inp, (np.cumsum(counts) - 1).tolist()

    # ---- running them --------------------------------------------------------------------------
    def forward(self, inp: DecodeInputs, last_rows: list[int]) -> torch.Tensor:
        """float32 logits [len(last_rows), V] of a step's rows (prompt and decode rows alike): one
        graph replay at the step's bucket, or eager passes of at most `max_rows` rows above the
        largest bucket. Passes run in row order, so a prompt split across passes is still causal."""
        last = torch.tensor(last_rows, dtype=torch.long)
        if self.graphs.graphs and inp.batch_size <= max(self.graphs.buckets):
            return self.graphs.forward(inp)[last.to(self.device, non_blocking=True)]
        picked = []
        for start in range(0, inp.batch_size, self.max_rows):
            stop = min(start + self.max_rows, inp.batch_size)
            chunk = DecodeInputs(inp.token_ids[start:stop], inp.positions[start:stop], inp.write_slots[start:stop],
                                 inp.page_table[start:stop])
            wanted = last[(last >= start) & (last < stop)] - start
            logits = self.graphs.eager(chunk)
            if len(wanted):
                picked.append(logits[wanted.to(self.device, non_blocking=True)])
        return torch.cat(picked)

    def execute(self, plan: StepPlan, requests: dict[str, Request]) -> Mapping[str, SampleOutput]:
        if self.future is not None:
            for rid in plan.aborted + plan.preempted:
                self.future.release(rid)
        if plan.empty:
            return {}
        # plan.extends order: prefill rows first, then decode rows (their requests are disjoint), all
        # in one pass: a row's bits do not depend on the rows beside it.
        parts = [self.build_inputs(extends, requests, decode=decode)
                 for extends, decode in ((plan.prefill, False), (plan.decode, True)) if extends]
        inp, last_rows = parts[0]
        if len(parts) == 2:
            (decode_inp, decode_last), offset = parts[1], inp.batch_size
            inp = DecodeInputs(*(torch.cat([a, b]) for a, b in zip(
                (inp.token_ids, inp.positions, inp.write_slots, inp.page_table),
                (decode_inp.token_ids, decode_inp.positions, decode_inp.write_slots, decode_inp.page_table))))
            last_rows = last_rows + [offset + row for row in decode_last]
        # After the inputs are built: in the normal loop the GPU idles while the host builds them.
        begin = self.timeline.begin() if self.timeline is not None else None
        logits = self.forward(inp, last_rows)
        rows = [requests[ext.rid] for ext in plan.extends]
        tokens, pending = sample_on_device(logits, rows)
        if self.future is not None:
            self.future.write([ext.rid for ext in plan.extends], tokens)
        if begin is not None and self.timeline is not None:
            self.timeline.end(begin)
        return pending
