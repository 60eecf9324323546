"""Ctrl-C during a program's start-up is never lost (runtime/interrupts.py).

Importing torch swallowed a SIGINT that landed in its C module's import of numpy: `runtime.generate
--tp 2` and `runtime.serve` then ran on as if nothing had happened. The latch's mechanism is tested
with a planted import that swallows the interrupt the same way, deterministically; the server's
start-up with real signals at moments spread over its imports and model load."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from canary.targets import free_port
from runtime.interrupts import INTERRUPTED_RC

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A start-up whose "import" swallows Ctrl-C, as torch's import of numpy does: the signal arrives inside
# a block that catches KeyboardInterrupt and carries on.
PROGRAM = textwrap.dedent("""
    import os, signal, sys, time
    from runtime.interrupts import INTERRUPTED_RC, InterruptLatch
    latch = InterruptLatch.hold() if os.environ["LATCH"] == "1" else None
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    if latch is not None and latch.release():
        sys.exit(INTERRUPTED_RC)
    try:  # released: Ctrl-C raises again
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)
    except KeyboardInterrupt:
        sys.exit(3)
    sys.exit(0)
""")


def run_program(latch: bool, code: str = PROGRAM) -> int:
    env = {**os.environ, "LATCH": "1" if latch else "0", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return proc.returncode


def test_a_swallowed_interrupt_is_kept_by_the_latch():
    assert run_program(latch=True) == INTERRUPTED_RC


def test_control_without_the_latch_the_interrupt_is_lost():
    """The planted swallow does lose the first Ctrl-C (the second, outside it, still raises)."""
    assert run_program(latch=False) == 3


def test_after_release_ctrl_c_raises_again():
    code = textwrap.dedent("""
        import os, signal, sys, time
        from runtime.interrupts import InterruptLatch
        assert InterruptLatch.hold().release() is False
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
        except KeyboardInterrupt:
            sys.exit(3)
    """)
    assert run_program(latch=True, code=code) == 3


def test_a_handler_of_the_programs_own_is_left_alone():
    code = textwrap.dedent("""
        import signal, sys
        from runtime.interrupts import InterruptLatch
        mine = lambda signum, frame: None
        signal.signal(signal.SIGINT, mine)
        latch = InterruptLatch.hold()
        assert signal.getsignal(signal.SIGINT) is mine and not latch.holding
        assert latch.release() is False and signal.getsignal(signal.SIGINT) is mine
    """)
    assert run_program(latch=True, code=code) == 0


def interrupt_at(cmd: list[str], moment_s: float) -> tuple[int, str]:
    """Start a program, send it SIGINT `moment_s` into its start-up; its exit status and stderr."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "DSV4_NUM_THREADS": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        time.sleep(moment_s)
        assert proc.poll() is None, "the program ended before the signal"
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, stderr


@pytest.mark.parametrize("moment_s", [0.3, 0.6, 0.7, 0.8, 1.0, 2.0])
def test_serve_interrupted_during_start_up_ends_as_interrupted(moment_s):
    """A SIGINT at any moment of `runtime.serve`'s start-up ends it as interrupted, soon; before the
    latch, one sent 0.8-1.0 s in left the server serving 30 s later (`interrupt_at` then times out).
    On a fast host the later moments can fall after the start-up: a serving server stops gracefully
    (status 0), which is right only if its start-up completed."""
    cmd = [sys.executable, "-m", "runtime.serve", "--model", "tiny-random", "--port", str(free_port())]
    rc, stderr = interrupt_at(cmd, moment_s)
    served = "Application startup complete" in stderr
    assert rc in (INTERRUPTED_RC, -signal.SIGINT) or (served and rc == 0), (rc, stderr[-2000:])


def test_held_while_importing_holds_only_for_a_program():
    """Imported (a test, another module): the latch holds nothing and the handler stays; run as a
    program: it holds, so a swallowed Ctrl-C is still noted."""
    from runtime.interrupts import held_while_importing

    before = signal.getsignal(signal.SIGINT)
    latch = held_while_importing("runtime.some_module")
    assert latch.holding is False and signal.getsignal(signal.SIGINT) is before
    assert latch.release() is False
    code = PROGRAM.replace('InterruptLatch.hold() if os.environ["LATCH"] == "1" else None',
                           'held_while_importing("__main__")').replace(
        "import INTERRUPTED_RC, InterruptLatch", "import INTERRUPTED_RC, held_while_importing")
    assert run_program(latch=True, code=code) == INTERRUPTED_RC


@pytest.mark.parametrize("moment_s", [0.4, 0.9])
def test_train_interrupted_during_start_up_ends_as_interrupted(tmp_path, moment_s):
    """`python -m runtime.train` (minutes to hours of work) stops on a Ctrl-C sent while it imports."""
    cmd = [sys.executable, "-m", "runtime.train", "--out", str(tmp_path / "model"), "--preset", "smoke"]
    rc, stderr = interrupt_at(cmd, moment_s)
    assert rc in (INTERRUPTED_RC, -signal.SIGINT), (rc, stderr[-2000:])
    assert not (tmp_path / "model" / "model.safetensors").exists(), "the run went on to write its model"
