"""Issue 16's PD chaos run: concurrent sessions through the router of a prefill/decode pair (three
processes, canary/pd_target.py `RestartablePDPair`), 10% of the requests aborted by their client
(streams closed after 0-3 content chunks: 0 is right after the headers, while the prompt computes or its KV
is in flight), the decode server SIGKILLed and restarted (a decode-only restart), then the prefill
server, then the prefill server stopped gracefully (SIGTERM: it drains, runtime/disagg/bootstrap.py)
and started again, while the sessions keep sending. It must end with:

- 0 hangs: every request answered within its bound (canary/pd_chaos.py `chat`);
- every failed request named: an OpenAI-shaped error (status + body, or a `data:` error chunk);
- the pair serving again within 10 s of each restart, timed by this test's clock from the new
  process being healthy to the first successful probe request (a bound, not a benchmark);
- 0 pages left on either side (/metrics: KV pages in use, pages reserved for transfers, staging slots held);
- the same greedy answer for the same prompt before and after the restarts.

80 sessions, as the issue asks (about 1 minute on the 2-core CPU), in `make test`'s serial stage (marker
`stress`: the 10 s recovery bound must not share the two cores with other test workers); `-s` prints the
summary line docs/results.md records. Before the decode side shared one HTTP client, the 80-session run missed
the 10 s recovery bound (each of the 80 requests arriving at the restarted decode server built a TLS context
on its event loop), so the default was 20. `PD_CHAOS_SESSIONS` sets the session count.

The negative control runs beside it: the same chaos (CONTROL_SESSIONS sessions, CONTROL_ABORT_RATIO of the
requests aborted) with both sides started with pd-abort-leak must fail the page check. (Until the forty-first
session both were `--run-slow` only and the control was run by hand; the fault matrix's PD gate had stopped
catching that fault unseen while its rows were slow.) The recovery bound's control is the PD fault gate's
pd-stale-bootstrap row (canary/faults/pd_gates.py); the request classifier's are in
tests/e2e/test_pd_chaos_client.py.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter

import pytest

from canary import pd_chaos
from canary.pd_target import RestartablePDPair
from runtime.config import DEFAULT_MODEL
from runtime.disagg.transfer import unavailable_reason

pytestmark = [pytest.mark.stress,
              pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))]

MODEL = "canary-moe-v2"
SESSIONS = int(os.environ.get("PD_CHAOS_SESSIONS", "80"))
# The negative control's sessions and abort ratio. With aborts after 1-3 content chunks only, it leaked 1-22 pages
# a run (forty-first session: 20, 80 and 40 sessions at 10-50% aborts): those aborts leak only in the few ms between
# the first token and the KV's admission, too near none. Aborts at the headers (0 chunks) land before it.
CONTROL_SESSIONS = 40
CONTROL_ABORT_RATIO = 0.5
PAGE_CHECK = "pages left"
ABORT_RATIO = 0.1
RECOVERY_S = 10.0
# (side, graceful) in order: SIGKILL the decode server, SIGKILL the prefill server, SIGTERM the prefill server.
RESTARTS = (("decode", False), ("prefill", False), ("prefill", True))
PHASE_DEADLINE_S = 300.0  # a phase that cannot reach its successes fails the test instead of waiting on
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "2+2=", "Name three colours.",
           "Explain photosynthesis briefly.", "Tell me a story " * 12, "List the planets.", "Say hello."]


class Sessions:
    """SESSIONS client threads sending one request after another until told to stop."""

    def __init__(self, router: str, seed: int, count: int, abort_ratio: float) -> None:
        self.router, self.seed, self.abort_ratio = router, seed, abort_ratio
        self.lock = threading.Lock()
        self.outcomes: list[tuple[str, bool, pd_chaos.Outcome]] = []  # (prompt, meant to abort, outcome)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.session, args=(i,), daemon=True) for i in range(count)]

    def session(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        while not self.stop.is_set():
            prompt, abort = rng.choice(PROMPTS), rng.random() < self.abort_ratio
            out = pd_chaos.chat(self.router, MODEL, prompt, stream=abort or rng.random() < 0.5, max_tokens=16,
                                abort_after=rng.randint(0, 3) if abort else None, timeout_s=90)
            with self.lock:
                self.outcomes.append((prompt, abort, out))
            if out.kind != pd_chaos.OK:
                time.sleep(0.2)  # a pair that is down answers at once: do not spin on it

    def successes(self) -> int:
        with self.lock:
            return sum(out.kind == pd_chaos.OK for _, _, out in self.outcomes)

    def wait_successes(self, count: int) -> None:
        deadline = time.monotonic() + PHASE_DEADLINE_S
        while self.successes() < count:
            assert time.monotonic() < deadline, f"only {self.successes()} of {count} requests succeeded"
            time.sleep(0.2)


def first_success_after(outcomes, since: float) -> float | None:
    """Seconds from `since` to the end of the first workload request sent after it that succeeded."""
    ends = [out.ended for _, _, out in outcomes if out.kind == pd_chaos.OK and out.started >= since]
    return min(ends) - since if ends else None


def chaos_run(tmp_path, sessions_count: int, faults: tuple[str, ...] = (), abort_ratio: float = ABORT_RATIO
              ) -> dict[str, str]:
    """One chaos run (module docstring) against a pair started with `faults`: each check that failed, by name,
    with what it saw; {} when the run passed them all."""
    restarts = []
    with RestartablePDPair(DEFAULT_MODEL, faults=faults, log_dir=tmp_path, timeout_s=10.0) as pair:
        sessions = Sessions(pair.router, seed=0, count=sessions_count, abort_ratio=abort_ratio)
        started = time.monotonic()
        for thread in sessions.threads:
            thread.start()
        try:
            for phase, (role, graceful) in enumerate(RESTARTS, start=1):
                sessions.wait_successes(phase * sessions_count)
                down_s = pair.restart_side(role, graceful=graceful)
                healthy_at = time.monotonic()
                recovery_s, last = pd_chaos.seconds_until_serving(pair.router, MODEL, PROMPTS[0], RECOVERY_S)
                restarts.append({"role": role + (" (graceful)" if graceful else ""), "kill_to_healthy_s": down_s,
                                 "recovery_s": recovery_s,
                                 "last_probe": f"{last.kind} {last.code or ''} {last.detail[:200]}",
                                 "healthy_at": healthy_at})
            sessions.wait_successes((len(RESTARTS) + 1) * sessions_count)
        finally:
            sessions.stop.set()
            for thread in sessions.threads:
                thread.join(timeout=120)
        wall_s = time.monotonic() - started
        alive = [t.name for t in sessions.threads if t.is_alive()]
        pages = {role: pd_chaos.pages_left(pair.url(role)) for role in pair.ROLES}

    outcomes = sessions.outcomes
    kinds = Counter(out.kind for _, _, out in outcomes)
    codes = Counter(out.code for _, _, out in outcomes if out.kind == pd_chaos.ERROR)
    for r in restarts:
        r["workload_recovery_s"] = first_success_after(outcomes, r.pop("healthy_at"))
    with_faults = f" faults {','.join(faults)}" if faults else ""
    print(f"\n[pd-chaos] {sessions_count} sessions{with_faults}, {len(outcomes)} requests in {wall_s:.0f} s: "
          f"{dict(kinds)}; aborts meant {sum(a for _, a, _ in outcomes)}; errors by code {dict(codes)}; restarts "
          + "; ".join(f"{r['role']}: kill->healthy {r['kill_to_healthy_s']:.1f} s, healthy->serving "
                      f"{r['recovery_s'] if r['recovery_s'] is None else round(r['recovery_s'], 2)} s (first "
                      f"workload success {r['workload_recovery_s'] and round(r['workload_recovery_s'], 2)} s)"
                      for r in restarts) + f"; pages after {pages}")

    failed: dict[str, str] = {}
    if alive:
        failed["session threads"] = f"still waiting: {alive}"
    hangs = [out for _, _, out in outcomes if out.kind in (pd_chaos.HANG, pd_chaos.UNNAMED)]
    if hangs:
        failed["hangs"] = f"{len(hangs)} requests hung or failed without an OpenAI error: {hangs[:3]}"
    if kinds[pd_chaos.ABORTED] == 0:
        failed["aborts"] = "no request was aborted by its client: the abort path went untested"
    late = [r for r in restarts if r["recovery_s"] is None]
    if late:
        failed["recovery"] = f"not serving within {RECOVERY_S:g} s of a restart: {late}"
    if not all(v == 0 for side in pages.values() for v in side.values()):
        failed[PAGE_CHECK] = str(pages)
    answers: dict[str, set[str]] = {}
    for prompt, _, out in outcomes:
        if out.kind == pd_chaos.OK:
            answers.setdefault(prompt, set()).add(out.text)
    differing = {p[:20]: sorted(t[:40] for t in texts) for p, texts in answers.items() if len(texts) > 1}
    if differing:
        failed["same answers"] = str(differing)
    return failed


def test_pd_pair_survives_aborts_and_a_restart_of_each_side(tmp_path):
    assert chaos_run(tmp_path, SESSIONS) == {}


def test_the_chaos_run_catches_pages_leaked_by_aborts(tmp_path):
    """The negative control: requests given up while their KV is in flight keep their reserved pages (pd-abort-leak,
    here seen on the decode side): the page check fails."""
    failed = chaos_run(tmp_path, CONTROL_SESSIONS, faults=("pd-abort-leak",), abort_ratio=CONTROL_ABORT_RATIO)
    assert PAGE_CHECK in failed, failed
