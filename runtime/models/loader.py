"""Load dsv4-mini HF-style from a directory (config.json, model.safetensors, tokenizer.json) or
from a named preset (seeded random weights, byte tokenizer, no files)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.config import PRESETS, ModelConfig
from runtime.models.weights import check_weights, init_random
from runtime.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

PRESET_SEED = 1234


@dataclass(frozen=True)
class LoadedModel:
    name: str
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    path: Path | None

    @property
    def weights_hash(self) -> str:
        digest = hashlib.sha256()
        for name in sorted(self.weights):
            digest.update(name.encode())
            digest.update(self.weights[name].contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()[:16]


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32) -> LoadedModel:
    if name_or_path in PRESETS:
        model_cfg = PRESETS[name_or_path]
        preset_tok = ByteTokenizer(model_cfg.vocab_size, model_cfg.bos_token_id, model_cfg.eos_token_id,
                            model_cfg.pad_token_id)
        return LoadedModel(name_or_path, model_cfg, init_random(model_cfg, PRESET_SEED, dtype), preset_tok, None)
    path = Path(name_or_path)
    if not path.is_dir():
        presets = ", ".join(sorted(PRESETS))
        raise FileNotFoundError(f"{name_or_path!r} is neither a model directory nor a preset ({presets})")
    from safetensors.torch import load_file

    for required in ("config.json", "model.safetensors"):
        if not (path / required).is_file():
            raise FileNotFoundError(f"model directory {path} has no {required}")
    model_cfg = ModelConfig.from_dict(json.loads((path / "config.json").read_text()))
    weights = {k: v.to(dtype) for k, v in load_file(str(path / "model.safetensors")).items()}
    check_weights(model_cfg, weights)
    if (path / "tokenizer.json").is_file():
        tok: Tokenizer = HFTokenizer(path / "tokenizer.json", model_cfg.bos_token_id, model_cfg.eos_token_id)
    else:
        tok = ByteTokenizer(model_cfg.vocab_size, model_cfg.bos_token_id, model_cfg.eos_token_id,
                            model_cfg.pad_token_id)
    if tok.vocab_size > model_cfg.vocab_size:
        raise ValueError(f"tokenizer has {tok.vocab_size} ids but the model only {model_cfg.vocab_size}")
    return LoadedModel(path.name, model_cfg, weights, tok, path)


def save_model(directory: Path, model_cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    check_weights(model_cfg, weights)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model_cfg.to_dict(), indent=2, sort_keys=True) + "\n")
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))
