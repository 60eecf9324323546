"""`StaticModelRunner`: executes a `StepPlan` on a CUDA device with the capturable decode model.

Every new token is one row of `StaticDecodeModel`: a prefill of 300 tokens is 300 rows at
positions start..start+299 sharing one page table, a decode is one row. One code path for prefill
and decode, and batch-invariant ops, mean a request's logits do not depend on how its tokens were
batched or chunked (batch invariance, and preemption recompute is exact).

A step's rows (prompt rows of its prefills, then one row per decoding request) run as one pass:
a CUDA-graph replay at the smallest bucket that holds them (`GraphRunner`; `step_buckets` reach the
largest step the scheduler plans: the prefill budget plus a decode row per running request), or above
the largest bucket (buckets set by hand, graphs off), eager passes of at most `max_rows` rows (the
prefill chunk: varlen over requests, in row order, so a prompt split across passes reads its prefix
from the paged cache).
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
from runtime.engine.plan import StepPlan
from runtime.engine.request import Request
from runtime.engine.sampler import SampleOutput
from runtime.env import Env
from runtime.faults import NO_FAULTS, FaultSet
from runtime.graph.decode_model import DecodeInputs, StaticDecodeModel
from runtime.graph.runner import GraphRunner, step_buckets
from runtime.kvcache.kv_cache import KVCache
from runtime.kvcache.page_pool import PagePool
from runtime.kvcache.page_table import PageTables
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
        buckets = tuple(env.graph_buckets or step_buckets(cfg.max_prefill_tokens, cfg.max_running_requests))
        self.max_rows = cfg.prefill_chunk  # rows per eager pass
        self.eager_passes = 0  # passes that ran outside the graphs (tests and benches read it)
        workspace_rows = max(self.max_rows, max(buckets))
        self.model = StaticDecodeModel(model_cfg, weights, page_size=self.page_size, max_pages=self.max_pages,
                                       max_batch=workspace_rows, faults=faults, all_reduce=all_reduce,
                                       moe_kernel=cfg.moe_kernel, attention_kernel=cfg.attention_kernel)
        self.graphs = GraphRunner(self.model, self.kv, self.streams, buckets=buckets,
                                  scratch_page=self.scratch_page, faults=faults, env=env)
        if cfg.cuda_graphs and on_gpu:
            self.graphs.capture()
        # Each request's page table, kept across steps (plans carry only new pages), padded with the
        # scratch page as the graphs' page tables are.
        self.tables = PageTables(self.max_pages, pad_page=self.scratch_page, rows=cfg.max_running_requests,
                                 mirrored=True)
        # Its device copy: a step sends only the entries that changed and gathers its rows' tables
        # here (was: every row's whole padded table, [rows, max_pages], copied every step).
        self.device_tables = torch.tensor(self.tables.block, device=self.device)  # [table rows, max_pages], a copy
        self.tables.take_changes()  # the copy above holds them
        self.future: FutureTokens | None = None  # set by build_runner for the overlap loop
        self.timeline: StepTimeline | None = None  # set by benchmarks

    # ---- building the rows ---------------------------------------------------------------------
    def build_step(self, plan: StepPlan, requests: dict[str, Request]) -> StepRows:
        """A step's rows (prefill extends, then decode extends) on the device, in one pass.

        Built with numpy in a few array operations over the whole step, then copied to the device
        as one pinned buffer: in the overlap loop this host work must fit inside one GPU step (under
        1 ms for the canary model), and each separate host-to-device copy of pageable memory costs
        a launch and may wait for the stream. The row of each extend's last token, the future
        buffer's read and write indices, and the page-table entries that changed since the last
        step travel in the same buffer; each row's page table is gathered from `device_tables`."""
        extends = plan.extends
        num_prefill = len(plan.prefill)
        from_future = self.future is not None
        tokens: list[int] = []
        future_rows: list[int] = []
        future_read: list[int] = []
        table_rows: list[int] = []  # each extend's row of self.tables
        row = 0
        for i, ext in enumerate(extends):
            ids = checked_input_ids(ext, requests[ext.rid], self.pool, self.page_size,
                                    from_future and i >= num_prefill, self.faults)
            table_rows.append(self.tables.apply(ext))
            if ids is None:
                assert self.future is not None  # rows come from it only in the overlap loop
                tokens.append(0)  # filled from the device-side future buffer below
                future_rows.append(row)
                future_read.append(self.future.held_slot(ext.rid))
            else:
                tokens.extend(ids)
            row += ext.num_new
        n, e = row, len(extends)
        # [extends, 2]: rows and first position of each extend
        shape = np.array([(ext.num_new, ext.start) for ext in extends], dtype=np.int64)
        counts, starts = shape[:, 0], shape[:, 1]
        table_of = np.asarray(table_rows, dtype=np.int64)  # [extends] row of self.tables
        last_rows = np.cumsum(counts) - 1
        if n == e:  # one row per extend (a decode step): the rows are the extends
            positions, row_tables = starts, table_of
        else:
            owner = np.repeat(np.arange(e), counts)  # [rows] which extend each row belongs to
            positions = starts[owner] + (np.arange(n) - (last_rows + 1 - counts)[owner])
            row_tables = table_of[owner]
        block = self.tables.block
        slots = block[row_tables, positions // self.page_size] * self.page_size + positions % self.page_size
        changed = self.tables.take_changes()  # [c] flat indices into the table block
        # Future-buffer slots the sampled tokens go to (assigned on a request's first step).
        future_write = [self.future.slot(ext.rid) for ext in extends] if self.future is not None else []
        f, w, c = len(future_rows), len(future_write), len(changed)
        flat = np.concatenate([np.asarray(tokens, dtype=np.int64), positions, slots, row_tables, last_rows,
                               np.asarray(future_rows + future_read + future_write, dtype=np.int64),
                               changed, block.reshape(-1)[changed]])
        host = torch.from_numpy(flat)
        if self.device.type == "cuda":
            # Pinned staging, so the copy is truly asynchronous; the caching host allocator keeps
            # the block until the copy has run.
            host = host.pin_memory()
        buf = host.to(self.device, non_blocking=True)
        token_ids, pos, write_slots, tables_of_rows, last, rows_f, read_f, write_f, changed_at, changed_to = \
            torch.split(buf, [n, n, n, n, e, f, f, w, c, c])
        if len(block) > len(self.device_tables):  # the host block grew (more live requests than rows)
            grown = torch.full((len(block) - len(self.device_tables), self.max_pages), self.scratch_page,
                               dtype=torch.long, device=self.device)
            self.device_tables = torch.cat([self.device_tables, grown])
        if c:  # stream-ordered after the previous step's gather: its rows' tables are already copied out
            self.device_tables.view(-1)[changed_at] = changed_to
        page_table = self.device_tables[tables_of_rows]  # [rows, max_pages]
        if f:
            assert self.future is not None
            token_ids[rows_f] = self.future.tokens[read_f]
        identity = n == e  # every extend is one row (a decode-only step): no gather of the last rows
        return StepRows(DecodeInputs(token_ids, pos, write_slots, page_table), last_rows, None if identity else last,
                        write_f if w else None)

    # ---- running them --------------------------------------------------------------------------
    def forward(self, inp: DecodeInputs, last_rows: np.ndarray, last: torch.Tensor | None) -> torch.Tensor:
        """float32 logits [len(last_rows), V] of a step's rows (prompt and decode rows alike): one
        graph replay at the step's bucket, or eager passes of at most `max_rows` rows above the
        largest bucket. Passes run in row order, so a prompt split across passes is still causal.
        `last` is `last_rows` on the device, or None where they are every row."""
        if self.graphs.graphs and inp.batch_size <= max(self.graphs.buckets):
            logits = self.graphs.forward(inp)
            return logits if last is None else logits[last]
        picked = []
        self.eager_passes += -(-inp.batch_size // self.max_rows)
        for start in range(0, inp.batch_size, self.max_rows):
            stop = min(start + self.max_rows, inp.batch_size)
            chunk = DecodeInputs(inp.token_ids[start:stop], inp.positions[start:stop], inp.write_slots[start:stop],
                                 inp.page_table[start:stop])
            wanted = last_rows[(last_rows >= start) & (last_rows < stop)] - start
            logits = self.graphs.eager(chunk)
            if len(wanted):
                picked.append(logits if len(wanted) == chunk.batch_size else
                              logits[torch.from_numpy(wanted).to(self.device, non_blocking=True)])
        return torch.cat(picked) if len(picked) > 1 else picked[0]

    def release(self, rid: str) -> None:
        """Forget a finished, aborted or preempted request: its page table and future slot."""
        self.tables.release(rid)
        if self.future is not None:
            self.future.release(rid)

    def execute(self, plan: StepPlan, requests: dict[str, Request]) -> Mapping[str, SampleOutput]:
        for rid in plan.aborted + plan.preempted:
            self.release(rid)
        if plan.copies:  # prefix-cache hits, queued before any row reads (or a new owner overwrites) the cached pages
            self.kv.copy_pages(plan.copies, self.page_size)
        if plan.empty:
            return {}
        # plan.extends order: prefill rows first, then decode rows (their requests are disjoint), all
        # in one pass: a row's bits do not depend on the rows beside it.
        rows = self.build_step(plan, requests)
        # After the inputs are built: in the normal loop the GPU idles while the host builds them.
        begin = self.timeline.begin() if self.timeline is not None else None
        logits = self.forward(rows.inputs, rows.last_rows, rows.last)
        tokens, pending = sample_on_device(logits, [requests[ext.rid] for ext in plan.extends])
        if rows.future_write is not None:
            assert self.future is not None
            self.future.tokens[rows.future_write] = tokens
        if begin is not None and self.timeline is not None:
            self.timeline.end(begin)
        return pending


@dataclasses.dataclass(frozen=True)
class StepRows:
    """What `build_step` hands the forward pass: the rows, where each extend's last row is (host,
    and on the device unless it is every row), and the future-buffer slots of the step's tokens."""

    inputs: DecodeInputs
    last_rows: np.ndarray  # [extends]
    last: torch.Tensor | None  # last_rows on the device; None: every row is a last row
    future_write: torch.Tensor | None  # [extends] slots of FutureTokens.tokens, overlap loop only
