"""SequenceState: the worker's copy of one sequence it serves, and a step's share of one.

Owns the per-sequence types the model runner and its decode lookahead both read: the copy
kept up to date from the wire format's deltas (`SequenceState`), the positions one step
computes of it (`Chunk`) and its sampling inputs. Plain data: it runs nothing on a device and
never reads the driver's objects (the worker fills it from step_input only).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from moe_runtime.sampling_params import SamplingParams
from moe_runtime.worker.step_input import NewSequence

SampleArgs = tuple[list[SamplingParams], list[int], list[int]]  # params, seeds, output positions


class BlockTable:
    """A sequence's KV block ids, in a numpy buffer grown by doubling. Why not a list: a step's
    batch takes each sequence's table as a view (`head`), copied at C speed; a list's ids went
    through Python one by one, O(context) a sequence on every step."""

    def __init__(self) -> None:
        self._ids = np.empty(16, dtype=np.int64)
        self._num_ids = 0

    def __len__(self) -> int:
        return self._num_ids

    def extend(self, block_ids: list[int]) -> None:
        end = self._num_ids + len(block_ids)
        if end > len(self._ids):
            grown = np.empty(max(end, 2 * len(self._ids)), dtype=np.int64)
            grown[: self._num_ids] = self._ids[: self._num_ids]
            self._ids = grown
        self._ids[self._num_ids : end] = block_ids
        self._num_ids = end

    def head(self, num_blocks: int) -> np.ndarray:
        """The first num_blocks ids (at most all): a view, valid until the next extend."""
        return self._ids[: min(num_blocks, self._num_ids)]


@dataclass(eq=False)
class SequenceState(NewSequence):
    """The worker's copy of one sequence, updated in place from each step's deltas."""

    block_table: BlockTable = field(default_factory=BlockTable)

    @classmethod
    def of(cls, new: NewSequence) -> SequenceState:
        state = {f.name: getattr(new, f.name) for f in fields(new)}
        return cls(**{**state, "token_ids": list(new.token_ids)})


@dataclass(frozen=True)
class Chunk:
    """Positions [start, start + num_tokens) of one sequence, computed this step."""

    seq: SequenceState
    start: int
    num_tokens: int


def sample_args_of(seqs: list[SequenceState]) -> SampleArgs:
    """The sampling inputs of each sequence's next token: params, seed, output position."""
    positions = [len(s.token_ids) - s.num_prompt_tokens for s in seqs]
    return [s.params for s in seqs], [s.seed for s in seqs], positions
