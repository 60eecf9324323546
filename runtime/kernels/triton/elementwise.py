"""Row-wise decode kernels: RMSNorm, fp8 e4m3
quantize/dequantize with one scale per token per 128 channels, and 128x128 block quantization of
weights (load time, plain torch). One program per row: a row never meets another row's data, so all
of these are batch-invariant by construction."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_GROUP = 128
FP8_MAX = 448.0  # largest finite e4m3fn value
FP8_DTYPE = torch.float8_e4m3fn


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, width, eps, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < width
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (x * inv * w).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    # x: [T, D], weight: [D] -> [T, D] in x.dtype (float32 math)
    out = torch.empty_like(x) if out is None else out
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](x, weight, out, x.shape[1], eps, x.stride(0), out.stride(0),
                                        BLOCK=triton.next_power_of_2(x.shape[1]))
    return out


@triton.jit
def quantize_group(x, FP8_MAX: tl.constexpr):
    """One token's 128 channels, float32 (zeros past the width) -> (e4m3 range values, their scale). The one
    formula of every activation quantization (quantize_groups, and kernels that quantize what they computed)."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / FP8_MAX
    return tl.clamp(x / scale, -FP8_MAX, FP8_MAX), scale


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, scale_ptr, width, stride_x, stride_q, stride_s, FP8_MAX: tl.constexpr,
                     GROUP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    offs = group * GROUP + tl.arange(0, GROUP)
    ok = offs < width
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    q, scale = quantize_group(x, FP8_MAX)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(scale_ptr + row * stride_s + group, scale)


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, per 128 channels: x [T, N] -> (e4m3 [T, N], float32 scales [T, ceil(N/128)]),
    x ~= q * scale."""
    rows, width = x.shape
    groups = triton.cdiv(width, FP8_GROUP)
    q = torch.empty(rows, width, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_kernel[(rows, groups)](x, q, scale, width, x.stride(0), q.stride(0), scale.stride(0),
                                         FP8_MAX=FP8_MAX, GROUP=FP8_GROUP)
    return q, scale


@triton.jit
def _dequantize_kernel(q_ptr, scale_ptr, out_ptr, width, stride_q, stride_s, stride_out, GROUP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    offs = group * GROUP + tl.arange(0, GROUP)
    ok = offs < width
    q = tl.load(q_ptr + row * stride_q + offs, mask=ok, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + row * stride_s + group)
    tl.store(out_ptr + row * stride_out + offs, (q * scale).to(out_ptr.dtype.element_ty), mask=ok)


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    rows, width = q.shape
    out = torch.empty(rows, width, dtype=dtype, device=q.device)
    if rows:
        _dequantize_kernel[(rows, scale.shape[1])](q, scale, out, width, q.stride(0), scale.stride(0),
                                                   out.stride(0), GROUP=FP8_GROUP)
    return out


def quantize_weight_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Load-time: w [..., N, K] -> (e4m3 [..., N, K], float32 scales [..., ceil(N/128), ceil(K/128)])."""
    *lead, n, k = w.shape
    pn, pk = triton.cdiv(n, FP8_GROUP) * FP8_GROUP, triton.cdiv(k, FP8_GROUP) * FP8_GROUP
    padded = torch.nn.functional.pad(w.float(), (0, pk - k, 0, pn - n))
    blocks = padded.reshape(*lead, pn // FP8_GROUP, FP8_GROUP, pk // FP8_GROUP, FP8_GROUP)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / FP8_MAX  # [..., N/128, K/128]
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).reshape(*lead, pn, pk)
    return q[..., :n, :k].to(FP8_DTYPE).contiguous(), scale.contiguous()


def dequantize_weight_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = q.shape[-2:]
    full = scale.repeat_interleave(FP8_GROUP, -2).repeat_interleave(FP8_GROUP, -1)[..., :n, :k]
    return q.float() * full
