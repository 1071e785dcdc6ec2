"""LLM: the public Python facade over the engine.

`LLM(config, **overrides)` -> `generate(prompts, params)`, `score(sequences, prompt_lens)`,
`shutdown()`. Overrides are "section.key" (or "section__key") keyword arguments, or a section
name with a dict of keys, and win over the config file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_runtime.config import SECTIONS, RuntimeConfig, load_config
from moe_runtime.engine import LLMEngine
from moe_runtime.sampling_params import SamplingParams
from moe_runtime.sequence import Sequence


@dataclass(frozen=True)
class CompletionOutput:
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str
    text: str
    # Per token: [MoE layer][K] logical experts of the position whose logits sampled it.
    routed_experts: list[list[list[int]]] = field(default_factory=list)
    seed: int | None = None  # the seed this sample drew its noise from


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # one per sample (n)

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def logprobs(self) -> list[float]:
        return self.outputs[0].logprobs

    @property
    def top_logprobs(self) -> list[dict[int, float]]:
        return self.outputs[0].top_logprobs

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def routed_experts(self) -> list[list[list[int]]]:
        return self.outputs[0].routed_experts


class LLM:
    def __init__(self, config: str | Path | dict | RuntimeConfig, **overrides: Any) -> None:
        self.config = load_config(config, _flatten_overrides(overrides))
        self.engine = LLMEngine(self.config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: list[str | list[int]] | str,
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order. Bad prompts raise before any work."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = (
            params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        for i, prompt in enumerate(prompts):
            try:
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                self.engine.validate_prompt(ids)
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from None
        requests = [
            self.engine.add_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)
        ]
        self._run_until_done()
        return [self._request_output(seqs) for seqs in requests]

    def score(self, sequences: list[list[int]], prompt_lens: list[int]) -> list[list[float]]:
        """Teacher-forced logprob of every token after the prompt, one list per sequence."""
        if len(sequences) != len(prompt_lens):
            raise ValueError(f"got {len(prompt_lens)} prompt_lens for {len(sequences)} sequences")
        seqs = [
            self.engine.add_score_request(list(s), n)
            for s, n in zip(sequences, prompt_lens, strict=True)
        ]
        self._run_until_done()
        return [list(s.output_logprobs) for s in seqs]

    def rebalance(self) -> dict:
        """Re-place the experts now from the recent load (EPLB); changes no output bit."""
        return self.engine.rebalance(force=True)

    def update_weights(self, source: str | dict) -> int:
        """New weights (HF checkpoint dir or HF-named state dict) on every rank; -> version."""
        return self.engine.update_weights(source)

    def shutdown(self) -> None:
        """Release the engine; nothing is left running in this process."""
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    def _run_until_done(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()

    def _request_output(self, seqs: list[Sequence]) -> RequestOutput:
        outputs = [
            CompletionOutput(
                list(s.output_token_ids),
                list(s.output_logprobs),
                list(s.output_top_logprobs),
                s.finish_reason,
                self.tokenizer.decode(s.output_token_ids),
                list(s.routed_experts),
                s.seed,
            )
            for s in seqs
        ]
        return RequestOutput(seqs[0].request_id, list(seqs[0].prompt_token_ids), outputs)


def _flatten_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    flat = {}
    for key, value in overrides.items():
        if key in SECTIONS and isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key.replace("__", ".")] = value
    return flat
