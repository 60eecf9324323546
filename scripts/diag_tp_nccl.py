"""Diagnostic for the x2 kind (issue 10): where does TP=2 startup over NCCL stop? Two spawned
ranks print a timestamped line at every stage of what runtime/distributed does at startup: gloo
group, set_device, NCCL group, the gloo handshake, an NCCL all-reduce, the same inside a CUDA graph.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        timeout 120 python3 scripts/diag_tp_nccl.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from runtime.distributed.collectives import init_collectives  # noqa: E402


def stage(rank: int, what: str, t0: float) -> None:
    print(f"[rank {rank} +{time.monotonic() - t0:6.2f}s] {what}", flush=True)


def rank_main(rank: int, init_file: str) -> None:
    t0 = time.monotonic()
    stage(rank, "start", t0)
    coll = init_collectives(rank, 2, init_file, 60.0, 30.0, 5.0, nccl=True)
    stage(rank, f"groups formed; current device {torch.cuda.current_device()}", t0)
    print(coll.all_gather({"rank": rank}), flush=True)
    stage(rank, "gloo handshake done", t0)
    x = torch.full((4,), float(rank + 1), device="cuda")
    coll.all_reduce(x)
    torch.cuda.synchronize()
    stage(rank, f"nccl all_reduce -> {x.tolist()}", t0)
    graph, y = torch.cuda.CUDAGraph(), torch.ones(4, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        coll.all_reduce(y)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        coll.all_reduce(y)
    y.fill_(rank + 1)
    graph.replay()
    torch.cuda.synchronize()
    stage(rank, f"captured all_reduce replayed -> {y.tolist()}", t0)
    coll.close()


if __name__ == "__main__":
    init_file = str(Path(tempfile.mkdtemp()) / "rendezvous")
    mp.start_processes(rank_main, args=(init_file,), nprocs=2, start_method="spawn")
