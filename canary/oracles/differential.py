"""The load-vs-solo differential oracle: a request's output must not depend on the load it ran under.

After the load phase, a sample of the gate's greedy requests (and every request sampled with a
seed, whose output the seed alone fixes) is sent again, one at a time on an idle server, with the
request body the driver recorded (`RequestRecord.request`), in the same mode (streamed or not).
The tokens (from logprobs) must match the loaded run's. This needs no golden transcripts and no
model that is good at the task, so it works for any server and model that return logprobs: the
corruption the seeds found (KV pages shared between live requests, stale inputs under overlap)
only shows when requests share a batch, and a solo replay is the reference that does not.

At the first differing token the divergence is benign only where it is a near-tie on both sides
(canary/oracles/logprob_close.py, the rule the golden store and the pairwise engine checks use): a server
whose reductions change with the batch shape may legitimately flip a near-tie. In exact mode
(`--deterministic`) no divergence is benign: a batch-invariant server (SGLang
--enable-deterministic-inference, vLLM VLLM_BATCH_INVARIANT=1, the embedded runtime) computes the
same logits for a request whatever shares its batch, so even a near-tie must resolve the same way.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from canary.oracles.logprob_close import Generation, NotClose, check_logprobs_close, first_mismatch, logprob_gap

TAG = "[load-vs-solo]"
# 24 replays, one at a time: about 10-14 s on the 2-core CPU (solo requests of the canary model, late
# turns' contexts included), a small part of the 80-session gate; kv-slot-reuse fails nearly all of them.
DEFAULT_SAMPLE = 24
LATE_EVERY = 3  # every third pick is its session's last request: late turns carry the longest contexts


@dataclass(frozen=True)
class Mismatch:
    """The first token where the solo replay and the loaded run differ (or, in exact mode, where
    they agree on the token but not on its top-k logprobs)."""

    position: int
    solo_token: Hashable | None  # None: that side ended here
    load_token: Hashable | None
    # Each side's logprob of its own token minus the other's, from its own top-k (None: not in it).
    solo_margin: float | None
    load_margin: float | None
    # Each side's top-1 minus top-2 logprob there: how far from a tie that side was.
    solo_top2: float | None
    load_top2: float | None
    benign: bool
    reason: str

    def describe(self) -> str:
        def num(value: float | None) -> str:
            return "n/a" if value is None else f"{value:.4f}"

        if self.solo_token == self.load_token:
            return f"token {self.position} {self.solo_token!r} agrees but {self.reason}"
        return (f"first divergence at token {self.position}: solo {self.solo_token!r} vs under load "
                f"{self.load_token!r}; margin over the other's token solo {num(self.solo_margin)}, under load "
                f"{num(self.load_margin)} (top-2 margin solo {num(self.solo_top2)}, under load "
                f"{num(self.load_top2)}): {self.reason}")


def compare(solo_tokens: Sequence[Hashable], solo_top: Sequence[Sequence[tuple[Hashable, float]]],
            load_tokens: Sequence[Hashable], load_top: Sequence[Sequence[tuple[Hashable, float]]],
            near_tie: float | None) -> Mismatch | None:
    """None when the runs agree. `near_tie`: the margin in nats within which a divergence is
    benign. None is exact mode: every divergence fails (an exact tie included: a deterministic
    server breaks a tie the same way every time), and so does any difference in the top-k logprobs
    where the tokens agree (same logits whatever the batch: on the embedded runtime, load and solo
    top-k logprobs were measured bit-identical). The near-tie verdict is `check_logprobs_close`'s."""
    solo, load = _generation(solo_tokens, solo_top), _generation(load_tokens, load_top)
    pos = first_mismatch(solo.tokens, load.tokens)
    if pos is None:
        if near_tie is None:
            at = next((p for p, (a, b) in enumerate(zip(solo.top, load.top)) if a != b), None)
            if at is not None:
                return Mismatch(at, solo.tokens[at], load.tokens[at], None, None, _top2(solo.top, at),
                                _top2(load.top, at), False, f"its top-k logprobs differ (exact mode): solo "
                                f"{_fmt(solo.top[at])} vs under load {_fmt(load.top[at])}")
        return None
    solo_tok = solo.tokens[pos] if pos < len(solo.tokens) else None
    load_tok = load.tokens[pos] if pos < len(load.tokens) else None
    margins: tuple[float | None, float | None] = (None, None)
    if solo_tok is not None and load_tok is not None:
        margins = (logprob_gap(dict(solo.top[pos]), solo_tok, load_tok),
                   logprob_gap(dict(load.top[pos]), load_tok, solo_tok))
    found = (*margins, _top2(solo.top, pos), _top2(load.top, pos))
    if None in (solo_tok, load_tok):
        why = f"one run ended first ({len(solo.tokens)} tokens solo, {len(load.tokens)} under load)"
    elif None in margins:
        why = "the tokens are not in each other's top-k"
    else:
        why = f"not a near-tie (within {near_tie} nats) on both sides"
    if near_tie is None:
        return Mismatch(pos, solo_tok, load_tok, *found, False, "exact mode, no near-ties allowed")
    try:
        # Token logprobs are not compared (infinite atol): a server that is not batch-invariant
        # moves them with the batch; only the token choice is held to the rule.
        check_logprobs_close([solo], [load], margin=near_tie, logprob_atol=math.inf)
    except NotClose:
        return Mismatch(pos, solo_tok, load_tok, *found, False, why)
    return Mismatch(pos, solo_tok, load_tok, *found, True, f"benign near-tie within {near_tie} nats")


