"""The fp8 latent cache (issue 15 item 2): a sparse-MLA cache row as bytes, the latent in fp8 with a power-of-two
scale per column group, the rope part unquantized. A decode step reads a row in 656 bytes instead of 1,152 (C=512,
R=64, bf16), and the sparse MLA kernel is bound by how fast each program pulls its gathered rows in.

One row (uint8, `row_bytes`):

    [0, C)           the latent as float8_e4m3fn, column group g divided by scales[g]
    [C, C + 16)      GROUPS float32 scales, one per column group of `group_columns(C)` columns: the groups
                     runtime/kernels/triton/mla_grouped.py's kernel loads and dots one at a time, so each of its
                     loads needs one scale (C=512: 128 columns, DeepSeek's fp8 tile)
    [C + 16, end)    the rope part in the model's dtype (positions keep their precision, as FlashMLA's fp8 cache does)

A scale is 2^ceil(log2(amax / 448)) (not below 2^MIN_SCALE_EXP), so dividing by it is exact and so is dequantizing:
an e4m3 value (4 significant bits) times a power of two is a bfloat16 / float32 number, never rounded (float16 too,
for rows within its range). The kernel dequantizes a block into q's dtype before its dots, so its output is the
16-bit kernel's on `dequantize_rows(cache)`, bit for bit on the GPU: that is the fp8 cache's numerics, and its tests'
oracle. What fp8 costs is the quantization itself (`quantize_rows`), measured against the unquantized rows.
"""

from __future__ import annotations

import torch

GROUPS = 4  # column groups, as mla_grouped.GROUPS (a test checks they agree)
SCALE_BYTES = 4 * GROUPS
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Scales stay at or above 2^-117, so the smallest e4m3 value (2^-9) dequantizes to a normal float32 / bfloat16
# number (>= 2^-126): groups whose largest value is below ~2^-108 lose their smallest values to zero, nothing
# dequantizes to a subnormal.
MIN_SCALE_EXP = -117
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def group_columns(latent: int) -> int:
    """Latent columns a scale covers: mla_grouped.block_g's rule (a power of two, GROUPS of them cover C)."""
    return 1 << max(0, (-(-latent // GROUPS) - 1).bit_length())


def _check(latent: int, dtype: torch.dtype) -> None:
    if latent <= 0 or latent % 16:
        raise ValueError(f"the fp8 latent cache needs a latent width that is a positive multiple of 16 (the "
                         f"scales' and rope's alignment), got {latent}")
    if dtype not in DTYPES:
        raise ValueError(f"the fp8 latent cache keeps its rope part as bfloat16, float16 or float32, got {dtype}")


def row_bytes(latent: int, rope: int, dtype: torch.dtype) -> int:
    """Bytes of one row: the fp8 latent, the scales, the rope part in `dtype`."""
    _check(latent, dtype)
    return latent + SCALE_BYTES + rope * dtype.itemsize


def rope_of(width_bytes: int, latent: int, dtype: torch.dtype) -> int:
    """The rope width of rows `width_bytes` wide, or ValueError when no rope width gives that row."""
    _check(latent, dtype)
    rope, left = divmod(width_bytes - latent - SCALE_BYTES, dtype.itemsize)
    if rope < 0 or left:
        raise ValueError(f"a row of {width_bytes} bytes is no fp8 latent cache row of a {latent}-wide latent "
                         f"with a {dtype} rope part ({latent} + {SCALE_BYTES} + rope x {dtype.itemsize} bytes)")
    return rope


def quantize_rows(rows: torch.Tensor, latent: int) -> torch.Tensor:
    """rows: [T, C+R] in bfloat16 / float16 / float32 -> [T, row_bytes] uint8 (this module's layout)."""
    if rows.dim() != 2 or rows.shape[1] < latent:
        raise ValueError(f"rows must be [T, C+R] with C={latent}, got {tuple(rows.shape)}")
    _check(latent, rows.dtype)
    tokens = rows.shape[0]
    cols = group_columns(latent)
    grouped = torch.nn.functional.pad(rows[:, :latent].float(), (0, GROUPS * cols - latent)).view(tokens, GROUPS, cols)
    amax = grouped.abs().amax(dim=-1)
    # log2 of 0 is -inf, clamped to the floor: an all-zero group stores zeros under the smallest scale.
    exponent = torch.ceil(torch.log2(amax / FP8_MAX)).clamp(min=MIN_SCALE_EXP)
    scales = torch.exp2(exponent)
    # amax / 448 may round down onto a power of two: the clamp keeps the one value above 448 that could give
    # inside e4m3's range (it rounds to 448 either way).
    fp8 = (grouped / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(tokens, GROUPS * cols)[:, :latent]
    out = torch.empty(tokens, row_bytes(latent, rows.shape[1] - latent, rows.dtype), dtype=torch.uint8,
                      device=rows.device)
    out[:, :latent] = fp8.view(torch.uint8)
    out[:, latent:latent + SCALE_BYTES] = scales.contiguous().view(torch.uint8)
    out[:, latent + SCALE_BYTES:] = rows[:, latent:].contiguous().view(torch.uint8)
    return out


def scales_of(cache: torch.Tensor, latent: int) -> torch.Tensor:
    """[T, GROUPS] float32 scales of fp8 rows."""
    return cache[:, latent:latent + SCALE_BYTES].contiguous().view(torch.float32)


def dequantize_rows(cache: torch.Tensor, latent: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, row_bytes] uint8 -> [T, C+R] in `dtype`: each latent value times its group's scale (exact), the rope part
    as stored. What the kernel's dots see."""
    if cache.dtype != torch.uint8 or cache.dim() != 2:
        raise ValueError(f"fp8 latent cache rows are [T, bytes] uint8, got {cache.dtype} {tuple(cache.shape)}")
    rope = rope_of(cache.shape[1], latent, dtype)
    tokens, cols = cache.shape[0], group_columns(latent)
    values = cache[:, :latent].contiguous().view(FP8).float()
    per_column = scales_of(cache, latent).repeat_interleave(cols, dim=1)[:, :latent]
    rope_part = cache[:, latent + SCALE_BYTES:].contiguous().view(dtype).view(tokens, rope)
    return torch.cat([(values * per_column).to(dtype), rope_part], dim=1)
