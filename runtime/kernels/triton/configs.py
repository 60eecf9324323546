"""Tuned launch configs, stored as JSON files keyed like SGLang's (`E=..,N=..,device_name=...json`).

A file maps a batch-size bucket ("1", "2", ... tokens) to Triton launch parameters; a batch uses
the smallest bucket >= its size (the largest bucket past the end). Only parameters that leave a
row's reduction order unchanged may vary between buckets (see moe.py), so buckets never break
batch invariance.

A tune (`python -m bench.kernels --only moe --tune-out tuned.json`, on the GPU the tables are for) is
installed into the committed tables by

    python -m runtime.kernels.triton.configs install tuned.json [--borrow-from DEVICE] [--dir DIR]

which checks every tuned launch, keeps an existing file's buckets above the tune's largest (the prefill
buckets a decode tune does not time), borrows those from DEVICE's file of the same kernel, shard and dtype
for a file that has none yet (`--borrow-from NVIDIA_H200`: said in what it prints, untimed here), and
prints each bucket it changed.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
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
    if 1 not in table:  # a table's rule, not only an install's: a hand-edited file is refused on load as well
        raise ConfigError(f"{name}: no bucket 1 (it has {sorted(table)}): one-token batches would take the next "
                          "bucket's launch; a tune covers batches from 1 up (`bench.kernels --tune-out`)")
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


def _device_of(name: str) -> str:
    found = re.search(r",device_name=([^,]+),", name)
    if found is None:
        raise ConfigError(f"{name}: no device_name in the file name")
    return found.group(1)


def merge_tuned(name: str, tuned: dict[int, dict], directory: Path, borrow_from: str | None = None
                ) -> tuple[dict[int, dict], list[str]]:
    """File `name`'s table after installing `tuned` (checked buckets): the tuned buckets, then the buckets above the
    largest tuned one from the file as it is, or, when there is no such file, from `borrow_from`'s file of the same
    kernel, shard and dtype. Returns the table and one line per bucket that changed, was borrowed or was dropped (a
    bucket of the file below the tune's largest that the tune did not time: a tune covers its range whole, from
    bucket 1, which `check_table` requires, so a few buckets picked out of a run are refused, not merged)."""
    existing, source = {}, "kept"
    path = directory / name
    if path.exists():
        existing = check_table(name, json.loads(path.read_text()))
    elif borrow_from is not None:
        other = name.replace(f",device_name={_device_of(name)},", f",device_name={borrow_from},")
        if (directory / other).exists():
            existing, source = check_table(other, json.loads((directory / other).read_text())), f"from {borrow_from}"
    table = dict(tuned)
    notes = []
    for bucket, launch in sorted(tuned.items()):
        before = existing.get(bucket)
        if before != launch:
            notes.append(f"  {bucket}: {json.dumps(before) if before else '(none)'} -> {json.dumps(launch)}")
    for bucket, launch in sorted(existing.items()):
        if bucket > max(tuned):
            table[bucket] = launch
            if source != "kept":
                notes.append(f"  {bucket}: {json.dumps(launch)} ({source}, not timed on this device)")
        elif bucket not in tuned and source == "kept":
            notes.append(f"  {bucket}: {json.dumps(launch)} -> dropped (below the tune's largest bucket, not timed)")
    return dict(sorted(table.items())), notes


def install(tuned_file: Path, directory: Path = CONFIG_DIR, borrow_from: str | None = None) -> list[str]:
    """Install `bench.kernels --tune-out`'s {file: {bucket: launch}} into `directory` (merge_tuned, file by file).
    Every file is checked before any is written: a bad launch changes nothing. Returns what it printed."""
    raw = json.loads(tuned_file.read_text())
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{tuned_file}: expected a non-empty {{file name: {{bucket: launch}}}} object")
    merged = {}
    for name, table in raw.items():
        if "/" in name or not name.endswith(".json"):
            raise ConfigError(f"{tuned_file}: {name!r} is not a config file name")
        merged[name] = merge_tuned(name, check_table(name, table), directory, borrow_from)
    lines = []
    for name, (table, notes) in merged.items():
        check_table(name, {str(k): v for k, v in table.items()})
        (directory / name).write_text(json.dumps({str(k): v for k, v in table.items()}, indent=1) + "\n")
        lines += [f"{name}: {len(notes)} bucket(s) changed" if notes else f"{name}: unchanged", *notes]
    load_table.cache_clear()
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.kernels.triton.configs",
                                     description="Install a tune into the launch tables (see the module doc).")
    sub = parser.add_subparsers(dest="command", required=True)
    put = sub.add_parser("install", help="merge `bench.kernels --tune-out` output into the tables")
    put.add_argument("tuned", type=Path)
    put.add_argument("--borrow-from", metavar="DEVICE", help="device_name whose larger buckets a new file takes")
    put.add_argument("--dir", type=Path, default=CONFIG_DIR, help="the tables' folder (default: the package's)")
    args = parser.parse_args(argv)
    if not args.tuned.is_file():
        parser.error(f"no such file: {args.tuned}")
    try:
        lines = install(args.tuned, args.dir, args.borrow_from)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
