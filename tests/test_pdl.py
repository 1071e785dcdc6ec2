"""Programmatic dependent launch (moe_kernels/triton_pdl.py), on the CPU.

- Every Triton kernel the ops launch with `pdl_launch` takes the PDL constexpr (off by
  default) and waits first (`pdl_start(PDL)` is its first statement): a kernel that read or
  wrote before the wait would race the kernel before it, on the GPU only. And every kernel
  that waits is launched with it.
- `pdl_launch` asks for PDL on CUDA devices that have it only (NVIDIA from sm90, never a
  ROCm build), and never when turned off.
- Compiled for sm_90, a kernel with PDL waits (griddepcontrol.wait) before its first global
  load and then lets the next kernel launch; without PDL it has neither instruction, and the
  launch carries Triton's launch_pdl only when asked.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from moe_kernels import triton_pdl

KERNELS = Path(__file__).resolve().parent.parent / "moe_kernels"


def _pdl_kernels() -> tuple[dict, set]:
    """({kernel name: its FunctionDef} of kernels launched with **pdl_launch(...), {names of
    functions whose body calls pdl_start}) over moe_kernels/*.py."""
    launched, waiting = {}, set()
    defs = {}
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                defs[node.name] = node
                calls = [n for n in ast.walk(node) if isinstance(n, ast.Call)]
                if any(getattr(c.func, "id", None) == "pdl_start" for c in calls):
                    waiting.add(node.name)
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Subscript)
                and any(
                    k.arg is None
                    and isinstance(k.value, ast.Call)
                    and getattr(k.value.func, "id", None) == "pdl_launch"
                    for k in node.keywords
                )
            ):
                launched[node.func.value.id] = None
    return {name: defs[name] for name in launched}, waiting


def test_every_pdl_launch_waits_first():
    launched, waiting = _pdl_kernels()
    assert len(launched) >= 20, sorted(launched)  # the ops' Triton kernels
    for name, fn in launched.items():
        params = fn.args.args + fn.args.kwonlyargs
        assert params[-1].arg == "PDL", f"{name}: PDL is not its last parameter"
        assert ast.unparse(params[-1].annotation) == "tl.constexpr", name
        assert ast.unparse(fn.args.defaults[-1]) == "False", f"{name}: PDL must default to off"
        first = fn.body[0]
        is_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
        body = fn.body[1:] if is_doc else fn.body
        assert ast.unparse(body[0]) == "pdl_start(PDL)", f"{name} does not wait first"
    assert waiting - {"pdl_start"} == set(launched), waiting ^ set(launched)


def test_pdl_launch_asks_only_where_the_gpu_has_it(monkeypatch):
    assert triton_pdl.pdl_launch(torch.device("cpu")) == {}
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(triton_pdl, "_has_pdl", lambda index: index == 0)
    assert triton_pdl.pdl_launch(cuda) == {"PDL": True, "launch_pdl": True}
    assert triton_pdl.pdl_launch(torch.device("cuda", 1)) == {}
    monkeypatch.setattr(triton_pdl, "ENABLED", False)
    assert triton_pdl.pdl_launch(cuda) == {}


def test_pdl_needs_an_nvidia_gpu_from_sm90(monkeypatch):
    has_pdl = triton_pdl._has_pdl.__wrapped__  # uncached
    for capability, expected in (((8, 0), False), ((9, 0), True), ((10, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        assert has_pdl(0) is expected, capability
    monkeypatch.setattr(torch.version, "hip", "6.4")  # a ROCm build: its capabilities differ
    assert has_pdl(0) is False


@pytest.mark.parametrize("is_pdl", [False, True])
def test_a_pdl_kernel_waits_before_its_first_load_sm90(is_pdl):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moe_kernels.triton_rmsnorm import _rms_norm_kernel

    signature = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "D": "i32", "eps": "fp32"}
    consts = {"BLOCK_D": 1024, "PDL": is_pdl}
    source = ASTSource(
        _rms_norm_kernel, {**signature, **dict.fromkeys(consts, "constexpr")}, consts
    )
    options = dict(num_warps=4, launch_pdl=is_pdl)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = compiled.asm["ptx"]
    assert compiled.metadata.launch_pdl is is_pdl
    if not is_pdl:
        assert "griddepcontrol" not in ptx
        return
    wait = ptx.index("griddepcontrol.wait")
    assert wait < ptx.index("ld.global"), "a load comes before the wait"
    assert wait < ptx.index("griddepcontrol.launch_dependents")
