"""`python -m canary faults [--json] [--gpu] [--only NAME ...] [--clean-runs N]`: the fault matrix.

Prints one line per gate run as it finishes (stderr), then the matrix and the clean-run table
(stdout; `--json` for machines). Exit 0 when every fault that ran was caught and no clean run
alarmed, 1 otherwise. Server and worker logs go to a temporary directory, kept (and named) only
when something failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    from runtime.faults import KNOWN_FAULTS

    p = sub.add_parser("faults", help="run every injected fault through the gates that should catch it")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--gpu", action="store_true", help="also run the GPU gates (on a machine with CUDA)")
    p.add_argument("--only", nargs="+", choices=sorted(KNOWN_FAULTS), metavar="NAME",
                   help=f"only these faults (default: all of {', '.join(KNOWN_FAULTS)})")
    p.add_argument("--clean-runs", type=int, default=1, metavar="N",
                   help="clean-runtime runs of each gate (default 1; the long form is 10)")
    p.set_defaults(func=command)


def command_line(args: argparse.Namespace) -> str:
    """The invocation, rebuilt from the parsed options (main() may be called with its own argv)."""
    parts = ["python", "-m", "canary", "faults", *(["--json"] if args.json else []), *(["--gpu"] if args.gpu else []),
             *(["--only", *args.only] if args.only else []), "--clean-runs", str(args.clean_runs)]
    return shlex.join(parts)


def provenance(args: argparse.Namespace) -> dict:
    from canary.provenance import device_name, git_commit, versions

    return {"commit": git_commit(), "device": device_name(), "cpus": os.cpu_count(), "host": platform.node(),
            "command": command_line(args), **versions(),
            "clean_runs": args.clean_runs, "gpu": args.gpu}


def command(args: argparse.Namespace) -> int:
    if args.clean_runs < 0:
        print("error: --clean-runs must be >= 0", file=sys.stderr)
        return 2
    if args.gpu:
        # Before the first cuBLAS call: deterministic GEMMs across streams (bit-for-bit comparisons).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    from canary.faults.detectors import DETECTORS
    from canary.faults.matrix import NOT_RUN, render_table, run_matrix, to_json
    from runtime.faults import KNOWN_FAULTS

    faults = args.only or list(KNOWN_FAULTS)
    workdir = Path(tempfile.mkdtemp(prefix="canary-faults-"))

    def row_done(row) -> None:
        took = "" if row.seconds is None else f" in {row.seconds:.1f}s"
        verdict = row.message if row.message.startswith(row.status) else f"{row.status}{took}: {row.message}"
        print(f"[faults] {row.fault} x {row.gate}: {verdict}", file=sys.stderr, flush=True)

    def clean_done(row) -> None:
        verdict = row.messages[0] if row.status == NOT_RUN else f"{row.runs} runs, {row.alarms} alarms"
        print(f"[faults] clean x {row.gate}: {verdict}", file=sys.stderr, flush=True)

    info = provenance(args)  # before the gates run: the TP gate sets this process's torch threads to 1
    report = run_matrix(DETECTORS, faults, clean_runs=args.clean_runs, gpu=args.gpu, workdir=workdir,
                        on_row=row_done, on_clean=clean_done)
    if args.json:
        print(json.dumps(to_json(report, info), indent=2))
    else:
        print(f"fault matrix: commit {info['commit']}, {info['device']}, {info['cpus']} CPUs, "
              f"clean runs {args.clean_runs}, gpu {'on' if args.gpu else 'off'}")
        print(render_table(report))
    # Logs are kept for a failed matrix only, and only when a gate wrote some: an empty directory
    # per failed run (the CLI's own negative-control tests fail on purpose) would pile up in /tmp.
    if report.ok or not any(workdir.iterdir()):
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"[faults] logs kept in {workdir}", file=sys.stderr)
    return 0 if report.ok else 1
