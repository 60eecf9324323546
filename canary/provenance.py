"""Where a result came from: commit, versions, device, config and model fingerprints."""

from __future__ import annotations

import hashlib
import json
import platform
import subprocess
from pathlib import Path


def git_commit(cwd: Path | None = None) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True,
                             timeout=10)
        commit = out.stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu:{platform.processor() or platform.machine()}x{torch.get_num_threads()}"


def gpu_identity() -> str | None:
    """The GPU this process computes on, by name and UUID (one physical GPU, so one host), or None on a
    machine without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return f"{props.name} {getattr(props, 'uuid', 'without a UUID')}"


def versions() -> dict[str, str]:
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__}


def fingerprint(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
