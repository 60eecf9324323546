"""The `tool-json-corrupt` fault: one character of a tool call's arguments flipped on its way out.

A faithful copy of the production symptom (tool-call JSON corrupted at high load): the model wrote
the right call and the client still receives a broken one. Whether a call is hit is drawn from a
generator seeded by the request (its seed and prompt) and the call's index, so a request replayed
gives the same corruption and a test can predict it; the rate is DSV4_TOOL_CORRUPT_RATE.
"""

from __future__ import annotations

import hashlib
import random


class ToolJsonCorruptor:
    def __init__(self, request_key: str, rate: float) -> None:
        self.request_key = request_key
        self.rate = rate
        self._pending: set[int] = set()  # calls chosen for corruption whose hit has not landed yet

    def start_call(self, index: int) -> None:
        if self._rng(index).random() < self.rate:
            self._pending.add(index)

    def arguments(self, index: int, fragment: str) -> str:
        if index not in self._pending:
            return fragment
        positions = [i for i, ch in enumerate(fragment) if ch.isascii() and ch.isprintable()]
        if not positions:
            return fragment  # nothing to flip here; the next fragment of this call takes the hit
        self._pending.discard(index)
        at = self._rng(index, "position").choice(positions)
        # Flip the lowest bit: always a different character, as a single-bit memory error would be.
        return fragment[:at] + chr(ord(fragment[at]) ^ 1) + fragment[at + 1:]

    def _rng(self, index: int, purpose: str = "hit") -> random.Random:
        digest = hashlib.sha256(f"{self.request_key}:{index}:{purpose}".encode()).digest()
        return random.Random(int.from_bytes(digest[:8], "little"))


def request_key(prompt_ids: list[int], seed: int | None) -> str:
    return hashlib.sha256(repr((seed, prompt_ids)).encode()).hexdigest()[:16]
