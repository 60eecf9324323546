"""Fixtures shared by every test folder, and the rule that a test's folder is its kind.

The folder under tests/ decides the kind marker (unit, kernels, gpu, e2e, stress), so selecting
by marker (`make test`, scripts/) and finding a test by folder give the same answer. A module
that marks itself with another folder's kind is refused at collection: move the file instead.
`gpu` is also a requirement marker (skipped without CUDA), so a single kernels or e2e case may
carry it beside its folder's kind.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).parent
KINDS = ("unit", "kernels", "gpu", "e2e", "stress")


def folder_kind(path: Path) -> str | None:
    try:
        top = Path(path).resolve().relative_to(TESTS.resolve()).parts[0]
    except (ValueError, IndexError):
        return None
    return top if top in KINDS else None


# tryfirst: the markers must be on the items before `-m` deselects and before the canary plugin
# skips gpu-marked tests.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        kind = folder_kind(item.path)
        if kind is None:
            continue
        others = {m.name for m in item.iter_markers() if m.name in KINDS} - {kind, "gpu"}
        if others:
            raise pytest.UsageError(f"{item.nodeid} is marked {sorted(others)} but lives in tests/{kind}/: "
                                    f"move it to the folder of its kind")
        item.add_marker(kind)


@pytest.fixture(scope="module")
def tiny():
    """The tiny-random model (random weights, loads in well under a second); one per module so
    no test sees another module's use of it."""
    from runtime.models.loader import load_model

    return load_model("tiny-random")


@pytest.fixture(scope="session")
def canary_model() -> str:
    """Path of the trained canary model the gate serves by default."""
    from runtime.config import DEFAULT_MODEL

    return DEFAULT_MODEL


@pytest.fixture(scope="session")
def api_key() -> str:
    """Bearer token of the e2e `server` fixture."""
    from tests.utils import API_KEY

    return API_KEY
