"""Triton's interpreter is chosen when a @jit function is defined, triton.language's helpers included:
if anything imported triton before the interpreter was switched on (sglang does, for the DSML
differential), interpreted kernels fail. The root conftest switches it on first; this checks it in a
fresh interpreter, the order a test worker sees (sglang's module first, then our kernels)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.unit

PROBE = """
import triton.language  # what any early importer of triton (sglang among them) does
from runtime.kernels.triton import moe
import torch
sorted_rows, tile_expert = moe.align_tokens(torch.tensor([[1, 0], [1, 1]]), 2)
print(tile_expert.tolist())
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is the CPU path")
def test_interpreted_kernels_survive_an_earlier_triton_import():
    import os

    env = {**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "")}
    ok = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env)
    assert ok.returncode == 0 and ok.stdout.strip() == "[0, 1, -1]", ok.stderr[-2000:]
    # Negative control: the same order with the interpreter switched on too late fails.
    late = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert late.returncode != 0 and "outside of the scope of a kernel" in late.stderr
