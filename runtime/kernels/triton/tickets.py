"""Zeroed int32 ticket counters for kernels whose last program to finish a unit of work does its
merge (sparse MLA's chunk fold).

Each launch leaves its counters zero again (the last program re-arms them), so one buffer per
(device, stream) serves every launch on that stream: launches on one stream run one after another,
captured CUDA graphs keep the address they were captured with, and a buffer outgrown by a larger
launch stays alive for the graphs that hold it.
"""

from __future__ import annotations

import torch
import triton

_HELD: dict[tuple[int, int], list[torch.Tensor]] = {}


def ticket_counters(device: torch.device, count: int) -> torch.Tensor:
    """At least `count` zeroed counters on `device` for the current stream."""
    key = (device.index or 0, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    held = _HELD.setdefault(key, [])
    if not held or held[-1].numel() < count:
        held.append(torch.zeros(triton.next_power_of_2(max(count, 1024)), dtype=torch.int32, device=device))
    return held[-1]
