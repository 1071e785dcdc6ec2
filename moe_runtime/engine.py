"""LLMEngine: requests in, finished sequences out, one scheduler step at a time.

Validates every request before it enters the queue (token ids in the vocabulary, prompt within
the context, fits the KV cache), so a bad request raises at `add_request` and never disturbs
the requests already in flight. `step()` is: schedule -> run the model -> update.
"""

from __future__ import annotations

import itertools

import torch

from kernels import build_op_table, pin_threads
from moe_runtime.block_manager import BlockManager
from moe_runtime.config import RuntimeConfig
from moe_runtime.model.loader import build_model
from moe_runtime.model_runner import ModelRunner, sample_seed
from moe_runtime.sampler import resolve_seed
from moe_runtime.sampling_params import SamplingParams
from moe_runtime.scheduler import Scheduler
from moe_runtime.sequence import Sequence
from moe_runtime.tokenizer import ByteTokenizer


class LLMEngine:
    def __init__(self, config: RuntimeConfig) -> None:
        self.config = config
        if config.parallel.world_size != 1:
            raise ValueError(
                f"parallel.world_size={config.parallel.world_size}: this engine runs one rank; "
                "expert parallelism across ranks is not available yet"
            )
        pin_threads(config.kernels)
        self.device = torch.device(config.parallel.device)
        self.ops = build_op_table(config.kernels, self.device)
        model = build_model(config.model, self.ops, self.device)
        cache = config.cache
        self.blocks = BlockManager(cache.num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.blocks, config.model.eos_token_id)
        self.runner = ModelRunner(model, self.ops, self.blocks, self.device)
        self.tokenizer = ByteTokenizer(
            config.model.vocab_size, config.model.bos_token_id, config.model.eos_token_id
        )
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()

    def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> list[Sequence]:
        """Queue one request (n sequences); raises ValueError naming the problem if it is bad."""
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate_prompt(token_ids)
        request_id = request_id if request_id is not None else f"req-{next(self._request_ids)}"
        seed = resolve_seed(params.seed)
        seqs = [
            Sequence(
                next(self._seq_ids),
                request_id,
                i,
                list(token_ids),
                params,
                sample_seed(seed, i, params.n),
            )
            for i in range(params.n)
        ]
        for seq in seqs:
            self.scheduler.add(seq)
        return seqs

    def add_score_request(
        self, token_ids: list[int], prompt_len: int, request_id: str | None = None
    ) -> Sequence:
        """Queue a teacher-forced scoring of token_ids[prompt_len:] given everything before."""
        self.validate_prompt(token_ids)
        if not 1 <= prompt_len < len(token_ids):
            raise ValueError(
                f"prompt_len must be in [1, {len(token_ids) - 1}] for a sequence of "
                f"{len(token_ids)} tokens, got {prompt_len}"
            )
        request_id = request_id if request_id is not None else f"score-{next(self._request_ids)}"
        seq = Sequence(
            next(self._seq_ids),
            request_id,
            0,
            list(token_ids[:prompt_len]),
            SamplingParams(),
            0,
            is_score=True,
            output_token_ids=list(token_ids[prompt_len:]),
        )
        self.scheduler.add(seq)
        return seq

    def validate_prompt(self, token_ids: list[int]) -> None:
        vocab = self.config.model.vocab_size
        max_len = self.config.scheduler.max_model_len
        if not token_ids:
            raise ValueError("prompt is empty")
        bad = next(
            (
                t
                for t in token_ids
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab
            ),
            None,
        )
        if bad is not None:
            raise ValueError(f"token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(token_ids) > max_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, more than scheduler.max_model_len={max_len}"
            )
        needed = -(-max_len // self.blocks.block_size)
        if needed > self.blocks.num_blocks:
            raise ValueError(
                f"a sequence of max_model_len={max_len} needs {needed} KV blocks, "
                f"the cache has cache.num_blocks={self.blocks.num_blocks}"
            )

    def step(self) -> list[Sequence]:
        """Run one scheduler step; returns the sequences that finished in it."""
        chunks = self.scheduler.schedule()
        samples, scored = self.runner.step(chunks)
        for chunk in chunks:
            chunk.seq.output_logprobs.extend(scored.get(chunk.seq.seq_id, []))
        return self.scheduler.update(chunks, samples)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
