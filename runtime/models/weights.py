"""The weight layout of dsv4-mini (tensor names and shapes) and seeded random initialisation.

Names follow an nn.Linear-like [out, in] layout so a safetensors file reads like an HF checkpoint.
"""

from __future__ import annotations

import torch

from runtime.config import ModelConfig


def weight_shapes(model_cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    D, H, C, R = model_cfg.hidden_size, model_cfg.num_heads, model_cfg.kv_latent_dim, model_cfg.rope_dim
    E, I, IS = model_cfg.n_routed_experts, model_cfg.moe_intermediate_size, model_cfg.shared_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (model_cfg.vocab_size, D), "norm.weight": (D,)}
    if not model_cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (model_cfg.vocab_size, D)
    for i in range(model_cfg.num_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "attn_norm.weight": (D,),
            p + "attn.wq.weight": (H * (C + R), D),
            p + "attn.wkv.weight": (C + R, D),
            p + "attn.kv_norm.weight": (C,),
            p + "attn.wo.weight": (D, H * C),
            p + "indexer.wq.weight": (model_cfg.index_heads * model_cfg.index_dim, D),
            p + "indexer.wk.weight": (model_cfg.index_dim, D),
            p + "indexer.weights_proj.weight": (model_cfg.index_heads, D),
            p + "ffn_norm.weight": (D,),
            p + "moe.gate.weight": (E, D),
            p + "moe.gate.e_score_correction_bias": (E,),
            p + "moe.experts.w_gate": (E, I, D),
            p + "moe.experts.w_up": (E, I, D),
            p + "moe.experts.w_down": (E, D, I),
        })
        if model_cfg.n_shared_experts:
            shapes.update({
                p + "moe.shared.w_gate": (IS, D),
                p + "moe.shared.w_up": (IS, D),
                p + "moe.shared.w_down": (D, IS),
            })
    return shapes


def init_random(model_cfg: ModelConfig, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Seeded weights scaled so activations keep unit-ish variance and logits are not flat
    (a random model must still produce varied, seed-dependent tokens)."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in weight_shapes(model_cfg).items():
        if name.endswith("norm.weight"):
            tensor = 1.0 + 0.1 * torch.randn(shape, generator=gen, dtype=torch.float64)
        elif name.endswith("e_score_correction_bias"):
            tensor = 0.1 * torch.randn(shape, generator=gen, dtype=torch.float64)
        elif name == "embed.weight":
            tensor = torch.randn(shape, generator=gen, dtype=torch.float64)
        else:
            fan_in = shape[-1]
            tensor = torch.randn(shape, generator=gen, dtype=torch.float64) / fan_in ** 0.5
        weights[name] = tensor.to(dtype)
    if "lm_head.weight" in weights:
        weights["lm_head.weight"] = weights["lm_head.weight"] * 3.0
    return weights


def check_weights(model_cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    expected = weight_shapes(model_cfg)
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, checkpoint has {tuple(weights[name].shape)}")
