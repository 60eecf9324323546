"""Executes a `StepPlan`: builds the flat `ForwardBatch`, runs the model, samples each request."""

from __future__ import annotations

import numpy as np
import torch

from runtime.engine.future import FutureTokens
from runtime.engine.plan import Extend, StepPlan
from runtime.engine.request import Request
from runtime.engine.sampler import SampleOutput, sample_row
from runtime.faults import NO_FAULTS, FaultSet
from runtime.kvcache.kv_cache import KVCache
from runtime.kvcache.page_pool import PagePool
from runtime.kvcache.page_table import PageTables
from runtime.models.batch import ForwardBatch, Segment
from runtime.models.dsv4_mini import DSV4Mini
from runtime.streams.tasks import StreamExecutor


def checked_input_ids(ext: Extend, req: Request, pool: PagePool, page_size: int, from_future: bool,
                      faults: FaultSet) -> list[int] | None:
    """Check one extend against its pages and their owner, and give its input ids: from the host
    token list, or None where the overlap loop reads them from the device-side future buffer.
    Shared by both runners, so the `overlap-stale-token` fault lives in one place."""
    end = ext.start + ext.num_new
    if ext.num_pages * page_size < end:
        raise RuntimeError(f"{ext.rid}: plan gives {ext.num_pages} pages for {end} tokens")
    pool.check_table(ext.rid, ext.new_pages, ext.num_pages)
    if from_future:
        if faults.enabled("overlap-stale-token"):
            # the bug: the host's last known token, one step behind
            return req.ids_between(req.total_len - 1, req.total_len)
        return None
    ids = req.ids_between(ext.start, end)
    assert len(ids) == ext.num_new, f"{ext.rid}: plan asks for tokens the request does not have"
    return ids


class ModelRunner:
    def __init__(self, model: DSV4Mini, kv: KVCache, pool: PagePool, streams: StreamExecutor,
                 faults: FaultSet = NO_FAULTS, *, max_pages: int | None = None, max_rows: int = 64) -> None:
        self.model = model
        self.kv = kv
        self.pool = pool
        self.streams = streams
        self.page_size = pool.page_size
        self.faults = faults
        # Each request's page table, kept across steps (plans carry only new pages).
        self.tables = PageTables(max_pages if max_pages is not None else pool.num_pages, pad_page=-1, rows=max_rows)
        # Set by build_runner(overlap=True): decode inputs then come from here, not from the host token lists.
        self.future: FutureTokens | None = None
        self._shared_generator = torch.Generator().manual_seed(0)  # the shared-sampling-generator fault's

    def slots_for(self, pages: np.ndarray, start: int, stop: int) -> torch.Tensor:
        positions = torch.arange(start, stop)
        page_ids = torch.from_numpy(pages)[positions // self.page_size]
        return page_ids * self.page_size + positions % self.page_size

    def release(self, rid: str) -> None:
        """Forget a finished, aborted or preempted request: its page table and future slot."""
        self.tables.release(rid)
        if self.future is not None:
            self.future.release(rid)

    def build_batch(self, plan: StepPlan, requests: dict[str, Request]) -> ForwardBatch:
        token_ids, positions, slots, segments = [], [], [], []
        row = 0
        for index, ext in enumerate(plan.extends):
            from_future = self.future is not None and index >= len(plan.prefill)
            ids = checked_input_ids(ext, requests[ext.rid], self.pool, self.page_size, from_future, self.faults)
            if ids is None:  # only rows the future buffer holds
                assert self.future is not None
                token_ids.append(self.future.read([ext.rid]))
            else:
                token_ids.append(torch.tensor(ids, dtype=torch.long))
            self.tables.apply(ext)
            end = ext.start + ext.num_new
            positions.append(torch.arange(ext.start, end))
            context = self.slots_for(self.tables.pages(ext.rid), 0, end)
            slots.append(context[ext.start:end])
            # One segment per extend, whatever it covers (a prompt, part of one after a prefix-cache hit,
            # a preemption's prompt + output): a row's bits do not depend on its segment (kernels/cpu.py).
            segments.append(Segment(row, row + ext.num_new, context))
            row += ext.num_new
        return ForwardBatch(torch.cat(token_ids), torch.cat(positions), torch.cat(slots), tuple(segments))

    def execute(self, plan: StepPlan, requests: dict[str, Request]) -> dict[str, SampleOutput]:
        for rid in plan.aborted + plan.preempted:
            self.release(rid)
        if plan.copies:  # prefix-cache hits, before any row reads (or a new owner overwrites) the cached pages
            self.kv.copy_pages(plan.copies, self.page_size)
        if plan.empty:
            return {}
        batch = self.build_batch(plan, requests)
        logits = self.model.forward(batch, self.kv, self.streams)
        if self.faults.enabled("shared-sampling-generator"):  # the bug: one generator draws for the whole batch
            for ext in plan.extends:
                requests[ext.rid].generator = self._shared_generator
        outputs = {ext.rid: sample_row(logits[i], requests[ext.rid]) for i, ext in enumerate(plan.extends)}
        if self.future is not None:
            rids = [ext.rid for ext in plan.extends]
            self.future.write(rids, torch.tensor([outputs[rid].token for rid in rids], dtype=torch.long))
        return outputs
