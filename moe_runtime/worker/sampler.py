"""Sampler: turns one step's logits into tokens and logprobs, each row on its own.

A request's result is a function of its own logits row, its SamplingParams, its seed and its
output position only. The ops run on the step's rows together, but each is row-wise (the op
table's log_softmax and cumsum, elementwise scaling, argmax and gathers, a stable sort along
each row), so no row's bits follow the others; the top-k / top-p rows of a step are filtered
together (one sort, one prefix sum). The Gumbel noise is a
counter-based hash of (seed, output position, vocab id) computed where the logits are (one
batch of integer ops on CUDA, no host draw or copy), so it needs no generator state. Results
reach the host in one copy. Before a row's min_tokens its EOS and stop ids are set to -inf
in what it samples from (after the raw logprobs are taken: see SamplingParams' logprobs rule),
and so are, in every row alike, the ids past the tokenizer's (`sampled_vocab_size`).
The sampler owns no state across steps and never mixes rows;
choosing seeds for n > 1 and recording fresh ones is the engine's job (moe_runtime.seeds).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from moe_kernels.triton_noise import gumbel_noise_triton
from moe_runtime.forward_batch import HostCopy, device_to_host, host_to_device
from moe_runtime.sampling_params import SamplingParams
from moe_runtime.worker.step_input import SampleResult

RowOp = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class SampleLaunch:
    """A step's sampling queued on the device: `table` [R, 2 + 2 * num_top] fp64 (token id,
    its logprob, top ids, top logprobs; None for no rows) and its copy to the host, queued
    behind the sampling, read back by `Sampler.read`.
    `rows`: the table's rows the launch stands for (None: all), one per params entry."""

    table: torch.Tensor | None
    params: list[SamplingParams]
    num_top: int
    host: HostCopy | None = None
    rows: list[int] | None = None


