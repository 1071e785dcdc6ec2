"""Repository layout: top-level packages resolve here, and the layering holds.

Layering `moe_kernels -> comm -> eplb -> moe_runtime -> launch`: a package may import only those to
its left. Only `launch/` and the driver's Ray executor (with its connect_ray) import ray; only
`launch/` reads environment variables and command-line flags (argparse, sys.argv). Inside
moe_runtime, the engine reaches the worker only through the wire format and the executors, the
worker never imports the engine, and no modules import each other in a cycle.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ["moe_kernels", "comm", "eplb", "moe_runtime", "launch"]
EXECUTORS = ROOT / "moe_runtime" / "executor"
RAY_DRIVER = {EXECUTORS / f"{name}.py" for name in ("ray_executor", "ray_connect", "ray_placement")}


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
    """Whether the file reads os.environ / os.getenv, sys.argv or imports argparse."""
    if "argparse" in _imports(path):
        return True
    read = {"os": ("environ", "getenv"), "sys": ("argv", "orig_argv")}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.attr in read.get(node.value.id, ()):
                return True
    return False


@pytest.mark.parametrize("package", LAYERS)
def test_layering(package):
    allowed = set(LAYERS[: LAYERS.index(package) + 1])
    for path in sorted((ROOT / package).rglob("*.py")):
        wrong = (_imports(path) & set(LAYERS)) - allowed
        assert not wrong, f"{path.relative_to(ROOT)} imports {sorted(wrong)} (a higher layer)"
        if package != "launch" and path not in RAY_DRIVER:
            assert "ray" not in _imports(path), f"{path.relative_to(ROOT)} imports ray"
        if package != "launch":
            assert not _reads_environment(path), (
                f"{path.relative_to(ROOT)} reads the environment or command-line flags"
            )


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports() -> dict[str, set[str]]:
    """moe_runtime module -> the moe_runtime modules it imports (anywhere in the file)."""
    graph = {}
    for path in sorted((ROOT / "moe_runtime").rglob("*.py")):
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.add(node.module)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[_module_name(path)] = {t for t in targets if t.startswith("moe_runtime")}
    return graph


def test_engine_reaches_the_worker_only_through_the_wire_format():
    for module, targets in _runtime_imports().items():
        if module.startswith("moe_runtime.engine"):
            wrong = {
                t
                for t in targets
                if t.startswith("moe_runtime.worker") and t != "moe_runtime.worker.step_input"
            }
            assert not wrong, f"{module} imports worker internals {sorted(wrong)}"


def test_worker_never_imports_the_engine():
    for module, targets in _runtime_imports().items():
        if module.startswith("moe_runtime.worker") or module.startswith("moe_runtime.model"):
            wrong = {
                t
                for t in targets
                if t.startswith(("moe_runtime.engine", "moe_runtime.executor", "moe_runtime.llm"))
            }
            assert not wrong, f"{module} imports the driver side {sorted(wrong)}"


def test_no_import_cycles():
    graph = _runtime_imports()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = path[path.index(module) :] + [module]
            raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
        if module in done or module not in graph:
            return
        for target in sorted(graph[module]):
            visit(target, path + [module])
        done.add(module)

    for module in graph:
        visit(module, [])
