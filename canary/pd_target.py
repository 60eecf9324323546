"""`embedded_pd_pair`: the embedded runtime as a PD pair - `runtime.serve --disaggregation-mode prefill`,
`... decode` and `python -m runtime.router` in front - yielding the router as the gate's `Target`
(`pytest -m stress --pd`). The router's /metrics sums both sides' KV pages, so the gate's leak check
covers the pair."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

from canary.targets import Target, _stop, embedded_server, free_port, wait_healthy


@contextmanager
def embedded_pd_pair(model: str, args: Sequence[str] = (), *, faults: Sequence[str] = (), log_dir: Path | None = None,
                     startup_timeout_s: float = 120.0) -> Iterator[Target]:
    log_dir = log_dir or Path(os.environ.get("TMPDIR", "/tmp"))
    with ExitStack() as stack:
        prefill = stack.enter_context(embedded_server(model, [*args, "--disaggregation-mode", "prefill"],
                                                      faults=faults, log_dir=log_dir,
                                                      startup_timeout_s=startup_timeout_s))
        decode = stack.enter_context(embedded_server(model, [*args, "--disaggregation-mode", "decode"],
                                                     faults=faults, log_dir=log_dir,
                                                     startup_timeout_s=startup_timeout_s))
        port = free_port()
        log_path = log_dir / f"pd-router-{port}.log"
        cmd = [sys.executable, "-m", "runtime.router", "--prefill", prefill.root_url, "--decode", decode.root_url,
               "--port", str(port), "--log-level", "warning"]
        with log_path.open("w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        stack.callback(_stop, proc)
        root = f"http://127.0.0.1:{port}"
        wait_healthy(root, proc, startup_timeout_s, log_path)
        yield Target(f"pd:{decode.name.split(':', 1)[-1]}", root + "/v1", decode.model, True, api_key=decode.api_key,
                     log_path=decode.log_path, pid=decode.pid)
