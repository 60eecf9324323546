"""Targets the harness talks to: the embedded runtime (started here on a free port) or any
OpenAI-compatible URL. Both end up as a `Target`: its URLs, its auth header, HTTP and openai
clients, and the two probes the harness reads from a server (`server_info`, `kv_pages_in_use`).

`embedded_server` is the one launcher of `python -m runtime.serve`: the gate, the fault matrix and
every e2e/stress test start their servers through it (vLLM's `RemoteOpenAIServer` in one function).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from runtime.server.prometheus_text import parse_samples, sample_sum


@dataclass(frozen=True)
class Target:
    name: str
    base_url: str  # ends with /v1
    model: str
    embedded: bool
    api_key: str = "EMPTY"
    log_path: Path | None = None
    pid: int | None = None  # the embedded server's process id (the soak samples its memory); None if remote
    # Every process of an embedded target by role ("server"; a PD pair's "prefill", "decode", "router"), for
    # benches that read what each one did on the host (bench/host_load.py).
    processes: dict[str, int] = field(default_factory=dict)

    @property
    def root_url(self) -> str:
        return self.base_url.removesuffix("/v1")

    @property
    def port(self) -> int:
        return urlsplit(self.base_url).port or 80

    def url_for(self, *parts: str) -> str:
        """`url_for("v1", "models")` -> http://host:port/v1/models."""
        return "/".join([self.root_url, *(part.strip("/") for part in parts)])

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def client(self, **kwargs):
        """A synchronous openai client for this target; no retries (a retry would hide a failure)."""
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key, **{"max_retries": 0, **kwargs})

    def async_client(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, **{"max_retries": 0, **kwargs})

    def server_info(self) -> dict:
        """The runtime's /server_info (config fingerprint, model hash, engine config); {} elsewhere."""
        try:
            resp = httpx.get(self.url_for("server_info"), timeout=10.0, headers=self.headers)
            return resp.json() if resp.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return {}

    def kv_pages_in_use(self) -> float | None:
        """The KV-pages gauge from the Prometheus text (keyed like every route); None without one."""
        return self.metric("dsv4_kv_pages_in_use")

    def metric(self, name: str) -> float | None:
        """The sample named exactly `name` in /metrics (a counter's `_total` included; a labelled one
        summed over its labels); None without one or without /metrics."""
        return self.metrics(name)[name]

    def metrics(self, *names: str) -> dict[str, float | None]:
        """`metric` for several names from one read of /metrics."""
        try:
            text = httpx.get(self.url_for("metrics"), timeout=10.0, headers=self.headers).text
        except httpx.HTTPError:
            return dict.fromkeys(names)
        samples = parse_samples(text)
        return {name: sample_sum(samples, name) for name in names}

    def wait_kv_pages_idle(self, timeout_s: float = 10.0) -> float | None:
        """Pages in use once they reach 0 or `timeout_s` passed (finished requests free theirs
        within a step or two of the last byte sent); None when the server has no such gauge."""
        deadline = time.monotonic() + timeout_s
        pages = self.kv_pages_in_use()
        while pages not in (None, 0.0) and time.monotonic() < deadline:
            time.sleep(0.1)
            pages = self.kv_pages_in_use()
        return pages


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(root_url: str, proc: subprocess.Popen | None, timeout_s: float, log_path: Path | None,
                 health_path: str = "/health") -> None:
    """Poll `health_path` until it answers 200 (a server without /health: a route it has, e.g. /v1/models)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log_path.read_text()[-3000:] if log_path and log_path.is_file() else ""
            raise RuntimeError(f"server exited with status {proc.returncode} before becoming healthy\n{tail}")
        try:
            if httpx.get(root_url + health_path, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"server at {root_url} not healthy after {timeout_s:.0f}s")


@contextmanager
def embedded_server(model: str, args: Sequence[str] = (), *, faults: Sequence[str] = (),
                    host: str | None = None, max_running: int | None = 128, num_pages: int | None = 8192,
                    env: dict[str, str] | None = None, log_dir: Path | None = None,
                    startup_timeout_s: float = 120.0, port: int | None = None,
                    cpus: Collection[int] | None = None, tree: Path | None = None,
                    python: str | None = None) -> Iterator[Target]:
    """Start `python -m runtime.serve --model MODEL ARGS` on a free loopback port; stop it (and its
    children) on exit. Stdout and stderr both go to `Target.log_path`.

    `host`, `max_running` and `num_pages` set the matching flag; None leaves the server's default
    (loopback for the host; the security tests start the CLI exactly as a user would); `port` None picks a
    free one (a PD side restarted in place passes its old one). `cpus` pins the server, every thread of
    it, to those CPUs (`pinned_command`); None leaves it to the scheduler. The default pool holds every
    session's whole context at once (80 sessions x a few hundred tokens): a smaller pool would turn
    the gate into a preemption benchmark. `tree`: another checkout whose runtime (and relative model path)
    to start, under `python` (default: this interpreter), for an A/B baseline (canary.cli.baseline_server)."""
    port = port or free_port()
    cmd = [python or sys.executable, "-m", "runtime.serve", "--model", model, "--port", str(port)]
    for flag, value in (("--host", host), ("--max-running", max_running), ("--num-pages", num_pages)):
        if value is not None:
            cmd += [flag, str(value)]
    cmd += [*args, *(arg for fault in faults for arg in ("--inject-fault", fault))]
    if cpus is not None:
        cmd = pinned_command(cmd, cpus)
    log_dir = log_dir or Path(os.environ.get("TMPDIR", "/tmp"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"embedded-server-{port}.log"
    if log_path.exists():  # a server restarted on its old port keeps its previous life's log
        log_path = log_dir / f"embedded-server-{port}-{time.monotonic_ns()}.log"
    # One torch thread for the engine: the harness (HTTP client, oracles) needs the other core, and
    # two torch threads fighting a busy client thrash (docs/results.md, "one engine thread").
    full_env = {**os.environ, "DSV4_NUM_THREADS": os.environ.get("DSV4_NUM_THREADS", "1"), **(env or {})}
    if tree is not None:  # the other checkout's packages first (`-m` puts its cwd first too)
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), full_env.get("PYTHONPATH")]))
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=full_env,
                                cwd=tree)
    root = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(root, proc, startup_timeout_s, log_path)
        yield Target(f"embedded:{Path(model).name}{'+' + '+'.join(faults) if faults else ''}", root + "/v1",
                     Path(model).name if Path(tree or ".", model).exists() else model, True,
                     api_key=api_key_in(args) or "EMPTY", log_path=log_path, pid=proc.pid,
                     processes={"server": proc.pid})
    finally:
        _stop(proc)


# Sets the process's CPUs, then becomes the real command (same pid): every thread the server starts later
# inherits the mask, which setting it from outside after the start would not guarantee.
_PIN_THEN_EXEC = ("import os, sys; os.sched_setaffinity(0, [int(c) for c in sys.argv[1].split(',')]); "
                  "os.execv(sys.argv[2], sys.argv[2:])")


def pinned_command(cmd: Sequence[str], cpus: Collection[int]) -> list[str]:
    """`cmd` (an absolute executable first) run on `cpus` only. Refused up front, naming them, where
    some are not this process's to give (a typo, or a container's narrower CPU set)."""
    wanted = check_cpus(cpus)
    return [sys.executable, "-c", _PIN_THEN_EXEC, ",".join(map(str, wanted)), *cmd]


def alive(pid: int | None) -> bool:
    """Whether process `pid` still runs (a child that exited stays a zombie until reaped: not alive)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def check_cpus(cpus: Collection[int]) -> list[int]:
    """`cpus`, sorted, once each; ValueError naming the CPUs this process may not give its children."""
    wanted = sorted(set(cpus))
    if not wanted:
        raise ValueError("pinning to no CPU at all")
    allowed = os.sched_getaffinity(0)
    if missing := [c for c in wanted if c not in allowed]:
        raise ValueError(f"CPUs {missing} are not among this process's CPUs {sorted(allowed)}")
    return wanted


