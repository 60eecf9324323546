"""Weight bundles passed to kernels, so reference and fast path share one signature."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoEWeights:
    # E = routed experts, I = expert intermediate, D = hidden, IS = shared intermediate
    router: torch.Tensor  # [E, D]
    bias: torch.Tensor  # [E] noaux_tc correction bias (selection only)
    w_gate: torch.Tensor  # [E, I, D]
    w_up: torch.Tensor  # [E, I, D]
    w_down: torch.Tensor  # [E, D, I]
    shared_gate: torch.Tensor | None  # [IS, D]
    shared_up: torch.Tensor | None  # [IS, D]
    shared_down: torch.Tensor | None  # [D, IS]
