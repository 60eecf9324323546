"""Seeded prompts for offline runs: the generate CLI, the golden scenarios, the engine gates and
the engine tests all draw the same mixed-length workload from here."""

from __future__ import annotations

import random

from runtime.config import ModelConfig


def draw_prompts(model_cfg: ModelConfig, num: int, seed: int, token_limit: int = 256) -> list[list[int]]:
    """Mixed lengths from 1 token to four times `window + topk`, so both the dense-everything
    regime (short contexts) and the sparse regime (tokens dropped) are covered."""
    rng = random.Random(seed)
    longest = max(2, 4 * model_cfg.selected_tokens)
    vocab = min(token_limit, model_cfg.vocab_size)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, longest))] for _ in range(num)]
