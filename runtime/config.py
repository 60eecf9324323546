"""Frozen configs: the model's architecture (`ModelConfig`) and the engine's limits (`EngineConfig`).

Both validate themselves in __post_init__, so a bad config.json or CLI flag fails at load time
with a message naming the field, not deep inside a forward pass.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from functools import cached_property
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 320
    hidden_size: int = 64
    num_layers: int = 2
    # Attention: MQA over one latent vector per token (DSV4), RoPE on a separate slice.
    num_heads: int = 4
    kv_latent_dim: int = 32
    rope_dim: int = 16
    rope_theta: float = 10000.0
    # Lightning indexer: H_I query heads against one index key per token.
    index_heads: int = 2
    index_dim: int = 16
    index_topk: int = 8
    sliding_window: int = 8
    # MoE: routed experts with sqrtsoftplus + noaux_tc selection, plus shared experts.
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    moe_intermediate_size: int = 32
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.5
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int = 256
    eos_token_id: int = 257
    pad_token_id: int = 258
    model_type: str = "dsv4-mini"

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "kv_latent_dim", "index_heads",
                    "index_dim", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group",
                    "topk_group", "max_position_embeddings")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.rope_dim <= 0 or self.rope_dim % 2:
            raise ValueError(f"ModelConfig.rope_dim must be a positive even number, got {self.rope_dim}")
        if self.index_dim < self.rope_dim:
            raise ValueError("ModelConfig.index_dim must be >= rope_dim (the indexer ropes a slice of its keys)")
        if self.sliding_window < 1 or self.index_topk < 0:
            raise ValueError("ModelConfig.sliding_window must be >= 1 and index_topk >= 0")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError("ModelConfig.num_experts_per_tok must be <= n_routed_experts")
        if self.n_routed_experts % self.n_group:
            raise ValueError("ModelConfig.n_routed_experts must be divisible by n_group")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError("ModelConfig.topk_group must be in [1, n_group]")
        if self.topk_group * (self.n_routed_experts // self.n_group) < self.num_experts_per_tok:
            raise ValueError("ModelConfig: topk_group groups hold fewer experts than num_experts_per_tok")
        if self.n_shared_experts < 0:
            raise ValueError("ModelConfig.n_shared_experts must be >= 0")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ValueError(f"ModelConfig.{name} must lie in [0, vocab_size)")

    @cached_property
    def qk_head_dim(self) -> int:
        """A query head scores against [latent | rope key], so its width is their sum."""
        return self.kv_latent_dim + self.rope_dim

    @cached_property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5

    @cached_property
    def selected_tokens(self) -> int:
        """Most earlier tokens one query attends to: the window plus the indexer's top-k."""
        return self.sliding_window + self.index_topk

    @cached_property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - {"architectures", "torch_dtype", "transformers_version"})
        if unknown:
            raise ValueError(f"unknown keys in model config: {unknown}")
        return cls(**{k: v for k, v in data.items() if k in known})

    @cached_property
    def fingerprint(self) -> str:
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


PRESETS: dict[str, ModelConfig] = {
    # Small enough for hypothesis-heavy CPU tests; window + topk = 16, so prompts of a few dozen
    # tokens already force the indexer to drop tokens.
    "tiny-random": ModelConfig(),
}

# The trained canary model (golden/models/, relative to the checkout): the only model with golden
# transcripts and perf baselines. The gate, the golden CLI, the fault matrix, tests and benches name it here.
DEFAULT_MODEL = "golden/models/canary-moe-v2"


def default_model() -> str:
    """The canary model where the checkout holds it, else the file-less preset."""
    return DEFAULT_MODEL if Path(DEFAULT_MODEL, "config.json").is_file() else "tiny-random"


# `EngineConfig.dtype` names -> the torch dtype weights and the KV cache are held in.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16
    num_pages: int = 512
    max_running_requests: int = 64
    # Upper bound on prompt tokens prefilled in one step (prompts are never split, so a prompt
    # longer than this is rejected at admission time rather than stalling the queue).
    max_prefill_tokens: int = 4096
    max_model_len: int = 4096
    # Static runner: prompt rows per eager pass (the prefill chunk). A step's prompt rows of all its
    # requests run in passes of at most this many rows, in order, so a prompt that spans passes reads
    # its prefix from the paged cache. Bits do not depend on it (every op is batch-invariant).
    prefill_chunk: int = 4096
    dtype: str = "float32"
    device: str = "cpu"
    # GPU only (runtime/engine/static_runner.py): decode steps replay CUDA graphs, and the indexer runs
    # on a side stream. Both on by default; off only to compare against or to bisect.
    cuda_graphs: bool = True
    multi_stream: bool = True
    # Which model runner executes steps: "eager" (models/dsv4_mini.py, the CPU fast path), "static"
    # (graph/decode_model.py: one row per token, capturable; what the GPU runs), or "auto" =
    # static on cuda, eager on cpu. Forcing "static" on CPU lets CI test the GPU runner's logic.
    runner: str = "auto"
    # Static runner: "triton" (runtime/kernels/triton/moe.py) or "torch" (gathered-expert torch ops,
    # the readable reference path); "auto" = triton on cuda, torch on cpu (where Triton only runs
    # under its slow interpreter).
    moe_kernel: str = "auto"
    # Static runner: "triton" (runtime/kernels/triton/indexer.py's paged indexer logits and
    # attention.py's split sparse MLA decode) or "torch" (gather + bmm); "auto" as for moe_kernel.
    # Each kernel choice is a different numerics, so a golden store belongs to one combination
    # (EngineConfig is in its fingerprint).
    attention_kernel: str = "auto"
    # Prefix cache (runtime/kvcache/prefix_cache.py): allowed where hits are proven exact (the eager
    # runner with the fast CPU kernels, the GPU runner with the Triton kernels; no TP; not a PD decode
    # server: `Engine.prefix_cache_refusal`). None = on where allowed on the CPU, where it pays; off on
    # a GPU unless True (measured slower there on the canary: `Engine.use_prefix_cache`). True where it
    # is not allowed is refused.
    prefix_cache: bool | None = None

    def __post_init__(self) -> None:
        for name in ("page_size", "num_pages", "max_running_requests", "max_prefill_tokens", "max_model_len",
                     "prefill_chunk"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EngineConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        for name in ("moe_kernel", "attention_kernel"):
            if getattr(self, name) not in ("auto", "torch", "triton"):
                raise ValueError(f"EngineConfig.{name} must be auto, torch or triton, got {getattr(self, name)!r}")
            if getattr(self, name) == "auto":  # resolved here, so fingerprints and golden paths name the choice
                object.__setattr__(self, name, "torch" if self.device == "cpu" else "triton")
        if self.runner not in ("auto", "eager", "static"):
            raise ValueError(f"EngineConfig.runner must be auto, eager or static, got {self.runner!r}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"EngineConfig.device must be cpu or cuda[:N], got {self.device!r}")

    @property
    def static_runner(self) -> bool:
        return self.runner == "static" or (self.runner == "auto" and self.device != "cpu")

    @cached_property
    def num_slots(self) -> int:
        return self.page_size * self.num_pages
