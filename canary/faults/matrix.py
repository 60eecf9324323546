"""The fault matrix: every fault of runtime/faults.py KNOWN_FAULTS (REGISTRY and PD_REGISTRY) through
the gate(s) meant to catch it, then the clean runtime through the same gates.

A `Detector` wraps one gate (canary/faults/detectors.py holds the registry). With the fault on, a
row is "caught" only when the gate failed for the reason it exists for (its named oracle or check:
`Detector.fires_for`), "missed" when the gate passed, and "error" when it crashed or failed for
some other reason: a crash proves nothing about the gate. A fault counts as caught when every gate
of it that ran caught it. Gates that need a GPU are "not run" without `gpu=True`, and a fault left
with no gate run is counted apart, never as caught. Mutation score = caught / faults run.
Clean runs: each distinct gate, no fault, N seeds; any failure or crash there is an alarm.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

CAUGHT, MISSED, ERROR, NOT_RUN = "caught", "missed", "error", "not run"
NEEDS_GPU = "not run: needs a GPU (use --gpu on the device)"
MESSAGE_CHARS = 220


@dataclass(frozen=True)
class GateResult:
    failures: list[str]  # what the gate reported, one line per failure, each naming its oracle/check
    seconds: float  # from the start of the gate's workload to its verdict
    setup_s: float = 0.0  # before the workload: server start, model load, worker spawn, graph capture


# (faults switched on, seed of the workload, directory for logs) -> the gate's verdict
GateFn = Callable[[tuple[str, ...], int, Path], GateResult]


@dataclass(frozen=True)
class Detector:
    gate: str  # names the gate; detectors with the same name are one gate (run once per clean seed)
    run: GateFn
    fires_for: Callable[[str], bool]  # is this failure line the gate firing for its own reason?
    needs_gpu: bool = False
    timed: bool = False  # its oracle measures speed: must not share the CPU with other tests
    # The failure tags ("[json-parse]") this gate should name for the fault it is registered under;
    # tests/e2e/test_fault_matrix.py asserts that one of them fired. `fires_for` decides the row's
    # status; this is the finer claim ("caught, and by the oracle we expected").
    oracles: tuple[str, ...] = ()
    # Why the gate cannot run on this machine (a missing package: the PD gate without Mooncake), or None;
    # such a gate is "not run", like a GPU gate without --gpu, never an error.
    unavailable: Callable[[], str | None] = lambda: None

    def expecting(self, *oracles: str) -> Detector:
        """The same gate, registered under a fault that it should catch through these oracles."""
        return replace(self, oracles=oracles)


@dataclass(frozen=True)
class Row:
    """One (fault, gate) cell of the matrix."""

    fault: str
    gate: str
    status: str
    seconds: float | None
    setup_s: float | None
    message: str
    fired: tuple[str, ...] = ()  # the distinct tags of the failure lines that fired, in order


@dataclass(frozen=True)
class CleanRow:
    """One gate against the clean runtime, `runs` times."""

    gate: str
    runs: int
    alarms: int
    seconds: list[float]
    messages: list[str]  # first line of each alarm
    status: str = "ran"  # or NOT_RUN


@dataclass
class MatrixReport:
    rows: list[Row] = field(default_factory=list)
    clean: list[CleanRow] = field(default_factory=list)
    wall_s: float = 0.0

    def fault_status(self, fault: str) -> str:
        rows = [r for r in self.rows if r.fault == fault]
        ran = [r for r in rows if r.status != NOT_RUN]
        if rows and not ran:
            return NOT_RUN
        return CAUGHT if ran and all(r.status == CAUGHT for r in ran) else MISSED

    @property
    def faults(self) -> list[str]:
        return list(dict.fromkeys(r.fault for r in self.rows))

    @property
    def score(self) -> dict:
        statuses = [self.fault_status(f) for f in self.faults]
        caught, not_run = statuses.count(CAUGHT), statuses.count(NOT_RUN)
        run = len(statuses) - not_run
        return {"caught": caught, "run": run, "not_run": not_run, "total": len(statuses),
                "mutation_score": caught / run if run else None}

    @property
    def clean_alarms(self) -> int:
        return sum(c.alarms for c in self.clean)

    @property
    def ok(self) -> bool:
        """Every fault that ran was caught and no clean run alarmed."""
        return self.score["caught"] == self.score["run"] and self.clean_alarms == 0


def tag_of(line: str) -> str:
    """"[golden] session 3 ..." -> "[golden]"; a line without a tag -> ""."""
    return line.split("]", 1)[0] + "]" if line.startswith("[") and "]" in line else ""


def first_line(text: str) -> str:
    line = (text.strip().splitlines() or [""])[0]
    return line if len(line) <= MESSAGE_CHARS else line[:MESSAGE_CHARS - 3] + "..."


def run_detector(fault: str, detector: Detector, *, gpu: bool, workdir: Path, seed: int = 0) -> Row:
    if detector.needs_gpu and not gpu:
        return Row(fault, detector.gate, NOT_RUN, None, None, NEEDS_GPU)
    if (reason := detector.unavailable()) is not None:
        return Row(fault, detector.gate, NOT_RUN, None, None, first_line(f"not run: {reason}"))
    started = time.perf_counter()
    try:
        result = detector.run((fault,), seed, workdir)
    except Exception as exc:  # noqa: BLE001 - a crashing gate is reported, never counted as a catch
        return Row(fault, detector.gate, ERROR, time.perf_counter() - started, None,
                   first_line(f"gate crashed: {type(exc).__name__}: {exc}"))
    fired = [line for line in result.failures if detector.fires_for(line)]
    if fired:
        return Row(fault, detector.gate, CAUGHT, result.seconds, result.setup_s, first_line(fired[0]),
                   tuple(dict.fromkeys(tag_of(line) for line in fired)))
    if result.failures:
        return Row(fault, detector.gate, ERROR, result.seconds, result.setup_s,
                   first_line(f"failed for another reason: {result.failures[0]}"))
    return Row(fault, detector.gate, MISSED, result.seconds, result.setup_s, "gate passed with the fault on")


def run_fault(fault: str, detectors: Sequence[Detector], *, gpu: bool, workdir: Path,
              on_row: Callable[[Row], None] = lambda row: None) -> list[Row]:
    if not detectors:
        row = Row(fault, "-", MISSED, None, None, "no gate registered for this fault")
        on_row(row)
        return [row]
    rows = []
    for detector in detectors:
        rows.append(run_detector(fault, detector, gpu=gpu, workdir=workdir))
        on_row(rows[-1])
    return rows


def distinct_gates(registry: Mapping[str, Sequence[Detector]], faults: Sequence[str]) -> list[Detector]:
    gates: dict[str, Detector] = {}
    for fault in faults:
        for detector in registry.get(fault, ()):
            gates.setdefault(detector.gate, detector)
    return list(gates.values())


def run_clean(detector: Detector, runs: int, *, gpu: bool, workdir: Path) -> CleanRow:
    """The gate against the clean runtime with seeds 0..runs-1: every failure or crash is an alarm."""
    if detector.needs_gpu and not gpu:
        return CleanRow(detector.gate, 0, 0, [], [NEEDS_GPU], NOT_RUN)
    if (reason := detector.unavailable()) is not None:
        return CleanRow(detector.gate, 0, 0, [], [first_line(f"not run: {reason}")], NOT_RUN)
    seconds, messages = [], []
    for seed in range(runs):
        started = time.perf_counter()
        try:
            result = detector.run((), seed, workdir)
        except Exception as exc:  # noqa: BLE001 - a crash on the clean runtime is an alarm
            seconds.append(time.perf_counter() - started)
            messages.append(first_line(f"seed {seed}: gate crashed: {type(exc).__name__}: {exc}"))
            continue
        seconds.append(result.seconds)
        if result.failures:
            messages.append(first_line(f"seed {seed}: {result.failures[0]}"))
    return CleanRow(detector.gate, runs, len(messages), seconds, messages)


def run_matrix(registry: Mapping[str, Sequence[Detector]], faults: Sequence[str], *, clean_runs: int, gpu: bool,
               workdir: Path, on_row: Callable[[Row], None] = lambda row: None,
               on_clean: Callable[[CleanRow], None] = lambda row: None) -> MatrixReport:
    started = time.perf_counter()
    report = MatrixReport()
    for fault in faults:
        report.rows += run_fault(fault, registry.get(fault, ()), gpu=gpu, workdir=workdir, on_row=on_row)
    if clean_runs > 0:
        for detector in distinct_gates(registry, faults):
            report.clean.append(run_clean(detector, clean_runs, gpu=gpu, workdir=workdir))
            on_clean(report.clean[-1])
    report.wall_s = time.perf_counter() - started
    return report


# ---- output -------------------------------------------------------------------------------------
def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def render_table(report: MatrixReport) -> str:
    """Markdown tables (readable in a terminal, pasteable into docs/results.md)."""
    lines = ["| fault | gate | result | detect s | message |", "|---|---|---|---|---|"]
    for r in report.rows:
        lines.append(f"| {r.fault} | {r.gate} | {r.status} | {_seconds(r.seconds)} | {r.message.replace('|', '/')} |")
    s = report.score
    score = "n/a" if s["mutation_score"] is None else f"{100 * s['mutation_score']:.0f}%"
    lines += ["", f"mutation score: {s['caught']}/{s['run']} faults run caught ({score}); "
                  f"{s['not_run']} of {s['total']} not run (needs a GPU or a missing package)"]
    if report.clean:
        lines += ["", "| clean gate | runs | alarms | mean s | first alarm |", "|---|---|---|---|---|"]
        for c in report.clean:
            mean = sum(c.seconds) / len(c.seconds) if c.seconds else None
            first = c.messages[0].replace("|", "/") if c.messages else "-"
            lines.append(f"| {c.gate} | {c.runs if c.status != NOT_RUN else NOT_RUN} | {c.alarms} | "
                         f"{_seconds(mean)} | {first} |")
        lines += ["", f"clean alarms: {report.clean_alarms} over "
                      f"{sum(c.runs for c in report.clean)} gate runs"]
    lines.append(f"wall: {report.wall_s:.0f} s; verdict: {'PASS' if report.ok else 'FAIL'}")
    return "\n".join(lines)


def to_json(report: MatrixReport, provenance: dict | None = None) -> dict:
    return {**(provenance or {}), "ok": report.ok, "score": report.score, "clean_alarms": report.clean_alarms,
            "wall_s": report.wall_s,
            "faults": {f: report.fault_status(f) for f in report.faults},
            "rows": [asdict(r) for r in report.rows], "clean": [asdict(c) for c in report.clean]}
