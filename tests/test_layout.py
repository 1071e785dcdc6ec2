"""Repository layout: top-level packages resolve here, and the layering holds.

Layering `kernels -> comm -> eplb -> moe_runtime -> launch`: a package may import only those to
its left. Only `launch/` and the driver's Ray executor import ray; only `launch/` reads environment
variables.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ["kernels", "comm", "eplb", "moe_runtime", "launch"]
RAY_DRIVER = ROOT / "moe_runtime" / "ray_executor.py"


@pytest.mark.parametrize("package", LAYERS)
def test_package_resolves_inside_this_repo(package):
    module = importlib.import_module(package)
    assert Path(module.__file__).resolve().parent == ROOT / package


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _reads_environment(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
            if isinstance(node.value, ast.Name) and node.value.id == "os":
                return True
    return False


@pytest.mark.parametrize("package", LAYERS)
def test_layering(package):
    allowed = set(LAYERS[: LAYERS.index(package) + 1])
    for path in sorted((ROOT / package).rglob("*.py")):
        wrong = (_imports(path) & set(LAYERS)) - allowed
        assert not wrong, f"{path.relative_to(ROOT)} imports {sorted(wrong)} (a higher layer)"
        if package != "launch" and path != RAY_DRIVER:
            assert "ray" not in _imports(path), f"{path.relative_to(ROOT)} imports ray"
        if package != "launch":
            assert not _reads_environment(path), f"{path.relative_to(ROOT)} reads the environment"
