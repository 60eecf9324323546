"""Triton decode kernels for DSV4 (GPU fast path; on CPU they run under the Triton interpreter).

One module per kernel family: `moe` (fused MoE, bf16 and fp8 block-scaled), `attention` (sparse
latent-MQA decode over the paged latent cache), `indexer` (lightning-indexer logits over paged
index keys + top-k), `topk` (the decode step's window U top-k selection), `elementwise` (RMSNorm,
fp8 quantize/dequantize), `glue` (the step's fused glue: add+RMSNorm, in-place RoPE, cache-row
writes, routing). Every kernel is batch-invariant: launch parameters that change a row's reduction
order never depend on the batch.

Triton chooses the interpreter when the kernels are defined, so without CUDA the interpreter is
switched on before the kernel modules are imported (the only way these kernels run on a CPU).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _row_uniform_interpreter_dot() -> None:
    """The interpreter runs `tl.dot` as one numpy matmul, and BLAS computes a tile's edge rows with
    other micro-kernels than its middle rows: a row's bits then depend on its position in the tile.
    A GPU's MMA treats every row alike, and kernels that gather rows into tiles (the fused MoE's
    aligned layout) rely on it. Here each row is its own [1, K] x [K, N] product, so under the
    interpreter too a row's bits depend only on its data, as on the GPU. The right operand is made
    contiguous first: BLAS takes a transposed view (`dot(a, b.T)`, the TMA GEMM's weight box) through
    other kernels than the same values laid out plainly, where an MMA reads both alike."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    plain_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.ndim != 2 or a.dtype.primitive_bitwidth == 8:
            return plain_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        right = np.ascontiguousarray(b.data)
        rows = [np.matmul(a.data[i:i + 1], right, dtype=d.data.dtype) for i in range(a.data.shape[0])]
        return interpreter.TensorHandle(np.concatenate(rows) + d.data, d.dtype.scalar)

    builder.create_dot = create_dot


if INTERPRETED:
    _row_uniform_interpreter_dot()
