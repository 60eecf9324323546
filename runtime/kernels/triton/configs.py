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


# The knobs a bucket may set, by kernel kind. None of them reaches a row's reduction order (moe.py: BLOCK_K is a
# constant, never tuned), which is what lets buckets differ without breaking batch invariance; a file that sets
# anything else is refused when it loads, not followed. "gate_up" and "down" are a bucket's own launches of the
# two GEMMs, each with its knobs.
KNOBS = {"fused_moe": {"BLOCK_M": int, "BLOCK_N": int, "num_warps": int, "num_stages": int,
                       "gate_up": {"FUSED_SPLITS": bool, "BLOCK_N": int, "num_warps": int, "num_stages": int},
                       "down": {"BLOCK_N": int, "N_TILES": int, "num_warps": int, "num_stages": int}}}
REQUIRED = {"fused_moe": ("BLOCK_N", "num_warps", "num_stages")}


class ConfigError(ValueError):
    """A tuned config file that is not a table of buckets of known knobs."""


def _check_launch(where: str, launch: object, knobs: dict) -> None:
    if not isinstance(launch, dict):
        raise ConfigError(f"{where}: a launch must be an object, not {launch!r}")
    for key, value in launch.items():
        kind = knobs.get(key)
        if kind is None:
            raise ConfigError(f"{where}: {key!r} is not a knob a bucket may set (allowed: {sorted(knobs)})")
        if isinstance(kind, dict):
            _check_launch(f"{where}.{key}", value, kind)
        elif kind is bool:
            if not isinstance(value, bool):
                raise ConfigError(f"{where}: {key} must be true or false, not {value!r}")
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1 or \
                (key != "num_stages" and value & (value - 1)):
            raise ConfigError(f"{where}: {key} must be a positive integer (a power of two but for num_stages), "
                              f"not {value!r}")


def check_table(name: str, raw: object) -> dict[int, dict]:
    """The file `name`'s parsed JSON as {bucket: launch}, or ConfigError saying what is wrong and where."""
    kind = name.split(",", 1)[0]
    if kind not in KNOBS:
        raise ConfigError(f"{name}: no knobs are known for kernel kind {kind!r}")
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{name}: must be a non-empty object of batch-size buckets")
    table = {}
    for bucket, launch in raw.items():
        if not (isinstance(bucket, str) and bucket.isdigit() and int(bucket) > 0):
            raise ConfigError(f"{name}: bucket {bucket!r} is not a positive token count")
        where = f"{name} bucket {bucket}"
        _check_launch(where, launch, KNOBS[kind])
        missing = [key for key in REQUIRED[kind] if key not in launch]
        if missing:
            raise ConfigError(f"{where}: missing {missing}")
        table[int(bucket)] = launch
    return table


@functools.lru_cache(maxsize=64)
def load_table(name: str) -> dict[int, dict]:
    path = CONFIG_DIR / name
    if not path.exists():
        return {}
    return check_table(name, json.loads(path.read_text()))


def pick(table: dict[int, dict], tokens: int) -> dict | None:
    if not table:
        return None
    buckets = sorted(table)
    for bucket in buckets:
        if tokens <= bucket:
            return table[bucket]
    return table[buckets[-1]]
