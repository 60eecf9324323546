"""The session driver spread over processes gives the same run as one process: every session
driven once, the same requests and tokens (the runtime is batch-invariant, so the load pattern
cannot change a greedy token), the same oracle verdicts, and every finished request reported to
the parent's callback as it happens."""

from __future__ import annotations

import pytest

from canary.driver import DriverOptions, SessionDriver
from canary.driver_pool import run_sessions
from canary.targets import embedded_server
from runtime.config import DEFAULT_MODEL

pytestmark = pytest.mark.e2e


def outcome(result):
    requests = sorted((r.session, r.hop, r.streamed, tuple(r.turn.tokens)) for r in result.requests)
    failures = sorted((f.session, f.oracle) for _, f in result.failures)
    # How each session ended and how often each oracle ran: the parent merges these from the shards.
    return (requests, failures, result.sessions_completed, result.sessions_aborted, sorted(result.session_ends),
            result.oracle_checks)


def test_two_driver_processes_give_the_one_process_run(tmp_path):
    options = DriverOptions(sessions=6, turns=1, stream_ratio=0.5, max_tokens=48)
    with embedded_server(DEFAULT_MODEL, log_dir=tmp_path) as target:
        single = SessionDriver(target, options).run()
        reported = []
        sharded = run_sessions(target, DriverOptions(**{**options.__dict__, "processes": 2}),
                               on_request_done=reported.append)
    assert {r.session for r in sharded.requests} == set(range(options.sessions)), "a session was not driven"
    assert outcome(sharded) == outcome(single)
    assert len(reported) == len(sharded.requests) and sharded.wall_s > 0


def test_processes_must_be_positive():
    with pytest.raises(ValueError, match="processes"):
        DriverOptions(processes=0)
