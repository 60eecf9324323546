"""`embedded_pd_pair`: the embedded runtime as a PD pair - `runtime.serve --disaggregation-mode prefill`,
`... decode` and `python -m runtime.router` in front - yielding the router as the gate's `Target`
(`pytest -m stress --pd`). The router's /metrics sums both sides' KV pages, so the gate's leak check
covers the pair.

`RestartablePDPair`: the same three processes on fixed ports, each PD side killable (or stoppable) and
restartable in place (the PD chaos test, the PD fault gate).

On a host with two GPUs or more the pair's sides take one each (`side_devices`), as a PD deployment places them: on
one GPU the prefill and decode servers' kernels take turns between two CUDA contexts, so the decode steps wait for
the prompts' (the forty-fourth session's gate: TPOT p50 22-24 ms against the colocated server's 15-17.5).
`CUDA_VISIBLE_DEVICES=0` keeps both on one."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

from canary.targets import Target, _stop, embedded_server, free_port, pinned_command, wait_healthy

# The PD deadline (`--disaggregation-timeout`, 30 s by default) counts a prompt's wait in the prefill
# server's queue. Under the 80-session gate on the 2-core CPU the prefill server is saturated (the turns
# re-send whole conversations: ~33 prompt tokens per token produced) and the pair's TTFT p50 sits at
# 24-33 s, so a 30 s deadline failed 26 sessions of a clean run with 504s that say nothing about the
# build. The gate's pair waits this long instead; a wedge still ends as a named error, only later.
# Since the prefill server keeps a prefix cache (fourteenth session) the same gate's TTFT p50 is ~1 s;
# the deadline stays until its tail under a loaded CI host is measured.
GATE_PD_TIMEOUT_S = 120.0
PD_ROLES = ("prefill", "decode", "router")  # the pair's processes, as `embedded_pd_pair` names and pins them


def with_gate_timeout(args: Sequence[str]) -> list[str]:
    """The servers' arguments with the gate's PD deadline, unless the caller chose one."""
    if any(a.split("=", 1)[0] == "--disaggregation-timeout" for a in args):
        return list(args)
    return [*args, "--disaggregation-timeout", f"{GATE_PD_TIMEOUT_S:g}"]


def visible_gpus(environ: Mapping[str, str] = os.environ,
                 list_gpus: Callable[[], list[str]] | None = None) -> list[str]:
    """The GPUs a server started from here may use, as CUDA_VISIBLE_DEVICES entries: that variable's own entries
    where it is set (set and empty: none), else the indices `nvidia-smi -L` lists; none on a host without it."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [entry.strip() for entry in environ["CUDA_VISIBLE_DEVICES"].split(",") if entry.strip()]
    return (list_gpus or _nvidia_smi_gpus)()


def _nvidia_smi_gpus() -> list[str]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(index) for index, _ in enumerate(line for line in listing.splitlines() if line.startswith("GPU "))]


def side_devices(gpus: Sequence[str]) -> dict[str, dict[str, str]]:
    """Each PD side's environment: with two GPUs or more, the prefill server on the first and the decode server on
    the second; with fewer, nothing (both see what there is)."""
    if len(gpus) < 2:
        return {}
    return {"prefill": {"CUDA_VISIBLE_DEVICES": gpus[0]}, "decode": {"CUDA_VISIBLE_DEVICES": gpus[1]}}


def placement_note(devices: Mapping[str, Mapping[str, str]]) -> str:
    """Where the pair's sides run, for a run's notes."""
    if not devices:
        return "PD pair: both sides on the same device(s)"
    return "PD pair: " + ", ".join(f"{role} on GPU {env['CUDA_VISIBLE_DEVICES']}" for role, env in devices.items())


