"""Errors of the tensor-parallel runtime: each says which rank, which step and what went wrong."""

from __future__ import annotations


class DesyncError(RuntimeError):
    """Ranks were about to execute different plans (or hold different weights)."""

    def __init__(self, step: int, differing: dict[str, dict[int, str | None]]) -> None:
        self.step = step
        self.differing = differing  # field -> {rank: digest}
        fields = ", ".join(f"{name} {ranks}" for name, ranks in sorted(differing.items()))
        super().__init__(f"tensor-parallel ranks desynchronized at step {step}: fields differ: {fields}")


class CollectiveError(RuntimeError):
    """A collective failed (a peer died or diverged); `timed_out` when it hit the deadline."""

    def __init__(self, rank: int, op: str, step: int, timeout_s: float, cause: BaseException) -> None:
        self.rank, self.op, self.step = rank, op, step
        self.timed_out = "timed out" in str(cause).lower() or "timeout" in str(cause).lower()
        what = f"did not complete within {timeout_s:g}s" if self.timed_out else f"failed ({cause})"
        super().__init__(f"rank {rank}: collective {op} at step {step} {what}: a peer rank is stuck, dead "
                         f"or executing a different plan")


class WorkerStartError(RuntimeError):
    pass
