"""Capturable ops of the static model: static shapes, no host syncs, batch-invariant per op.

Inside a CUDA graph nothing may read a value back to the host (`.item()`, `.tolist()`, a
data-dependent shape), so where cpu.py loops over requests or over the experts actually chosen,
these ops use fixed-size gathers: each query attends over exactly `window + topk` gathered slots
(invalid ones masked) and each token's experts are gathered by id.

Batch invariance is each op's own property; the model runs every op once over the whole batch.
On a GPU, dense projections are the Triton GEMM (kernels/triton/matmul.py: one launch config per
weight shape) and RMSNorm the row-wise Triton kernel. Library kernels that choose their algorithm by
shape (cuBLAS batched GEMMs; on CPU, BLAS blocking and SIMD tails of transcendentals) are called on
fixed groups of GROUP rows instead (`by_row_groups`): every call has one shape whatever the batch.
Device-agnostic, so CI checks the numerics on CPU. B = rows, L = context capacity,
S = window + topk selected slots, K = experts per token; other letters as in reference.py.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from runtime.kernels.cpu import select_experts

GROUP = 16  # rows per call of a shape-dependent library kernel (see by_row_groups)
# Set once if the Triton selection kernel fails (compile error on this Triton build): select_slots
# then sorts, with one warning. Its own tests (tests/kernels/test_indexer_topk.py) call it directly.
_TRITON_SELECT_FAILED: list[str] = []


def by_row_groups(fn, *tensors: torch.Tensor):
    """`fn` over consecutive groups of exactly GROUP leading rows (the last zero-padded), results
    concatenated: each call has one shape, so a row's bits do not depend on the batch. Weights are
    closed over by `fn`; the tensors here are per-row data (activations, ids, gathered KV)."""
    rows = tensors[0].shape[0]
    padded = -(-rows // GROUP) * GROUP
    if padded != rows:
        tensors = tuple(torch.cat([t, t.new_zeros(padded - rows, *t.shape[1:])]) for t in tensors)
    outs = [fn(*(t[s:s + GROUP] for t in tensors)) for s in range(0, padded, GROUP)]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts)[:rows] for parts in zip(*outs))
    return torch.cat(outs)[:rows]


def _rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    # x: [B, D], weight: [D] -> [B, D] (float32 math), into `out` when given (rows contiguous)
    if x.is_cuda:
        from runtime.kernels.triton.elementwise import rms_norm as triton_rms_norm

        return triton_rms_norm(x.contiguous(), weight, eps, out=out)
    normed = by_row_groups(lambda rows: _rms_norm_rows(rows, weight, eps), x)
    return normed if out is None else out.copy_(normed)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm: (x + delta, rms_norm(x + delta)) [B, D]; `out` receives the norm."""
    if x.is_cuda:
        from runtime.kernels.triton.glue import add_rms_norm as triton_add_rms_norm

        return triton_add_rms_norm(x.contiguous(), delta.contiguous(), weight, eps, out=out)
    total = x + delta
    normed = rms_norm(total, weight, eps)
    return total, normed if out is None else out.copy_(normed)


