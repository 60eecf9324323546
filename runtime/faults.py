"""Named fault switches: faithful copies of real serving bug classes, all off by default.

Each fault exists so that some gate of the canary suite can prove it catches that bug class
(a negative control). The runtime asks `faults.enabled(NAME)` at the one place the bug lives.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from runtime.env import Env


@dataclass(frozen=True)
class FaultSpec:
    name: str
    bug_class: str


REGISTRY: dict[str, FaultSpec] = {
    spec.name: spec
    for spec in (
        FaultSpec("stream-race", "side-stream indexer output read before its join (missing event wait)"),
        FaultSpec("stale-graph-metadata", "capture-time sequence length baked into a CUDA graph"),
        FaultSpec("kv-slot-reuse", "page allocator hands out a KV page another live request still owns"),
        FaultSpec("tp-local-abort", "a tensor-parallel rank applies an abort on its own"),
        FaultSpec("overlap-stale-token", "overlap loop feeds the previous step's token as the next input"),
        FaultSpec("tool-json-corrupt", "tool-call arguments corrupted on their way out of the server"),
        FaultSpec("indexer-window-off-by-one", "sliding window one token too wide (eager runner): logprobs "
                  "move by ~1e-4, tokens stay"),
        FaultSpec("abort-leak", "a request aborted by its client keeps its KV pages (never returned to the pool)"),
        FaultSpec("stop-string-kept", "the engine stops on a stop string but the reply keeps it (and the rest "
                  "of its token)"),
        FaultSpec("shared-sampling-generator", "one generator draws for the whole batch (eager runner): a seeded "
                  "request is reproducible only alone"),
        FaultSpec("slow-step", "every engine step takes extra wall time (throughput regression)"),
        FaultSpec("prefix-cache-stale-page", "a prefix-cache hit copies one matched page's KV from the wrong "
                  "cache entry (the page before it in the chain)"),
    )
}

# Faults of prefill/decode disaggregation (runtime/disagg/): the fault matrix runs them through the PD
# gate (canary/faults/pd_gates.py, a restartable PD pair); tests/e2e/test_pd.py catches each too.
PD_REGISTRY: dict[str, FaultSpec] = {
    spec.name: spec
    for spec in (
        FaultSpec("pd-stale-bootstrap", "a restarted decode server is handed its previous session state"),
        FaultSpec("pd-abort-leak", "a request that ends while its KV is in flight leaks its reserved pages"),
        FaultSpec("pd-kv-corrupt", "one transferred KV block arrives with a flipped byte"),
    )
}
KNOWN_FAULTS: dict[str, FaultSpec] = {**REGISTRY, **PD_REGISTRY}


class UnknownFaultError(ValueError):
    pass


class FaultSet:
    """The set of faults switched on for one engine; immutable once built."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        names = tuple(dict.fromkeys(names))
        for name in names:
            if name not in KNOWN_FAULTS:
                known = ", ".join(sorted(KNOWN_FAULTS))
                raise UnknownFaultError(f"unknown fault {name!r}; known faults: {known}")
        self._names = frozenset(names)

    @classmethod
    def from_env(cls, env: Env | None = None, extra: Iterable[str] = ()) -> FaultSet:
        env = env or Env.load()
        return cls((*env.faults, *extra))

    def enabled(self, name: str) -> bool:
        if name not in KNOWN_FAULTS:
            raise UnknownFaultError(f"unknown fault {name!r}")
        return name in self._names

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._names))

    def __bool__(self) -> bool:
        return bool(self._names)

    def __repr__(self) -> str:
        return f"FaultSet({list(self.names)})"


NO_FAULTS = FaultSet()
