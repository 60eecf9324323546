"""The training loop: dense warm-up, then sparse training, with the indexer distilled throughout.

Phases (by progress = max(step / steps, elapsed / time budget), so a wall-clock-limited GPU run
still completes its schedule):
- progress < dense_fraction: attention is dense (causal); the indexer learns from the KL towards
  the attention distribution, nothing depends on it yet;
- afterwards: attention over window U indexer top-k, exactly the served function; the indexer keeps
  distilling, now from a model that has learnt to rely on it.
The LM loss covers assistant tokens only. The routing bias follows noaux_tc's load rule.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from runtime.config import ModelConfig
from runtime.train.data import batches
from runtime.train.model import TrainModel, init_params


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 4000
    time_budget_s: float = 1e9
    batch_size: int = 64
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup_fraction: float = 0.03
    weight_decay: float = 0.05
    dense_fraction: float = 0.25
    kl_weight: float = 1.0
    bias_update: float = 1e-3
    grad_clip: float = 1.0
    seed: int = 0
    workers: int = 0
    log_every: int = 50
    device: str = "cpu"


def lr_at(progress: float, tc: TrainConfig) -> float:
    if progress < tc.warmup_fraction:
        return tc.lr * progress / tc.warmup_fraction
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - tc.warmup_fraction) / (1 - tc.warmup_fraction))))
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * cos)


def train(model_cfg: ModelConfig, tc: TrainConfig, tokenizer_path: str, pad_id: int,
          log_path: Path, init: dict[str, torch.Tensor] | None = None) -> tuple[dict, dict]:
    """Returns (weights in the inference layout, summary). init: start from these weights (a
    continued run: a fresh optimiser and LR schedule over the new budget) instead of random ones."""
    torch.manual_seed(tc.seed)
    if tc.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    model = TrainModel(model_cfg, init if init is not None else init_params(model_cfg, tc.seed)).to(tc.device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=tc.lr, betas=(0.9, 0.95))
    started = time.perf_counter()
    step, tokens, progress = 0, 0, 0.0
    history = []
    log = log_path.open("w")
    for batch in batches(tokenizer_path, tc.batch_size, pad_id, tc.seed, tc.workers):
        progress = max(step / tc.steps, (time.perf_counter() - started) / tc.time_budget_s)
        if progress >= 1.0:
            break
        batch = batch.to(tc.device)
        sparse = progress >= tc.dense_fraction
        for group in opt.param_groups:
            group["lr"] = lr_at(progress, tc)
        out = model(batch.ids, batch.valid, sparse=sparse)
        targets, mask = batch.ids[:, 1:], batch.loss_mask[:, 1:]
        logits = out.logits[:, :-1][mask]
        ce = F.cross_entropy(logits, targets[mask])
        loss = ce + tc.kl_weight * out.indexer_kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        with torch.no_grad():
            for layer, load in enumerate(out.expert_load):
                bias = getattr(model, f"bias{layer}")
                bias += tc.bias_update * torch.sign(load.mean() - load)
        step += 1
        tokens += int(batch.valid.sum())
        if step % tc.log_every == 0 or step == 1:
            with torch.no_grad():
                acc = (logits.argmax(-1) == targets[mask]).float().mean().item()
            row = {"step": step, "elapsed_s": round(time.perf_counter() - started, 1), "progress": round(progress, 4),
                   "sparse": sparse, "lr": opt.param_groups[0]["lr"], "ce": ce.item(),
                   "indexer_kl": out.indexer_kl.item(),
                   "assistant_token_acc": acc, "tokens": tokens}
            history.append(row)
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(json.dumps(row), flush=True)
    log.close()
    summary = {"steps": step, "tokens": tokens, "elapsed_s": round(time.perf_counter() - started, 1),
               "final": history[-1] if history else None, "train_config": asdict(tc)}
    return model.state(), summary
