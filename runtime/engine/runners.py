"""`build_runner`: the one place that decides which model runner executes a config's steps, for rank 0
(`Engine`) and the tensor-parallel workers alike."""

from __future__ import annotations

from collections.abc import Callable

import torch

from runtime.config import DTYPES, EngineConfig, ModelConfig
from runtime.engine.future import FutureTokens
from runtime.engine.model_runner import ModelRunner
from runtime.engine.static_runner import StaticModelRunner
from runtime.env import Env
from runtime.faults import FaultSet
from runtime.kernels import select_kernels
from runtime.kvcache.kv_cache import KVCache
from runtime.models.dsv4_mini import DSV4Mini
from runtime.streams.tasks import InOrderExecutor, StreamExecutor


def build_runner(model_cfg: ModelConfig, weights: dict[str, torch.Tensor], cfg: EngineConfig, pool, faults: FaultSet,
                 env: Env, *, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 streams: StreamExecutor | None = None, overlap: bool = False) -> ModelRunner | StaticModelRunner:
    """The static runner (capturable decode model; GPU, or forced on CPU) or the eager CPU runner.
    `weights` are already on `cfg.device` in `cfg.dtype` (and sharded, with `all_reduce`, under TP);
    `streams` applies to the eager runner (the static one picks its own from the config).
    `overlap` gives the runner the overlap loop's `FutureTokens` buffer, here and only here, so rank 0
    and the workers size and place it alike."""
    runner: StaticModelRunner | ModelRunner
    if cfg.static_runner:
        runner = StaticModelRunner(model_cfg, weights, cfg, pool, faults, env, all_reduce=all_reduce)
    else:
        kernels = select_kernels(device=cfg.device, use_reference=env.reference_kernels)
        model = DSV4Mini(model_cfg, weights, kernels, all_reduce=all_reduce, faults=faults)
        runner = ModelRunner(model, KVCache(model_cfg, cfg, DTYPES[cfg.dtype]), pool, streams or InOrderExecutor(),
                             faults, max_pages=-(-cfg.max_model_len // cfg.page_size),
                             max_rows=cfg.max_running_requests)
    if overlap:
        runner.future = FutureTokens(2 * cfg.max_running_requests, device=cfg.device)
    return runner
