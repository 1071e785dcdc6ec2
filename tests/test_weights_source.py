"""A rebuild serves the weights it served before, or none (moe_runtime/engine/weights_source.py).

A rebuilt worker group reads its weights again from their source. A checkpoint directory
overwritten or deleted since, or a state dict changed in place since, gave other weights (other
bits) under the same weight_version, or a rebuild that failed over and over: each is now
refused by name, and the serving loop gives up at once instead of rebuilding in a loop.
"""

from __future__ import annotations

import shutil
import time

import pytest
import torch
from safetensors.torch import load_file

from moe_runtime import LLM, SamplingParams
from moe_runtime.engine.async_engine import AsyncEngine
from moe_runtime.engine.weights_source import WeightsChangedError, WeightsSource
from tests.invariance import fingerprint
from tests.serving import write_checkpoint

PARAMS = SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=2, ignore_eos=True)
PROMPT = [5, 6, 7]


def _llm(path: str) -> LLM:
    return LLM({"model": {"path": path}, "scheduler": {"max_model_len": 256}})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two different random checkpoints (seeds 1, 2)."""
    root = tmp_path_factory.mktemp("weights")
    return write_checkpoint(root / "one", seed=1), write_checkpoint(root / "two", seed=2)


def _answer(llm: LLM):
    return fingerprint(llm.generate(PROMPT, PARAMS)[0])


def test_an_unchanged_update_directory_is_served_again_after_a_rebuild(checkpoints, tmp_path):
    one, two = checkpoints
    served = shutil.copytree(two, tmp_path / "served")
    llm = _llm(one)
    try:
        llm.update_weights(str(served))
        before = _answer(llm)
        llm.engine.restart()
        assert llm.engine.num_restarts == 1 and llm.engine.weight_version == 1
        assert _answer(llm) == before
    finally:
        llm.shutdown()


def test_an_update_directory_overwritten_since_refuses_the_rebuild(checkpoints, tmp_path):
    """A trainer saving its next step to the path it last sent: the rebuild served the new
    file's weights as weight_version 1."""
    one, two = checkpoints
    served = tmp_path / "served"
    shutil.copytree(one, served)
    llm = _llm(two)
    try:
        llm.update_weights(str(served))
        time.sleep(0.01)  # a later modification time on any file system clock
        shutil.copyfile(f"{two}/model.safetensors", served / "model.safetensors")
        with pytest.raises(WeightsChangedError, match=r"'model.safetensors' in .*served.* changed"):
            llm.engine.restart()
        assert llm.engine.num_restarts == 0  # refused before anything was torn down
    finally:
        llm.shutdown()


def test_an_update_directory_deleted_since_refuses_the_rebuild(checkpoints, tmp_path):
    one, _ = checkpoints
    served = shutil.copytree(one, tmp_path / "served")
    llm = _llm(one)
    try:
        llm.update_weights(str(served))
        shutil.rmtree(served)
        with pytest.raises(WeightsChangedError, match="cannot be read"):
            llm.engine.restart()
    finally:
        llm.shutdown()


def test_a_state_dict_changed_in_place_refuses_the_rebuild_and_a_replaced_entry_does_not(
    checkpoints,
):
    one, two = checkpoints
    state = load_file(f"{two}/model.safetensors")
    llm = _llm(one)
    try:
        llm.update_weights(state)
        before = _answer(llm)
        name = "model.layers.0.mlp.down_proj.weight"
        state[name] = state[name] * 2  # a new tensor in the caller's dict: ours is untouched
        llm.engine.restart()
        assert _answer(llm) == before
        state["model.norm.weight"].mul_(1.01)  # in place: the tensor the engine was given
        with pytest.raises(WeightsChangedError, match="'model.norm.weight' in the state dict"):
            llm.engine.restart()
    finally:
        llm.shutdown()


