"""`ForwardBatch`: what one model forward computes, flattened over the requests of a step."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segment:
    """The new tokens of one request: rows [start, end) of the batch, attending over its context."""

    start: int
    end: int
    context_slots: torch.Tensor  # [L] KV slots of positions 0..L-1; L = last new position + 1


@dataclass(frozen=True)
class ForwardBatch:
    token_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slots: torch.Tensor  # [T] long, where each new token's KV is written
    segments: tuple[Segment, ...]

    def __post_init__(self) -> None:
        n = self.token_ids.shape[0]
        assert self.positions.shape == (n,) and self.slots.shape == (n,), "one position and slot per token"
        assert all(0 <= s.start < s.end <= n for s in self.segments), "segments must be non-empty row ranges"

    @property
    def last_rows(self) -> torch.Tensor:
        return torch.tensor([s.end - 1 for s in self.segments], dtype=torch.long)