def _fmt(top: Sequence[tuple[Hashable, float]]) -> str:
    return "[" + ", ".join(f"{tok!r}: {lp!r}" for tok, lp in top) + "]"


def _top2(tops: Sequence[Sequence[tuple[Hashable, float]]], pos: int) -> float | None:
    values = sorted((lp for _, lp in tops[pos]), reverse=True) if pos < len(tops) else []
    return values[0] - values[1] if len(values) >= 2 else None


def _key(token: Hashable) -> Hashable:
    return tuple(token) if isinstance(token, list) else token


def _generation(tokens: Sequence[Hashable], tops: Sequence[Sequence[tuple[Hashable, float]]]) -> Generation:
    keys = [_key(t) for t in tokens]
    top = [[(_key(tok), lp) for tok, lp in (tops[p] if p < len(tops) else [])] for p in range(len(keys))]
    # A token's own logprob is not kept by the driver; its top-k entry stands in (nan outside it),
    # which only matters to the atol check that is off here.
    own = [dict(top[p]).get(keys[p], math.nan) for p in range(len(keys))]
    return Generation(keys, own, top)


# ---- which requests ------------------------------------------------------------------------------
def seeded_sampling(body: dict) -> bool:
    """Sampled (temperature > 0) with a seed: reproducible only through the seed, so replayed whole."""
    return bool(body.get("temperature")) and body.get("seed") is not None


def choose(records: Sequence, sample: int, seed: int) -> list:
    """The requests to replay: every seeded sampled one, plus `sample` greedy ones picked from the
    seed, round-robin over the sessions in a shuffled order (spread over sessions), each pick at a
    random depth of its session but every `LATE_EVERY`-th its last request (late turns included).
    Aborted requests have no complete output to compare and are never picked."""
    if sample <= 0:
        return []
    eligible = [r for r in records if not r.aborted and getattr(r, "request", None) is not None]
    seeded = [r for r in eligible if seeded_sampling(r.request)]
    by_session: dict[int, list] = {}
    for r in eligible:
        if not r.request.get("temperature"):
            by_session.setdefault(r.session, []).append(r)
    for recs in by_session.values():
        recs.sort(key=lambda r: r.hop)
    rng = random.Random(f"load-vs-solo:{seed}")
    sessions = sorted(by_session)
    rng.shuffle(sessions)
    picked: list = []
    k = 0
    while len(picked) < sample and any(by_session.values()):
        for session in sessions:
            remaining = by_session[session]
            if not remaining or len(picked) >= sample:
                continue
            depth = 1.0 if k % LATE_EVERY == 0 else rng.random()
            picked.append(remaining.pop(round(depth * (len(remaining) - 1))))
            k += 1
    return seeded + sorted(picked, key=lambda r: (r.session, r.hop))