def test_the_serving_loop_gives_up_at_once_when_the_start_up_path_changed(checkpoints, tmp_path):
    """model.path overwritten while served, then a fault: no rebuild loop, the loop gives up
    with the reason (serve_ep then exits and /health says 503 meanwhile)."""
    one, two = checkpoints
    served = shutil.copytree(one, tmp_path / "served")
    llm = _llm(str(served))
    loop = AsyncEngine(llm.engine)
    try:
        loop.submit([PROMPT], [PARAMS]).result(timeout=60)
        time.sleep(0.01)
        shutil.copyfile(f"{two}/model.safetensors", served / "model.safetensors")

        def broken_commit():
            raise RuntimeError("injected: copy failed")

        llm.engine.executor.worker.commit_weights = broken_commit  # kills the engine
        with pytest.raises(RuntimeError, match="injected"):
            loop.call(lambda engine: engine.update_weights(str(served))).result(timeout=30)
        deadline = time.monotonic() + 30
        while not loop.has_given_up:
            assert time.monotonic() < deadline, "the loop did not give up"
            time.sleep(0.05)
        assert loop.error.startswith("WeightsChangedError: "), loop.error
        assert "'model.safetensors' in" in loop.error, loop.error
        assert llm.engine.num_restarts == 0
    finally:
        loop.shutdown()


def test_random_weights_have_nothing_to_change():
    assert WeightsSource.of(None).changed() is None


def test_the_stamp_names_an_added_or_removed_file(tmp_path):
    for name in ("config.json", "a.safetensors", "b.safetensors"):
        (tmp_path / name).write_text(name)
    stamp = WeightsSource.of(str(tmp_path))
    (tmp_path / "adapter.safetensors").write_text("x")  # sorts first: shifted every pair
    assert (
        stamp.changed()
        == f"'adapter.safetensors' in {str(tmp_path)!r} was added since the weights were read"
    )
    (tmp_path / "adapter.safetensors").unlink()
    (tmp_path / "a.safetensors").unlink()
    assert (
        stamp.changed()
        == f"'a.safetensors' in {str(tmp_path)!r} was removed since the weights were read"
    )


def test_the_stamp_names_a_rewritten_shard_index(tmp_path):
    """The loader reads the shards the index names: an index rewritten since (a trainer's
    next save, sharded otherwise) may name other files, so a rebuild must see it."""
    for name in ("config.json", "model.safetensors.index.json", "a.safetensors"):
        (tmp_path / name).write_text(name)
    stamp = WeightsSource.of(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text("a longer index")
    assert stamp.changed() == (
        f"'model.safetensors.index.json' in {str(tmp_path)!r} changed since the weights were read"
    )


def test_a_state_dict_of_inference_tensors_is_accepted(checkpoints):
    """Tensors made under torch.inference_mode keep no version counter: reading it raised, and
    update_weights refused the dict."""
    one, two = checkpoints
    with torch.inference_mode():
        state = {k: v.clone() for k, v in load_file(f"{two}/model.safetensors").items()}
    llm = _llm(one)
    try:
        assert llm.update_weights(state) == 1
    finally:
        llm.shutdown()


def test_a_rebuild_after_an_update_needs_the_start_up_checkpoint(checkpoints, tmp_path):
    """The new group builds its model from model.path before loading the update's weights: a
    start-up checkpoint pruned since failed every rebuild until the restarts ran out."""
    one, two = checkpoints
    start = shutil.copytree(one, tmp_path / "start")
    llm = _llm(str(start))
    try:
        llm.update_weights(two)
        shutil.rmtree(start)
        with pytest.raises(WeightsChangedError, match="start.* cannot be read"):
            llm.engine.restart()
    finally:
        llm.shutdown()


def test_a_refused_state_dict_is_named_as_one(checkpoints):
    one, _ = checkpoints
    llm = _llm(one)
    try:
        with pytest.raises(ValueError, match="the state dict") as failure:
            llm.update_weights({"lm_head.weight": torch.zeros(3, 3)})
        assert "tensor(" not in str(failure.value), failure.value
    finally:
        llm.shutdown()
