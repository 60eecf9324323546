"""The canary pytest plugin: one option group, marker behaviour, session state on `config`.

Heavy imports (torch, the runtime) stay inside hooks and fixtures so `pytest --help` is fast.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("canary", "DSV4 canary suite")
    group.addoption("--run-gpu", action="store_true", default=False,
                    help="fail (instead of skip) gpu-marked tests when no CUDA device is present")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-gpu") or _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run on the device machine: scripts/gpu_suite.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
