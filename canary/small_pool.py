"""The small-pool run: the gate's workload mix against an embedded server whose KV pool is smaller
than its working set, so requests really are preempted and recomputed. Golden tokens and logprobs,
every oracle and the exact load-vs-solo replays must hold; it fails loudly (`[preemption]`) when
nothing was preempted, since the run would then not have tested what it claims.

Its own module, not canary/workload.py: it runs the gate (canary/gate.py), and the gate's driver
imports the workload mix; keeping it beside the mix made an import cycle.
"""

from __future__ import annotations

import dataclasses

from canary.gate import GateOutcome, run_gate
from canary.options import CanaryOptions, driver_options
from canary.targets import embedded_server

SMALL_POOL_SESSIONS, SMALL_POOL_TURNS, SMALL_POOL_REPLAYS = 24, 2, 8


def small_pool_gate(options: CanaryOptions, model: str, server_args: list[str], log_dir) -> GateOutcome:
    """The gate's workload mix (`options`: CanaryOptions) on 24 sessions x 2 turns against an
    embedded server with `options.small_pool_pages` KV pages: golden tokens and logprobs, every
    oracle and the load-vs-solo replays must hold while requests are preempted and recomputed
    (the runtime recomputes exactly). A `[preemption]` failure when nothing was preempted."""
    driver = driver_options(options)
    driver = dataclasses.replace(driver, sessions=min(driver.sessions, SMALL_POOL_SESSIONS),
                                 turns=min(driver.turns or SMALL_POOL_TURNS, SMALL_POOL_TURNS))
    pages = options.small_pool_pages
    with embedded_server(model, server_args, num_pages=pages, faults=options.faults, log_dir=log_dir) as target:
        # Exact mode (the embedded runtime's default): a preempted request's recompute must give the
        # bits of its solo run, top-k logprobs included (segment invariance: runtime/kernels/cpu.py).
        outcome = run_gate(target, driver, perf_gate=False, near_tie=0.05, progress=False,
                           differential_sample=min(options.differential_sample, SMALL_POOL_REPLAYS))
    preempted = outcome.summary.get("preemptions")
    outcome.summary["kv_pool_pages"] = pages
    if preempted is None:
        outcome.failures.append("[preemption] the small-pool server exports no dsv4_preemptions_total: cannot "
                                "tell whether it preempted")
    elif preempted == 0:
        outcome.failures.append(f"[preemption] {driver.sessions} sessions x {driver.turns} turns on {pages} KV pages "
                                "preempted nothing: the run did not test preemption (lower --small-pool-pages)")
    return outcome
