"""Per-layer KV storage addressed by slot (page * page_size + offset).

Each token stores one latent vector [C + R] (the latent plus its roped key, shared by every query
head) and one index key [DI] for the lightning indexer. Slot 0.. are owned through PagePool.
"""

from __future__ import annotations

import torch

from runtime.config import EngineConfig, ModelConfig


class KVCache:
    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig, dtype: torch.dtype) -> None:
        slots = cfg.num_slots
        self.latent = torch.empty(model_cfg.num_layers, slots, model_cfg.qk_head_dim, dtype=dtype, device=cfg.device)
        self.index_keys = torch.empty(model_cfg.num_layers, slots, model_cfg.index_dim, dtype=dtype, device=cfg.device)
        # Poison: a read of a never-written slot shows up as NaN instead of plausible numbers.
        self.latent.fill_(float("nan"))
        self.index_keys.fill_(float("nan"))

    def write(self, layer: int, slots: torch.Tensor, latent: torch.Tensor, index_keys: torch.Tensor) -> None:
        # slots: [T], latent: [T, C+R], index_keys: [T, DI]
        assert latent.shape[0] == slots.shape[0] == index_keys.shape[0], "one slot per token"
        self.latent[layer, slots] = latent
        self.index_keys[layer, slots] = index_keys

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.latent[layer, slots], self.index_keys[layer, slots]

    def copy_pages(self, copies: tuple[tuple[int, int], ...], page_size: int) -> None:
        """KV of each (source page, destination page) pair, every layer: a prefix-cache hit's pages."""
        # Slots built on the host and moved in one copy: per-page arithmetic on a GPU pool would be a
        # handful of tiny launches per page on the step's critical path. Pinned, so the copy does not
        # make the host wait for the GPU's queued work (the overlap loop plans ahead of it).
        slots = torch.tensor(copies, dtype=torch.long)[:, :, None] * page_size + torch.arange(page_size)
        if self.latent.device.type == "cuda":
            slots = slots.pin_memory().to(self.latent.device, non_blocking=True)
        src, dst = slots[:, 0].reshape(-1), slots[:, 1].reshape(-1)
        self.latent[:, dst] = self.latent[:, src]
        self.index_keys[:, dst] = self.index_keys[:, src]
