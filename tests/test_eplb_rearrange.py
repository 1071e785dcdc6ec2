"""rearrange_experts' memory on its way through the layers and on a rank's local failure.

A rearrange runs where the experts' weights already fill most of the GPU, so what it keeps alive
decides whether it fits: one layer's transfer buffers at a time, and after a local failure
(out of memory while staging) nothing more allocated and nothing staged kept, since an
allocation that runs out of memory too would escape the rank's collectives and its peers
would wait out the timeout. Checked in one process (world size 1): which tensors are still
alive when the next allocation is made.
"""

from __future__ import annotations

import gc
import types
import weakref

import pytest
import torch

import eplb.rearrange as rearrange
from eplb.rearrange import _LayerExchange, rearrange_experts

NUM_LAYERS, NUM_SLOTS = 3, 4


def _experts() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(NUM_SLOTS, 6, 5), torch.randn(NUM_SLOTS, 5, 3)) for _ in range(NUM_LAYERS)]


def _plans() -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.arange(NUM_SLOTS).repeat(NUM_LAYERS, 1)
    return old, old.flip(1)  # every slot moves


class _Recorder:
    """Weak references to what rearrange allocated: its staging copies and transfer buffers."""

    def __init__(self) -> None:
        self.staging: list[weakref.ref] = []
        self.buffers: list[weakref.ref] = []

    @staticmethod
    def alive(refs: list[weakref.ref]) -> int:
        gc.collect()
        return sum(ref() is not None for ref in refs)


@pytest.fixture
def recorder(monkeypatch) -> _Recorder:
    record = _Recorder()

    class RecordingTorch(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)

        def empty_like(self, tensor, *args, **kwargs):
            out = torch.empty_like(tensor, *args, **kwargs)
            record.staging.append(weakref.ref(out))
            return out

    monkeypatch.setattr(rearrange, "torch", RecordingTorch("torch"))
    return record


def test_one_layer_of_transfer_buffers_at_a_time(monkeypatch, recorder):
    """Layer l's buffers were allocated while layer l-1's were still bound (send, recv): two
    layers of transfer rows at the peak, where the module promises one."""
    buffers = _LayerExchange.buffers
    alive_before: list[int] = []

    def recording_buffers(self, gate_up, down):
        alive_before.append(_Recorder.alive(recorder.buffers))
        send, recv = buffers(self, gate_up, down)
        recorder.buffers += [weakref.ref(send), weakref.ref(recv)]
        return send, recv

    monkeypatch.setattr(_LayerExchange, "buffers", recording_buffers)
    old, new = _plans()
    result = rearrange_experts(_experts(), old, new, 0, 1, None)
    assert result.ok and len(alive_before) == NUM_LAYERS  # engagement: every layer staged
    assert alive_before == [0] * NUM_LAYERS


@pytest.mark.parametrize("fail_layer", [0, 1, 2])
def test_nothing_is_allocated_or_kept_after_a_local_failure(monkeypatch, recorder, fail_layer):
    """Out of memory allocating layer `fail_layer`'s transfer buffers: the rank then allocated
    placeholders of the agreed sizes (as large as what just failed) for that layer and every
    later one, outside the try, so on a full GPU the placeholder ran out of memory too and left
    the collectives. Now it allocates nothing after the failure (every later allocation here
    raises, as on a full GPU) and returns a refusal holding nothing staged."""
    buffers = _LayerExchange.buffers
    is_full = [False]

    def failing_buffers(self, gate_up, down):
        if is_full[0] or self.layer == fail_layer:
            is_full[0] = True
            raise torch.OutOfMemoryError("injected: transfer buffers")
        send, recv = buffers(self, gate_up, down)
        recorder.buffers += [weakref.ref(send), weakref.ref(recv)]
        return send, recv

    def full_gpu(allocate):
        def allocate_unless_full(*args, **kwargs):
            if is_full[0]:
                raise torch.OutOfMemoryError("injected: the GPU is full")
            return allocate(*args, **kwargs)

        return allocate_unless_full

    monkeypatch.setattr(_LayerExchange, "buffers", failing_buffers)
    for name in ("new_empty", "new_zeros"):
        monkeypatch.setattr(torch.Tensor, name, full_gpu(getattr(torch.Tensor, name)))
    old, new = _plans()
    result = rearrange_experts(_experts(), old, new, 0, 1, None)
    assert not result.ok and result.weights is None
    assert result.error == f"layer {fail_layer}: OutOfMemoryError: injected: transfer buffers"
    # Engagement: every layer up to the failed one was staged (two copies a layer).
    assert len(recorder.staging) == 2 * (fail_layer + 1)
    assert _Recorder.alive(recorder.staging) == _Recorder.alive(recorder.buffers) == 0
