"""`StepPlan`: every scheduling decision of one step, made once and executed by the model runner.

This object is the unit the overlap loop and tensor parallelism share: rank 0 builds it and every
rank executes exactly it, so no rank ever acts on a decision of its own.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Extend:
    """Run `num_new` tokens of request `rid` starting at position `start` (prefill: many; decode: 1)."""

    rid: str
    start: int
    num_new: int
    # The request's page table as a delta, so a plan's size does not grow with the batch's KV: the
    # pages allocated since its last extend, appended at index `first_page` of the table the runner
    # keeps (`PageTables`). 0 starts a fresh table: a prefill (also a preemption's recompute) and a
    # request's first step on this engine (PD decode), which carry every page.
    first_page: int
    new_pages: tuple[int, ...]

    @property
    def num_pages(self) -> int:
        """Pages in the request's table after this step."""
        return self.first_page + len(self.new_pages)


@dataclass(frozen=True)
class StepPlan:
    step: int
    prefill: tuple[Extend, ...]
    decode: tuple[Extend, ...]
    aborted: tuple[str, ...] = ()
    preempted: tuple[str, ...] = ()
    # Prefix-cache hits (runtime/kvcache/prefix_cache.py): (cached page, request page) pairs whose KV
    # the runner copies before the step's forward, every layer's latent and index keys.
    copies: tuple[tuple[int, int], ...] = ()

    @property
    def extends(self) -> tuple[Extend, ...]:
        return self.prefill + self.decode

    @property
    def empty(self) -> bool:
        return not self.extends

    @property
    def num_tokens(self) -> int:
        return sum(e.num_new for e in self.extends)

    def digest(self) -> str:
        """Stable hash of the plan; ranks compare it to prove they execute the same step."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
