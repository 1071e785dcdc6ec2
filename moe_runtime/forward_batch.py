"""ForwardBatch: everything one model step reads, as explicit tensors (no globals).

Shapes: T tokens in the step, B sequences, MB max blocks per sequence, R rows needing logits.
The same request's rows carry the same values whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class ForwardBatch:
    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each token in its sequence
    query_seq_ids: torch.Tensor  # [T] int64, row of block_tables each token belongs to
    block_tables: torch.Tensor  # [B, MB] int64, -1 padded
    slot_mapping: torch.Tensor  # [T] int64, flat KV slot each token's latent is written to
    logits_indices: torch.Tensor  # [R] int64, token rows whose logits are needed

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def to(self, device: torch.device) -> ForwardBatch:
        return ForwardBatch(*(host_to_device(getattr(self, f.name), device) for f in fields(self)))


def host_to_device(values: torch.Tensor | list, device: torch.device | str) -> torch.Tensor:
    """A CPU tensor or a list (torch.tensor's dtype) on `device`, without waiting for the work
    already queued there. Why: a copy from pageable host memory to a CUDA device waits for its
    stream, so one issued behind a decode step's graph replay held the host until the replay
    ended and the sampler's launches then ran one by one on an idle GPU; from page-locked
    memory the copy is queued like a kernel (the pinned block is not reused before it ends)."""
    tensor = values if isinstance(values, torch.Tensor) else torch.tensor(values)
    device = torch.device(device)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class HostCopy:
    """A device tensor's copy to the host, queued on its stream (`device_to_host`)."""

    host: torch.Tensor  # page-locked on CUDA; the tensor itself on the CPU
    copied: torch.cuda.Event | None  # marks the copy's end on CUDA

    def wait(self) -> torch.Tensor:
        """The host tensor, once the copy has landed."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host


def device_to_host(tensor: torch.Tensor) -> HostCopy:
    """Queue tensor's copy to the host without waiting. Why queued, not read: a step launched
    after it (a decode lookahead) would otherwise sit between the tensor's producer and a copy
    issued later, which would then wait for that whole step."""
    if tensor.device.type != "cuda":
        return HostCopy(tensor, None)
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return HostCopy(host, copied)
