"""Triton decode kernels for DSV4 (GPU fast path; on CPU they run under the Triton interpreter).

One module per kernel family: `moe` (fused MoE, bf16 and fp8 block-scaled), `attention` (sparse
latent-MQA decode over the paged latent cache), `indexer` (lightning-indexer logits over paged
index keys + top-k), `elementwise` (RMSNorm, RoPE, fp8 quantize/dequantize). Every kernel is
batch-invariant: launch parameters that change a row's reduction order never depend on the batch.

Triton chooses the interpreter when the kernels are defined, so without CUDA the interpreter is
switched on before the kernel modules are imported (the only way these kernels run on a CPU).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
