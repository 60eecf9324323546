"""`python -m canary baseline-server --tree DIR [--port P] [--server-cpus LIST] [--model M] [--python PY]
[-- SERVE_ARGS...]`: another build's server, started exactly as the gate starts its embedded one, for an A/B run.

The perf verdict's A/B mode (`pytest -m stress --baseline-url URL`) compares two builds, and only the build may
differ: the same pool (`--max-running 128 --num-pages 8192`), one engine thread (DSV4_NUM_THREADS=1) and, with
`--server-cpus`, the same CPUs as the gate gives its own server. Those settings live in one place,
`canary.targets.embedded_server`; this command starts DIR's `runtime.serve` through it (DIR's model path, DIR's
packages, DIR's `.venv` interpreter when it has one), prints the URL once the server is healthy, and stops the
server when it is interrupted or terminated. Run it from the candidate's checkout:

    .venv/bin/python -m canary baseline-server --tree ../production --port 31000 --server-cpus 4,5 &
    .venv/bin/pytest -m stress --sessions 80 --server-cpus 4,5 --baseline-url http://127.0.0.1:31000
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from runtime.config import DEFAULT_MODEL


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("baseline-server", help="start another checkout's server as the gate starts its own (A/B)")
    p.add_argument("--tree", type=Path, required=True, help="the baseline build's checkout")
    p.add_argument("--port", type=int, default=None, help="port (default: a free one, printed)")
    p.add_argument("--server-cpus", default=None, metavar="LIST",
                   help="pin the server to these CPUs, e.g. 4,5 (give the gate the same --server-cpus)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model path inside the tree (default {DEFAULT_MODEL})")
    p.add_argument("--python", default=None,
                   help="interpreter to run the tree's server with (default: the tree's .venv, else this one)")
    p.add_argument("--log-dir", type=Path, default=None, help="where the server's log goes (default: $TMPDIR)")
    p.add_argument("--startup-timeout", type=float, default=120.0, help="seconds to wait for /health")
    p.add_argument("serve_args", nargs=argparse.REMAINDER,
                   help="after --: extra runtime.serve arguments, e.g. -- --dtype float32")
    p.set_defaults(func=command)


def interpreter(tree: Path, given: str | None) -> str:
    if given:
        return given
    own = tree / ".venv" / "bin" / "python"
    return str(own) if own.exists() else sys.executable


def command(args: argparse.Namespace) -> int:
    from canary.targets import alive, check_cpus, embedded_server, parse_cpu_list

    tree = args.tree.resolve()
    if not (tree / "runtime" / "serve.py").is_file():
        print(f"error: --tree {args.tree}: no runtime/serve.py there (not a checkout of this project)", file=sys.stderr)
        return 2
    if not (tree / args.model).exists():
        print(f"error: --model {args.model}: not found in {tree}", file=sys.stderr)
        return 2
    cpus = None
    if args.server_cpus is not None:
        try:
            cpus = check_cpus(parse_cpu_list(args.server_cpus))
        except ValueError as exc:
            print(f"error: --server-cpus {args.server_cpus!r}: {exc}", file=sys.stderr)
            return 2
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # leave the context below, which stops the server
        signal.signal(sig, lambda *_: stop.set())
    try:
        with embedded_server(args.model, serve_args, port=args.port, cpus=cpus, tree=tree,
                             python=interpreter(tree, args.python), log_dir=args.log_dir,
                             startup_timeout_s=args.startup_timeout) as target:
            print(f"baseline server from {tree} at {target.root_url} (log {target.log_path})", flush=True)
            while not stop.wait(1.0):
                if not alive(target.pid):  # a server that died leaves no one to serve the A/B: say so, not hang
                    tail = target.log_path.read_text()[-2000:] if target.log_path else ""
                    print(f"error: the baseline server exited; its log ends:\n{tail}", file=sys.stderr)
                    return 1
    except (RuntimeError, TimeoutError) as exc:  # it never became healthy (its log's end is in the message)
        print(f"error: the baseline server did not start: {exc}", file=sys.stderr)
        return 1
    print("baseline server stopped", flush=True)
    return 0
