"""rearrange_experts' memory on its way through the layers and on a rank's local failure.

A rearrange runs where the experts' weights already fill most of the GPU, so what it keeps alive
decides whether it fits: one layer's transfer buffers at a time, and after a local failure
(out of memory while staging) nothing staged when the placeholders of the agreed sizes are
allocated, since a placeholder that runs out of memory too escapes the rank's collectives and
its peers wait out the timeout. Checked in one process (world size 1): which tensors are still
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
def test_nothing_staged_survives_a_local_failure(monkeypatch, recorder, fail_layer):
    """Out of memory allocating layer `fail_layer`'s transfer buffers: the placeholders of the
    agreed sizes (as large as what just failed) were allocated with that layer's staging copy
    and the layer before's buffers still alive; at layer 0 nothing else had been freed, so on
    a full GPU the placeholder ran out of memory too and left the collectives."""
    buffers, placeholders = _LayerExchange.buffers, _LayerExchange.placeholders
    alive_at_placeholders: list[tuple[int, int]] = []

    def failing_buffers(self, gate_up, down):
        if self.layer == fail_layer:
            raise torch.OutOfMemoryError("injected: transfer buffers")
        send, recv = buffers(self, gate_up, down)
        recorder.buffers += [weakref.ref(send), weakref.ref(recv)]
        return send, recv

    def recording_placeholders(self, gate_up):
        alive = (_Recorder.alive(recorder.staging), _Recorder.alive(recorder.buffers))
        alive_at_placeholders.append(alive)
        return placeholders(self, gate_up)

    monkeypatch.setattr(_LayerExchange, "buffers", failing_buffers)
    monkeypatch.setattr(_LayerExchange, "placeholders", recording_placeholders)
    old, new = _plans()
    result = rearrange_experts(_experts(), old, new, 0, 1, None)
    assert not result.ok and "OutOfMemoryError" in result.error
    assert result.weights is None
    # Engagement: the failed layer and every later one took placeholders; staging was made.
    assert len(alive_at_placeholders) == NUM_LAYERS - fail_layer
    assert len(recorder.staging) >= 2
    assert alive_at_placeholders == [(0, 0)] * (NUM_LAYERS - fail_layer)