@contextmanager
def cpus_apart(taken: Collection[int]) -> Iterator[None]:
    """The calling thread (the harness: its clients, oracles, and the processes and threads it starts from here
    on, which inherit the mask) off the CPUs `taken` by a server it pinned, while the context lasts, where any
    other CPU is left. After the server's start: `pinned_command` gives a child only CPUs its parent holds."""
    before = os.sched_getaffinity(0)
    rest = before - set(taken)
    if rest:
        os.sched_setaffinity(0, rest)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def parse_cpu_list(spec: str) -> list[int]:
    """A CPU list as taskset -c and /sys write one: "4,5", "4-7", "0,4-5" (ValueError on anything else)."""
    cpus: set[int] = set()
    for part in spec.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{part!r} is not a CPU number or a range like 4-7")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"the range {part!r} runs backwards")
        cpus.update(range(low, high + 1))
    return sorted(cpus)


def api_key_in(args: Sequence[str]) -> str | None:
    """The key an `--api-key` among the server's arguments sets, so the harness sends it too."""
    for i, arg in enumerate(args):
        if arg.startswith("--api-key="):
            return arg.split("=", 1)[1]
        if arg == "--api-key" and i + 1 < len(args):
            return args[i + 1]
    return None


def _stop(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM the server's process group, SIGKILL it after `grace_s`; a worker rank left behind by a
    server that already exited (a test may stop the server itself) is killed too."""
    try:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=grace_s)


def remote_target(base_url: str, model: str | None, api_key: str | None = None) -> Target:
    base = base_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    if model is None:
        # Ask the server which model it serves, as a convenience for single-model deployments.
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        models = httpx.get(base + "/models", headers=headers, timeout=10.0).json()["data"]
        if len(models) != 1:
            raise ValueError(f"{base} serves {len(models)} models; pass --model")
        model = models[0]["id"]
    return Target(f"remote:{base}", base, model, False, api_key or "EMPTY")