@contextmanager
def embedded_pd_pair(model: str, args: Sequence[str] = (), *, faults: Sequence[str] = (), log_dir: Path | None = None,
                     startup_timeout_s: float = 120.0, cpus: Mapping[str, Collection[int]] | None = None,
                     devices: Mapping[str, Mapping[str, str]] | None = None) -> Iterator[Target]:
    """The pair and its router, yielded as the router's `Target` (`processes` names all three). `cpus` pins a
    role (PD_ROLES) to those CPUs (`pinned_command`); a role it leaves out is not pinned. `devices`: each PD
    side's extra environment (None: `side_devices(visible_gpus())`, a GPU each where there are two)."""
    log_dir = log_dir or Path(os.environ.get("TMPDIR", "/tmp"))
    args = with_gate_timeout(args)
    cpus = cpus or {}
    if unknown := set(cpus) - set(PD_ROLES):
        raise ValueError(f"no PD role named {sorted(unknown)}: the roles are {', '.join(PD_ROLES)}")
    devices = side_devices(visible_gpus()) if devices is None else devices
    with ExitStack() as stack:
        prefill, decode = (stack.enter_context(embedded_server(
            model, [*args, "--disaggregation-mode", role], faults=faults, log_dir=log_dir,
            env=dict(devices.get(role, {})), startup_timeout_s=startup_timeout_s, cpus=cpus.get(role)))
            for role in ("prefill", "decode"))
        port = free_port()
        log_path = log_dir / f"pd-router-{port}.log"
        cmd = [sys.executable, "-m", "runtime.router", "--prefill", prefill.root_url, "--decode", decode.root_url,
               "--port", str(port), "--log-level", "warning"]
        if "router" in cpus:
            cmd = pinned_command(cmd, cpus["router"])
        with log_path.open("w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        stack.callback(_stop, proc)
        root = f"http://127.0.0.1:{port}"
        wait_healthy(root, proc, startup_timeout_s, log_path)
        yield Target(f"pd:{decode.name.split(':', 1)[-1]}", root + "/v1", decode.model, True, api_key=decode.api_key,
                     log_path=decode.log_path, pid=decode.pid,
                     processes={"prefill": prefill.processes["server"], "decode": decode.processes["server"],
                                "router": proc.pid})


class RestartablePDPair:
    """Prefill, decode and router as processes on fixed loopback ports, each PD side restartable in
    place (SIGKILL, then a new process on the same port; the decode server keeps its
    `--disaggregation-name`), so the router and the surviving side reach the new process at the old
    URL: the chaos test's and the PD fault gate's pair (a decode-only restart, a prefill restart).

    `start()` / `stop()` bracket it (or use it as a context manager); `targets[role]` is the live
    process of "prefill" / "decode", `router` the front the clients use."""

    ROLES = ("prefill", "decode")

    def __init__(self, model: str, args: Sequence[str] = (), *, faults: Sequence[str] = (), log_dir: Path,
                 timeout_s: float = 10.0, router_timeout_s: float = 60.0, startup_timeout_s: float = 120.0,
                 env: dict[str, str] | None = None) -> None:
        """`env`: extra environment of both PD sides (e.g. the `slow-step` fault's DSV4_SLOW_STEP_MS); each side
        also gets its GPU where the host has two (`side_devices`)."""
        self.model, self.faults, self.log_dir, self.env = model, tuple(faults), log_dir, env
        self.devices = side_devices(visible_gpus())
        self.startup_timeout_s, self.router_timeout_s = startup_timeout_s, router_timeout_s
        # One deadline for every PD wait, short enough that a wedged room turns into an error quickly.
        self.args = (*args, "--disaggregation-timeout", f"{timeout_s:g}")
        self.ports = {role: free_port() for role in self.ROLES}
        self.targets: dict[str, Target] = {}
        self._sides: dict[str, ExitStack] = {}
        self._router: subprocess.Popen | None = None
        self.router = ""

    def __enter__(self) -> RestartablePDPair:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def url(self, role: str) -> str:
        return f"http://127.0.0.1:{self.ports[role]}"

    def start(self) -> None:
        try:
            for role in self.ROLES:
                self.start_side(role)
            port = free_port()
            log_path = self.log_dir / f"pd-router-{port}.log"
            cmd = [sys.executable, "-m", "runtime.router", "--prefill", self.url("prefill"), "--decode",
                   self.url("decode"), "--port", str(port), "--timeout", f"{self.router_timeout_s:g}",
                   "--log-level", "warning"]
            with log_path.open("w") as log:
                self._router = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            self.router = f"http://127.0.0.1:{port}"
            wait_healthy(self.router, self._router, self.startup_timeout_s, log_path)
        except BaseException:
            self.stop()
            raise

    def start_side(self, role: str) -> Target:
        mode = ["--disaggregation-mode", role] + (["--disaggregation-name", "decode-0"] if role == "decode" else [])
        stack = ExitStack()
        self.targets[role] = stack.enter_context(embedded_server(
            self.model, [*self.args, *mode], faults=self.faults, env={**(self.env or {}), **self.devices.get(role, {})},
            log_dir=self.log_dir,
            port=self.ports[role], startup_timeout_s=self.startup_timeout_s))
        self._sides[role] = stack
        return self.targets[role]

    def kill_side(self, role: str) -> None:
        """SIGKILL the side's process group (no graceful shutdown: a crash), and reap it."""
        target = self.targets.pop(role)
        assert target.pid is not None
        try:
            os.killpg(target.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._sides.pop(role).close()

    def stop_side(self, role: str) -> None:
        """Stop the side as an operator does (SIGTERM: its graceful shutdown, a prefill server's drain
        included; SIGKILL only past the grace period), and reap it."""
        self.targets.pop(role)
        self._sides.pop(role).close()

    def restart_side(self, role: str, graceful: bool = False) -> float:
        """Kill (or with `graceful`, stop) the side and start it again on its port; the seconds from the
        signal to healthy."""
        started = time.monotonic()
        (self.stop_side if graceful else self.kill_side)(role)
        self.start_side(role)
        return time.monotonic() - started

    def stop(self) -> None:
        if self._router is not None:
            _stop(self._router)
            self._router = None
        for role in list(self._sides):
            self._sides.pop(role).close()
        self.targets.clear()
