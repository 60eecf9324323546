"""Differentiable dsv4-mini forward over whole padded sequences, the same function as inference.

runtime/models/dsv4_mini.py computes token by token over a paged KV cache; here every position
of a [B, T] batch is computed at once with masks: causal U window U indexer top-k, the same
selection rule as kernels.cpu.selection_mask (stable descending sort, ties to the earlier token).
tests/unit/test_train_model.py checks logits against the engine's prefill on the same weights.

Training-only additions, none of which changes the served function:
- `sparse=False` attends densely (warm-up while the indexer is still untrained);
- the indexer reads a detached copy of the hidden state and is trained only by a KL loss towards
  the main attention distribution (mean over heads), so the LM loss never moves it;
- routing bias (noaux_tc) is a buffer nudged towards balanced expert load, not a gradient.
B = batch, T = tokens, D = hidden, H = heads, C = latent, R = rope, HI/DI = indexer, E = experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.config import ModelConfig
from runtime.models.weights import weight_shapes


@dataclass
class ForwardOut:
    logits: torch.Tensor  # [B, T, V]
    indexer_kl: torch.Tensor  # scalar, mean over valid query tokens and layers
    expert_load: torch.Tensor  # [layers, E] tokens routed to each expert (for the bias update)


def init_params(model_cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Small-std init: residual outputs (wo, w_down) scaled by depth so early training is stable."""
    gen = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape in weight_shapes(model_cfg).items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        elif name.endswith("e_score_correction_bias"):
            t = torch.zeros(shape)
        elif name in ("embed.weight", "lm_head.weight"):
            t = torch.randn(shape, generator=gen) * 0.02
        else:
            t = torch.randn(shape, generator=gen) * shape[-1] ** -0.5
            if name.endswith(("attn.wo.weight", "w_down")):
                t = t / math.sqrt(2 * model_cfg.num_layers)
        params[name] = t
    return params


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE; x: [B, T, ..., R] at positions 0..T-1 (angles in float64, as in cpu.rope)."""
    T, half = x.shape[1], x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(half, dtype=torch.float64, device=x.device) * 2 / (2 * half))
    angles = torch.arange(T, dtype=torch.float64, device=x.device)[:, None] * inv_freq[None, :]
    shape = (1, T) + (1,) * (x.dim() - 3) + (half,)
    cos, sin = angles.cos().to(x.dtype).view(shape), angles.sin().to(x.dtype).view(shape)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def selection(scores: torch.Tensor, window: int, topk: int) -> torch.Tensor:
    """[B, T, T] bool: key s is attended by query t (window (t-window, t] plus top-k older tokens)."""
    T = scores.shape[-1]
    t = torch.arange(T, device=scores.device)[:, None]
    s = torch.arange(T, device=scores.device)[None, :]
    in_window = (s <= t) & (s > t - window)
    candidate = (s <= t - window).expand_as(scores)
    if topk == 0:
        return in_window.expand_as(scores)
    ranked = torch.where(candidate, scores, torch.full_like(scores, float("-inf")))
    k = min(topk, T)
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :k]
    chosen = torch.zeros_like(candidate).scatter_(-1, order, torch.gather(candidate, -1, order))
    return in_window | chosen


class TrainModel(torch.nn.Module):
    def __init__(self, model_cfg: ModelConfig, params: dict[str, torch.Tensor]) -> None:
        super().__init__()
        if model_cfg.tie_word_embeddings:
            raise ValueError("the training forward expects an untied lm_head")
        self.model_cfg = model_cfg
        self.names = sorted(params)
        # nn.ParameterDict keys may not contain dots; map them once.
        self.p = torch.nn.ParameterDict({n.replace(".", "__"): torch.nn.Parameter(params[n].float().clone())
                                         for n in self.names if not n.endswith("e_score_correction_bias")})
        for i in range(model_cfg.num_layers):
            self.register_buffer(f"bias{i}", params[f"layers.{i}.moe.gate.e_score_correction_bias"].float().clone())

    def w(self, name: str) -> torch.Tensor:
        if name.endswith("e_score_correction_bias"):
            return getattr(self, f"bias{name.split('.')[1]}")
        return self.p[name.replace(".", "__")]

    def state(self) -> dict[str, torch.Tensor]:
        """The checkpoint in the inference layout (runtime/models/weights.py names)."""
        return {n: self.w(n).detach().float().cpu().contiguous() for n in self.names}

    def indexer_params(self) -> list[torch.nn.Parameter]:
        return [p for k, p in self.p.items() if "__indexer__" in k]

    def forward(self, ids: torch.Tensor, valid: torch.Tensor, sparse: bool) -> ForwardOut:
        """ids, valid: [B, T] (valid = not padding)."""
        model_cfg = self.model_cfg
        x = F.embedding(ids, self.w("embed.weight"))
        kls, loads = [], []
        for layer in range(model_cfg.num_layers):
            attn, kl = self._attention(layer, x, valid, sparse)
            x = x + attn
            moe, load = self._moe(layer, x, valid)
            x = x + moe
            kls.append(kl)
            loads.append(load)
        h = rms_norm(x, self.w("norm.weight"), model_cfg.rms_norm_eps)
        return ForwardOut(h @ self.w("lm_head.weight").T, torch.stack(kls).mean(), torch.stack(loads))

    def _attention(self, layer: int, x: torch.Tensor, valid: torch.Tensor, sparse: bool):
        model_cfg, p = self.model_cfg, f"layers.{layer}."
        B, T, _ = x.shape
        H, C, R = model_cfg.num_heads, model_cfg.kv_latent_dim, model_cfg.rope_dim
        h = rms_norm(x, self.w(p + "attn_norm.weight"), model_cfg.rms_norm_eps)
        q = (h @ self.w(p + "attn.wq.weight").T).view(B, T, H, C + R)
        q = torch.cat([q[..., :C], rope(q[..., C:], model_cfg.rope_theta)], -1)
        kv = h @ self.w(p + "attn.wkv.weight").T
        kv = torch.cat([rms_norm(kv[..., :C], self.w(p + "attn.kv_norm.weight"), model_cfg.rms_norm_eps),
                        rope(kv[..., C:], model_cfg.rope_theta)], -1)  # [B, T, C+R]
        scores = torch.einsum("bthd,bsd->bhts", q, kv) * model_cfg.softmax_scale
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        index_scores = self._indexer(layer, h.detach())  # [B, T, T]
        if sparse:
            mask = selection(index_scores.detach(), model_cfg.sliding_window, model_cfg.index_topk)
        else:
            mask = causal.expand(B, T, T)
        probs = torch.softmax(scores.masked_fill(~mask[:, None], float("-inf")), dim=-1)
        out = torch.einsum("bhts,bsc->bthc", probs, kv[..., :C]).reshape(B, T, H * C)

        # Indexer distillation: match the dense attention distribution (mean over heads).
        with torch.no_grad():
            target = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1).mean(1)
        log_q = torch.log_softmax(index_scores.masked_fill(~causal, float("-inf")), dim=-1)
        kl_rows = (target * (torch.log(target.clamp_min(1e-12)) - log_q)).masked_fill(~causal, 0).sum(-1)
        kl = (kl_rows * valid).sum() / valid.sum().clamp_min(1)
        return out @ self.w(p + "attn.wo.weight").T, kl

    def _indexer(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        model_cfg, p = self.model_cfg, f"layers.{layer}.indexer."
        B, T, _ = h.shape
        HI, DI, R = model_cfg.index_heads, model_cfg.index_dim, model_cfg.rope_dim
        q = (h @ self.w(p + "wq.weight").T).view(B, T, HI, DI)
        q = torch.cat([q[..., :DI - R], rope(q[..., DI - R:], model_cfg.rope_theta)], -1)
        k = h @ self.w(p + "wk.weight").T
        k = torch.cat([k[..., :DI - R], rope(k[..., DI - R:], model_cfg.rope_theta)], -1)
        head_w = (h @ self.w(p + "weights_proj.weight").T) * (HI * DI) ** -0.5  # [B, T, HI]
        per_head = torch.relu(torch.einsum("bthd,bsd->bths", q, k))
        return (per_head * head_w[..., None]).sum(2)

    def _moe(self, layer: int, x: torch.Tensor, valid: torch.Tensor):
        model_cfg, p = self.model_cfg, f"layers.{layer}."
        B, T, D = x.shape
        h = rms_norm(x, self.w(p + "ffn_norm.weight"), model_cfg.rms_norm_eps).reshape(B * T, D)
        affinity = torch.sqrt(F.softplus(h @ self.w(p + "moe.gate.weight").T))  # [N, E]
        choice = (affinity + self.w(p + "moe.gate.e_score_correction_bias")).detach()
        if model_cfg.n_group > 1:
            grouped = choice.view(B * T, model_cfg.n_group, -1)
            best_two = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            groups = torch.sort(best_two, dim=-1, descending=True, stable=True).indices[:, :model_cfg.topk_group]
            allowed = torch.zeros_like(best_two, dtype=torch.bool).scatter_(1, groups, True)
            choice = choice.masked_fill(~allowed[:, :, None].expand_as(grouped).reshape_as(choice), float("-inf"))
        ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :model_cfg.num_experts_per_tok]
        weights = affinity.gather(1, ids)
        if model_cfg.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        combine = torch.zeros_like(affinity).scatter(1, ids, weights * model_cfg.routed_scaling_factor)  # [N, E]
        # Every expert on every token: at this size a dense einsum beats gathering token lists.
        gate = torch.einsum("nd,eid->nei", h, self.w(p + "moe.experts.w_gate"))
        up = torch.einsum("nd,eid->nei", h, self.w(p + "moe.experts.w_up"))
        expert_out = torch.einsum("nei,edi->ned", F.silu(gate) * up, self.w(p + "moe.experts.w_down"))
        out = torch.einsum("ne,ned->nd", combine, expert_out)
        if model_cfg.n_shared_experts:
            shared = F.silu(h @ self.w(p + "moe.shared.w_gate").T) * (h @ self.w(p + "moe.shared.w_up").T)
            out = out + shared @ self.w(p + "moe.shared.w_down").T
        load = torch.zeros(model_cfg.n_routed_experts, device=x.device).index_add_(
            0, ids.flatten(), valid.reshape(-1, 1).expand_as(ids).flatten().float())
        return out.view(B, T, D), load