def embed_rms_norm(token_ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float,
                   out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Embedding rows and their RMSNorm: (table[token_ids], rms_norm(table[token_ids])) [B, D]."""
    if table.is_cuda:
        from runtime.kernels.triton.glue import embed_rms_norm as triton_embed_rms_norm

        return triton_embed_rms_norm(token_ids, table, weight, eps, out=out)
    rows = table[token_ids]
    return rows, rms_norm(rows, weight, eps, out=out)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # x: [B, IN], weight: [OUT, IN] -> [B, OUT]
    if x.is_cuda:
        from runtime.kernels.triton.matmul import matmul

        return matmul(x.contiguous(), weight)
    return by_row_groups(lambda rows: torch.mm(rows, weight.t()), x)


def cublas_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """NOT batch-invariant (cuBLAS picks its kernel and split by M): what `linear` costs without the
    invariance rule. bench/decode_step.py only."""
    return torch.mm(x, weight.t())


def rope_table(half: int, theta: float, length: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [length, half], built once at load time so decode never computes a table size."""
    inv_freq = 1.0 / theta ** (torch.arange(half, dtype=torch.float64) * 2 / (2 * half))
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, ..., R], positions: [B]
    half = x.shape[-1] // 2
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos[positions].view(shape), sin[positions].view(shape)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rope` written back into x: [B, H, R] (a strided view of a projection); returns x."""
    if x.is_cuda:
        from runtime.kernels.triton.glue import rope_ as triton_rope_

        return triton_rope_(x, positions, cos, sin)
    return x.copy_(rope(x, positions, cos, sin))


def write_cache_rows(src: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, cache: torch.Tensor, rope_dim: int, norm_weight: torch.Tensor | None = None,
                     eps: float = 0.0) -> None:
    """Each token's cache row from its projection src: [B, W] into cache: [num_slots, W] at slots: [B]:
    the head W - R channels RMSNormed (when norm_weight is given, else copied), the last R roped."""
    if src.is_cuda:
        from runtime.kernels.triton.glue import write_cache_rows as triton_write_cache_rows

        return triton_write_cache_rows(src, positions, slots, cos, sin, cache, rope_dim, norm_weight, eps)
    head = src.shape[1] - rope_dim
    cache[slots, :head] = src[:, :head] if norm_weight is None else rms_norm(src[:, :head], norm_weight, eps)
    cache[slots, head:] = rope(src[:, head:], positions, cos, sin)
    return None


def context_slots(page_table: torch.Tensor, page_size: int) -> torch.Tensor:
    # page_table: [B, P] -> [B, L = P * page_size] KV slot of every context position
    offsets = torch.arange(page_size, device=page_table.device)
    return (page_table[:, :, None] * page_size + offsets).flatten(1)


def selected_slots(page_table: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                   page_size: int) -> torch.Tensor:
    """The cache slot of each selected context position: page_table: [B, P], positions, valid: [B, S]
    -> int32 [B, S], -1 where not valid (the slot ids sparse MLA reads)."""
    if page_table.is_cuda:
        from runtime.kernels.triton.glue import selected_slots as triton_selected_slots

        return triton_selected_slots(page_table, positions, valid, page_size)
    slots = context_slots(page_table, page_size).gather(1, positions.clamp(min=0))
    return torch.where(valid, slots, -1).to(torch.int32)


def triton_compile_errors() -> tuple[type[Exception], ...]:
    """What Triton raises when it cannot build a kernel for this device (front end, ptxas, too many
    registers or too much shared memory). Anything else (a CUDA fault, a wrong argument) is a bug
    and must surface, not fall back."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources, PTXASError

    return CompilationError, OutOfResources, PTXASError


def select_slots(scores: torch.Tensor, positions: torch.Tensor, window: int,
                 topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions each query attends to: the window ending at itself, plus the top-k older ones.
    scores: [B, L] -> (positions [B, S] long, valid [B, S] bool). Ties go to the earlier position
    (stable sort), as in reference.select_tokens. On a GPU the Triton radix select
    (kernels/triton/topk.py) returns the same tensors bit for bit without sorting whole rows."""
    if scores.is_cuda and topk > 0 and not _TRITON_SELECT_FAILED:
        from runtime.kernels.triton.topk import select_slots as triton_select_slots

        try:
            return triton_select_slots(scores, positions, window, topk)
        except triton_compile_errors() as err:  # a Triton build that cannot compile it: the same result by sorting
            triton_select_failed(err)
    return select_slots_by_sort(scores, positions, window, topk)


def triton_select_failed(err: Exception) -> None:
    """Note (once, with a warning) that this Triton build cannot compile the selection: from now on
    every caller sorts instead (`select_slots`, and the indexer's fused path)."""
    _TRITON_SELECT_FAILED.append(f"{type(err).__name__}: {err}")
    warnings.warn(f"Triton top-k selection unavailable, using torch.sort: {_TRITON_SELECT_FAILED[0][:500]}",
                  RuntimeWarning, stacklevel=3)


def select_slots_by_sort(scores: torch.Tensor, positions: torch.Tensor, window: int,
                         topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """select_slots by a stable descending sort of every row: the readable definition (and the CPU path)."""
    cols = torch.arange(scores.shape[1], device=scores.device)[None, :]
    pos = positions[:, None]
    window_pos = pos - window + 1 + torch.arange(window, device=scores.device)[None, :]
    window_ok = window_pos >= 0
    if topk == 0:
        return window_pos.clamp(min=0), window_ok
    candidate = cols <= pos - window
    ranked = torch.where(candidate, scores, torch.full_like(scores, float("-inf")))
    top = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[:, :topk]
    top_ok = torch.gather(candidate, 1, top)
    return torch.cat([window_pos.clamp(min=0), top], 1), torch.cat([window_ok, top_ok], 1)


def indexer_scores(q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    # q: [B, HI, DI], head_weights: [B, HI], keys: [B, L, DI] -> [B, L]
    def group(q, head_weights, keys):
        per_head = torch.relu(torch.bmm(q, keys.transpose(1, 2)))  # [B, HI, L]
        return torch.bmm(head_weights[:, None, :], per_head)[:, 0]
    return by_row_groups(group, q, head_weights, keys)


def gathered_attention(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, latent_dim: int,
                       scale: float) -> torch.Tensor:
    # q: [B, H, C+R], kv: [B, S, C+R] gathered selected slots, valid: [B, S] -> [B, H, C]
    def group(q, kv, valid):
        scores = torch.bmm(q, kv.transpose(1, 2)).float() * scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(kv.dtype)
        return torch.bmm(probs, kv[:, :, :latent_dim])
    return by_row_groups(group, q, kv, valid)


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
          scaling: float, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """As cpu.route (sqrtsoftplus, noaux_tc, group-limited), with every tensor on logits' device.
    On a GPU one Triton kernel (kernels/triton/glue.py); `route_torch` is its readable reference."""
    if logits.is_cuda:
        from runtime.kernels.triton.glue import route as triton_route

        return triton_route(logits.contiguous(), bias, top_k, n_group, topk_group, scaling, normalize)
    return route_torch(logits, bias, top_k, n_group, topk_group, scaling, normalize)


def route_torch(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                scaling: float, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    def group(logits):
        affinity = torch.sqrt(F.softplus(logits.float()))
        return select_experts(affinity, bias, top_k, n_group, topk_group, scaling, normalize)
    # Elementwise CUDA kernels give every element the same code path; CPU SIMD tails do not.
    return group(logits) if logits.is_cuda else by_row_groups(group, logits)


def gathered_experts(x: torch.Tensor, ids: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                     w_down: torch.Tensor) -> torch.Tensor:
    """SwiGLU of each token through each of its K experts, weights gathered by id (no host sync).
    x: [B, D], ids: [B, K] -> [B, K, D]"""
    def group(x, ids):
        B, K = ids.shape
        flat = ids.flatten()
        xs = x[:, None, :].expand(B, K, x.shape[1]).reshape(B * K, 1, -1)  # [BK, 1, D]
        gate = torch.bmm(xs, w_gate[flat].transpose(1, 2))  # [BK, 1, I]
        up = torch.bmm(xs, w_up[flat].transpose(1, 2))
        return torch.bmm(F.silu(gate) * up, w_down[flat].transpose(1, 2)).view(B, K, -1)
    return by_row_groups(group, x, ids)


def shared_expert(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    def swiglu(x):
        return linear(F.silu(linear(x, w_gate)) * linear(x, w_up), w_down)
    return swiglu(x) if x.is_cuda else by_row_groups(swiglu, x)
