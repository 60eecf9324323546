"""docs/architecture.md stays a complete map: every Python module under runtime/, canary/ and bench/
(package `__init__.py` files included: each package has its own bullet) is named by exactly one bullet
`` - `path/to/module.py`: what it owns ``, and every such bullet names a module that exists.

Read from the file tree and the doc's text only; no module is imported.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("runtime", "canary", "bench")

pytestmark = pytest.mark.unit

# A bullet: "- `runtime/engine/plan.py`: ..." (any indentation; the path in backticks, then a colon).
ROOTS = "|".join(PACKAGES)
BULLET = re.compile(rf"^\s*[-*] `(?P<path>(?:{ROOTS})/[^`\s]+\.py)`:", re.MULTILINE)


def modules(root: Path = ROOT) -> set[str]:
    """Every *.py under the packages, as a repository-relative posix path."""
    found = set()
    for pkg in PACKAGES:
        for path in (root / pkg).rglob("*.py"):
            rel = path.relative_to(root)
            if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
                continue
            found.add(rel.as_posix())
    return found


def bullet_paths(text: str) -> list[str]:
    return [m.group("path") for m in BULLET.finditer(text)]


def problems(text: str, existing: set[str]) -> list[str]:
    """One line per module without a bullet, bullet without a module, and module with several bullets."""
    listed = bullet_paths(text)
    out = [f"missing from docs/architecture.md: `{p}`" for p in sorted(existing - set(listed))]
    out += [f"stale bullet in docs/architecture.md (no such module): `{p}`" for p in sorted(set(listed) - existing)]
    out += [f"several bullets for `{p}`" for p in sorted({p for p in listed if listed.count(p) > 1})]
    return out


def test_every_module_has_exactly_one_bullet_and_every_bullet_a_module():
    found = problems(DOC.read_text(encoding="utf-8"), modules())
    assert not found, "\n".join(found)


def test_the_walk_sees_the_packages():
    # Guard against a check that passes because it looks at nothing.
    found = modules()
    for path in ("runtime/engine/engine.py", "canary/gate.py", "bench/kernels.py", "runtime/kernels/triton/moe.py",
                 "runtime/engine/__init__.py"):
        assert path in found
    assert len(bullet_paths(DOC.read_text(encoding="utf-8"))) == len(found)


def test_negative_controls():
    text = DOC.read_text(encoding="utf-8")
    existing = modules()
    victim = "runtime/engine/scheduler.py"
    line = next(ln for ln in text.splitlines(keepends=True) if ln.startswith(f"- `{victim}`:"))

    assert problems(text.replace(line, ""), existing) == [f"missing from docs/architecture.md: `{victim}`"]

    ghost = text + "- `runtime/train/dsml.py`: a module that does not exist.\n"
    assert problems(ghost, existing) == ["stale bullet in docs/architecture.md (no such module): "
                                         "`runtime/train/dsml.py`"]

    assert problems(text + line, existing) == [f"several bullets for `{victim}`"]

    # A new module on disk without a bullet is reported too.
    assert problems(text, existing | {"canary/new_module.py"}) == [
        "missing from docs/architecture.md: `canary/new_module.py`"]

    # A path merely mentioned in prose is not a bullet.
    assert victim not in bullet_paths(f"The scheduler (`{victim}`) plans.\n")
