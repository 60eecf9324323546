"""The canary pytest plugin: one option group, marker behaviour, session state on `config`.

Heavy imports (torch, the runtime) stay inside hooks and fixtures so `pytest --help` is fast.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("canary", "DSV4 canary suite")
    group.addoption("--run-gpu", action="store_true", default=False,
                    help="fail (instead of skip) gpu-marked tests when no CUDA device is present")
    group.addoption("--run-slow", action="store_true", default=False,
                    help="run slow-marked tests (also selected by -m slow)")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Long runs (soak, full fault matrix) stay out of `make test` unless asked for explicitly.
    if not config.getoption("--run-slow") and "slow" not in (config.getoption("markexpr") or ""):
        skip_slow = pytest.mark.skip(reason="slow: run with -m slow or --run-slow")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip_slow)
    if config.getoption("--run-gpu") or _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run on the device machine: scripts/gpu_suite.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
