"""What the scheduler-only benches (dp_share.py, admission.py) put in place of a model: a
step's sampled tokens."""

from __future__ import annotations

from moe_runtime.engine.scheduler import ScheduledChunk, Scheduler
from moe_runtime.worker.step_input import SampleResult


def finish_step(scheduler: Scheduler, chunks: list[ScheduledChunk]) -> None:
    """A token (7) for every chunk that ends its sequence's known tokens, as a worker samples
    them; the scheduler advanced past the step and its released sequences collected."""
    samples = {
        c.seq.seq_id: SampleResult(7, 0.0, {})
        for c in chunks
        if c.start + c.num_tokens == c.seq.num_tokens
    }
    scheduler.update(chunks, samples)
    scheduler.collect_released()
