"""Plain torch references for every op of dsv4-mini: readable, float64, one formula per function.

These define what the fast paths must compute; they are deliberately slow and loop where the math
loops. Shapes: T = tokens, D = hidden, H = query heads, C = latent dim, R = rope dim,
HI = indexer heads, DI = indexer dim, L = context length, E = routed experts, K = experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.kernels.types import MoEWeights

F64 = torch.float64


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [T, D], weight: [D]
    x = x.to(F64)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(F64)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # x: [T, IN], weight: [OUT, IN] (nn.Linear layout)
    return x.to(F64) @ weight.to(F64).T


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE on the last dim. x: [T, ..., R], positions: [T]."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(half, dtype=F64) * 2 / x.shape[-1])
    angles = positions.to(F64)[:, None] * inv_freq[None, :]  # [T, R/2]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = angles.cos().view(shape), angles.sin().view(shape)
    x = x.to(F64)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def indexer_scores(q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor,
                   positions: torch.Tensor | None = None) -> torch.Tensor:
    """score[i, t] = sum_h w[i, h] * relu(q[i, h] . k[t]). q: [T, HI, DI], w: [T, HI], keys: [L, DI].
    Every column is scored (`positions`, the queries' positions, bounds what the fast path scores)."""
    q, w, k = q.to(F64), head_weights.to(F64), keys.to(F64)
    out = torch.zeros(q.shape[0], k.shape[0], dtype=F64)
    for i in range(q.shape[0]):
        for h in range(q.shape[1]):
            out[i] += w[i, h] * torch.relu(k @ q[i, h])
    return out


def select_tokens(scores: torch.Tensor, positions: torch.Tensor, window: int, topk: int) -> list[list[int]]:
    """For each query at position p: the window (p-window, p] plus the top-k earlier tokens by
    indexer score among positions <= p - window; ties go to the earlier position.
    scores: [T, L] (only columns <= p are read), positions: [T]. Returns sorted position lists."""
    selected = []
    for i, p in enumerate(positions.tolist()):
        in_window = list(range(max(0, p - window + 1), p + 1))
        candidates = list(range(0, max(0, p - window + 1)))
        ranked = sorted(candidates, key=lambda t: (-float(scores[i, t]), t))
        selected.append(sorted(ranked[:topk] + in_window))
    return selected


def selection_mask(scores: torch.Tensor, positions: torch.Tensor, window: int, topk: int) -> torch.Tensor:
    """The same selection as a boolean [T, L] mask (the fast path's contract)."""
    mask = torch.zeros(scores.shape, dtype=torch.bool)
    for i, chosen in enumerate(select_tokens(scores, positions, window, topk)):
        mask[i, chosen] = True
    return mask


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, latent_dim: int,
                     scale: float) -> torch.Tensor:
    """MQA over the latent: each head scores [latent | rope key] of the selected tokens and
    averages their latents. q: [T, H, C+R], kv: [L, C+R] (one shared vector per token),
    mask: [T, L] selected tokens. Returns [T, H, C]."""
    q, kv = q.to(F64), kv.to(F64)
    out = torch.empty(q.shape[0], q.shape[1], latent_dim, dtype=F64)
    for i in range(q.shape[0]):
        keys = kv[mask[i]]  # [S, C+R]
        probs = torch.softmax(q[i] @ keys.T * scale, dim=-1)  # [H, S]
        out[i] = probs @ keys[:, :latent_dim]
    return out


def gathered_attention(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, latent_dim: int,
                       scale: float) -> torch.Tensor:
    """sparse_attention over each row's selected tokens gathered: q: [T, H, C+R], kv: [T, W, C+R],
    valid: [T, W] (which gathered columns are selected tokens). Returns [T, H, C]."""
    q, kv = q.to(F64), kv.to(F64)
    out = torch.empty(q.shape[0], q.shape[1], latent_dim, dtype=F64)
    for i in range(q.shape[0]):
        keys = kv[i][valid[i]]  # [S, C+R]
        probs = torch.softmax(q[i] @ keys.T * scale, dim=-1)  # [H, S]
        out[i] = probs @ keys[:, :latent_dim]
    return out


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
          scaling: float, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """DSV4 routing: sqrtsoftplus affinities; experts chosen by affinity + correction bias
    (noaux_tc, group-limited), weighted by the unbiased affinity. Ties go to the lower expert id.
    logits: [T, E]. Returns (weights [T, K] float64, expert ids [T, K])."""
    affinity = torch.sqrt(F.softplus(logits.to(F64)))
    choice = affinity + bias.to(F64)
    num_tokens, num_experts = logits.shape
    per_group = num_experts // n_group
    weights = torch.empty(num_tokens, top_k, dtype=F64)
    ids = torch.empty(num_tokens, top_k, dtype=torch.long)
    for t in range(num_tokens):
        group_score = []
        for g in range(n_group):
            members = sorted(choice[t, g * per_group:(g + 1) * per_group].tolist(), reverse=True)
            group_score.append(sum(members[:2]) if per_group > 1 else members[0])
        groups = sorted(range(n_group), key=lambda g: (-group_score[g], g))[:topk_group]
        allowed = [e for e in range(num_experts) if e // per_group in groups]
        chosen = sorted(allowed, key=lambda e: (-float(choice[t, e]), e))[:top_k]
        w = affinity[t, chosen]
        if normalize:
            w = w / w.sum()
        weights[t] = w * scaling
        ids[t] = torch.tensor(chosen)
    return weights, ids


def swiglu_expert(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    # x: [D]; w_gate, w_up: [I, D]; w_down: [D, I]
    x = x.to(F64)
    return w_down.to(F64) @ (F.silu(w_gate.to(F64) @ x) * (w_up.to(F64) @ x))


def moe(x: torch.Tensor, weights: MoEWeights, *, top_k: int, n_group: int, topk_group: int,
        scaling: float, normalize: bool) -> torch.Tensor:
    """Routed experts + shared expert, token by token. x: [T, D] -> [T, D]."""
    logits = linear(x, weights.router)
    route_w, route_ids = route(logits, weights.bias, top_k, n_group, topk_group, scaling, normalize)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=F64)
    for t in range(x.shape[0]):
        for j in range(top_k):
            e = int(route_ids[t, j])
            out[t] += route_w[t, j] * swiglu_expert(x[t], weights.w_gate[e], weights.w_up[e], weights.w_down[e])
        if weights.shared_gate is not None:
            assert weights.shared_up is not None and weights.shared_down is not None
            out[t] += swiglu_expert(x[t], weights.shared_gate, weights.shared_up, weights.shared_down)
    return out
