"""SequenceState: the worker's copy of one sequence it serves, and a step's share of one.

Owns the per-sequence types the model runner and its decode lookahead both read: the copy
kept up to date from the wire format's deltas (`SequenceState`), the positions one step
computes of it (`Chunk`) and its sampling inputs. Plain data: it runs nothing on a device and
never reads the driver's objects (the worker fills it from step_input only).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from moe_runtime.sampling_params import SamplingParams
from moe_runtime.worker.step_input import NewSequence

SampleArgs = tuple[list[SamplingParams], list[int], list[int]]  # params, seeds, output positions


@dataclass(eq=False)
class SequenceState(NewSequence):
    """The worker's copy of one sequence, updated in place from each step's deltas."""

    block_table: list[int] = field(default_factory=list)

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
