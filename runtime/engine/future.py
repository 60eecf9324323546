"""`FutureTokens`: the device-side buffer the overlap loop reads next-step input ids from.

In the overlap loop step N+1 is built before the CPU has seen step N's sampled tokens, so a decode
row cannot take its input id from the request's host-side token list (that would be one step
stale). Sampling writes each request's token into its slot here, on the device, and the next
step's batch gathers its decode inputs from the slots: no host round trip sits between steps.
Slots are per request (not per batch row) because a request's row moves as the batch changes.
"""

from __future__ import annotations

import torch


class FutureSlotsExhausted(RuntimeError):
    pass


class FutureTokens:
    def __init__(self, capacity: int, device: str = "cpu") -> None:
        self.tokens = torch.full((capacity,), -1, dtype=torch.long, device=device)  # [capacity]
        self._slot: dict[str, int] = {}
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out the lowest slot first

    @property
    def live(self) -> int:
        return len(self._slot)

    def slot(self, rid: str) -> int:
        """The request's slot, assigned on first use (its prefill)."""
        if rid not in self._slot:
            if not self._free:
                raise FutureSlotsExhausted(f"no future-token slot left for {rid} ({self.tokens.shape[0]} live)")
            self._slot[rid] = self._free.pop()
        return self._slot[rid]

    def held_slot(self, rid: str) -> int:
        """The slot of a request that already has one (a decode row reads its last token there)."""
        return self._slot[rid]

    def release(self, rid: str) -> None:
        """Free the slot of a finished, aborted or preempted request. Safe while one of its rows is
        still in flight: execution is in order, so a later owner's write lands after that row's."""
        slot = self._slot.pop(rid, None)
        if slot is not None:
            self._free.append(slot)

    def _index(self, slots: list[int]) -> torch.Tensor:
        # non_blocking: a blocking host-to-device copy would wait for the GPU to drain, which is
        # exactly the stall the overlap loop exists to avoid (the staging copy is immediate).
        return torch.tensor(slots, dtype=torch.long).to(self.tokens.device, non_blocking=True)

    def read(self, rids: list[str]) -> torch.Tensor:
        # -> [len(rids)] long, gathered on the device
        return self.tokens[self._index([self._slot[rid] for rid in rids])]

    def write(self, rids: list[str], tokens: torch.Tensor) -> None:
        self.tokens[self._index([self.slot(rid) for rid in rids])] = tokens.to(self.tokens.device)
