"""`GraphRunner`: capture the decode step once per batch-size bucket, pad each real batch to its
bucket, replay; eager above the largest bucket (after mini-sglang's engine/graph.py).

Capture runs on small dummy inputs (position 0, the scratch page); every replay first copies the
real batch into the static `GraphCaptureBuffer`, so nothing about the capture-time batch may
survive into a replay. The `stale-graph-metadata` fault breaks exactly that: it captures the
positions as a tensor snapshotted at capture time instead of the static buffer, so every replay
attends as if each request were at position 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.env import Env
from runtime.faults import NO_FAULTS, FaultSet
from runtime.graph.decode_model import DecodeInputs, StaticDecodeModel
from runtime.kvcache.kv_cache import KVCache
from runtime.streams.tasks import StreamExecutor

# A step is one pass over the padded batch, so a padded row costs little (weights are read once
# either way) but not nothing. Fine: powers of two to 8, then every 8 rows (SGLang's default shape).
# Coarse: powers of two (fewer graphs, a deeper padding sawtooth).
FINE_BUCKETS = (1, 2, 4, 8) + tuple(range(16, 129, 8))
COARSE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# The engine's default: a step's prompt rows ride in the same graph as its decode rows, so buckets go
# on past the decode batch sizes, coarser, up to the prefill budget (EngineConfig.max_prefill_tokens),
# so a step with fresh prompts is one replay too: an eager pass costs the host ~5 ms of kernel
# launches under the GIL, 44% of the engine thread in the H200 gate when buckets stopped at 1,024.
STEP_BUCKETS = FINE_BUCKETS + (160, 192, 256, 320, 384, 512, 640, 768, 1024, 1280, 1536, 2048, 2560, 3072, 4096)
# Past STEP_BUCKETS' top, buckets every this many rows up to the engine's largest step.
LARGE_BUCKET_STEP = 1024


def step_buckets(max_prefill_tokens: int, max_running_requests: int) -> tuple[int, ...]:
    """STEP_BUCKETS, continued up to the largest step the scheduler can plan: a full prefill budget
    plus one decode row for every other running request. Stopping at the prefill budget sent exactly
    the busiest steps (fresh prompts while others decode) to eager passes: on the H200 gate those
    compiled Triton variants on the serving path (1.9 s of the engine thread in a 13.5 s run, every
    eager pass a new context width for the indexer's selection) and paid ~5 ms of launches each."""
    largest = max_prefill_tokens + max_running_requests
    extra = tuple(range(max(STEP_BUCKETS) + LARGE_BUCKET_STEP, largest, LARGE_BUCKET_STEP))
    return STEP_BUCKETS + extra + ((largest,) if largest > max(STEP_BUCKETS) else ())


def pad_batch(batch_size: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket that holds `batch_size` rows (ValueError above the largest)."""
    for bucket in sorted(buckets):
        if bucket >= batch_size:
            return bucket
    raise ValueError(f"batch of {batch_size} exceeds the largest graph bucket {max(buckets)}")


def can_use_cuda_graph(batch_size: int, buckets: tuple[int, ...]) -> bool:
    return 0 < batch_size <= max(buckets)


def pad_inputs(inp: DecodeInputs, rows: int, scratch_page: int, page_size: int) -> DecodeInputs:
    """`inp` plus dummy rows up to `rows`: token 0 at position 0 of the scratch page, which no
    request owns, so a padded row never writes or reads another request's KV."""
    extra = rows - inp.batch_size
    if extra == 0:
        return inp
    dev = inp.token_ids.device
    long = dict(dtype=torch.long, device=dev)
    return DecodeInputs(
        torch.cat([inp.token_ids, torch.zeros(extra, **long)]),
        torch.cat([inp.positions, torch.zeros(extra, **long)]),
        torch.cat([inp.write_slots, torch.full((extra,), scratch_page * page_size, **long)]),
        torch.cat([inp.page_table, torch.full((extra, inp.page_table.shape[1]), scratch_page, **long)]))


@dataclass
class GraphCaptureBuffer:
    """Static inputs and outputs every graph reads and writes (a bucket uses the first rows)."""

    token_ids: torch.Tensor  # [M]
    positions: torch.Tensor  # [M]
    write_slots: torch.Tensor  # [M]
    page_table: torch.Tensor  # [M, P]

    @classmethod
    def allocate(cls, max_rows: int, max_pages: int, device) -> GraphCaptureBuffer:
        z = dict(dtype=torch.long, device=device)
        return cls(torch.zeros(max_rows, **z), torch.zeros(max_rows, **z), torch.zeros(max_rows, **z),
                   torch.zeros(max_rows, max_pages, **z))

    def view(self, rows: int) -> DecodeInputs:
        return DecodeInputs(self.token_ids[:rows], self.positions[:rows], self.write_slots[:rows],
                            self.page_table[:rows])

    def fill(self, inp: DecodeInputs) -> None:
        n = inp.batch_size
        self.token_ids[:n].copy_(inp.token_ids)
        self.positions[:n].copy_(inp.positions)
        self.write_slots[:n].copy_(inp.write_slots)
        self.page_table[:n].copy_(inp.page_table)


class GraphRunner:
    def __init__(self, model: StaticDecodeModel, kv: KVCache, streams: StreamExecutor, *,
                 buckets: tuple[int, ...] | None = None, scratch_page: int, faults: FaultSet = NO_FAULTS,
                 env: Env | None = None) -> None:
        self.model, self.kv, self.streams, self.faults = model, kv, streams, faults
        self.buckets = tuple(sorted(set(buckets or (env or Env.load()).graph_buckets or FINE_BUCKETS)))
        if self.buckets[0] <= 0:
            raise ValueError(f"graph buckets must be positive, got {self.buckets}")
        self.scratch_page = scratch_page
        self.buffer = GraphCaptureBuffer.allocate(max(self.buckets), model.max_pages, model.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0
        self._snapshots: list[torch.Tensor] = []

    def _dummy(self, rows: int) -> DecodeInputs:
        empty = torch.zeros(0, dtype=torch.long, device=self.model.device)
        inp = DecodeInputs(empty, empty, empty, torch.zeros(0, self.model.max_pages, dtype=torch.long,
                                                            device=self.model.device))
        return pad_inputs(inp, rows, self.scratch_page, self.model.page_size)

    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):  # largest first: smaller graphs reuse its pool memory
            self.buffer.fill(self._dummy(bucket))
            static = self.buffer.view(bucket)
            if self.faults.enabled("stale-graph-metadata"):
                # The bug: metadata snapshotted at capture time; replays read the snapshot forever.
                # (kept alive in `_snapshots`: the graph reads its address on every replay)
                static = DecodeInputs(static.token_ids, static.positions.clone(), static.write_slots,
                                      static.page_table)
                self._snapshots.append(static.positions)
            warmup = torch.cuda.Stream()
            warmup.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(warmup):
                self.model.forward(static, self.kv, self.streams)  # warm up allocator and libraries
            torch.cuda.current_stream().wait_stream(warmup)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self.model.forward(static, self.kv, self.streams)
            self.graphs[bucket] = graph
        torch.cuda.synchronize()

    def forward(self, inp: DecodeInputs) -> torch.Tensor:
        """Logits [N, V] for a real batch: graph replay at its bucket, or eager above the largest."""
        n = inp.batch_size
        if not self.graphs or not can_use_cuda_graph(n, self.buckets):
            return self.eager(inp)
        bucket = pad_batch(n, self.buckets)
        self.buffer.fill(pad_inputs(inp, bucket, self.scratch_page, self.model.page_size))
        self.graphs[bucket].replay()
        self.replays += 1
        return self.outputs[bucket][:n].clone()

    def eager(self, inp: DecodeInputs) -> torch.Tensor:
        """One eager pass over exactly these rows (no padding: no op's result depends on the batch)."""
        return self.model.forward(inp, self.kv, self.streams)
