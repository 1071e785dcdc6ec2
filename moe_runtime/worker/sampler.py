"""Sampler: turns one step's logits into tokens and logprobs, one request at a time.

A request's result is a function of its own logits row, its SamplingParams, its seed and its
output position only: every row is processed alone, and the Gumbel noise is drawn from a
generator seeded by (seed, output position), one value per vocab id. The sampler owns no
state across steps and never looks at other rows; choosing seeds for n > 1 and recording
fresh ones is the engine's job (moe_runtime.seeds).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moe_runtime.sampling_params import SamplingParams
from moe_runtime.seeds import derive_seed
from moe_runtime.worker.step_input import SampleResult

RowOp = Callable[[torch.Tensor], torch.Tensor]


class Sampler:
    """Samples one token per row with two ops of the kernel table: `log_softmax(x [R, V]
    fp32) -> [R, V] fp32` and `cumsum(x [V]) -> [V]` (a fixed-order scan when invariant)."""

    def __init__(self, log_softmax: RowOp, cumsum: RowOp) -> None:
        self._log_softmax, self._cumsum = log_softmax, cumsum

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        seeds: list[int],
        output_positions: list[int],
    ) -> list[SampleResult]:
        """logits [R, V] fp32; params, seeds, output_positions: one per row."""
        if logits.dim() != 2 or logits.dtype != torch.float32:
            raise ValueError(
                f"logits must be [R, V] fp32, got {tuple(logits.shape)} {logits.dtype}"
            )
        num_rows = logits.shape[0]
        if not len(params) == len(seeds) == len(output_positions) == num_rows:
            raise ValueError(
                f"need one params/seed/output_position per row: {num_rows} rows, "
                f"{len(params)} params, {len(seeds)} seeds, {len(output_positions)} positions"
            )
        # Each row alone, as a [1, V] slice: no op below may see another request's logits.
        return [
            self._sample_row(logits[i : i + 1], params[i], seeds[i], output_positions[i])
            for i in range(num_rows)
        ]

    def _sample_row(
        self, row: torch.Tensor, params: SamplingParams, seed: int, position: int
    ) -> SampleResult:
        raw = self._log_softmax(row)
        if params.is_greedy:
            # torch.argmax returns the first maximum: ties go to the lower id.
            token_id = int(torch.argmax(row[0]))
            reported = raw
        else:
            processed = self._process(row, params)
            noise = _gumbel_noise(seed, position, row.shape[1]).to(row.device)
            token_id = int(torch.argmax(processed[0] + noise))
            reported = raw if params.logprobs_mode == "raw" else self._log_softmax(processed)
        return SampleResult(
            token_id=token_id,
            logprob=reported[0, token_id].item(),
            top_logprobs=_top_logprobs(reported[0], params.logprobs or 0),
        )

    def _process(self, row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """[1, V] logits -> [1, V] temperature-scaled logits, -inf outside top-k / top-p."""
        scaled = row / params.temperature
        vocab_size = row.shape[1]
        top_k = vocab_size if params.top_k == -1 else min(params.top_k, vocab_size)
        if top_k == vocab_size and params.top_p >= 1.0:
            return scaled
        # Stable descending sort: equal logits keep id order, so boundary ties go to the lower id.
        sorted_logits, sorted_ids = torch.sort(scaled[0], descending=True, stable=True)
        keep = torch.zeros(vocab_size, dtype=torch.bool, device=row.device)
        keep[:top_k] = True
        if params.top_p < 1.0:
            masked = sorted_logits.masked_fill(~keep, float("-inf"))
            probs = self._log_softmax(masked[None])[0].exp()
            # Keep a token while the mass before it is short of top_p: the smallest prefix
            # reaching top_p. The table's cumsum: a fixed-order scan in invariant mode.
            mass_before = self._cumsum(probs) - probs
            keep &= mass_before < params.top_p
            keep[0] = True
        keep_by_id = torch.zeros_like(keep)
        keep_by_id[sorted_ids[keep]] = True
        return scaled.masked_fill(~keep_by_id[None], float("-inf"))


def _gumbel_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """[V] fp32 Gumbel noise, a function of (seed, position, vocab id) only.

    Drawn on the CPU generator, whose value i does not depend on how many are drawn, so the
    noise is the same whatever the device and the batch.
    """
    generator = torch.Generator(device="cpu").manual_seed(derive_seed(seed, position))
    u = torch.rand(vocab_size, generator=generator, dtype=torch.float32)
    # rand is in [0, 1); clamping away 0 keeps u in (0, 1) and the noise finite.
    u = u.clamp_(min=torch.finfo(torch.float32).tiny)
    return -torch.log(-torch.log(u))


def _top_logprobs(logprobs: torch.Tensor, num: int) -> dict[int, float]:
    """The `num` highest of a [V] row as {token_id: logprob}; ties go to the lower id."""
    if num <= 0:
        return {}
    values, ids = torch.sort(logprobs, descending=True, stable=True)
    return dict(zip(ids[:num].tolist(), values[:num].tolist(), strict=True))
