"""What rank 0 broadcasts each step, and the plan-digest check that turns a desync into an error.

A `StepMessage` carries everything a worker needs to execute exactly rank 0's plan: the plan
itself, the prompts and sampling parameters of requests it has not seen yet, and the requests
that finished since the last message (so the worker frees their pages and slots).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from runtime.distributed.errors import DesyncError
from runtime.engine.plan import StepPlan
from runtime.engine.request import SamplingParams


@dataclass(frozen=True)
class RequestSpec:
    rid: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True)
class StepMessage:
    kind: str  # "step" (execute plan) | "stats" (report accounting) | "stop" (shut down)
    plan: StepPlan | None = None
    new_requests: tuple[RequestSpec, ...] = ()
    released: tuple[str, ...] = ()  # finished since the last message: free their pages and slots


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:12]


def plan_field_digests(plan: StepPlan, released: tuple[str, ...]) -> dict[str, str]:
    """One digest per field, so a mismatch names what differs, not just that something does."""
    fields = asdict(plan)
    digests = {name: _digest(value) for name, value in fields.items()}
    digests["released"] = _digest(sorted(released))
    return digests


def find_desync(step: int, per_rank: list[dict[str, str]]) -> DesyncError | None:
    """Compare every rank's digests with rank 0's; the error names each differing field."""
    differing: dict[str, dict[int, str | None]] = {}
    for name, expected in per_rank[0].items():
        values = {rank: digests.get(name) for rank, digests in enumerate(per_rank)}
        if any(value != expected for value in values.values()):
            differing[name] = values
    return DesyncError(step, differing) if differing else None
