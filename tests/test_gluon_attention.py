"""The Gluon attention kernel without a GPU: it compiles for sm_90 from this machine's Triton
(the same front end as the GPU machine's), inside the GPU's shared memory and with the spills
it was measured with, and the op routes only its one shape to it. Its bits are checked on the
GPU (tests/test_gpu_kernels.py)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch
import triton

from moe_kernels.attention_launch import WIDE_LAUNCH, WIDE_LONG_SPLIT_BLOCKS
from moe_kernels.gluon_attention import (
    GLUON_SHAPE,
    MAXNREG,
    WIDE_VALUE_PARTS,
    _mla_wide_split_kernel,
    fits_gluon,
)

SM90_SHARED_BYTES = 232448  # the H100/H200 limit on one block's dynamic shared memory
# The local memory (register spills) a thread of each form takes, as compiled ((write_out,
# v_parts): the bytes): the partials' form 16 (176 with the value split, whose products sit in
# two branches; 8 and 160 before the base-2 softmax's folded scale), the direct form none;
# more means something new stays live through the walk.
SPILL_BYTES = {(False, 1): 16, (True, 1): 0, (False, 2): 176, (True, 2): 0}
# The MMA waits ptxas may leave, by v_parts: one per MMA chain (each partition's scores and
# two value products; with the value split each value product's branch has its own).
MMA_WAITS = {1: 6, 2: 10}
CTA_BARRIERS = 56  # bar.sync in the PTX: the analysis's own and the kernel's


@pytest.mark.parametrize("long_blocks", (0, 64))
@pytest.mark.parametrize("v_parts", WIDE_VALUE_PARTS)
@pytest.mark.parametrize("write_out", (False, True))
def test_gluon_split_kernel_compiles_for_sm90(tmp_path, write_out, v_parts, long_blocks):
    """Both forms (partials; the output of a launch's one split), with and without the value
    split, and with and without long splits (of WIDE_LONG_SPLIT_BLOCKS from long_blocks: a
    split size read at run time), compile for sm_90 as the GPU's JIT specializes them, inside
    the GPU's shared memory, with TMA copies and warpgroup MMAs of the value columns a program
    keeps (N = 256 / v_parts) that ptxas did not serialise, spilling at most SPILL_BYTES a
    thread, with no more than CTA_BARRIERS CTA barriers."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    def descriptor(columns: int) -> str:  # a TMA descriptor of 64-row boxes, as the launch's
        layout = gl.NVMMASharedLayout.get_default_for([64, columns], gl.bfloat16)
        return f"tensordesc<bf16[64, {columns}],{layout!r}>"

    signature = {
        "q_desc": descriptor(GLUON_SHAPE["v_dim"] // 2), "q_pe_desc": descriptor(64),
        "tile_desc": descriptor(64), "seq_ids_ptr": "*i64", "tables_ptr": "*i64",
        "positions_ptr": "*i64", "acc_ptr": "*fp32", "stats_ptr": "*fp32", "out_ptr": "*bf16",
        "scale": "fp32", "num_heads": "i32", "num_splits": "i32", "table_width": "i32",
    }  # fmt: skip
    consts = dict(
        SPLIT_BLOCKS=WIDE_LAUNCH.split_blocks, TAIL_BLOCKS=WIDE_LAUNCH.tail_blocks,
        WRITE_OUT=write_out, V_PARTS=v_parts, num_warps=GLUON_SHAPE["num_warps"],
        LONG_BLOCKS=long_blocks, LONG_SPLIT_BLOCKS=WIDE_LONG_SPLIT_BLOCKS if long_blocks else 0,
    )  # fmt: skip
    names = [*signature, *consts]
    aligned = [n for n in signature if n.endswith("_ptr")] + ["num_heads"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    source = GluonASTSource(
        _mla_wide_split_kernel, {**signature, **dict.fromkeys(consts, "constexpr")}, consts, attrs
    )
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=consts["num_warps"], maxnreg=MAXNREG),
    )  # fmt: skip
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx  # the MMAs, TMA copies
    assert "setmaxnreg" in ptx  # the warp-specialised partitions' registers
    assert f"m64n{256 // v_parts}k16" in ptx  # the value products' width
    assert compiled.metadata.shared <= SM90_SHARED_BYTES, compiled.metadata.shared
    assert _stack_bytes(compiled, tmp_path) <= SPILL_BYTES[write_out, v_parts]
    # Triton's barrier analysis puts a CTA barrier before a wait on any element of a barrier
    # array and after every mbarrier.arrive: the kernel's barriers have their own allocations
    # and signal by zero-byte expects, which leaves 52 in each form (122-137 with arrays and
    # arrives, 9 of them before a block's tile waits in each partition).
    assert ptx.count("bar.sync") <= CTA_BARRIERS, ptx.count("bar.sync")
    # ptxas waits after every wgmma when it cannot prove an accumulator is not read in flight
    # (advisory C7514): the kernel keeps one wait per MMA chain (each partition's scores and
    # two value products), not one per wgmma.
    sass = _cuobjdump(compiled, tmp_path, "-sass")
    assert sass.count("HGMMA") >= 80, "the MMAs are missing from the SASS"
    assert "LDGSTS" not in sass, "cp.async copies are back beside TMA"
    assert sass.count("WARPGROUP.DEPBAR") <= MMA_WAITS[v_parts], "ptxas serialised the wgmmas"


def test_only_the_mla_shape_on_cuda_takes_the_gluon_kernel():
    q = torch.empty(2, 128, 576, dtype=torch.bfloat16)
    kv = torch.empty(4, 64, 576, dtype=torch.bfloat16)
    assert not fits_gluon(q, kv, 512, 64)  # CPU tensors: the Triton kernel (interpreter)
    meta_q, meta_kv = q.to("meta"), kv.to("meta")
    assert not fits_gluon(meta_q, meta_kv, 512, 64)


def _sm90_compiled(kernel, args: tuple, kwargs: dict):
    """kernel compiled for sm_90 as launched with (args, kwargs), specialized as the GPU's JIT
    specializes it (Triton's own rule: pointer and integer types, 16-divisible pointers and
    integers marked so, integers equal to 1 made constants, except the kernel's
    do_not_specialize arguments), constexprs, warps and stages from the keywords. Without the
    divisibility marks the compile is another kernel: the split launch took 92 KB of shared
    memory and 255 registers with 320 bytes spilled; with them 164 KB, 193 registers and none,
    the registers and spills the device's own probe reported (twenty-sixth session)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    signature, consts, attrs = {}, {}, {}
    for index, (param, arg) in enumerate(zip(kernel.params, args, strict=False)):
        kind, attr = native_specialize_impl(
            CUDABackend, arg, False, not param.do_not_specialize, True
        )
        if kind == "constexpr":
            consts[param.name] = arg
        elif attr:
            attrs[(index,)] = CUDABackend.parse_attr(attr)
        signature[param.name] = kind
    consts.update((k, v) for k, v in kwargs.items() if k not in ("num_warps", "num_stages"))
    source = ASTSource(kernel, {**signature, **dict.fromkeys(consts, "constexpr")}, consts, attrs)
    options = dict(num_warps=kwargs["num_warps"], num_stages=kwargs["num_stages"])
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def _cuobjdump(compiled, tmp_path, flag: str) -> str:
    """Triton's cuobjdump run with flag on the compiled kernel's cubin (the test skips without
    the tool)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        pytest.skip("Triton's cuobjdump is not installed")
    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    return subprocess.run(
        [tool, flag, str(cubin)], capture_output=True, text=True, check=True
    ).stdout


def _stack_bytes(compiled, tmp_path) -> int:
    """The local memory a thread of the compiled kernel takes: its register spills."""
    usage = _cuobjdump(compiled, tmp_path, "--dump-resource-usage")
    return int(re.search(r"STACK:(\d+) ", usage).group(1))


def _recorded_launches(monkeypatch) -> list:
    """From here on the invariant attention op's split-kernel launches are recorded as (grid,
    args, kwargs) in the list returned instead of run (CPU tensors take the GPU's choices)."""
    import moe_kernels.triton_attention as attention

    launches = []

    class Recorder:
        def __init__(self, record: bool) -> None:
            self.record = record

        def __getitem__(self, grid):
            return lambda *args, **kwargs: self.record and launches.append((grid, args, kwargs))

    monkeypatch.setattr(attention, "_mla_split_kernel", Recorder(True))
    monkeypatch.setattr(attention, "_mla_merge_kernel", Recorder(False))
    monkeypatch.setattr(attention, "_check", lambda *args: None)
    return launches


@pytest.mark.parametrize(
    "group_splits, tokens, width, launch",
    [
        (8, 32, 128, (32, 32, False, False, 3)),  # 96 programs of groups: the split launch
        (8, 64, 64, (64, 2, True, True, 3)),  # a program a group, one an SM
        (8, 64, 128, (64, 4, True, True, 3)),  # 3 groups at 3/4 of the table: 192 programs
        (8, 128, 128, (128, 4, True, True, 2)),  # 384: two programs an SM
        (8, 128, 16, (128, 1, True, True, 3)),  # one group
        (8, 256, 16, (256, 1, True, True, 2)),  # one group: a program a query
        (8, 256, 128, (256, 4, True, True, 2)),  # the table's 4 groups, 3 counted: 768
        (0, 64, 128, (64, 32, False, False, 3)),  # no groups: a program a query from 128
        (0, 128, 128, (128, 1, True, False, 3)),
        (0, 256, 128, (256, 1, True, False, 2)),
    ],
)
def test_16_head_launch_follows_the_programs_of_groups(
    monkeypatch, group_splits, tokens, width, launch
):
    """The 16-head op's launch, as (grid axis 1: queries, grid axis 2: groups or splits,
    WHOLE_QUERY, a program a group, num_stages), with groups of 8 splits (and a tail of one
    split) and with none: a program a query's group (without groups: a query) from 128
    programs of groups (two stages from 256), counted for a query three quarters of the table
    long (the engine's graph tables double in width), else the split launch (three stages).
    group_splits is the op's argument (kernels.attention_group_splits through the op
    table)."""
    import moe_kernels.triton_attention as attention
    from moe_kernels.attention_launch import NARROW_LAUNCH

    # The cases above count splits of 4 blocks, none longer (long splits off: long_blocks 0).
    assert NARROW_LAUNCH.split_blocks == 4
    launches = _recorded_launches(monkeypatch)
    q = torch.zeros(tokens, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    tables = torch.zeros(tokens, width, dtype=torch.int64)
    rows = torch.zeros(tokens, dtype=torch.int64)
    attention.mla_attention_triton(
        q, kv, rows, tables, rows, scale=192**-0.5, v_dim=512, group_splits=group_splits,
        long_blocks=0,
    )  # fmt: skip
    [(grid, _, kwargs)] = launches
    is_whole = kwargs["WHOLE_QUERY"]
    is_group = kwargs["GROUP_BLOCKS"] > 0
    got = (grid[1], grid[2], is_whole, is_group, kwargs["num_stages"])
    assert got == launch, got
    assert kwargs["GROUP_BLOCKS"] == (4 * group_splits if is_whole else 0)
    assert kwargs["GROUP_TAIL"] == (4 if is_whole and group_splits else 0)


@pytest.mark.parametrize("group_splits", (None, 8))
def test_the_ops_triton_launches_fit_sm90_shared_memory(tmp_path, monkeypatch, group_splits):
    """Every Triton split-kernel launch the invariant attention op takes on a GPU without the
    Gluon kernel's shape (16 heads; fp32 or bf16; one to 256 queries; tables of 16 and 128
    blocks) compiles for sm_90 inside its shared memory: the launch choices (value split,
    whole-query stages, the table read ahead) follow host shapes, so a choice that does not fit
    would fail only on the GPU, at that batch. (fp32 with the read ahead needed 336 KB.)
    So with the model's launch (None) and with groups of 8 splits. Engagement: the launches
    recorded cover the split and whole-query forms, the value split and the read ahead, and
    with groups a program a group.
    The bf16 split launches (the op's decode below 128 programs) also compile without spilling
    registers; the whole-query forms hold 255 registers and spill 32-64 bytes a thread (as
    on the GPU)."""
    import moe_kernels.triton_attention as attention

    kernel = attention._mla_split_kernel
    launches = _recorded_launches(monkeypatch)
    for dtype in (torch.float32, torch.bfloat16):
        for tokens in (1, 8, 32, 128, 256):
            for width in (16, 128):
                q = torch.zeros(tokens, 16, 576, dtype=dtype)
                kv = torch.zeros(4, 64, 576, dtype=dtype)
                tables = torch.zeros(tokens, width, dtype=torch.int64)
                rows = torch.zeros(tokens, dtype=torch.int64)
                attention.mla_attention_triton(
                    q, kv, rows, tables, rows, scale=192**-0.5, v_dim=512,
                    group_splits=group_splits,
                )  # fmt: skip
    # 64 heads a program: fp32 does not fit at all (311 KB), refused with the dtype named.
    wide_q = torch.zeros(8, 128, 576)
    with pytest.raises(ValueError, match="128-head model.*torch.float32"):
        attention.mla_attention_triton(
            wide_q, torch.zeros(4, 64, 576), rows[:8], tables[:8], rows[:8], scale=0.1, v_dim=512
        )
    shapes = {}
    for _, args, kwargs in launches:
        key = (args[0].dtype, *sorted((k, str(v)) for k, v in kwargs.items()))
        shapes.setdefault(key, (args, kwargs))
    seen = {(k["V_PARTS"], k["WHOLE_QUERY"], k["TABLE_AHEAD"]) for _, k in shapes.values()}
    assert {(4, False, True), (1, False, True), (1, True, True), (1, True, False)} <= seen, seen
    is_groups = any(k["GROUP_BLOCKS"] for _, k in shapes.values())
    assert is_groups == bool(group_splits), "a program a group: launched with groups only"
    for args, kwargs in shapes.values():
        compiled = _sm90_compiled(kernel, args, kwargs)
        shared = compiled.metadata.shared
        assert shared <= SM90_SHARED_BYTES, (args[0].dtype, kwargs, shared)
        if args[0].dtype == torch.bfloat16 and not kwargs["WHOLE_QUERY"]:
            stack = _stack_bytes(compiled, tmp_path)
            assert stack == 0, (kwargs, f"{stack} bytes spilled a thread")
