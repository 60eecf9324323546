"""The phases of one request's time to first token, from the marks the servers keep for a traced
request (runtime/server/trace.py) and the client's own two: the PD pair's critical path, the decode
side's branch that opens the room meanwhile, and the colocated server's path (`bench.pd_ttft --phases`).

A path is a list of (mark, phase): the phase ends at its mark and starts at the previous mark the
request has (a mark missing - "kv_gathered" in direct transfer mode - merges its phase into the next).
Marks are "side.name"; side is client, router, prefill, decode, or server (colocated).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from runtime.server.trace import CPU_SUFFIX, ON_CPU_SUFFIX, PROCESS_CPU_SUFFIX

Path = Sequence[tuple[str, str]]

PD_PATH: Path = (
    ("client.sent", "start"),
    ("router.received", "client -> router"),
    ("prefill.received", "router -> prefill server"),
    ("prefill.body_read", "prefill: body read"),
    ("prefill.parsed", "prefill: parse"),
    ("prefill.prepared", "prefill: template, tokenize"),
    ("prefill.engine_accepted", "prefill: to the engine thread"),
    ("prefill.step_started", "prefill: queued for a step"),
    ("prefill.kv_held", "prefill: prompt step (first token)"),
    ("prefill.first_relayed", "prefill: answer wakes, first token's chunk written"),
    ("router.first_token_relayed", "prefill -> router"),
    ("client.first_token", "router -> client"),
)

# Beside PD_PATH's relay of the first token (runtime/disagg/protocol.py): the decode side takes the same
# token into its request's output, and its stream writes RELAYED_EVENT in its place.
PD_DECODE_FIRST: Path = (
    ("prefill.kv_held", "start"),
    ("prefill.first_replying", "prefill: /pd/transfer handler wakes with the first token"),
    ("decode.first_answered", "/pd/transfer's first line reaches decode"),
    ("decode.first_token", "decode: line read, first token onto its sink"),
    ("decode.first_token_out", "decode: RELAYED_EVENT into its stream"),
)

# Beside the KV path's write: the sender's digest, on a thread of its own.
PD_SENDER_DIGEST: Path = (
    ("prefill.write_started", "start"),
    ("prefill.kv_digested", "prefill: sender's KV digest (beside the gather and write)"),
)

# Beside PD_PATH's first token: the prefill side writes the KV and says so (the answer's second line),
# the decode side lands and checks it, then admits the request (its second token waits for this, its
# first does not).
PD_KV_CHECK: Path = (
    ("prefill.kv_held", "start"),
    ("prefill.write_started", "prefill: KV held -> write starts (room wait, thread hop)"),
    ("prefill.kv_gathered", "prefill: gather into the send slot"),
    ("prefill.kv_written", "prefill: KV write (Mooncake)"),
    ("prefill.kv_digest_awaited", "prefill: sender's digest, what is left of it after the write"),
    ("prefill.room_completed", "prefill: back on the event loop, room completed"),
    ("prefill.transfer_replying", "prefill: the result line"),
    ("decode.transfer_answered", "the result line reaches decode"),
    ("decode.kv_landed", "decode: to the engine thread, scatter"),
    ("decode.kv_checked", "decode: receiver's KV digest"),
    ("decode.engine_accepted", "decode: digest compared, admitted"),
)

# What a traced PD request waits for before its marks are read: the last mark each side makes after
# the first token. Both sides are needed: the router reads the prefill server's marks, then the decode
# server's, so a decode side that had finished could be read beside a prefill snapshot taken just
# before the prefill side's last marks (the CI host saw this once in ~30 requests).
PD_AFTER_FIRST_TOKEN: tuple[str, ...] = tuple(
    {mark.split(".")[0]: mark for mark, _ in PD_KV_CHECK}.values())

# Runs beside PD_PATH: the decode side opens the room, and with it the client's stream, while the prompt
# computes.
PD_ROOM_BRANCH: Path = (
    ("router.received", "start"),
    ("router.prefill_sent", "router: the prompt's call written (the decode call waits for it)"),
    ("decode.received", "router -> decode server"),
    ("decode.body_read", "decode: body read"),
    ("decode.parsed", "decode: parse"),
    ("decode.prepared", "decode: template, tokenize"),
    ("decode.staging_reserved", "decode: receive slot"),
    ("decode.pages_reserved", "decode: pages (engine thread)"),
    ("decode.transfer_requested", "decode: session"),
    ("prefill.room_opened", "decode -> prefill: room opened"),
    ("decode.stream_opened", "prefill -> decode: /pd/transfer's headers, the client's answer opens"),
    ("router.decode_headers", "decode -> router: the decode stream's headers (the client's stream opens)"),
)

# Each path's model compute: `overhead_ms` leaves it out.
PD_COMPUTE = "prefill: prompt step (first token)"
COLOCATED_COMPUTE = "prompt step (first token)"

COLOCATED_PATH: Path = (
    ("client.sent", "start"),
    ("server.received", "client -> server"),
    ("server.body_read", "body read"),
    ("server.parsed", "parse"),
    ("server.prepared", "template, tokenize"),
    ("server.engine_accepted", "to the engine thread"),
    ("server.step_started", "queued for a step"),
    ("server.first_token", "prompt step (first token)"),
    ("server.first_token_out", "first token into the stream"),
    ("client.first_token", "server -> client"),
)


# Spans also marked on their thread's CPU clock (runtime/server/app.py): side, first mark, last mark,
# label. The loop thread's CPU time beside the span's wall time: a span that took longer on one server
# than on another while its CPU time matched was waiting (for the GIL, for a core), not working.
CPU_SPANS: tuple[tuple[str, str, str, str], ...] = (
    ("prefill", "parsed", "prepared", "prefill: template, tokenize"),
    ("decode", "parsed", "prepared", "decode: template, tokenize"),
    ("server", "parsed", "prepared", "colocated: template, tokenize"),
)


def cpu_and_wall_ms(rows: Sequence[Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Per CPU_SPANS span the requests have: the median wall time, the loop thread's CPU time and the
    CPU time of the server's other threads in the span (the process's less the thread's), in ms."""
    out: dict[str, dict[str, float]] = {}
    for side, first, last, label in CPU_SPANS:
        def span(row: Mapping[str, float], suffix: str = "") -> float:
            return row[f"{side}.{last}{suffix}"] - row[f"{side}.{first}{suffix}"]  # noqa: B023 - used at once

        found = [row for row in rows if all(f"{side}.{mark}{suffix}" in row for mark in (first, last)
                                            for suffix in ("", CPU_SUFFIX, PROCESS_CPU_SUFFIX))]
        if not found:
            continue
        thread = [span(row, CPU_SUFFIX) for row in found]
        # The two clocks are read one after the other: a difference of a few microseconds either way is 0.
        others = [max(0.0, span(row, PROCESS_CPU_SUFFIX) - cpu) for row, cpu in zip(found, thread)]
        out[label] = {"wall_ms": _median_ms([span(row) for row in found]), "cpu_ms": _median_ms(thread),
                      "other_threads_cpu_ms": _median_ms(others)}
    return out


