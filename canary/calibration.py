"""Calibration for a model this project did not train: every session runs alone first (concurrency 1),
and under load only what passed alone can be corruption.

A task oracle (the nonce echo, the required tool calls, tool-call JSON and schema, repetition, ...)
holds a model to the task. A model that cannot do the task (Gemma 3 270M asked to echo a nonce and
call tools) fails it alone as well as under load: that is model quality, not corruption. The same
holds for a protocol oracle a server fails alone (llama-cpp-python sends no usage chunk whatever
`stream_options` asks): that is how the server always behaves, not something the load did to it.
So `apply` splits the load run's failures: an oracle's failure in a scenario where the same oracle
failed in the solo run is reported under its label ("model quality", "server protocol, also alone")
and counted, not failed; every other failure fails the gate. Integrity oracles (cross-session bleed,
HTTP and transport errors, a stream the client cannot read) are never calibrated away, and fail the
gate in the solo run too.

The solo run is also a reference for every load request (`compare_with_solo`): where a load request's
body equals the solo run's request with the same number in the same session (same context: nothing
diverged before it), the outputs must agree: tokens under the near-tie rule (canary/oracles/
differential.py `compare`), and where the tokens agree, the same text, tool calls and finish reason.
This needs no model that is good at anything: a digit flipped in an answer under load differs from
the same answer alone, whatever the answer says.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from typing import Any

from canary.oracles import differential

TAG = "[solo-reference]"
MODEL_QUALITY = "model quality"
SERVER_PROTOCOL = "server protocol, also alone"
# Oracles that hold the model to the task: failing them alone is model quality.
TASK_ORACLES = frozenset({"nonce-echo", "required-calls", "json-parse", "json-schema", "known-function",
                          "ungrounded-argument", "ungrounded-answer", "repetition", "gibberish",
                          "max-tokens-no-tool-call", "session-incomplete"})
# Oracles that hold the server to the API: failing them alone is the server's constant behaviour.
PROTOCOL_ORACLES = frozenset({"finish-reason", "usage", "tool-call-id", "stream-done", "stream-usage",
                              "tool-call-index", "control-text", "stream-equivalence", "stop-string"})


def label(oracle: str) -> str | None:
    """What a failure of `oracle` that also happened alone means; None: it is never calibrated away."""
    if oracle in TASK_ORACLES:
        return MODEL_QUALITY
    if oracle in PROTOCOL_ORACLES:
        return SERVER_PROTOCOL
    return None


def solo_options(options):
    """The calibration run: the same sessions (same seeds, so the same streamed/aborted choices),
    one at a time, each going on past its failures."""
    return dataclasses.replace(options, concurrency=1, processes=1, keep_going=True)


def apply(solo, load, outcome, *, near_tie: float | None) -> None:
    """`solo`, `load`: the RunResults of the calibration run and of the load run (both keep_going).
    Adds the load run's uncalibrated failures, the solo run's integrity failures and the
    `[solo-reference]` differences to `outcome.failures`; the calibrated ones to notes and
    `outcome.summary["calibration"]`."""
    failed_alone: dict[tuple[int, str], int] = Counter((f.session, f.oracle) for _, f in solo.failures)
    for _, f in solo.failures:
        if label(f.oracle) is None:  # a server that breaks integrity alone is broken, load or not
            outcome.failures.append(f"alone (calibration run): {f.describe()}")
    excused: dict[str, Counter] = {}  # oracle -> per-scenario count of load failures calibrated away
    for _, f in load.failures:
        if label(f.oracle) is not None and (f.session, f.oracle) in failed_alone:
            excused.setdefault(f.oracle, Counter())[f.session] += 1
        else:
            outcome.failures.append(f.describe())
    reference = compare_with_solo(solo, load, near_tie)
    outcome.failures += reference.pop("failures")
    scenarios = load.options.sessions
    by_oracle: dict[str, set[int]] = {}
    for session, oracle in failed_alone:
        by_oracle.setdefault(oracle, set()).add(session)
    summary: dict[str, Any] = {
        "scenarios": scenarios, "solo_requests": len(solo.requests), "solo_wall_s": round(solo.wall_s, 2),
        "failed_alone": {oracle: {"label": label(oracle), "scenarios": len(sessions),
                                  "load_failures_excused": sum(excused.get(oracle, Counter()).values())}
                         for oracle, sessions in sorted(by_oracle.items())},
        "solo_reference": reference}
    outcome.summary["calibration"] = summary
    for oracle, facts in summary["failed_alone"].items():
        if facts["label"] is not None:
            outcome.notes.append(f"calibration: {oracle} failed alone in {facts['scenarios']}/{scenarios} scenarios "
                                 f"({facts['label']}): its {facts['load_failures_excused']} failures under load in "
                                 "those scenarios are not counted as corruption")


def _key(record) -> tuple[int, int, str]:
    return record.session, record.hop, json.dumps(record.request, sort_keys=True, default=str)


def _solo_by_key(solo) -> dict:
    """The solo run's whole requests by (session, number, body): a load request's counterpart."""
    return {_key(r): r for r in solo.requests if not r.aborted and r.request is not None}


def has_counterpart(solo):
    """Whether a load request has its solo run counterpart (the same session, number and body), i.e.
    whether `compare_with_solo` compares it: the load-vs-solo replays need not run it alone again."""
    alone = _solo_by_key(solo)
    return lambda record: record.request is not None and _key(record) in alone


def _output(turn) -> tuple:
    """What a client reads from a response: text, tool calls (arguments parsed: key order and
    whitespace are presentation) and finish reason."""
    def parsed(arguments: str) -> Any:
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments

    return turn.content, [(c.name, parsed(c.arguments)) for c in turn.tool_calls], turn.finish_reason


def compare_with_solo(solo, load, near_tie: float | None) -> dict[str, Any]:
    """Each load request against the solo run's request with the same session, number and body.
    Returns the counts and `failures` (lines tagged `[solo-reference]`). Aborted requests have no
    whole output and are skipped; a load request whose context differs from the solo run's (an
    earlier benign near-tie, a sampled probe's own text) has no counterpart and is counted as such."""
    alone = _solo_by_key(solo)
    counts = {"compared": 0, "equal": 0, "benign_near_ties": 0, "failed": 0, "no_counterpart": 0, "no_tokens": 0}
    failures: list[str] = []
    for record in load.requests:
        if record.aborted or record.request is None:
            continue
        ref = alone.get(_key(record))
        if ref is None:
            counts["no_counterpart"] += 1
            continue
        if not (ref.turn.tokens or record.turn.tokens) and near_tie is not None \
                and _output(ref.turn) != _output(record.turn):
            counts["no_tokens"] += 1  # no logprobs: a near-tie cannot be told from a wrong token
            continue
        counts["compared"] += 1
        where = f"session {record.session} turn {record.turn.turn} request {record.hop}"
        mismatch = None
        if ref.turn.tokens or record.turn.tokens:  # else exact mode: the outputs alone must agree
            mismatch = differential.compare(
                ref.turn.tokens, ref.transcript.top_logprobs if ref.transcript else [],
                record.turn.tokens, record.transcript.top_logprobs if record.transcript else [], near_tie)
            if mismatch is not None and mismatch.benign and differential.seeded_sampling(record.request):
                mismatch = dataclasses.replace(mismatch, benign=False,
                                               reason="a seeded sample must give the same tokens alone and under load")
        if mismatch is None:
            if _output(ref.turn) == _output(record.turn):
                counts["equal"] += 1
            else:
                counts["failed"] += 1
                failures.append(f"{TAG} {where}: the same tokens as alone but another output: alone "
                                f"{_output(ref.turn)!r} vs under load {_output(record.turn)!r}"[:600])
        elif mismatch.benign:
            counts["benign_near_ties"] += 1
        else:
            counts["failed"] += 1
            failures.append(f"{TAG} {where}: {mismatch.describe()}")
    return {**counts, "near_tie": near_tie, "failures": failures}
