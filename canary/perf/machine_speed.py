"""How fast this machine is right now, on a fixed CPU workload that never touches the runtime.

The perf gate's stored baselines are wall-clock figures. Shared 2-core runners differ in speed from
one host to the next and from one minute to the next (this probe measured 1.9 and then 2.5 ms per
block within seconds on one runner), and an unchanged runtime once failed the CPU gate on TTFT by
54% on a slower runner. The perf trials therefore probe the machine just before and just after each
trial and store the probes with a baseline when they record one; a stored verdict whose machine
reads beyond the tolerance of the recording's is inconclusive (ratio_stats.speed_not_comparable: a
loaded runner read 0.16x). The probe guards the comparison and no longer scales it: within one
host it moved 3-11% while the server's figures did not (canary/perf/trials.py). It shares nothing
with the runtime, so a slower build never reads as a slower machine.
"""

from __future__ import annotations

import time

import torch

# A block: eight small MLP matmuls (the canary's decode is small-matmul bound on CPU) and a dict
# loop (its scheduler and server are Python bound), in fixed proportions.
_LAYERS, _WIDTH, _HIDDEN, _ROWS, _PY_OPS = 8, 512, 1024, 16, 3000


def _weights() -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ws = [(torch.randn(_WIDTH, _HIDDEN, generator=g) / 32, torch.randn(_HIDDEN, _WIDTH, generator=g) / 32)
          for _ in range(_LAYERS)]
    return ws, torch.randn(_ROWS, _WIDTH, generator=g)


def _block(ws: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor) -> None:
    for w1, w2 in ws:
        x = torch.nn.functional.silu(x @ w1) @ w2
    counts: dict[int, int] = {}
    for i in range(_PY_OPS):
        counts[i % 97] = counts.get(i % 97, 0) + i


def probe(seconds: float = 0.5) -> float:
    """Blocks per second: the fastest block of those that fit in `seconds` (the least disturbed).
    On one torch thread, like the engine (DSV4_NUM_THREADS=1): two threads on a loaded 2-core
    machine read 1-10 blocks/s against 463 idle, the threads' handoffs measured instead of the core."""
    if seconds <= 0:
        raise ValueError(f"probe needs a positive duration, got {seconds}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _probe(seconds)
    finally:
        torch.set_num_threads(threads)


def _probe(seconds: float) -> float:
    ws, x = _weights()
    _block(ws, x)  # warm-up: allocator and kernels
    best, deadline = float("inf"), time.perf_counter() + seconds
    while True:
        started = time.perf_counter()
        _block(ws, x)
        best = min(best, time.perf_counter() - started)
        if started >= deadline:
            return 1.0 / best
