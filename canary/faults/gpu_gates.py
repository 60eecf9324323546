"""GPU gates over the capturable decode path (runtime/graph), each returning a `GateResult`.

- graph vs eager: one `GraphRunner` decodes the same batch eagerly and by graph replay, from the
  same KV snapshot; logits must be identical bit for bit (catches `stale-graph-metadata`).
- jitter vs in-order: one `StaticDecodeModel` behind two runners, one on a single in-order stream
  and one on real CUDA streams with the seeded jitter injector (busy-waits at every record/wait);
  graph-replayed logits must be identical bit for bit (catches `stream-race`). Sharing the model
  keeps the comparison about the stream layout alone.
Every comparison restores the KV cache between runs: a run writes its tokens into the requests'
pages, and a later run would otherwise attend over them. Needs CUBLAS_WORKSPACE_CONFIG=:4096:8
(set before the first cuBLAS call) for bits that do not depend on the stream.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

from canary.faults.matrix import GateResult

MODEL = "tiny-random"
PAGE, PAGES_PER_REQUEST, STEPS = 16, 24, 6
BUCKETS = (16, 32, 48, 64)
JITTER_CYCLES = 2_000_000  # ~1 ms: far longer than the main-stream work between fork and attention


class DecodeCase:
    """tiny-random in bf16 on the GPU, a KV cache of random (finite) context for max(BUCKETS)
    requests plus the scratch page padded rows write to."""

    def __init__(self, faults: tuple[str, ...], seed: int) -> None:
        from runtime.config import EngineConfig
        from runtime.faults import FaultSet
        from runtime.graph.decode_model import StaticDecodeModel
        from runtime.kvcache.kv_cache import KVCache
        from runtime.models.loader import load_model

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device: GPU gates run only on the device machine")
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        loaded = load_model(MODEL)
        self.cfg, self.faults, self.seed = loaded.config, FaultSet(faults), seed
        weights = {k: v.to("cuda", torch.bfloat16) for k, v in loaded.weights.items()}
        self.max_batch = max(BUCKETS)
        self.scratch_page = self.max_batch * PAGES_PER_REQUEST
        ecfg = EngineConfig(page_size=PAGE, num_pages=self.scratch_page + 1, device="cuda", dtype="bfloat16")
        self.kv = KVCache(self.cfg, ecfg, torch.bfloat16)
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.kv.latent.normal_(generator=gen)
        self.kv.index_keys.normal_(generator=gen)
        self.model = StaticDecodeModel(self.cfg, weights, page_size=PAGE, max_pages=PAGES_PER_REQUEST,
                                       max_batch=self.max_batch, faults=self.faults)

    def runner(self, streams):
        from runtime.graph.runner import GraphRunner

        runner = GraphRunner(self.model, self.kv, streams, buckets=BUCKETS, scratch_page=self.scratch_page,
                             faults=self.faults)
        runner.capture()
        return runner

    def decode(self, forward: Callable, n: int) -> torch.Tensor:
        """STEPS greedy decode steps of n requests (long and short contexts mixed); per-step logits
        [STEPS, n, V]. Leaves the KV cache as it found it."""
        from runtime.graph.decode_model import DecodeInputs

        rng = random.Random(self.seed * 7919 + n)
        longest = PAGE * PAGES_PER_REQUEST - STEPS - 1
        starts = torch.tensor([rng.choice([rng.randint(0, 20), rng.randint(100, longest)]) for _ in range(n)],
                              device="cuda")
        ids = torch.tensor([rng.randrange(256) for _ in range(n)], device="cuda")
        table = (torch.arange(n)[:, None] * PAGES_PER_REQUEST + torch.arange(PAGES_PER_REQUEST)).cuda()
        snapshot = self.kv.latent.clone(), self.kv.index_keys.clone()
        logits = []
        try:
            for step in range(STEPS):
                pos = starts + step
                slots = table.gather(1, (pos // PAGE)[:, None])[:, 0] * PAGE + pos % PAGE
                out = forward(DecodeInputs(ids, pos, slots, table))
                ids = out.argmax(-1)
                logits.append(out.clone())
        finally:
            self.kv.latent.copy_(snapshot[0])
            self.kv.index_keys.copy_(snapshot[1])
        return torch.stack(logits)


def differing_pairs(a: torch.Tensor, b: torch.Tensor) -> str:
    bad = (a != b).flatten(2).any(-1).nonzero().tolist()
    return f"{len(bad)} of {a.shape[0] * a.shape[1]} (step, row) pairs differ, first {bad[:4]}"


def graph_vs_eager(faults: tuple[str, ...], seed: int, workdir: Path) -> GateResult:
    from runtime.streams.cuda import CudaStreamExecutor

    started = time.perf_counter()
    case = DecodeCase(faults, seed)
    runner = case.runner(CudaStreamExecutor())
    n = random.Random(seed).randint(2, case.max_batch)  # pads to a bucket: padded rows are exercised too
    setup = time.perf_counter() - started
    started = time.perf_counter()
    eager = case.decode(runner.eager, n)
    replayed = case.decode(runner.forward, n)
    failures = []
    if not torch.equal(eager, replayed):
        failures.append(f"[graph-vs-eager] bs={n} (seed {seed}): graph replay differs from eager: "
                        f"{differing_pairs(eager, replayed)}")
    return GateResult(failures, time.perf_counter() - started, setup)


def jitter_vs_in_order(faults: tuple[str, ...], seed: int, workdir: Path) -> GateResult:
    from runtime.streams.cuda import CudaStreamExecutor
    from runtime.streams.tasks import InOrderExecutor

    started = time.perf_counter()
    case = DecodeCase(faults, seed)
    in_order = case.runner(InOrderExecutor())
    jittered = case.runner(CudaStreamExecutor(jitter_cycles=JITTER_CYCLES, seed=seed))
    n = case.max_batch
    setup = time.perf_counter() - started
    started = time.perf_counter()
    reference = case.decode(in_order.forward, n)
    raced = case.decode(jittered.forward, n)
    failures = []
    if not torch.equal(reference, raced):
        failures.append(f"[jitter-vs-in-order] bs={n} (seed {seed}): jittered multi-stream replay differs from "
                        f"in-order: {differing_pairs(reference, raced)}")
    return GateResult(failures, time.perf_counter() - started, setup)