class Sampler:
    """Samples one token per row with two ops of the kernel table: `log_softmax(x [R, V]
    fp32) -> [R, V] fp32` and `cumsum(x [R, V]) -> [R, V]` along each row (exact, in integers,
    when invariant)."""

    def __init__(
        self,
        log_softmax: RowOp,
        cumsum: RowOp,
        eos_token_ids: tuple[int, ...] = (),
        sampled_vocab_size: int | None = None,
    ) -> None:
        """sampled_vocab_size: ids at or past it (the model's padding of its vocabulary past
        the tokenizer's, which decodes to nothing) are never sampled, EOS ids excepted; None:
        any."""
        self._log_softmax, self._cumsum = log_softmax, cumsum
        self._eos_token_ids = eos_token_ids  # held off before a sample's min_tokens
        self._sampled_vocab_size = sampled_vocab_size
        self._past_mask: tuple | None = None  # ((device, vocab size), [V] bool): _past_tokenizer

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        seeds: list[int],
        output_positions: list[int],
    ) -> list[SampleResult]:
        """logits [R, V] fp32; params, seeds, output_positions: one per row."""
        launched = self.launch(logits, params, seeds, output_positions)
        return self.results(launched, self.read(launched))

    def launch(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        seeds: list[int],
        output_positions: list[int],
    ) -> SampleLaunch:
        """`sample`'s device work, queued and not waited for: `read` waits for it. A decode
        step launched ahead (ModelRunner's lookahead) samples this way behind its replay."""
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
        if num_rows == 0:
            return SampleLaunch(None, params, 0)
        raw = self._log_softmax(logits)
        logits = self._hold_off(self._past_tokenizer(logits), params, output_positions)
        # Sampled rows: scaled (and filtered) logits plus their own noise; greedy rows: the
        # logits themselves (argmax returns the first maximum: ties go to the lower id).
        scores, reported = logits, raw
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        if sampled:
            rows = host_to_device(sampled, logits.device)
            temperatures = [params[i].temperature for i in sampled]
            processed = logits[rows] / host_to_device(temperatures, logits.device)[:, None]
            filtered = [j for j, i in enumerate(sampled) if _is_filtered(params[i])]
            if filtered:
                picked = host_to_device(filtered, logits.device)
                kept = self._filter(processed[picked], [params[sampled[j]] for j in filtered])
                processed[picked] = kept
            noise = gumbel_noise(
                [seeds[i] for i in sampled],
                [output_positions[i] for i in sampled],
                logits.shape[1],
                logits.device,
            )
            scores = logits.index_copy(0, rows, processed + noise)
            processed_mode = [j for j, i in enumerate(sampled) if params[i].logprobs_mode != "raw"]
            if processed_mode:
                picked = host_to_device(processed_mode, logits.device)
                reported = raw.index_copy(0, rows[picked], self._log_softmax(processed[picked]))
        token_ids = row_argmax(scores)
        chosen = reported.gather(1, token_ids[:, None])
        columns = [token_ids[:, None], chosen]
        num_top = max(p.logprobs or 0 for p in params)
        if num_top:
            top_values, top_ids = top_logprobs(reported, num_top)
            columns += [top_ids, top_values]
        # Read back in one device-to-host copy: fp64 holds ids < 2**53 and fp32 logprobs exactly.
        table = torch.cat([c.to(torch.float64) for c in columns], dim=1)
        return SampleLaunch(table, params, num_top, host=device_to_host(table))

    def _past_tokenizer(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [R, V] with the ids at or past sampled_vocab_size (EOS ids excepted) at -inf
        in every row: a new tensor, the model's logits and raw logprobs untouched, so a
        decode's raw logprob is still score()'s. Why it keeps the bits of every row: the same
        columns in every row, whatever the batch, on every rank alike (the engine's number).
        The mask is built once a device (a step's sampling reads it, copies nothing)."""
        vocab_size = logits.shape[1]
        if self._sampled_vocab_size is None or self._sampled_vocab_size >= vocab_size:
            return logits
        key = (logits.device, vocab_size)
        if self._past_mask is None or self._past_mask[0] != key:
            is_past = torch.arange(vocab_size) >= self._sampled_vocab_size
            for eos in self._eos_token_ids:  # a stop even where the tokenizer has no text for it
                if 0 <= eos < vocab_size:
                    is_past[eos] = False
            self._past_mask = (key, is_past.to(logits.device))
        return logits.masked_fill(self._past_mask[1], float("-inf"))

    def _hold_off(
        self, logits: torch.Tensor, params: list[SamplingParams], output_positions: list[int]
    ) -> torch.Tensor:
        """logits [R, V] with each row's held-off ids (EOS and stop ids before its min_tokens,
        SamplingParams.ids_held_off) at -inf: a new tensor, the model's logits (and the raw
        logprobs of them) untouched. Why it keeps the bits of every row: each masked element
        is chosen by its own row's request and output position alone, and no row is read."""
        if not any(p.min_tokens for p in params):  # (a decode step's host loop otherwise)
            return logits
        rows, ids = [], []
        for row, (p, position) in enumerate(zip(params, output_positions, strict=True)):
            held = p.ids_held_off(position, self._eos_token_ids)
            rows += [row] * len(held)
            ids += held
        if not rows:
            return logits
        index = (host_to_device(rows, logits.device), host_to_device(ids, logits.device))
        minus_inf = torch.tensor(float("-inf"), device=logits.device)
        return logits.index_put(index, minus_inf)

    @staticmethod
    def read(launched: SampleLaunch) -> list[list[float]]:
        """Waits for a launch's copy to the host: its rows (token id first)."""
        if launched.table is None:
            return []
        rows = launched.host.wait().tolist()
        return rows if launched.rows is None else [rows[i] for i in launched.rows]

    @staticmethod
    def token_ids(launched: SampleLaunch) -> torch.Tensor:
        """The sampled ids [R] int64 where they were sampled, not waited for: a decode step
        launched before `read` feeds on them."""
        ids = launched.table[:, 0]
        if launched.rows is not None:
            ids = ids[host_to_device(launched.rows, ids.device)]
        return ids.to(torch.int64)

    @staticmethod
    def rows_of(launched: SampleLaunch, rows: list[int]) -> SampleLaunch:
        """The launch standing for its rows `rows` (indices into its own rows) only."""
        table_rows = rows if launched.rows is None else [launched.rows[i] for i in rows]
        params = [launched.params[i] for i in rows]
        return replace(launched, params=params, rows=table_rows)

    @staticmethod
    def results(launched: SampleLaunch, rows: list[list[float]]) -> list[SampleResult]:
        """The rows `read` returned -> one result per row."""
        params, num_top, results = launched.params, launched.num_top, []
        for i, row in enumerate(rows):
            num = params[i].logprobs or 0
            ids, values = row[2 : 2 + num], row[2 + num_top : 2 + num_top + num]
            top = {int(t): v for t, v in zip(ids, values, strict=True)}
            results.append(SampleResult(token_id=int(row[0]), logprob=row[1], top_logprobs=top))
        return results

    def _filter(self, scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """[R, V] temperature-scaled logits -> the same, -inf outside each row's top-k / top-p.
        Every step is row-wise (a stable sort per row, the table's log_softmax and cumsum along
        each row), so a row's result ignores the others; the rows share one sort launch and one
        cumsum (in invariant mode an exact integer scan on the rows' device)."""
        vocab_size = scaled.shape[1]
        device = scaled.device
        top_k = [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params]
        # Stable descending sort: equal logits keep id order, so boundary ties go to the lower id.
        sorted_logits, sorted_ids = torch.sort(scaled, dim=1, descending=True, stable=True)
        ranks = torch.arange(vocab_size, device=device)
        keep = ranks[None, :] < host_to_device(top_k, device)[:, None]
        nucleus = [r for r, p in enumerate(params) if p.top_p < 1.0]
        if nucleus:
            rows = host_to_device(nucleus, device)
            masked = sorted_logits[rows].masked_fill(~keep[rows], float("-inf"))
            probs = self._log_softmax(masked).exp()
            # Keep a token while the mass before it is short of top_p: the smallest prefix
            # reaching top_p. The table's cumsum: an exact scan in invariant mode.
            mass_before = self._cumsum(probs) - probs
            top_p = host_to_device([params[r].top_p for r in nucleus], device)
            keep[rows] &= mass_before < top_p[:, None]
            keep[:, 0] = True
        keep_by_id = torch.zeros_like(keep).scatter_(1, sorted_ids, keep)
        return scaled.masked_fill(~keep_by_id, float("-inf"))


ARGMAX_PART = 2048  # columns a part of a wide row's argmax covers
ARGMAX_SPLIT_MIN = 32768  # rows at least this wide take the argmax in parts


def top_logprobs(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest logprobs and their ids, [R, k] each, by a stable descending sort:
    equal logprobs keep id order. Decode (Sampler) and scoring (ModelRunner) both take their
    tops here: the same selection, so the same bits."""
    values, ids = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    return values[:, :k], ids[:, :k]


def row_argmax(scores: torch.Tensor) -> torch.Tensor:
    """torch.argmax(scores, dim=-1) exactly (the first maximum's index: ties go to the lower
    id). Why in parts for wide rows: CUDA reduces a lone row in one block (22.6 us at 102400
    columns on the H200, behind every B = 1 decode step); each part's first maximum, then the
    first part holding the largest, is the same index from many blocks."""
    num_rows, width = scores.shape
    if width < ARGMAX_SPLIT_MIN:
        return torch.argmax(scores, dim=-1)
    num_parts = -(-width // ARGMAX_PART)
    padded = scores
    if width % ARGMAX_PART:  # -inf past the row: never a first maximum (NaN still wins)
        padded = torch.nn.functional.pad(
            scores, (0, num_parts * ARGMAX_PART - width), value=-torch.inf
        )
    part_max, part_index = padded.view(num_rows, num_parts, ARGMAX_PART).max(dim=-1)
    best = torch.argmax(part_max, dim=-1, keepdim=True)
    return (best * ARGMAX_PART + part_index.gather(1, best))[:, 0]


def _is_filtered(params: SamplingParams) -> bool:
    return params.top_k != -1 or params.top_p < 1.0


# splitmix64 (Steele, Lea, Flood 2014): a Weyl sequence through a 64-bit finaliser. Constants as
# int64 (two's complement): torch's int64 adds and multiplies wrap, as the hash wants.
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)
_NOISE_ROWS = 32  # rows hashed at a time off the CPU without Triton: bounds the temporaries


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic on signed ints)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def gumbel_noise(
    seeds: list[int], positions: list[int], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[R, V] fp32 Gumbel noise; row r a function of (seeds[r], positions[r], vocab id) only.

    The key of a row is the splitmix64 output number position + 1 of the generator seeded with
    the seed; vocab id v draws output number v + 1 of the generator seeded with the key, whose
    top 52 bits make the noise (noise_from_bits). The integers are the same on every device;
    on CUDA one Triton launch draws and transforms every element in registers
    (moe_kernels/triton_noise.py: libdevice's logs, one formula per element). On CPU each row
    is hashed in its own tensor, so a row's elements meet the same vectorised and scalar code
    paths whatever the batch.
    """
    counters = host_to_device(positions, device) + 1
    keys = _mix(host_to_device(seeds, device) + _GOLDEN * counters)
    if device.type == "cuda":  # one launch, the draws and logs in registers (the same integers)
        return gumbel_noise_triton(keys, vocab_size, NOISE_BITS)
    vocab_steps = _GOLDEN * torch.arange(1, vocab_size + 1, device=device)
    step = 1 if device.type == "cpu" else _NOISE_ROWS
    parts = []
    for start in range(0, len(seeds), step):
        bits = _shift_right(_mix(keys[start : start + step, None] + vocab_steps), 64 - NOISE_BITS)
        parts.append(noise_from_bits(bits))
    return torch.cat(parts)


# Random bits a draw's noise is made of. Why 52 and fp64: the noise of a token far below the
# top must reach as high as its gap, or the token is never sampled. From 23 bits (u on a grid
# of 2**-23, fp32) the noise topped out at 16.6: a token 19.5 nats below the top (at the
# temperature) was never drawn and one 17 below at 0.72 of its probability, so sampling at
# temperature 1 over a 100k vocabulary lost most of the far tail's mass (1.5e-3 a step at a
# gap of 18 drawn as 2.4e-4: an RL trainer's importance ratios assume the model's own
# distribution). With u on a grid of 2**-52 (1 - u exact at every point) it reaches 36.7.
NOISE_BITS = 52


def noise_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """fp32 Gumbel noise of int64 draws of NOISE_BITS random bits: u = 1 - (k + 0.5) / 2**52
    in (0, 1), exact in fp64 (a multiple of 2**-53), and the noise -log(-log(u)) in fp64,
    rounded to fp32 once: fine where the tail needs it (u near 1, the noise's top: 1 - u is
    exact at any k, and fp64's log near 1 keeps its relative precision) and from -3.6 to 36.7
    over the grid."""
    # u = (1 - 2**-53) - k * 2**-52, each step exact in fp64; then the logs in place.
    u = bits.double().mul_(-(2.0**-NOISE_BITS)).add_(1.0 - 2.0 ** -(NOISE_BITS + 1))
    return u.log_().neg_().log_().neg_().float()
