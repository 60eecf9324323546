"""Capturable decode ops in plain torch: static shapes, no host syncs, batch-invariant by tiles.

Inside a CUDA graph nothing may read a value back to the host (`.item()`, `.tolist()`, a
data-dependent shape), so where cpu.py loops over requests or over the experts actually chosen,
these ops use fixed-size gathers: each query attends over exactly `window + topk` gathered slots
(invalid ones masked) and each token's experts are gathered by id. Every op is called on a tile
of exactly TILE rows, so a row's bits never depend on its batch (cuBLAS and torch reductions pick
kernels by shape): eager at any batch size equals graph replay at its padded bucket.
Device-agnostic, so CI checks the numerics on CPU. B = TILE rows, L = context capacity,
S = window + topk selected slots, K = experts per token; other letters as in reference.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.kernels.cpu import select_experts

TILE = 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # x: [B, IN], weight: [OUT, IN] -> [B, OUT]
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


def context_slots(page_table: torch.Tensor, page_size: int) -> torch.Tensor:
    # page_table: [B, P] -> [B, L = P * page_size] KV slot of every context position
    offsets = torch.arange(page_size, device=page_table.device)
    return (page_table[:, :, None] * page_size + offsets).flatten(1)


def select_slots(scores: torch.Tensor, positions: torch.Tensor, window: int,
                 topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions each query attends to: the window ending at itself, plus the top-k older ones.
    scores: [B, L] -> (positions [B, S] long, valid [B, S] bool). Ties go to the earlier position
    (stable sort), as in reference.select_tokens."""
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
    per_head = torch.relu(torch.bmm(q, keys.transpose(1, 2)))  # [B, HI, L]
    return torch.bmm(head_weights[:, None, :], per_head)[:, 0]


def gathered_attention(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, latent_dim: int,
                       scale: float) -> torch.Tensor:
    # q: [B, H, C+R], kv: [B, S, C+R] gathered selected slots, valid: [B, S] -> [B, H, C]
    scores = torch.bmm(q, kv.transpose(1, 2)).float() * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(kv.dtype)
    return torch.bmm(probs, kv[:, :, :latent_dim])


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
          scaling: float, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """As cpu.route (sqrtsoftplus, noaux_tc, group-limited), with every tensor on logits' device."""
    affinity = torch.sqrt(F.softplus(logits.float()))
    return select_experts(affinity, bias, top_k, n_group, topk_group, scaling, normalize)


def gathered_experts(x: torch.Tensor, ids: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                     w_down: torch.Tensor) -> torch.Tensor:
    """SwiGLU of each token through each of its K experts, weights gathered by id (no host sync).
    x: [B, D], ids: [B, K] -> [B, K, D]"""
    B, K = ids.shape
    flat = ids.flatten()
    xs = x[:, None, :].expand(B, K, x.shape[1]).reshape(B * K, 1, -1)  # [BK, 1, D]
    gate = torch.bmm(xs, w_gate[flat].transpose(1, 2))  # [BK, 1, I]
    up = torch.bmm(xs, w_up[flat].transpose(1, 2))
    return torch.bmm(F.silu(gate) * up, w_down[flat].transpose(1, 2)).view(B, K, -1)


def shared_expert(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return linear(F.silu(linear(x, w_gate)) * linear(x, w_up), w_down)
