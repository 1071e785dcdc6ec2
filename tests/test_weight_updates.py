"""update_weights: a copy of the weights changes no bit, other weights change the output,
a bad source is refused without touching the model, and prefixes cached under the old weights
are never reused. Checkpoints are tiny DeepSeek-V3 models written with transformers."""

from __future__ import annotations

import pytest
import torch

from moe_runtime import LLM, SamplingParams
from tests.invariance import fingerprint
from tests.serving import write_checkpoint

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return (
        write_checkpoint(tmp_path_factory.mktemp("a"), seed=1),
        write_checkpoint(tmp_path_factory.mktemp("b"), seed=2),
    )


def _generate(llm: LLM, prompts) -> list[tuple]:
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=5, logprobs=3, ignore_eos=True)
    return [fingerprint(o) for o in llm.generate(prompts, params)]


def test_update_to_self_then_other_then_back(checkpoints):
    first, second = checkpoints
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6] * 5, [2, 7, 1, 8, 2, 8]]
    llm = LLM({"model": {"path": first}, "scheduler": {"max_model_len": 256}})
    original = _generate(llm, prompts)
    assert llm.update_weights(first) == 1
    assert _generate(llm, prompts) == original, "a copy of the weights changed the output"
    assert llm.update_weights(second) == 2
    changed = _generate(llm, prompts)
    assert changed != original, "different weights left the output unchanged"
    fresh = LLM({"model": {"path": second}, "scheduler": {"max_model_len": 256}})
    assert changed == _generate(fresh, prompts), "cached prefixes of the old weights were reused"
    assert llm.update_weights(first) == 3
    assert _generate(llm, prompts) == original


def test_state_dict_source_and_bad_sources(checkpoints):
    first, second = checkpoints
    llm = LLM({"model": {"path": first}, "scheduler": {"max_model_len": 256}})
    prompts = [[10, 20, 30, 40, 50]]
    original = _generate(llm, prompts)
    from safetensors.torch import load_file

    state = load_file(f"{second}/model.safetensors")
    llm.update_weights(state)
    assert _generate(llm, prompts) != original
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        llm.update_weights("/nonexistent/weights")
    broken = dict(state)
    broken.pop("lm_head.weight")
    with pytest.raises(ValueError, match="missing"):
        llm.update_weights(broken)
    wrong = dict(state)
    wrong["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="model.norm.weight"):
        llm.update_weights(wrong)
    assert llm.engine.weight_version == 1, "a refused update must not count"
    fresh = LLM({"model": {"path": second}, "scheduler": {"max_model_len": 256}})
    assert _generate(llm, prompts) == _generate(fresh, prompts), "a refused update changed weights"
