"""Keep a Ctrl-C that arrives while a program's heavy modules import.

Importing torch swallows a KeyboardInterrupt raised inside it: its C module imports numpy and, when that
import fails, goes on without numpy, the interrupt dropped with the error. `python -c "import torch;
..."` interrupted 0.6 s into its start ran on to rc 0 on the 2-core CPU host (probed 2026-12-03), as did
`runtime.generate --tp 2` (caught by tests/unit/test_tp_lifecycle.py) and `runtime.serve` (still
serving 30 s after a SIGINT sent 0.8-1.0 s in). A program's entry point therefore holds SIGINT while
those imports run, so the signal is only noted, and asks afterwards whether one came:

    latch = InterruptLatch.hold()
    import torch  # or anything that imports it
    if latch.release():
        return 128 + signal.SIGINT   # as interrupted, without a traceback

The latch holds only where Python's own handler is in place on the main thread: a program that set
its own handler (or a test runner that imports the module) keeps it untouched. A module that is both a
program and importable holds from its first lines with `held_while_importing(__name__)`.
"""

from __future__ import annotations

import signal
import threading

# The exit status of a program that ended because of Ctrl-C, as a shell reports it.
INTERRUPTED_RC = 128 + signal.SIGINT


class InterruptLatch:
    """SIGINT noted, not raised, between `hold()` and `release()`."""

    def __init__(self, holding: bool) -> None:
        self.holding = holding
        self.noted = False

    @classmethod
    def hold(cls) -> InterruptLatch:
        holding = (threading.current_thread() is threading.main_thread()
                   and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
        latch = cls(holding)
        if holding:
            signal.signal(signal.SIGINT, latch._note)
        return latch

    def _note(self, signum, frame) -> None:
        self.noted = True

    def release(self) -> bool:
        """Ctrl-C raises again from here on; True when one came while held (the caller ends now)."""
        if self.holding:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self.holding = False
        return self.noted


def held_while_importing(module_name: str) -> InterruptLatch:
    """For a module's top, before its heavy imports: holding when the module runs as a program
    (`python -m ...`, module_name == "__main__"), a latch that holds nothing when it is imported (a
    test, another module), whose handler stays as it was."""
    return InterruptLatch.hold() if module_name == "__main__" else InterruptLatch(holding=False)
