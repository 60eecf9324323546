"""Time to first token of the PD pair (router -> prefill + decode, Mooncake over loopback) against the
colocated server on the same requests, one at a time (issue 16's target: PD <= 1.2x colocated).

By default every server is its own process, as deployed (canary/pd_target.py, canary/targets.py).
`--threads` runs all four on threads of this process instead (tests/e2e/pd_pair.py): there the PD
side's three event loops and two engine threads share one GIL, which the colocated server does not
pay, so that form overstates PD's cost.

    python -m bench.pd_ttft --repeats 10 --words 8,400 [--threads] [--phases] [--hang-up] [--pin MODE]
        [--server-arg=...] [--out F]

Each stream is read to its end, as a client does; `--hang-up` closes it at the first token instead (every
request then an abort on both PD sides, and a reconnect from the router: see `ttft`).

`--server-arg` goes to every server, PD sides and colocated alike (scripts/gpu_suite.sh's pd_gpu_ttft
runs them on the GPU with `--server-arg=--dtype=float32`).

`--pin apart` gives each process (this client, the router, the prefill and decode servers, the colocated server)
whole physical cores of its own (two CPUs at least: a server's event loop and engine thread run at once);
`--pin apart-swapped` is apart with the prefill and colocated servers' CPUs traded (the prefill server's slow
tokenize pinned apart on an H100 host, forty-third session: its CPUs' or its own?); `--pin pd-shared` the same
as apart but the prefill and decode servers share theirs. Either way, and unpinned, the report
keeps what the host did to each process over each prompt size (bench/host_load.py: its CPU time, its busiest
thread's and where it ran). On an H100 host the prefill server's template + tokenize took 1.6-1.9x the CPU time of
the colocated server's on the same body (thirty-seventh session) with no other thread of its process running:
pinning tells a neighbour on the same core apart from the server's own work.

`--phases` traces every timed request (`x-dsv4-trace`, runtime/server/trace.py) and prints, per prompt
size, the median of each phase of the PD pair's critical path, of the decode side's room-opening
branch and KV check beside it, and of the colocated server's path (bench/pd_phases.py names them). The servers must
run on this host: the marks of all processes are read on one monotonic clock.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from bench.host_load import HostSampler, physical_cores, sample_line
from bench.pd_phases import (
    COLOCATED_COMPUTE,
    COLOCATED_PATH,
    PD_AFTER_FIRST_TOKEN,
    PD_COMPUTE,
    PD_DECODE_FIRST,
    PD_KV_CHECK,
    PD_PATH,
    PD_ROOM_BRANCH,
    PD_SENDER_DIGEST,
    cpu_and_wall_ms,
    flatten,
    medians_ms,
    overhead_ms,
    phases,
    room_slack_ms,
    tokenize_core_sharing,
)
from canary.pd_target import PD_ROLES, embedded_pd_pair, placement_note, side_devices, visible_gpus
from canary.provenance import git_commit
from canary.targets import embedded_server
from runtime.config import DEFAULT_MODEL
from runtime.server.trace import TRACE_HEADER
from tests.e2e.pd_pair import pd_pair, serve_state, server_state

PIN_MODES = ("apart", "apart-swapped", "pd-shared")
PIN_ROLES = ("client", "router", "prefill", "decode", "colocated")
PIN_SERVERS = ("prefill", "decode", "colocated")  # the roles that share the cores left over (pin_plan)
IDLE_SAMPLE_S = 1.0
MARKS_WAIT_S = 5.0  # for the marks a server makes after the first token (the PD decode side's KV check)

def ttft(client: httpx.Client, url: str, words: int, i: int, headers: dict[str, str] | None = None,
         marks: dict[str, float] | None = None, hang_up: bool = False) -> float:
    """One request's time to its first content token. `client` is kept across requests: a new httpx
    client costs its TLS context, 30-45 ms on the loaded 2-core CPU, which would be counted on both
    sides and hide the servers' own difference (the first version of this bench did that). `marks`
    gets the client's own phase marks ("sent", "first_token"), on the servers' clock.

    The stream is read to its end, as a client does, unless `hang_up`: then the client closes it at the
    first token (what this bench did until the twenty-seventh session). A hang-up makes every request an
    abort: the router drops its upstream connections mid-stream and connects again for the next request
    (py-spy of the router: 16% of its samples in connect), and the PD pair runs its abort path on both
    sides, so the figure is no longer the serving TTFT."""
    body = {"model": "canary-moe-v2", "stream": True, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": " ".join(f"w{i}x{k}" for k in range(words))}]}
    started = time.monotonic()
    first: float | None = None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120, headers=headers) as reply:
        for line in reply.iter_lines():
            if first is None and '"content"' in line and '"content": ""' not in line:
                first = time.monotonic()
                if marks is not None:
                    marks.update(sent=started, first_token=first)
                if hang_up:
                    break
    if first is None:
        raise RuntimeError("no token came back")
    return first - started


def traced_ttft(client: httpx.Client, url: str, words: int, i: int, headers: dict[str, str] | None,
                side: str | None, until: tuple[str, ...] = (), hang_up: bool = False) -> tuple[float, dict[str, float]]:
    """`ttft` of a traced request, and its marks on every side, flattened ("router.received", ...).
    `side`: the name of a lone server's marks (colocated); None for the router, which names its own.
    `until`: marks made after the first token (the PD pair's PD_AFTER_FIRST_TOKEN: every side's last), waited for
    up to MARKS_WAIT_S."""
    key = uuid.uuid4().hex
    mine: dict[str, float] = {}
    seconds = ttft(client, url, words, i, {**(headers or {}), TRACE_HEADER: key}, mine, hang_up)
    deadline = time.monotonic() + MARKS_WAIT_S
    while True:
        reply = client.get(f"{url}/debug/trace/{key}", headers=headers, timeout=30)
        reply.raise_for_status()
        found = reply.json()
        marks = flatten({**({side: found["marks"]} if side else found), "client": mine})
        if all(mark in marks for mark in until) or time.monotonic() > deadline:
            return seconds, marks
        time.sleep(0.01)


def print_phases(words: int, pd_marks: list[dict[str, float]], co_marks: list[dict[str, float]],
                 core_of: dict[int, int]) -> dict:
    """The phase medians of one prompt size, printed and returned."""
    pd_rows = [phases(PD_PATH, m) for m in pd_marks]
    co_rows = [phases(COLOCATED_PATH, m) for m in co_marks]
    report: dict[str, Any] = {
        "pd_overhead_ms": overhead_ms(pd_rows, PD_COMPUTE),
        "colocated_overhead_ms": overhead_ms(co_rows, COLOCATED_COMPUTE),
        "pd_path_ms": medians_ms(pd_rows, PD_PATH),
        "pd_decode_first_ms": medians_ms([phases(PD_DECODE_FIRST, m) for m in pd_marks], PD_DECODE_FIRST),
        "pd_room_branch_ms": medians_ms([phases(PD_ROOM_BRANCH, m) for m in pd_marks], PD_ROOM_BRANCH),
        "pd_sender_digest_ms": medians_ms([phases(PD_SENDER_DIGEST, m) for m in pd_marks], PD_SENDER_DIGEST),
        "pd_kv_check_ms": medians_ms([phases(PD_KV_CHECK, m) for m in pd_marks], PD_KV_CHECK),
        "colocated_path_ms": medians_ms(co_rows, COLOCATED_PATH),
        "loop_thread_cpu_ms": cpu_and_wall_ms(pd_marks + co_marks)}
    sharing = tokenize_core_sharing(pd_marks, core_of)
    if sharing is not None:
        report["pd_tokenize_core_sharing"] = sharing
    slack = [s for s in map(room_slack_ms, pd_marks) if s is not None]
    if slack:
        report["room_open_before_kv_held_ms"] = round(statistics.median(slack), 2)
    print(f"--- {words} words: medians in ms ---")
    print(f"  overhead (the path less its prompt step): PD {report['pd_overhead_ms']}, colocated "
          f"{report['colocated_overhead_ms']}")
    for title, key in (("PD critical path", "pd_path_ms"),
                       ("PD decode side, taking the relayed first token (beside it)", "pd_decode_first_ms"),
                       ("PD decode side, opening the room (beside the prompt)", "pd_room_branch_ms"),
                       ("PD sender's digest (beside the write)", "pd_sender_digest_ms"),
                       ("PD KV write, landing, check and admission (beside the first token)", "pd_kv_check_ms"),
                       ("colocated", "colocated_path_ms")):
        print(f"  {title}: (sum {sum(report[key].values()):.2f})")
        for phase, ms in report[key].items():
            print(f"    {ms:8.2f}  {phase}")
    for label, figures in report["loop_thread_cpu_ms"].items():
        print(f"  {label}: {figures['wall_ms']:.2f} ms wall, the event loop thread's CPU {figures['cpu_ms']:.2f} ms, "
              f"the server's other threads' CPU {figures['other_threads_cpu_ms']:.2f} ms")
    if sharing is not None:
        by_case = "; ".join(f"{side} {sharing.get(f'{side}_cpu_ms_shared_core', '-')} shared, "
                            f"{sharing.get(f'{side}_cpu_ms_apart', '-')} apart" for side in ("prefill", "decode"))
        print(f"  the PD sides' template + tokenize at once on one physical core: {sharing['shared_core']:.0f} "
              f"requests, apart: {sharing['apart']:.0f}; loop-thread CPU ms {by_case}")
    if slack:
        print(f"  the room was open {report['room_open_before_kv_held_ms']:.2f} ms before the prompt's KV "
              f"(negative: the KV waited for it)")
    return report


def pin_plan(mode: str, cpus: list[int], cores: list[list[int]] | None = None) -> dict[str, list[int]]:
    """Each of PIN_ROLES' CPU set under `--pin MODE`: whole physical cores (`cores`: `cpus` grouped by core,
    read from the host by default), in order. Every role gets cores until it holds two CPUs; the cores left are
    shared equally by the servers (PIN_SERVERS), so a big host does not run a GPU server's engine, event loop and
    transfer threads on two CPUs (the H100's 16 vCPUs, thirty-ninth session: 1.55x at 8 words pinned at two
    each, 1.30x unpinned). Under "pd-shared" the decode server gets the prefill server's. ValueError where the
    host has too few."""
    if mode not in PIN_MODES:
        raise ValueError(f"unknown pinning {mode!r}; known: {', '.join(PIN_MODES)}")
    left = list(cores if cores is not None else physical_cores(cpus))
    roles = [role for role in PIN_ROLES if not (role == "decode" and mode == "pd-shared")]
    counts: dict[str, int] = {}  # cores a role takes
    used = 0
    for role in roles:
        taken = 0
        while taken < 2 and used < len(left):
            taken += len(left[used])
            used += 1
            counts[role] = counts.get(role, 0) + 1
        if taken < 2:
            raise ValueError(f"--pin {mode} needs two CPUs for each of {', '.join(PIN_ROLES)} on whole cores; "
                             f"this process has {len(cpus)} CPUs")
    servers = [role for role in roles if role in PIN_SERVERS]
    for role in servers:
        counts[role] += (len(left) - used) // len(servers)
    plan: dict[str, list[int]] = {}
    start = 0
    for role in PIN_ROLES:
        if role not in counts:  # pd-shared
            plan[role] = plan["prefill"]
            continue
        plan[role] = [cpu for core in left[start:start + counts[role]] for cpu in core]
        start += counts[role]
    # Client and router keep their places; a server moved later holds at least one core more than it needed at
    # its first place, so still two CPUs whatever the cores' sizes.
    if mode == "apart-swapped":  # the same sets, the prefill and colocated servers' traded: a slow CPU moves sides
        plan["prefill"], plan["colocated"] = plan["colocated"], plan["prefill"]
    return plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--words", default="8,400", help="prompt lengths in words, comma-separated")
    parser.add_argument("--threads", action="store_true", help="all servers on threads of this process")
    parser.add_argument("--phases", action="store_true",
                        help="trace each request and print the median of each phase (bench/pd_phases.py)")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="an argument for every server (repeatable), e.g. --server-arg=--dtype=float32")
    parser.add_argument("--hang-up", action="store_true",
                        help="close each stream at its first token (every request an abort), as before 2026-12-05")
    parser.add_argument("--pin", choices=PIN_MODES, default=None,
                        help="whole cores per process, the servers sharing the cores left equally (apart; "
                             "apart-swapped: the prefill and colocated servers' sets traded), or the PD "
                             "sides sharing theirs (pd-shared); "
                             "default: the scheduler places them")
    parser.add_argument("--out", type=Path, default=None, help="the report as JSON")
    args = parser.parse_args(argv)
    if args.pin and args.threads:
        parser.error("--pin pins processes: it does not go with --threads")
    try:
        pins = pin_plan(args.pin, sorted(os.sched_getaffinity(0))) if args.pin else {}
    except ValueError as error:
        parser.error(str(error))
    server_args = tuple(args.server_arg)
    # CPU number -> physical core, for the phases' core-sharing split (every CPU: a pinned server's too).
    core_of = {cpu: n for n, siblings in enumerate(physical_cores(list(range(os.cpu_count() or 1))))
               for cpu in siblings}
    rows: dict[int, dict[str, Any]] = {}
    with ExitStack() as stack:
        client = stack.enter_context(httpx.Client())
        pd_headers: dict[str, str] | None = None
        co_headers: dict[str, str] | None = None
        processes: dict[str, int] = {}  # by role, for the host's load (none with --threads: one process)
        idle_host: dict = {}
        placement = "PD pair: in-process threads (--threads)"
        if args.threads:
            pd_url = stack.enter_context(pd_pair(server_args, server_args)).router
            co_url = stack.enter_context(serve_state(server_state(*server_args)))
        else:  # each server started with its own API key
            log_dir = Path(tempfile.mkdtemp(prefix="pd-ttft-"))
            devices = side_devices(visible_gpus())
            placement = placement_note(devices)
            print(placement, flush=True)
            pd_target = stack.enter_context(embedded_pd_pair(
                DEFAULT_MODEL, server_args, log_dir=log_dir,
                cpus={role: cpus for role, cpus in pins.items() if role in PD_ROLES}, devices=devices))
            co_target = stack.enter_context(embedded_server(DEFAULT_MODEL, server_args, log_dir=log_dir,
                                                            cpus=pins.get("colocated")))
            pd_url, co_url, pd_headers, co_headers = (pd_target.root_url, co_target.root_url, pd_target.headers,
                                                      co_target.headers)
            processes = {**pd_target.processes, "colocated": co_target.processes["server"]}
            if pins:  # after the servers' start: pinned_command gives a child only CPUs this process holds
                os.sched_setaffinity(0, pins["client"])
                print(f"pinned: {pins}", flush=True)
            idle = HostSampler(processes)  # a thread that spins while nothing is asked shows here
            time.sleep(IDLE_SAMPLE_S)
            idle_host = idle.sample()
            print(f"idle {IDLE_SAMPLE_S:g} s: {sample_line(idle_host)}", flush=True)
        for words in map(int, args.words.split(",")):
            ttft(client, pd_url, words, -1, pd_headers), ttft(client, co_url, words, -1, co_headers)  # warm both
            host = HostSampler(processes)
            pd, co = [], []
            pd_marks: list[dict[str, float]] = []
            co_marks: list[dict[str, float]] = []
            for i in range(args.repeats):  # interleaved: a load spike on the shared CPU hits both
                if args.phases:
                    for url, headers, side, times, marks in ((pd_url, pd_headers, None, pd, pd_marks),
                                                             (co_url, co_headers, "server", co, co_marks)):
                        until = PD_AFTER_FIRST_TOKEN if side is None else ()
                        seconds, request_marks = traced_ttft(client, url, words, i, headers, side, until,
                                                             args.hang_up)
                        times.append(seconds)
                        marks.append(request_marks)
                else:
                    pd.append(ttft(client, pd_url, words, i, pd_headers, hang_up=args.hang_up))
                    co.append(ttft(client, co_url, words, i, co_headers, hang_up=args.hang_up))
            rows[words] = {"pd_ms": round(statistics.median(pd) * 1e3, 1),
                           "colocated_ms": round(statistics.median(co) * 1e3, 1),
                           "ratio": round(statistics.median(pd) / statistics.median(co), 2)}
            if processes:
                rows[words]["host"] = host.sample()
            print(words, {key: value for key, value in rows[words].items() if key != "host"}, flush=True)
            if processes:
                print(f"  host over these requests: {sample_line(rows[words]['host'])}", flush=True)
            if args.phases:
                rows[words]["phases"] = print_phases(words, pd_marks, co_marks, core_of)
    report = {"commit": git_commit(), "servers": "threads" if args.threads else "processes", "phases": args.phases,
              "hang_up": args.hang_up, "pin": args.pin, "cpus": pins or None, "placement": placement,
              "idle_host": idle_host,
              "server_args": list(server_args), "rows": rows}
    print(json.dumps(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
