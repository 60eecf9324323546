"""Where a result came from: commit, versions, device, config and model fingerprints."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path


def git_commit(cwd: Path | None = None) -> str:
    """HEAD's short hash, with "-dirty-tree<hash>" when the files differ from it: the tree of the files as
    they are (what `git rev-parse COMMIT^{tree}` gives for the commit that holds them). A copy whose .git
    is older than its files (the device machine's) then still says what ran."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True,
                             timeout=10)
        commit = out.stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        if not dirty:
            return commit
        tree = working_tree(cwd)
        return f"{commit}-dirty" + (f"-tree{tree[:7]}" if tree else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def working_tree(cwd: Path | None = None) -> str | None:
    """The git tree hash of the files as they are, untracked ones that git does not ignore included,
    through a temporary index (the repository's own index is left alone); None if git cannot say.
    scripts/gpu_suite.sh writes it into the device call's commit.txt."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        try:
            added = subprocess.run(["git", "add", "-A"], cwd=cwd, env=env, capture_output=True, timeout=60)
            tree = subprocess.run(["git", "write-tree"], cwd=cwd, env=env, capture_output=True, text=True,
                                  timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
    if added.returncode != 0 or tree.returncode != 0:
        return None
    return tree.stdout.strip() or None


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
