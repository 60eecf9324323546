"""Helpers shared by tests in several folders (fixtures live in tests/conftest.py; pytest advises
against importing from a conftest, so plain values and classes live here).

- `API_KEY`: the bearer token of the e2e `server` fixture.
- `sampled_rows`: random logits and sampling parameters (temperature, top-p, top-k, seed) for the
  sampler tests on CPU and on the GPU.
- `ExtendCase`, `make_batch`: random extend batches over a pre-filled KV cache, shared by the
  stream tests (tests/unit) and the static-graph tests (tests/kernels).

Each request owns a contiguous slot range; its prefix (possibly empty) is prefilled in order,
then one step extends every request by a few tokens. Prefix lengths go past `window + topk`, so
the indexer really drops tokens and a stale selection changes the result.
"""

from __future__ import annotations

import random

import torch

from runtime.config import EngineConfig
from runtime.engine.request import SamplingParams
from runtime.faults import FaultSet
from runtime.kernels import cpu
from runtime.kvcache.kv_cache import KVCache
from runtime.models.batch import ForwardBatch, Segment
from runtime.models.dsv4_mini import DSV4Mini
from runtime.streams.tasks import InOrderExecutor, StreamExecutor

API_KEY = "test-key"

SLOTS_PER_REQUEST = 128


def sampled_rows(seed: int, n: int, vocab: int) -> tuple[torch.Tensor, list[SamplingParams]]:
    """n rows of logits at a random scale (flat to peaked) and n parameter sets mixing top-p on/off
    and top-k on/off, each with its own seed."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=gen) * float(torch.empty(()).uniform_(0.5, 6.0, generator=gen))
    params = []
    for i in range(n):
        t, p, k = torch.rand(3, generator=gen).tolist()
        params.append(SamplingParams(temperature=0.2 + 1.8 * t, top_p=1.0 if p > 0.7 else 0.3 + 0.7 * p,
                                     top_k=0 if k > 0.5 else 1 + int(k * 40), seed=seed * 1000 + i))
    return logits, params


def make_batch(spans: list[tuple[int, int]], token_ids: list[list[int]]) -> ForwardBatch:
    """spans[i] = (start, stop) positions of request i's new tokens; token_ids[i] its full ids."""
    ids, positions, slots, segments, row = [], [], [], [], 0
    for i, (start, stop) in enumerate(spans):
        base = i * SLOTS_PER_REQUEST
        ids.append(torch.tensor(token_ids[i][start:stop], dtype=torch.long))
        positions.append(torch.arange(start, stop))
        slots.append(base + torch.arange(start, stop))
        segments.append(Segment(row, row + stop - start, base + torch.arange(stop)))
        row += stop - start
    return ForwardBatch(torch.cat(ids), torch.cat(positions), torch.cat(slots), tuple(segments))


class ExtendCase:
    """A pre-filled cache plus one extend step; `run` replays that step on a copy of the cache."""

    def __init__(self, tiny, seed: int, num_requests: int = 4) -> None:
        rng = random.Random(seed)
        cfg = tiny.config
        self.tiny = tiny
        self.prefix = [rng.randint(0, 3 * cfg.selected_tokens) for _ in range(num_requests - 1)]
        self.prefix.append(2 * cfg.selected_tokens)  # at least one request on the sparse path
        self.new = [rng.randint(1, 4) for _ in range(num_requests)]
        self.ids = [[rng.randrange(cfg.vocab_size) for _ in range(p + n)] for p, n in zip(self.prefix, self.new)]
        # One extra page past the requests: the graph runner's scratch page for padded rows.
        self.scratch_page = num_requests * SLOTS_PER_REQUEST // 16
        engine_cfg = EngineConfig(page_size=16, num_pages=self.scratch_page + 1)
        self.kv = KVCache(cfg, engine_cfg, torch.float32)
        filled = [i for i, p in enumerate(self.prefix) if p > 0]
        if filled:
            # Prefill only the requests with a prefix, in their own slot ranges.
            prefill = make_batch([(0, self.prefix[i]) for i in filled], [self.ids[i] for i in filled])
            prefill = _relocate(prefill, filled)
            self.model().forward(prefill, self.kv, InOrderExecutor())
        self.batch = make_batch([(p, p + n) for p, n in zip(self.prefix, self.new)], self.ids)

    def model(self, faults: tuple[str, ...] = ()) -> DSV4Mini:
        return DSV4Mini(self.tiny.config, self.tiny.weights, cpu, faults=FaultSet(faults))

    def run(self, streams: StreamExecutor, faults: tuple[str, ...] = ()) -> torch.Tensor:
        kv = KVCache.__new__(KVCache)
        kv.latent, kv.index_keys = self.kv.latent.clone(), self.kv.index_keys.clone()
        return self.model(faults).forward(self.batch, kv, streams)


def _relocate(batch: ForwardBatch, owners: list[int]) -> ForwardBatch:
    """`make_batch` numbers requests 0..n-1; move each to its owner's slot range."""
    shift = [(owner - i) * SLOTS_PER_REQUEST for i, owner in enumerate(owners)]
    slots = batch.slots.clone()
    segments = []
    for i, seg in enumerate(batch.segments):
        slots[seg.start:seg.end] += shift[i]
        segments.append(Segment(seg.start, seg.end, seg.context_slots + shift[i]))
    return ForwardBatch(batch.token_ids, batch.positions, slots, tuple(segments))
