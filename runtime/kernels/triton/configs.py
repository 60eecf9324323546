"""Tuned launch configs, stored as JSON files keyed like SGLang's (`E=..,N=..,device_name=...json`).

A file maps a batch-size bucket ("1", "2", ... tokens) to Triton launch parameters; a batch uses
the smallest bucket >= its size (the largest bucket past the end). Only parameters that leave a
row's reduction order unchanged may vary between buckets (see moe.py), so buckets never break
batch invariance.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs"


def device_name() -> str:
    if not torch.cuda.is_available():
        return "interpreter"
    return torch.cuda.get_device_name().replace(" ", "_")


def config_file_name(kind: str, num_experts: int, shard: int, dtype: str) -> str:
    return f"{kind},E={num_experts},N={shard},device_name={device_name()},dtype={dtype}.json"


@functools.lru_cache(maxsize=64)
def load_table(name: str) -> dict[int, dict]:
    path = CONFIG_DIR / name
    if not path.exists():
        return {}
    return {int(k): v for k, v in json.loads(path.read_text()).items()}


def pick(table: dict[int, dict], tokens: int) -> dict | None:
    if not table:
        return None
    buckets = sorted(table)
    for bucket in buckets:
        if tokens <= bucket:
            return table[bucket]
    return table[buckets[-1]]
