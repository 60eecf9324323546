"""The import rules of the house, read from the source (ast: module-level and function-level
imports, TYPE_CHECKING ones included, since a loop through them is still a loop in the design):

- no import cycle within runtime/ or within canary/;
- runtime/ never imports canary/ or bench/ (the harness sits above the runtime, never below);
- no non-CLI module imports a CLI module (`__main__`, `*_cli`, `serve`, `generate`, the `cli/`
  wing): constants and helpers that others need belong in a lower room;
- the PD router, an HTTP proxy, never loads torch (it did, through the PD protocol module, and took
  3.8 s to import on the CPU host instead of 0.6 s).
Package `__init__` files are not nodes: importing `a.b` does not make `a/__init__` a dependency here.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("runtime", "canary", "bench")

pytestmark = pytest.mark.unit


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imported(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Project modules that `path` (module `name`) imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            # `import a.b.c` depends on the deepest project module it names.
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and modules[target].name != "__init__.py":
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imported(path, name, modules) for name, path in modules.items() if path.name != "__init__.py"}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def is_cli(name: str) -> bool:
    parts = name.split(".")
    # bisect_step is what `git bisect run` executes (python -m canary.bisect_step): a command line too.
    return parts[-1] in ("__main__", "serve", "generate", "bisect_step") or parts[-1].endswith("_cli") \
        or "cli" in parts[1:-1]


@pytest.mark.parametrize("package", ["runtime", "canary"])
def test_no_import_cycle_within(package):
    inside = {m: {d for d in deps if d.startswith(package + ".")} for m, deps in graph().items()
              if m.startswith(package + ".")}
    assert cycles(inside) == []


def test_runtime_imports_neither_the_harness_nor_the_benches():
    upward = [(m, d) for m, deps in graph().items() if m.startswith("runtime.")
              for d in sorted(deps) if d.split(".")[0] in ("canary", "bench")]
    assert upward == []


def test_no_module_but_a_cli_imports_a_cli():
    bad = [(m, d) for m, deps in graph().items() if not is_cli(m) for d in sorted(deps) if is_cli(d)]
    assert bad == []


def test_the_walker_sees_function_level_and_relative_imports(tmp_path):
    # A planted module: its lazy import must count, or the rules above would miss half the edges.
    modules = {"canary.a": tmp_path / "a.py", "canary.golden_cli": tmp_path / "golden_cli.py"}
    modules["canary.a"].write_text("def f():\n    from .golden_cli import X\n")
    assert imported(modules["canary.a"], "canary.a", modules) == {"canary.golden_cli"}
    assert cycles({"x": {"y"}, "y": {"x"}, "z": {"x"}}) == [["x", "y"]]


def loads_torch(module: str) -> bool:
    code = f"import sys, {module}; sys.exit(3 if 'torch' in sys.modules else 0)"
    rc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, timeout=120).returncode
    assert rc in (0, 3), f"importing {module} failed (rc {rc})"
    return rc == 3


def test_the_router_does_not_load_torch():
    assert not loads_torch("runtime.router")


def test_control_a_module_that_loads_torch_is_seen():
    assert loads_torch("runtime.disagg.bootstrap")
