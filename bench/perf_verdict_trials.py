"""The perf verdict's error rates, measured: N clean runs and N runs of a server slowed by a known
percentage (`slow-step`, DSV4_SLOW_STEP_PCT), each a whole verdict (canary/perf/trials.py), in the
A/B form (a clean baseline server beside the candidate) and/or the stored form (a trials baseline
recorded once from the clean server, compared raw behind the machine-speed probe's guard on CPU).

Issue 17's bar: 20 clean runs with 0 alarms, the 10% slowdown caught in >= 19 of 20. A clean run
"alarms" on any verdict but ok (inconclusive fails the gate too); a slowed run is "caught" when
called slower (inconclusive is counted apart: it fails the gate, but it is not a detection).

Resumable: every verdict is one JSON line in --out, and a rerun with the same --out skips what is
there (the stored baseline is kept beside it). Clean and slowed runs alternate, so a machine that
drifts hits both, and --budget-s stops starting new runs in time for a device call's limit. Each
row also keeps, pair by pair, what the host did to the two servers (bench/host_load.py: steal time, CPU
time, the CPU each one's busiest thread ran on): the H200's pairs came in slow stretches. `--pin` says
where the processes run (PIN_MODES); a series is one method, so a file holds one pinning.

    python -m bench.perf_verdict_trials --runs 20 --out perf_trials.jsonl            # 2-core CPU
    python -m bench.perf_verdict_trials --runs 20 --mode ab --budget-s 540 \\
        --perf-workload '{"concurrency": [8], "ttft_rate": 16, "rounds": 10}' \\
        --server-arg=--dtype=float32 --out $OUT/perf_trials.jsonl                    # H200
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from bench.host_load import HostSampler, summary
from canary.perf import machine_speed, ratio_stats
from canary.perf.trial_load import WORKLOAD_KEYS, TrialWorkload
from canary.perf.trials import (
    MAX_TRIALS_FACTOR,
    MIN_TRIALS_DEFAULT,
    ab_trials,
    record_trials,
    recorded_trials,
    stored_trials,
)
from canary.provenance import device_name, git_commit
from canary.targets import Target, embedded_server
from runtime.config import DEFAULT_MODEL


def workload_arg(spec: str) -> TrialWorkload:
    """`--perf-workload`: a JSON object of changes to the default trial workload, checked up front."""
    try:
        changes = json.loads(spec)
        if not isinstance(changes, dict):
            raise ValueError("not a JSON object")
        return TrialWorkload.from_dict(changes)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"{spec!r}: {exc}") from exc


# `--pin`: where each process may run.
#   apart:  the harness, the baseline server and the candidate servers on disjoint CPU sets (a quarter for the
#           harness, the rest halved; clean and slowed never run at once, so they share theirs): no process of
#           the trials takes a CPU from another.
#   shared: the harness on a quarter, and both sides' servers on the same two CPUs. The sides' bursts
#           alternate, so they never run at once, and each then runs on the very CPUs the other ran on a burst
#           before: a CPU slowed for a while (a neighbour on its sibling hyperthread, its clock) slows both
#           sides alike, where under `apart`, or left to the scheduler, it slows whichever side sits there.
#           Two, not one: the engine thread and the event loop run at once.
PIN_MODES = ("apart", "shared")


def cpu_split(cpus: list[int], mode: str = "apart") -> dict[str, list[int]]:
    """The CPU sets of `--pin MODE` (PIN_MODES) out of `cpus`: "harness" (this process: clients, oracles),
    "baseline" and "candidates" (the clean and the slowed server)."""
    if mode not in PIN_MODES:
        raise ValueError(f"unknown pinning {mode!r}; known: {', '.join(PIN_MODES)}")
    cpus = sorted(cpus)
    if len(cpus) < 3:
        raise ValueError(f"--pin needs at least 3 CPUs, this process has {len(cpus)}")
    harness = max(1, len(cpus) // 4)
    if mode == "shared":
        servers = cpus[harness:harness + 2]
        return {"harness": cpus[:harness], "baseline": servers, "candidates": servers}
    half = (len(cpus) - harness) // 2
    return {"harness": cpus[:harness], "baseline": cpus[harness:harness + half],
            "candidates": cpus[harness + half:]}


def done_runs(out: Path, device: str | None = None, method: dict | None = None) -> list[dict]:
    """The runs `out` holds. With `device`: refused (ValueError) when any of them ran on another machine,
    since error rates are one machine's; a resumed series would otherwise count them as its own (the
    twenty-fifth session's H200 series resumed on an H100 that way). With `method` (e.g. {"pin": "shared"}):
    likewise refused when any of them was run another way (a row without a key ran with None)."""
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()] if out.is_file() else []
    others = sorted({r["device"] for r in rows if device is not None and r.get("device", device) != device})
    if others:
        raise ValueError(f"{out} holds runs of {', '.join(others)}, and this is {device}: error rates are one "
                         "machine's, so go on in another --out (or move this one aside)")
    for key, value in (method or {}).items():
        if others := sorted({str(r.get(key)) for r in rows if r.get(key) != value}):
            raise ValueError(f"{out} holds runs of {key} {', '.join(others)}, and this series' is {value}: a series "
                             "is one method, so go on in another --out (or move this one aside)")
    return rows


def counts(rows: list[dict], mode: str, kind: str) -> dict[str, int]:
    statuses = [r["status"] for r in rows if r["mode"] == mode and r["kind"] == kind]
    return {s: statuses.count(s) for s in (ratio_stats.OK, ratio_stats.SLOWER, ratio_stats.INCONCLUSIVE)} | {
        "runs": len(statuses)}


def by_metric(rows: list[dict], mode: str, kind: str) -> dict[str, dict]:
    """Per metric: how many of the runs' verdicts on it were ok / slower / inconclusive, and the median
    width of its interval (as a ratio, 0.1 = 10 points): which metric cries wolf, and why."""
    seen: dict[str, list[dict]] = {}
    for r in rows:
        if r["mode"] == mode and r["kind"] == kind:
            for v in r.get("verdicts", []):
                seen.setdefault(v["metric"], []).append(v)
    out: dict[str, dict[str, float]] = {}  # counts, and the median width (a ratio)
    for metric, verdicts in seen.items():
        statuses = [v["status"] for v in verdicts]
        widths = sorted(v["high"] - v["low"] for v in verdicts if v["trials"])
        out[metric] = {s: statuses.count(s) for s in (ratio_stats.OK, ratio_stats.SLOWER, ratio_stats.INCONCLUSIVE)}
        out[metric]["median_width"] = widths[len(widths) // 2] if widths else math.nan
    return out


def report(rows: list[dict], modes: list[str], pct: float) -> bool:
    """Print the alarm counts per mode; True when every mode meets the issue's bar for its runs."""
    met = True
    for mode in modes:
        clean, slowed = counts(rows, mode, "clean"), counts(rows, mode, "slowed")
        alarms = clean["runs"] - clean[ratio_stats.OK]
        caught = slowed[ratio_stats.SLOWER]
        ok = alarms == 0 and slowed["runs"] > 0 and caught >= 0.95 * slowed["runs"]
        met &= ok
        print(f"[{mode}] clean: {alarms} alarms in {clean['runs']} runs ({clean[ratio_stats.SLOWER]} slower, "
              f"{clean[ratio_stats.INCONCLUSIVE]} inconclusive); slowed {pct:g}%: caught {caught} of {slowed['runs']} "
              f"({slowed[ratio_stats.INCONCLUSIVE]} inconclusive, {slowed[ratio_stats.OK]} missed) -> "
              f"{'meets' if ok else 'DOES NOT MEET'} the bar (0 alarms, >= 95% caught)", flush=True)
        for kind in ("clean", "slowed"):
            for metric, c in by_metric(rows, mode, kind).items():
                print(f"[{mode}]   {kind} {metric}: ok {c[ratio_stats.OK]}, slower {c[ratio_stats.SLOWER]}, "
                      f"inconclusive {c[ratio_stats.INCONCLUSIVE]}; median interval width "
                      f"{c['median_width'] * 100:.1f} points", flush=True)
    return met


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="clean runs and slowed runs, each (default 20)")
    parser.add_argument("--mode", choices=("ab", "stored", "both"), default="both")
    parser.add_argument("--slow-pct", type=float, default=10.0, help="slow-step size, %% of step time (default 10)")
    parser.add_argument("--tolerance", type=float, default=0.1)
    parser.add_argument("--trials", type=int, default=MIN_TRIALS_DEFAULT,
                        help="trials (A/B: pairs) before the first look")
    parser.add_argument("--perf-workload", type=workload_arg, default=TrialWorkload(), metavar="JSON",
                        help="the trial workload, as the gate's --perf-workload takes it: changes to the default "
                             f"{json.dumps(TrialWorkload().describe())} (keys: {', '.join(WORKLOAD_KEYS)})")
    parser.add_argument("--server-arg", action="append", default=[], help="extra runtime.serve argument")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--pin", choices=PIN_MODES, default=None,
                        help="pin the harness and the servers: apart (disjoint CPUs) or shared (both sides' "
                             "servers on the same two CPUs); default: the scheduler places them")
    parser.add_argument("--budget-s", type=float, default=None, help="start no new run after this many seconds")
    parser.add_argument("--out", type=Path, default=Path("perf_trials.jsonl"))
    args = parser.parse_args(argv)
    # `timeout` (scripts/gpu_suite.sh) sends SIGTERM: exit through the `with` so the servers stop too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    workload: TrialWorkload = args.perf_workload
    modes = ["ab", "stored"] if args.mode == "both" else [args.mode]
    try:
        rows = done_runs(args.out, device_name(), method={"pin": args.pin})
    except ValueError as exc:
        parser.error(str(exc))
    todo = [(mode, kind, run) for run in range(args.runs) for mode in modes for kind in ("clean", "slowed")
            if not any(r["mode"] == mode and r["kind"] == kind and r["run"] == run for r in rows)]
    pins: dict[str, list[int]] = {}
    if args.pin:
        try:
            pins = cpu_split(list(os.sched_getaffinity(0)), args.pin)
        except ValueError as exc:
            parser.error(str(exc))
    commit = git_commit()  # once: with files that differ from HEAD it hashes their tree
    print(f"perf verdict trials on {device_name()} at {commit}: {len(rows)} runs done, {len(todo)} to go; "
          f"workload {workload.describe()}, tolerance {args.tolerance}, slowed by {args.slow_pct:g}%"
          + (f"; CPUs {pins}" if pins else ""), flush=True)
    started = time.monotonic()
    logs = args.out.parent / (args.out.stem + "-servers")
    with ExitStack() as stack:
        def serve(role: str, faults: tuple[str, ...] = (), env: dict[str, str] | None = None) -> Target:
            return stack.enter_context(embedded_server(args.model, args.server_arg, faults=faults, env=env,
                                                       log_dir=logs, cpus=pins.get(role)))

        servers: dict[str, Target] = {}
        if todo:
            servers = {"baseline": serve("baseline"), "clean": serve("candidates"),
                       "slowed": serve("candidates", ("slow-step",), {"DSV4_SLOW_STEP_PCT": str(args.slow_pct)})}
        if pins:  # after the servers: pinned_command gives only CPUs this process holds
            os.sched_setaffinity(0, pins["harness"])
        # The probe speaks for the server only where it computes on this machine's CPU.
        probe = machine_speed.probe if device_name().startswith("cpu:") else None
        stored_path = args.out.parent / (args.out.stem + "-baseline.json")
        for mode, kind, run in todo:
            if args.budget_s is not None and time.monotonic() - started > args.budget_s:
                print(f"budget of {args.budget_s:.0f}s spent: stopping; rerun with the same --out to go on", flush=True)
                break
            t0 = time.monotonic()
            # What the host did to each server, pair by pair (bench/host_load.py): steal, CPU placement. The
            # first pair's sample also holds the A/B warm-up pair.
            sides = {"candidate": servers[kind], "baseline": servers["baseline"]}
            sampler = HostSampler({side: t.pid for side, t in sides.items() if t.pid is not None})
            host_samples: list[dict] = []

            def progress(trial: dict, label: str = f"{mode} {kind} run {run}") -> None:
                side = trial.get("side", "candidate")
                number = trial.get("pair", trial.get("trial"))
                if not host_samples or host_samples[-1]["trial"] != number:  # a pair's first callback: it is done
                    host_samples.append({"trial": number, **sampler.sample()})
                print(f"  {label} trial {trial.get('pair', trial.get('trial'))} {side}: " + ", ".join(
                    f"{k} {v:.4g}" for k, v in trial["figures"].items()), flush=True)

            if mode == "ab":
                outcome = ab_trials(servers[kind], servers["baseline"], workload, args.tolerance,
                                    min_pairs=args.trials, max_pairs=MAX_TRIALS_FACTOR * args.trials,
                                    on_trial=progress)
            else:
                if not stored_path.is_file():
                    stored_path.write_text(json.dumps(record_trials(
                        servers["baseline"], workload, recorded_trials(args.trials), probe=probe,
                        on_trial=lambda t: progress(t, "recording the stored baseline"))))
                outcome = stored_trials(servers[kind], json.loads(stored_path.read_text()), workload, args.tolerance,
                                        min_trials=args.trials, max_trials=MAX_TRIALS_FACTOR * args.trials, probe=probe,
                                        on_trial=progress)
            row = {"mode": mode, "kind": kind, "run": run, "status": outcome.status, "wall_s": time.monotonic() - t0,
                   "verdicts": ratio_stats.verdict_dicts(outcome.verdicts), "trials": outcome.trials,
                   "device": device_name(), "commit": commit, "slow_pct": args.slow_pct,
                   "host": host_samples, "pin": args.pin, "cpus": pins or None}
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            rows.append(row)
            print(f"{mode} {kind} run {run}: {outcome.status} in {row['wall_s']:.0f}s; "
                  + "; ".join(f"{v.metric} {(v.ratio - 1) * 100:+.1f}% [{(v.low - 1) * 100:+.1f}, "
                              f"{(v.high - 1) * 100:+.1f}] n={v.trials}" for v in outcome.verdicts), flush=True)
            print(f"  host: {summary(host_samples)}", flush=True)
    return 0 if report(rows, modes, args.slow_pct) else 1


if __name__ == "__main__":
    raise SystemExit(main())
