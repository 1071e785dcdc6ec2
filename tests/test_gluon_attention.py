"""The Gluon attention kernel without a GPU: it compiles for sm_90 from this machine's Triton
(the same front end as the GPU machine's), inside the GPU's shared memory and without
spilling registers, and the op routes only its one shape to it. Its bits are checked on the
GPU (tests/test_gpu_kernels.py)."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
import triton

from kernels.attention_launch import WIDE_LAUNCH
from kernels.gluon_attention import GLUON_SHAPE, _mla_wide_split_kernel, fits_gluon

SM90_SHARED_BYTES = 232448  # the H100/H200 limit on one block's dynamic shared memory


@pytest.mark.parametrize("is_whole_query", (False, True))
def test_gluon_split_kernel_compiles_for_sm90_without_spilling(tmp_path, is_whole_query):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    def descriptor(columns: int) -> str:  # a TMA descriptor of 64-row boxes, as the launch's
        layout = gl.NVMMASharedLayout.get_default_for([64, columns], gl.bfloat16)
        return f"tensordesc<bf16[64, {columns}],{layout!r}>"

    v_dim, rope = GLUON_SHAPE["v_dim"], GLUON_SHAPE["cache_dim"] - GLUON_SHAPE["v_dim"]
    signature = {
        "q_desc": descriptor(v_dim), "q_pe_desc": descriptor(rope),
        "lat_desc": descriptor(v_dim), "pe_desc": descriptor(rope), "seq_ids_ptr": "*i64",
        "tables_ptr": "*i64", "positions_ptr": "*i64", "acc_ptr": "*fp32",
        "stats_ptr": "*fp32", "out_ptr": "*bf16", "scale": "fp32", "num_heads": "i32",
        "num_splits": "i32", "table_width": "i32",
    }  # fmt: skip
    consts = dict(
        C=GLUON_SHAPE["cache_dim"], V=GLUON_SHAPE["v_dim"],
        R=GLUON_SHAPE["cache_dim"] - GLUON_SHAPE["v_dim"], BS=GLUON_SHAPE["block_size"],
        BLOCK_H=GLUON_SHAPE["block_h"], SPLIT_BLOCKS=16, TAIL_BLOCKS=WIDE_LAUNCH.tail_blocks,
        WRITE_OUT=False,
        WHOLE_QUERY=is_whole_query, num_warps=GLUON_SHAPE["num_warps"],
    )  # fmt: skip
    names = [*signature, *consts]
    aligned = [n for n in signature if n.endswith("_ptr")] + ["num_heads"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    source = GluonASTSource(
        _mla_wide_split_kernel, {**signature, **dict.fromkeys(consts, "constexpr")}, consts, attrs
    )
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=consts["num_warps"])
    )
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx  # the MMAs, TMA copies
    assert compiled.metadata.shared <= SM90_SHARED_BYTES, compiled.metadata.shared
    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        pytest.skip("Triton's cuobjdump is not installed")
    usage = subprocess.run(
        [tool, "--dump-resource-usage", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    assert "STACK:0 " in usage, usage  # no register spills
    # ptxas waits after every wgmma when it cannot prove an accumulator is not read in flight
    # (advisory C7514): the kernel keeps one wait per MMA chain (scores, values), not forty.
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True)
    assert sass.stdout.count("HGMMA") >= 40, "the MMAs are missing from the SASS"
    assert "LDGSTS" not in sass.stdout, "cp.async copies are back beside TMA"
    assert sass.stdout.count("WARPGROUP.DEPBAR") <= 2, "ptxas serialised the wgmmas"


def test_only_the_mla_shape_on_cuda_takes_the_gluon_kernel():
    q = torch.empty(2, 128, 576, dtype=torch.bfloat16)
    kv = torch.empty(4, 64, 576, dtype=torch.bfloat16)
    assert not fits_gluon(q, kv, 512, 64)  # CPU tensors: the Triton kernel (interpreter)
    meta_q, meta_kv = q.to("meta"), kv.to("meta")
    assert not fits_gluon(meta_q, meta_kv, 512, 64)
