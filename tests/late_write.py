"""A PDL predecessor that stores late, for GPU tests of the kernels that follow one.

The repo's Triton kernels launch with programmatic dependent launch (moe_kernels/triton_pdl.py):
each waits for the kernel before it, then lets the next one launch while it runs. A kernel from
elsewhere (cuBLAS, torch's grouped GEMM, FlashAttention, FlashMLA) that follows one is safe only
if it is launched plainly or waits before its first read. `written_late(src)` returns a copy of
src that such a Triton kernel fills only after a busy loop, queued and not waited for: a kernel
run on it next reads src's values if it waited, and the NaN the copy started as if it did not.
`read_without_waiting(src)` is such a kernel that does not wait (launched with PDL, its wait
left out): the probes' control.
"""

from __future__ import annotations

import functools

import torch

LATE_SPINS = 200_000  # the busy loop before the store: well over 100 us on an H200
BLOCK = 1024


@functools.cache
def _copy_kernel():
    """Built on first use: CPU-only runs never load Triton's compiler front end."""
    import triton
    import triton.language as tl

    from moe_kernels.triton_pdl import pdl_start

    @triton.jit
    def copy(src, dst, n, spins, PDL: tl.constexpr, BLOCK: tl.constexpr):
        pdl_start(PDL)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(src + offs, mask=mask)
        t = tl.zeros([BLOCK], tl.float32)
        for _ in range(spins):
            t = t * 0.5 + 1.0  # stays in (0, 2]: the store below keeps x
        tl.store(dst + offs, tl.where(t >= 0.0, x, 0.0).to(x.dtype), mask=mask)

    return copy


def pdl_launch() -> dict:
    """The Triton launch arguments of this GPU's kernels; the probes need PDL to mean anything."""
    from moe_kernels import triton_pdl

    launch = triton_pdl.pdl_launch(torch.device("cuda", torch.cuda.current_device()))
    assert launch, "the GPU has no PDL (sm90 and later): the probe would test nothing"
    return launch


def written_late(src: torch.Tensor) -> torch.Tensor:
    """A copy of src (contiguous) stored by a PDL-launched Triton kernel after a busy loop."""
    _check(src)
    dst = torch.full_like(src, float("nan"))
    torch.cuda.synchronize()  # everything before is done: only the copy can be in flight
    _launch(src, dst, LATE_SPINS, pdl_launch())
    return dst


def read_without_waiting(src: torch.Tensor) -> torch.Tensor:
    """A copy of src by a kernel launched with PDL that does not wait for the one before it
    (no kernel of its own comes first: the output is allocated, not filled)."""
    _check(src)
    dst = torch.empty_like(src)
    _launch(src, dst, 0, pdl_launch() | {"PDL": False})
    return dst


def _check(src: torch.Tensor) -> None:
    if not src.is_contiguous():
        raise ValueError("the late copy takes a contiguous tensor (views are taken after it)")


def _launch(src: torch.Tensor, dst: torch.Tensor, spins: int, launch: dict) -> None:
    grid = (-(-src.numel() // BLOCK),)
    _copy_kernel()[grid](src, dst, src.numel(), spins, BLOCK=BLOCK, **launch)
