"""Programmatic dependent launch (PDL) for the Triton kernels (GPU path, sm90 and later).

In a CUDA graph each kernel boundary costs the next kernel's launch after the last program
of the one before has exited. With PDL a kernel is launched while the one before it still
runs: its programs start, wait (`griddepcontrol.wait`) until every earlier kernel has
finished and its writes are visible, and only then let the kernel after them launch. Every
kernel waits before its first load or store, so no kernel reads or writes anything earlier
than it would have without PDL: the arithmetic and the bits are unchanged; only the launch
gap shrinks. A kernel that is not launched with PDL (torch's, NCCL's, the Gluon kernel) runs
as before: one that follows it starts when it ends. A kernel from elsewhere that is launched
with PDL must wait before its first read, since the kernel before it lets it launch early:
FlashMLA's dense decode does not, so fast mode puts a plain launch before it
(moe_kernels/fast_attention.py `_wait_for_earlier_kernels`); tests/test_gpu_pdl_followers.py
probes the other kernels fast mode takes from elsewhere.

H200, V2-Lite shape through the engine, graphs on (BENCHMARKS.md, twenty-second session):
invariant decode B = 1 2.96 -> 2.82-2.83 ms/step, B = 8 6.08 -> 5.91-5.97, B = 64 9.64 ->
9.31-9.46; in a chain of small kernels ~0.4-0.6 us a boundary. The wait comes before the
trigger: a trigger first let a chain of 128-program kernels launch ahead of itself (4.75 ->
12.5 us a kernel).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moe_kernels.triton_dot import is_interpreted

# (major, minor) from which the GPU has griddepcontrol (Hopper).
MIN_CAPABILITY = (9, 0)
# Whether launches use PDL where the GPU has it; bench/ turns it off to measure its gain.
ENABLED = True


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """A kernel's first statement: with PDL, wait for the kernels before it to finish, then
    let the next kernel launch (after the wait, so at most one kernel waits ahead)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.cache
def _has_pdl(device_index: int) -> bool:
    """Whether the GPU has griddepcontrol: NVIDIA from MIN_CAPABILITY (a ROCm build's "cuda"
    devices report capabilities of their own numbering and have no such instruction)."""
    if torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device_index) >= MIN_CAPABILITY


def pdl_launch(device: torch.device) -> dict:
    """Launch keyword arguments for a kernel on device: its PDL constexpr and Triton's
    launch_pdl where the GPU has PDL, else none (a kernel's PDL defaults to off; the
    interpreter runs without it)."""
    if not ENABLED or device.type != "cuda" or is_interpreted():
        return {}
    if not _has_pdl(device.index if device.index is not None else torch.cuda.current_device()):
        return {}
    return {"PDL": True, "launch_pdl": True}