def tokenize_core_sharing(rows: Sequence[Mapping[str, float]], core_of: Mapping[int, int]) -> dict[str, float] | None:
    """The PD sides' template + tokenize spans (CPU_SPANS') split by whether they ran at once on one physical core
    (`core_of`: CPU number -> core), from the CPUs each loop thread was on at the span's two ends (ON_CPU_SUFFIX):
    how many requests did, and the median loop-thread CPU time of each side in each case, in ms. The thirty-seventh
    session's H100 showed the prefill side's span at 1.6-1.9x the CPU time of the decode side's, which runs beside
    it: two loop threads on SMT siblings slow each other. None where the marks lack the CPU numbers (not Linux) or
    the requests are not PD ones."""
    spans = {side: (first, last) for side, first, last, _ in CPU_SPANS if side in ("prefill", "decode")}
    found = [row for row in rows if all(f"{side}.{mark}{suffix}" in row for side, ends in spans.items()
                                        for mark in ends for suffix in ("", CPU_SUFFIX, ON_CPU_SUFFIX))]
    if not found:
        return None
    split: dict[bool, list[Mapping[str, float]]] = {True: [], False: []}
    for row in found:
        starts = [row[f"{side}.{first}"] for side, (first, _) in spans.items()]
        ends = [row[f"{side}.{last}"] for side, (_, last) in spans.items()]
        cores = [{core_of.get(int(row[f"{side}.{mark}{ON_CPU_SUFFIX}"]), -1) for mark in both}
                 for side, both in spans.items()]
        split[min(ends) > max(starts) and bool(cores[0] & cores[1])].append(row)
    out: dict[str, float] = {"shared_core": len(split[True]), "apart": len(split[False])}
    for shared, name in ((True, "shared_core"), (False, "apart")):
        for side, (first, last) in spans.items():
            cpu = [row[f"{side}.{last}{CPU_SUFFIX}"] - row[f"{side}.{first}{CPU_SUFFIX}"] for row in split[shared]]
            if cpu:
                out[f"{side}_cpu_ms_{name}"] = _median_ms(cpu)
    return out


def _median_ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1e3, 2)


def flatten(marks_by_side: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    return {f"{side}.{name}": t for side, marks in marks_by_side.items() for name, t in marks.items()}


def phases(path: Path, marks: Mapping[str, float]) -> dict[str, float]:
    """Seconds per phase of `path` for one request's flattened marks."""
    out: dict[str, float] = {}
    previous: float | None = None
    for mark, phase in path:
        if mark not in marks:
            continue
        if previous is not None:
            out[phase] = marks[mark] - previous
        previous = marks[mark]
    return out


def medians_ms(rows: list[dict[str, float]], path: Path) -> dict[str, float]:
    """Each phase's median over requests, in ms, in path order."""
    out: dict[str, float] = {}
    for _, phase in path[1:]:
        values = [row[phase] for row in rows if phase in row]
        if values:
            out[phase] = _median_ms(values)
    return out


def overhead_ms(rows: Sequence[Mapping[str, float]], compute: str) -> float | None:
    """The median over requests of a path's time less its `compute` phase (the prompt step), in ms:
    what serving adds around the model. The PD pair's beside the colocated server's is steadier than
    the TTFT ratio, which the prompt step's own noise moves (9.6-12.8 ms at 8 words on the 2-core host,
    where the pair adds ~4 ms). `rows`: `phases` of one path per request."""
    values = [sum(row.values()) - row[compute] for row in rows if compute in row]
    return _median_ms(values) if values else None


def room_slack_ms(marks: Mapping[str, float]) -> float | None:
    """How long the opened room waited for the prompt's KV (negative: the KV waited for the room)."""
    if "prefill.room_opened" in marks and "prefill.kv_held" in marks:
        return (marks["prefill.kv_held"] - marks["prefill.room_opened"]) * 1e3
    return None