# ---- the replay ----------------------------------------------------------------------------------
def replay(client, body: dict[str, Any], streamed: bool) -> tuple[list, list]:
    """One request, alone, exactly as recorded; its (tokens, top-k) from the logprobs."""
    from canary.driver import _logprob_tokens

    if not streamed:
        resp = client.chat.completions.create(**body)
        choice = resp.choices[0]
        return _logprob_tokens(choice.logprobs.content if choice.logprobs else None)
    tokens: list = []
    tops: list = []
    stream = client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True})
    try:
        for chunk in stream:
            for choice in chunk.choices:
                if choice.logprobs and choice.logprobs.content:
                    t, p = _logprob_tokens(choice.logprobs.content)
                    tokens += t
                    tops += p
    finally:
        stream.close()
    return tokens, tops


def check_load_vs_solo(target, result, outcome, *, sample: int = DEFAULT_SAMPLE, exact: bool = False,
                       near_tie: float = 0.05, timeout_s: float = 300.0, compared_alone=None) -> None:
    """Replay the chosen requests of `result` (a RunResult) against `target` one at a time and add
    `[load-vs-solo]` failures, a note when skipped, and `summary["differential"]` to `outcome`.
    `compared_alone(record)`: True for a request the calibration run already ran alone in the same
    context (canary/calibration.py `has_counterpart`); those are not replayed a second time, the
    sample is drawn from the rest (requests whose context moved under load, e.g. after a benign near-tie)."""
    if sample <= 0:
        outcome.notes.append("load-vs-solo differential oracle off (--differential-sample 0)")
        return
    if not result.options.logprobs or not any(r.turn.tokens for r in result.requests if not r.aborted):
        outcome.notes.append(f"load-vs-solo differential oracle skipped: {target.name} returned no logprobs "
                             "(the comparison reads tokens from them)")
        return
    import openai

    pool = [r for r in result.requests if compared_alone is None or not compared_alone(r)]
    chosen = choose(pool, sample, result.options.seed)
    counts = {"compared": 0, "equal": 0, "benign_near_ties": 0, "failed": 0}
    started = time.perf_counter()
    client = target.client(timeout=timeout_s)
    try:
        for record in chosen:
            where = f"session {record.session} turn {record.turn.turn} request {record.hop}"
            try:
                solo_tokens, solo_top = replay(client, record.request, record.streamed)
            except (openai.APIStatusError, openai.APIConnectionError) as exc:
                # Never retried: a server that fails a request it served under load is a finding.
                counts["failed"] += 1
                outcome.failures.append(f"{TAG} {where}: the solo replay failed: {type(exc).__name__} "
                                        f"{getattr(exc, 'status_code', '') or ''}".rstrip() + f" {str(exc)[:200]}")
                continue
            counts["compared"] += 1
            load_top = record.transcript.top_logprobs if record.transcript is not None else []
            mismatch = compare(solo_tokens, solo_top, record.turn.tokens, load_top, None if exact else near_tie)
            if mismatch is not None and mismatch.benign and seeded_sampling(record.request):
                # A draw is not an argmax: a near-tie says nothing about it, and the seed alone fixes it.
                mismatch = dataclasses.replace(mismatch, benign=False,
                                               reason="a seeded sample must replay token for token")
            if mismatch is None:
                counts["equal"] += 1
            elif mismatch.benign:
                counts["benign_near_ties"] += 1
            else:
                counts["failed"] += 1
                mode = "streamed" if record.streamed else "not streamed"
                outcome.failures.append(f"{TAG} {where} ({mode}): {mismatch.describe()}")
    finally:
        client.close()
    outcome.summary["differential"] = {
        **counts, "sample": sample, "seeded_sampling": sum(seeded_sampling(r.request) for r in chosen),
        "exact": exact, "near_tie": None if exact else near_tie, "wall_s": round(time.perf_counter() - started, 2),
        **({"compared_alone_in_calibration": len(result.requests) - len(pool)} if compared_alone else {})}
