"""The canary plugin's pytest11 entry point (pyproject.toml) names a real plugin module, under the
name the root conftest.py loads it by, so an installed checkout registers it once and early."""

from __future__ import annotations

import ast
import importlib
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.unit


def entry_points() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["entry-points"]["pytest11"]


def conftest_plugins() -> list[str]:
    tree = ast.parse((ROOT / "conftest.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytest_plugins" for t in node.targets):
            return ast.literal_eval(node.value)
    return []


def test_the_entry_point_names_an_importable_plugin_module():
    (name, target), = entry_points().items()
    module = importlib.import_module(target)
    assert callable(getattr(module, "pytest_addoption", None)), f"{target} defines no pytest_addoption"


def test_the_root_conftest_loads_the_plugin_under_the_entry_point_name():
    # pytest skips a `pytest_plugins` name that is already registered: with any other entry point
    # name, an installed checkout would register the module twice and fail at startup.
    (name, target), = entry_points().items()
    assert name == target
    assert conftest_plugins() in ([], [name])
