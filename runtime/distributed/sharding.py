"""Column/row-parallel shards of the dsv4-mini weights for one rank.

Attention: wq is column-parallel over query heads, wo row-parallel over the same heads, so each
rank's attention output is a partial sum (all-reduced by the model). The latent KV projection,
the indexer and the router are small and replicated: every rank writes the same latent cache.
MoE: every expert's intermediate dimension is split (w_gate/w_up by rows, w_down by columns), and
the shared expert likewise, so the routed + shared output is one partial sum per rank.
"""

from __future__ import annotations

import torch

from runtime.config import ModelConfig


def check_divisible(model_cfg: ModelConfig, world: int) -> None:
    for name, value in (("num_heads", model_cfg.num_heads), ("moe_intermediate_size", model_cfg.moe_intermediate_size),
                        ("shared_intermediate_size", model_cfg.shared_intermediate_size)):
        if value % world:
            raise ValueError(f"tensor parallel size {world} does not divide ModelConfig.{name} ({value})")


def shard_weights(model_cfg: ModelConfig, weights: dict[str, torch.Tensor], rank: int,
                  world: int) -> dict[str, torch.Tensor]:
    check_divisible(model_cfg, world)
    H, C, R, D = model_cfg.num_heads, model_cfg.kv_latent_dim, model_cfg.rope_dim, model_cfg.hidden_size
    heads = slice(rank * H // world, (rank + 1) * H // world)

    def part(size: int) -> slice:
        return slice(rank * size // world, (rank + 1) * size // world)

    routed, shared = part(model_cfg.moe_intermediate_size), part(model_cfg.shared_intermediate_size)
    out = {}
    for name, t in weights.items():
        if name.endswith("attn.wq.weight"):  # [H*(C+R), D]
            t = t.view(H, C + R, D)[heads].reshape(-1, D)
        elif name.endswith("attn.wo.weight"):  # [D, H*C]
            t = t.view(D, H, C)[:, heads].reshape(D, -1)
        elif name.endswith(("moe.experts.w_gate", "moe.experts.w_up")):  # [E, I, D]
            t = t[:, routed]
        elif name.endswith("moe.experts.w_down"):  # [E, D, I]
            t = t[:, :, routed]
        elif name.endswith(("moe.shared.w_gate", "moe.shared.w_up")):  # [IS, D]
            t = t[shared]
        elif name.endswith("moe.shared.w_down"):  # [D, IS]
            t = t[:, shared]
        out[name] = t.contiguous()
    return out
