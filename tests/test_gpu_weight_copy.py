"""Host-to-GPU weight copies through pinned buffers (weight_checks.HostToDevice): the values
land exactly as copy_ puts them, in chunks and across chunk boundaries, casts and strided
tensors taking copy_; a host update of a whole model leaves its bits as copy_ would."""

from __future__ import annotations

import pytest
import torch

from moe_runtime.model import weight_checks
from moe_runtime.model.weight_checks import HostToDevice, SlotRows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_chunks_land_as_copy_puts_them(monkeypatch):
    monkeypatch.setattr(weight_checks, "HOST_CHUNK_BYTES", 1000)  # many chunks, odd ends
    gen = torch.Generator().manual_seed(0)
    cases = [
        torch.randn(37, 53, generator=gen).to(torch.bfloat16),  # 3922 bytes: 4 chunks
        torch.randn(7, generator=gen),  # one short chunk
        torch.randn(64, 300, generator=gen).to(torch.bfloat16),
    ]
    to_device = HostToDevice()
    targets = [torch.full(c.shape, float("nan"), dtype=c.dtype, device="cuda") for c in cases]
    for dst, src in zip(targets, cases, strict=True):
        to_device.copy(dst, src)
    to_device.finish()
    assert to_device._buffers, "engagement: the pinned path ran"
    for dst, src in zip(targets, cases, strict=True):
        assert torch.equal(dst.cpu(), src)


def test_casts_and_strided_tensors_take_copy_():
    src = torch.randn(16, 32)
    to_device = HostToDevice()
    cast = torch.empty(16, 32, dtype=torch.bfloat16, device="cuda")
    to_device.copy(cast, src)  # fp32 into bf16: copy_ casts
    strided = torch.empty(32, 16, device="cuda")
    to_device.copy(strided, src.t())  # not contiguous: copy_
    to_device.finish()
    assert not to_device._buffers  # neither went through the buffers
    assert torch.equal(cast, src.to("cuda", torch.bfloat16))
    assert torch.equal(strided, src.t().cuda())


def test_slot_rows_from_the_host_equal_a_stacked_copy(monkeypatch):
    monkeypatch.setattr(weight_checks, "HOST_CHUNK_BYTES", 4096)
    gen = torch.Generator().manual_seed(1)
    gate = [torch.randn(24, 40, generator=gen).to(torch.bfloat16) for _ in range(3)]
    up = [torch.randn(24, 40, generator=gen).to(torch.bfloat16) for _ in range(3)]
    rows = SlotRows(tuple(zip(gate, up, strict=True)))
    param = torch.zeros(3, 48, 40, dtype=torch.bfloat16, device="cuda")
    to_device = HostToDevice()
    rows.copy_into(param, to_device)
    to_device.finish()
    assert torch.equal(param.cpu(), rows.stacked())
