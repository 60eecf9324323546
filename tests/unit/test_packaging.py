"""What a wheel of this project carries besides Python: every non-Python file under the packages (the MoE launch
tables, the chat template) must be listed in pyproject.toml's [tool.setuptools.package-data], or a `pip install`
of the runtime silently serves without it (the editable install the tests use reads the tree, so nothing else
would notice). Checked against the configuration rather than by building a wheel: no build backend needed."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("runtime", "canary")


def unlisted(root: Path, package_data: dict[str, list[str]]) -> list[str]:
    """Non-Python files under the packages of `root` that no package-data pattern of an enclosing package covers."""
    missing = []
    for top in PACKAGES:
        for path in sorted((root / top).rglob("*")):
            if not path.is_file() or path.suffix in (".py", ".pyc") or "__pycache__" in path.parts:
                continue
            rel = path.relative_to(root)
            covered = False
            for depth in range(1, len(rel.parts)):
                package, inside = ".".join(rel.parts[:depth]), "/".join(rel.parts[depth:])
                covered |= any(fnmatch.fnmatch(inside, pattern) for pattern in package_data.get(package, ()))
            if not covered:
                missing.append(str(rel))
    return missing


def package_data() -> dict[str, list[str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return config["tool"]["setuptools"].get("package-data", {})


def test_every_data_file_of_the_packages_goes_into_the_wheel():
    assert unlisted(ROOT, package_data()) == []


def test_an_unlisted_data_file_is_named(tmp_path):
    """Negative control: the tables listed, a template left out (as before this test), found by its path."""
    (tmp_path / "runtime" / "chat_templates").mkdir(parents=True)
    (tmp_path / "runtime" / "chat_templates" / "t.jinja").write_text("{{ x }}")
    (tmp_path / "runtime" / "kernels" / "triton" / "configs").mkdir(parents=True)
    (tmp_path / "runtime" / "kernels" / "triton" / "configs" / "a.json").write_text("{}")
    (tmp_path / "runtime" / "engine.py").write_text("")
    (tmp_path / "canary").mkdir()
    listed = {"runtime.kernels.triton": ["configs/*.json"]}
    assert unlisted(tmp_path, listed) == ["runtime/chat_templates/t.jinja"]
    assert unlisted(tmp_path, {**listed, "runtime": ["chat_templates/*.jinja"]}) == []
