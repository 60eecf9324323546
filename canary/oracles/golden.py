"""Golden transcripts: exact tokens plus top-k logprobs per scenario, and the first-divergence check.

A run matches its golden transcript when the tokens are identical and, where the store recorded
them, every shared token's own logprob is within the store's `logprob_atol` (a bug that shifts the
logits a little, such as an indexer window one token too wide, keeps every greedy token but moves
logprobs by ~1e-4: only this check sees it). A store recorded before logprobs were kept falls back
to tokens alone, with a note. At the first differing
position the divergence is benign only if it is a recorded near-tie (canary/oracles/logprob_close.py): both
tokens appear in the recorded top-k and their recorded logprobs differ by at most `near_tie` nats.
After any divergence the rest of the scenario is not comparable and is not checked.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from canary.oracles.logprob_close import first_mismatch, is_near_tie, logprob_gap

DEFAULT_NEAR_TIE = 0.05  # nats
# Exit status of `python -m canary golden check` on a regression; canary/cli/bisect.py reads it as "bad".
EXIT_REGRESSION = 3


@dataclass
class Transcript:
    scenario: str
    tokens: Sequence[Hashable]
    # Per position: the top-k alternatives [(token, logprob), ...] as the run reported them.
    top_logprobs: Sequence[Sequence[tuple[Hashable, float]]]
    extra: dict[str, Any] = field(default_factory=dict)
    # Per position: the logprob of the token the run produced (empty in stores recorded before
    # logprobs were kept: those are compared on tokens only).
    logprobs: Sequence[float] = field(default_factory=list)


# Recorded into a store's metadata (`logprob_atol`) when it is written, by the dtype it was recorded
# in. The embedded runtime is batch-invariant, so a rerun on the same machine is bit-identical; the
# bound leaves room for another CPU's BLAS summation order (float32: ~1e-6 on logprobs of a few nats)
# and stays below the 3.5e-4 the indexer off-by-one moved them (measured: docs/results.md).
LOGPROB_ATOL = {"float32": 5e-5, "float16": 5e-3, "bfloat16": 2e-2}


@dataclass(frozen=True)
class LogprobDrift:
    scenario: str
    position: int  # the first token whose logprob moved beyond the tolerance
    token: Hashable
    expected: float
    got: float
    max_diff: float  # over every shared position of the transcript
    atol: float

    def describe(self) -> str:
        return (f"{self.scenario}: token {self.position} {self.token!r} has logprob {self.got:.6f}, golden "
                f"{self.expected:.6f} (|diff| {abs(self.got - self.expected):.2e} > atol {self.atol:.0e}; "
                f"largest over the transcript {self.max_diff:.2e}); every token up to here matched")


def logprob_drift(golden: Transcript, run: Transcript, atol: float, upto: int | None = None) -> LogprobDrift | None:
    """The first of the first `upto` positions (default: all shared ones) where the two runs' own-token
    logprobs differ by more than `atol`; None when all agree or either side recorded none."""
    n = min(len(golden.logprobs), len(run.logprobs), len(golden.tokens), len(run.tokens))
    n = n if upto is None else min(n, upto)
    diffs = [abs(float(run.logprobs[p]) - float(golden.logprobs[p])) for p in range(n)]
    first = next((p for p, d in enumerate(diffs) if not d <= atol), None)  # `not <=`: nan fails too
    if first is None:
        return None
    return LogprobDrift(golden.scenario, first, golden.tokens[first], float(golden.logprobs[first]),
                        float(run.logprobs[first]), max(diffs), atol)


@dataclass(frozen=True)
class Divergence:
    scenario: str
    position: int
    expected: Hashable | None
    got: Hashable | None
    benign: bool
    margin: float | None  # recorded logprob(expected) - logprob(got), when both were recorded
    reason: str

    def describe(self) -> str:
        margin = "n/a" if self.margin is None else f"{self.margin:.4f}"
        kind = "benign near-tie" if self.benign else "REGRESSION"
        return (f"{self.scenario}: first divergence at token {self.position}: expected {self.expected!r}, "
                f"got {self.got!r} (recorded margin {margin}; {kind}: {self.reason})")


def first_divergence(golden: Transcript, run: Transcript, near_tie: float = DEFAULT_NEAR_TIE) -> Divergence | None:
    pos = first_mismatch(golden.tokens, run.tokens)
    if pos is None:
        return None
    if pos >= min(len(golden.tokens), len(run.tokens)):
        want = golden.tokens[pos] if pos < len(golden.tokens) else None
        got = run.tokens[pos] if pos < len(run.tokens) else None
        return Divergence(golden.scenario, pos, want, got, False, None, "lengths differ")
    want, got = golden.tokens[pos], run.tokens[pos]
    recorded = {_key(tok): lp for tok, lp in golden.top_logprobs[pos]} if pos < len(golden.top_logprobs) else {}
    margin = logprob_gap(recorded, _key(want), _key(got))
    if margin is None:
        return Divergence(golden.scenario, pos, want, got, False, None, "token not among the recorded top-k")
    benign = is_near_tie(margin, near_tie)
    reason = "within the near-tie margin" if benign else f"margin exceeds {near_tie}"
    return Divergence(golden.scenario, pos, want, got, benign, margin, reason)


def _key(token: Hashable) -> Hashable:
    return tuple(token) if isinstance(token, list) else token


def write_store(path: Path, metadata: dict[str, Any], transcripts: list[Transcript]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w") as f:
        f.write(json.dumps({"metadata": metadata}, sort_keys=True) + "\n")
        for t in transcripts:
            f.write(json.dumps(asdict(t), sort_keys=True) + "\n")
    tmp.replace(path)  # never leave a half-written golden file behind


def read_store(path: Path) -> tuple[dict[str, Any], dict[str, Transcript]]:
    lines = path.read_text().splitlines()
    if not lines or "metadata" not in json.loads(lines[0]):
        raise ValueError(f"{path} is not a golden store (first line must hold metadata)")
    metadata = json.loads(lines[0])["metadata"]
    transcripts = {}
    for line in lines[1:]:
        raw = json.loads(line)
        raw["top_logprobs"] = [[(_key(tok), lp) for tok, lp in pos] for pos in raw["top_logprobs"]]
        raw["tokens"] = [_key(t) for t in raw["tokens"]]
        raw["logprobs"] = raw.get("logprobs") or []
        transcripts[raw["scenario"]] = Transcript(**raw)
    return metadata, transcripts
