"""The session driver spread over processes: shard k of n runs sessions k, k+n, k+2n, ... in its
own event loop (DriverOptions.processes), and the parent merges the shards' results into one
RunResult, so oracles, metrics and reports see one run. Finished requests stream back to the
parent as they happen (for the progress bar and soak sampling), not only at the end.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import queue
import time
from collections.abc import Callable

from canary.driver import DriverOptions, RequestRecord, RunResult, SessionDriver
from canary.targets import Target

_DONE = "done"


def _shard_main(target: Target, options, shard: tuple[int, int], events) -> None:
    def report(record: RequestRecord) -> None:
        events.put(("request", record))

    try:
        result = SessionDriver(target, options, on_request_done=report, shard=shard).run()
        events.put((_DONE, result))
    except BaseException as exc:  # the parent must learn why a shard ended, not wait for it
        events.put((_DONE, exc))


def run_sessions(target: Target, options: DriverOptions,
                 on_request_done: Callable[[RequestRecord], None] | None = None) -> RunResult:
    """The run `options` asks for: in this process, or spread over `options.processes`."""
    if options.processes == 1:
        return SessionDriver(target, options, on_request_done=on_request_done).run()
    return run_sharded(target, options, on_request_done)


def run_sharded(target: Target, options: DriverOptions,
                on_request_done: Callable[[RequestRecord], None] | None) -> RunResult:
    n = options.processes
    shard_options = dataclasses.replace(options, processes=1)
    # spawn, not fork: the parent is a pytest process with threads (fork would copy held locks).
    context = multiprocessing.get_context("spawn")
    spawned = time.time()
    events = context.Queue()
    workers = [context.Process(target=_shard_main, args=(target, shard_options, (k, n), events), daemon=True)
               for k in range(n)]
    for worker in workers:
        worker.start()
    results: list[RunResult] = []
    errors: list[BaseException] = []
    try:
        while len(results) + len(errors) < n:
            try:
                kind, payload = events.get(timeout=1.0)
            except queue.Empty:
                dead = [w for w in workers if w.exitcode not in (None, 0)]
                if dead and len(results) + len(errors) + len(dead) >= n:
                    raise RuntimeError(f"driver shard exited with status {dead[0].exitcode} before reporting") \
                        from None
                continue
            if kind == "request":
                if on_request_done is not None:
                    on_request_done(payload)
            elif isinstance(payload, BaseException):
                errors.append(payload)
            else:
                results.append(payload)
    finally:
        for worker in workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.terminate()
    if errors:
        raise errors[0]
    merged = merge_shards(options, target.name, results)
    merged.startup_s = merged.started - spawned
    return merged


def merge_shards(options: DriverOptions, target_name: str, results: list[RunResult]) -> RunResult:
    """One run from its shards. Its wall time runs from the first shard's first session to the last
    shard's end, not from the spawn: each process's start-up (a Python interpreter importing the
    client and the harness) is the harness's time, not the server's, and counting it made the H200
    gate's tok/s read low."""
    first = min(r.started for r in results)
    merged = RunResult(options, target_name, first, max(r.started + r.wall_s for r in results) - first)
    for result in results:
        merged.requests += result.requests
        merged.failures += result.failures
        merged.sessions_completed += result.sessions_completed
        merged.sessions_aborted += result.sessions_aborted
        merged.session_ends += result.session_ends
        merged.replays += result.replays
        for oracle, count in result.oracle_checks.items():
            merged.oracle_checks[oracle] = merged.oracle_checks.get(oracle, 0) + count
    merged.failures.sort(key=lambda item: item[0])
    return merged
