"""Kernel sets: each op has a readable torch reference and a fast path with the same signature.

`select_kernels()` returns the module the model calls. The reference set is selectable too
(DSV4_REFERENCE_KERNELS=1), which makes the readable math runnable end to end for debugging.
"""

from __future__ import annotations

from types import ModuleType

from runtime.kernels import cpu, reference


def select_kernels(*, device: str = "cpu", use_reference: bool = False) -> ModuleType:
    if use_reference:
        return reference
    if device != "cpu":
        raise NotImplementedError(f"no fast kernels for device {device!r} in this build")
    return cpu
