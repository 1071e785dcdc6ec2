"""update_weights: a copy of the weights changes no bit, other weights change the output,
a bad source (bad tensors, or a config.json that differs from the running model's) is refused
without touching the model, prefixes cached under the old weights are never reused, and the
ranks' read is bounded by parallel.weight_read_timeout_s, not by the steps' bound.
Checkpoints are tiny DeepSeek-V3 models written with transformers."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch

from moe_runtime import LLM, SamplingParams
from moe_runtime.executor import WorkerError
from tests.checkpoints import rewrite_checkpoint
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
    assert llm.update_weights(Path(first)) == 1
    assert _generate(llm, prompts) == original, "a copy of the weights changed the output"
    assert llm.update_weights(second) == 2
    changed = _generate(llm, prompts)
    assert changed != original, "different weights left the output unchanged"
    fresh = LLM({"model": {"path": second}, "scheduler": {"max_model_len": 256}})
    assert changed == _generate(fresh, prompts), "cached prefixes of the old weights were reused"
    assert llm.update_weights(first) == 3
    assert _generate(llm, prompts) == original


def test_a_directory_changed_while_the_ranks_read_it_is_refused(checkpoints, tmp_path):
    """A trainer saving over the update's directory while the ranks read it (each rank reads
    on its own, so they could hold different weights): refused, nothing changed. Simulated in
    one rank: its read done, the directory's weights file is replaced before the check."""
    import os
    import shutil

    first, second = checkpoints
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
    llm = LLM({"model": {"path": first}, "scheduler": {"max_model_len": 256}})
    original = _generate(llm, prompts)
    target = tmp_path / "saving"
    shutil.copytree(second, target)
    worker = llm.engine.executor.worker
    read = worker.prepare_weights

    def read_then_overwritten(source):
        read(source)
        shutil.copy(Path(first) / "model.safetensors", target / "next.tmp")
        os.replace(target / "next.tmp", target / "model.safetensors")  # another step lands

    worker.prepare_weights = read_then_overwritten
    with pytest.raises(ValueError, match=r"'model.safetensors' in .* changed since .* read"):
        llm.update_weights(target)
    assert llm.engine.weight_version == 0 and worker.staged_weights is None
    assert _generate(llm, prompts) == original
    worker.prepare_weights = read
    assert llm.update_weights(target) == 1  # once it stands still, it loads


def test_model_path_changed_while_the_ranks_read_it_at_start_is_refused(
    checkpoints, tmp_path, monkeypatch
):
    """A trainer saving over model.path while the ranks read it at start-up: each rank may
    hold other weights (at world size 2 the same request gave each DP rank other bits, equal
    to neither checkpoint) and the engine started at version 0 with no error. Now the start
    is refused as an update is. Simulated at world size 1: the ranks built, then the file
    replaced before the check; once it stands still, the engine starts."""
    import os
    import shutil

    import moe_runtime.engine.worker_group as worker_group_module

    first, second = checkpoints
    target = tmp_path / "saving"
    shutil.copytree(first, target)
    build = worker_group_module.create_executor

    def built_then_overwritten(*args, **kwargs):
        executor = build(*args, **kwargs)
        shutil.copy(Path(second) / "model.safetensors", target / "next.tmp")
        os.replace(target / "next.tmp", target / "model.safetensors")  # a step lands
        return executor

    monkeypatch.setattr(worker_group_module, "create_executor", built_then_overwritten)
    config = {"model": {"path": str(target)}, "scheduler": {"max_model_len": 256}}
    with pytest.raises(ValueError, match=r"model.path: 'model.safetensors' in .* changed"):
        LLM(config)
    monkeypatch.setattr(worker_group_module, "create_executor", build)
    assert _generate(LLM(config), [[2, 7, 1, 8]]) == _generate(
        LLM({**config, "model": {"path": second}}), [[2, 7, 1, 8]]
    )


def test_an_update_reads_only_the_ranks_own_experts(checkpoints):
    """A rank preparing an update reads the checkpoint's shared tensors and its own experts;
    other ranks' expert tensors stay headers (checked by name, shape and dtype, never read):
    every rank read the whole checkpoint (~31 GB a rank at V2-Lite). The checked values of a
    rank whose slots hold experts 0 and 5 equal those from the whole read."""
    from moe_runtime.model.loader import read_checkpoint
    from moe_runtime.model.weight_checks import SlotRows, check_weights

    first, second = checkpoints
    llm = LLM({"model": {"path": first}, "scheduler": {"max_model_len": 256}})
    model = llm.engine.executor.worker.runner.model
    cfg = model.config
    slots = len(llm.engine.executor.worker._local_experts()[0])  # the model's local slots
    local = [[(0, 5)[i % 2] for i in range(slots)]] * cfg.num_moe_layers  # experts 0 and 5
    part = read_checkpoint(Path(second), cfg, local_experts=local)
    experts = {key: value for key, value in part.items() if ".mlp.experts." in key}
    read = {key for key, value in experts.items() if not value.is_meta}
    assert read and all(".experts.0." in key or ".experts.5." in key for key in read), read
    assert len(read) == 2 * 3 * cfg.num_moe_layers and len(experts) > len(read)
    assert not any(v.is_meta for k, v in part.items() if ".mlp.experts." not in k)
    whole = read_checkpoint(Path(second), cfg)
    got = check_weights(model, part, local, second)
    expected = check_weights(model, whole, local, second)
    assert got.keys() == expected.keys()

    def whole(value):
        return value.stacked() if isinstance(value, SlotRows) else value

    assert all(torch.equal(whole(got[name]), whole(expected[name])) for name in got)


def test_a_relative_directory_reaches_the_ranks_resolved(checkpoints, monkeypatch):
    """A rank on another node, or in another working directory, would read a relative path
    against its own: the ranks get the directory resolved where the update was asked."""
    first, second = checkpoints
    llm = LLM({"model": {"path": first}, "scheduler": {"max_model_len": 256}})
    worker, read = llm.engine.executor.worker, llm.engine.executor.worker.prepare_weights
    sources = []
    worker.prepare_weights = lambda source: sources.append(source) or read(source)
    monkeypatch.chdir(Path(second).parent)
    assert llm.update_weights(Path(second).name) == 1
    assert sources == [str(Path(second).resolve())]


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
    with pytest.raises(ValueError, match="File name too long"):
        llm.update_weights("/tmp/" + "x" * 5000)  # an OSError before: a 500 over HTTP
    norm = state["model.norm.weight"]
    for odd, named in [({1: norm}, "1"), ({"model.norm.weight": None}, "NoneType")]:
        with pytest.raises(ValueError, match=f"maps HF weight names .* got .*{named}"):
            llm.update_weights(odd)
    with pytest.raises(ValueError, match="a checkpoint directory or an HF-named state dict"):
        llm.update_weights([("model.norm.weight", state["model.norm.weight"])])
    broken = dict(state)
    broken.pop("lm_head.weight")
    with pytest.raises(ValueError, match="missing"):
        llm.update_weights(broken)
    wrong = dict(state)
    wrong["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="model.norm.weight"):
        llm.update_weights(wrong)
    int_expert = {**state, "model.layers.1.mlp.experts.3.up_proj.weight": torch.ones(32, 64).long()}
    with pytest.raises(ValueError, match=r"experts\.3\.up_proj\.weight is \(32, 64\) torch\.int64"):
        llm.update_weights(int_expert)
    nan_expert = dict(state)
    nan_expert["model.layers.1.mlp.experts.3.up_proj.weight"] = state[
        "model.layers.1.mlp.experts.3.up_proj.weight"
    ].clone()
    nan_expert["model.layers.1.mlp.experts.3.up_proj.weight"][5, 6] = float("nan")
    with pytest.raises(ValueError, match=r"experts\.3\.up_proj\.weight holds 1 non-finite"):
        llm.update_weights(nan_expert)  # a diverged trainer's update: refused, nothing changes
    meta = {**state, "model.norm.weight": torch.empty(64, device="meta")}
    with pytest.raises(ValueError, match="model.norm.weight holds no values .*meta"):
        llm.update_weights(meta)  # it passed the checks and failed the copy: the engine died
    assert llm.engine.weight_version == 1, "a refused update must not count"
    fresh = LLM({"model": {"path": second}, "scheduler": {"max_model_len": 256}})
    assert _generate(llm, prompts) == _generate(fresh, prompts), "a refused update changed weights"


# World size 1 without copies has one placement (keep_held_slots keeps the rank's slots), so
# the permuted one comes from two ranks there.
@pytest.mark.parametrize(("world_size", "redundant"), ((2, 0), (1, 4)))
def test_transformers_fused_experts_are_placed_by_logical_expert(
    checkpoints, world_size, redundant
):
    """transformers 5's in-memory state dict holds a layer's experts fused
    (mlp.experts.gate_up_proj [E, 2I, D], row e logical expert e), under the names of the
    runtime's own slot-indexed parameters: after a rebalance it loaded row e into slot e,
    another expert's (outputs other than a fresh engine's, no error), and with redundant
    experts it was refused quoting the runtime's slot shape. Now each row goes to its
    expert's slots. Engagement: the rebalance moved experts, the dict is fused; a fused tensor
    of the wrong expert count is refused naming it."""
    first, second = checkpoints
    fused = transformers.AutoModelForCausalLM.from_pretrained(second).state_dict()
    if "model.layers.1.mlp.experts.gate_up_proj" not in fused:
        pytest.skip("this transformers keeps experts apart in memory")
    config = {
        "model": {"path": first},
        "scheduler": {"max_model_len": 256},
        "eplb": {"num_redundant_experts": redundant},
        "parallel": {"world_size": world_size},
    }
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6] * 5, [2, 7, 1, 8, 2, 8]]
    llm = LLM(config)
    _generate(llm, [list(range(i, i + 30)) for i in range(0, 200, 20)])  # a load to balance
    assert llm.rebalance()["experts_moved"] > 0
    llm.update_weights(fused)
    # At world size 1 (every EP degree gives the same bits): two ranks' LLMs at once would
    # need four CPUs of the test's Ray cluster.
    fresh = LLM({**config, "model": {"path": second}, "parallel": {"world_size": 1}})
    assert _generate(llm, prompts) == _generate(fresh, prompts)
    short = {**fused, "model.layers.1.mlp.experts.down_proj": fused[
        "model.layers.1.mlp.experts.down_proj"][:3]}  # fmt: skip
    with pytest.raises(ValueError, match=r"experts\.down_proj is \(3, .*routed experts"):
        llm.update_weights(short)
    # An expert given twice, fused and apart, kept one of the two values with no error.
    gate = "model.layers.1.mlp.experts.3.gate_proj.weight"
    inter = fused["model.layers.1.mlp.experts.down_proj"].shape[2]
    both = {**fused, gate: fused["model.layers.1.mlp.experts.gate_up_proj"][3, :inter] + 1}
    with pytest.raises(ValueError, match=r"both the fused tensor .*experts\.3\.gate_proj"):
        llm.update_weights(both)
    assert _generate(llm, prompts) == _generate(fresh, prompts)  # refused: nothing changed


def test_transformers_fused_experts_are_cut_per_rank(checkpoints, monkeypatch):
    """Over Ray the fused expert tensors went whole to every rank (every expert's rows, R
    times); they are cut into each rank's own experts like per-expert tensors, with the bits
    of a fresh engine on the new weights, and a fused tensor of the wrong expert count is
    still refused naming it."""

    from moe_runtime.model.weight_checks import EXPERT_KEY, FUSED_KEY

    first, second = checkpoints
    fused = transformers.AutoModelForCausalLM.from_pretrained(second).state_dict()
    if "model.layers.1.mlp.experts.gate_up_proj" not in fused:
        pytest.skip("this transformers keeps experts apart in memory")
    config = {"model": {"path": first}, "scheduler": {"max_model_len": 256}}
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6] * 5, [2, 7, 1, 8, 2, 8]]
    fresh = LLM({**config, "model": {"path": second}})
    expected = _generate(fresh, prompts)
    fresh.shutdown()
    puts = _record_dict_puts(monkeypatch)
    llm = LLM(config, **{"parallel.world_size": 2})
    try:
        llm.update_weights(fused)
        assert not any(FUSED_KEY.match(k) for part in puts for k in part)
        experts = [sum(1 for k in part if EXPERT_KEY.match(k)) for part in puts]
        num_experts = 2 * 16 * 3  # MoE layers x routed experts x projections
        assert sorted(experts) == [0, num_experts // 2, num_experts // 2], experts
        assert _generate(llm, prompts) == expected
        short = {**fused, "model.layers.1.mlp.experts.down_proj": fused[
            "model.layers.1.mlp.experts.down_proj"][:3]}  # fmt: skip
        with pytest.raises(ValueError, match=r"experts\.down_proj is \(3, .*routed experts"):
            llm.update_weights(short)
        assert _generate(llm, prompts) == expected  # refused: nothing changed
    finally:
        llm.shutdown()


CONFIG_EDITS = {
    "hidden_act": ({"hidden_act": "gelu"}, r"hidden_act='gelu'"),
    "model_type_v2": (
        {"model_type": "deepseek_v2", "norm_topk_prob": False},
        r"scoring_func='softmax', the running model has 'sigmoid'",
    ),
    "routed_scaling_factor": ({"routed_scaling_factor": 1.0}, r"routed_scaling_factor=1\.0"),
    "rope_theta": ({"rope_parameters": {"rope_theta": 500.0}}, r"rope_theta=500\.0"),
    "vocab_size": ({"vocab_size": 600}, r"vocab_size=600"),
    "num_hidden_layers": ({"num_hidden_layers": 2}, r"num_hidden_layers=2"),
}


@pytest.fixture(scope="module")
def serving(checkpoints):
    llm = LLM({"model": {"path": checkpoints[0]}, "scheduler": {"max_model_len": 256}})
    yield llm, _generate(llm, [[10, 20, 30, 40, 50]])
    llm.shutdown()


@pytest.mark.parametrize("case", [*CONFIG_EDITS, "no_config", "bad_json"])
def test_directory_whose_config_differs_is_refused(checkpoints, serving, tmp_path, case):
    """update_weights reads the new directory's config.json as the start-up does: a field that
    differs from the running model, or a missing or malformed file, is refused by name in
    phase 1, and nothing changes."""
    llm, original = serving
    edit, match = CONFIG_EDITS.get(case, ({}, None))
    path = rewrite_checkpoint(checkpoints[1], tmp_path / case, config=lambda hf: {**hf, **edit})
    if case == "no_config":
        (path / "config.json").unlink()
        match = r"has no config\.json"
    elif case == "bad_json":
        (path / "config.json").write_text("{not json")
        match = r"config\.json is not valid JSON"
    with pytest.raises(ValueError, match=match):
        llm.update_weights(str(path))
    assert llm.engine.weight_version == 0 and llm.engine.error is None
    assert _generate(llm, [[10, 20, 30, 40, 50]]) == original


def test_one_yarn_model_saved_in_both_spellings_updates_and_another_factor_does_not(
    checkpoints, tmp_path
):
    """DeepSeek's files write rope_scaling {"type": "yarn", ...}; transformers saves the same
    settings as rope_parameters with "rope_type" added. A server started from one must take the
    other's weights (a trainer saving through transformers), with the same bits; a different
    YaRN factor is still refused."""
    yarn = {"factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32}

    def spelled(hub: bool, factor: float = 4.0):
        def config(hf: dict) -> dict:
            hf = {k: v for k, v in hf.items() if k != "rope_parameters"}
            settings = {**yarn, "factor": factor}
            if hub:
                return {**hf, "rope_theta": 10000.0, "rope_scaling": {"type": "yarn", **settings}}
            both = {"rope_type": "yarn", "type": "yarn", "rope_theta": 10000.0, **settings}
            return {**hf, "rope_parameters": both}

        return config

    first = checkpoints[0]
    hub = rewrite_checkpoint(first, tmp_path / "hub", config=spelled(hub=True))
    saved = rewrite_checkpoint(first, tmp_path / "saved", config=spelled(hub=False))
    other = rewrite_checkpoint(first, tmp_path / "other", config=spelled(hub=False, factor=2.0))
    llm = LLM({"model": {"path": str(hub)}, "scheduler": {"max_model_len": 256}})
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6] * 5]
    before = _generate(llm, prompts)
    assert llm.update_weights(saved) == 1
    assert _generate(llm, prompts) == before
    with pytest.raises(ValueError, match="config.json has rope_scaling=.*'factor': 2.0"):
        llm.update_weights(other)


def test_a_request_across_an_update_reports_both_versions(checkpoints):
    """A weight update while a request runs: its later tokens come from the new weights over KV
    of the old, equal to neither version's alone; its output said only the newest version, so a
    trainer took the sample as wholly on-policy for it. first_weight_version now says where the
    request began."""
    first, second = checkpoints
    llm = LLM({"model": {"path": first}, "scheduler": {"max_model_len": 256}})
    engine = llm.engine
    # Seeded: unseeded, each request drew its own seed, so the control below compared two
    # draws that differ whatever the weights (it could not fail).
    params = SamplingParams(max_tokens=10, seed=7, ignore_eos=True)
    old = llm.generate([[4, 5, 6]], params)[0]
    across = engine.add_request([4, 5, 6], params)
    engine.step()
    engine.step()
    num_before = len(across.samples[0].output_token_ids)
    assert num_before >= 1  # engagement: tokens before the update
    engine.update_weights(second)
    after = engine.add_request([4, 5, 6], params)
    while engine.has_unfinished():
        engine.step()
    mixed, fresh = engine.output(across), engine.output(after)
    assert (mixed.first_weight_version, mixed.weight_version) == (0, 1)
    assert (fresh.first_weight_version, fresh.weight_version) == (1, 1)
    assert mixed.token_ids[:num_before] == old.token_ids[:num_before]  # the old weights' start
    assert mixed.token_ids != old.token_ids  # control: the update reached the running request
    assert mixed.token_ids != fresh.token_ids  # and its start was the old weights'
    llm.shutdown()


def test_a_waiting_requests_prefix_match_is_not_used_across_an_update(checkpoints):
    """A request heading the queue holds its prefix match (blocks computed with the old
    weights) while it waits for room; an update came, and it then ran its last tokens with the
    new weights over the old weights' prefix KV, matching neither. The update makes it give
    the match back: it computes everything with the new weights, as a fresh engine does."""
    first, second = checkpoints
    cramped = {"scheduler": {"max_model_len": 64}, "cache": {"block_size": 4, "num_blocks": 16}}
    cached, behind = list(range(10, 22)), list(range(10, 22)) + list(range(30, 38))
    params = SamplingParams(max_tokens=4, seed=3, ignore_eos=True, temperature=0.0, logprobs=1)
    fresh = LLM({"model": {"path": second}, **cramped}).generate([behind], params)[0]
    llm = LLM({"model": {"path": first}, **cramped})
    engine = llm.engine
    llm.generate([cached], SamplingParams(max_tokens=1, seed=1))  # its blocks cached
    running = engine.add_request(list(range(100, 144)), SamplingParams(max_tokens=12, seed=2))
    engine.step()
    waiting = engine.add_request(behind, params)
    engine.step()
    assert len(waiting.samples[0].block_table) == 3  # engagement: it holds the old blocks
    engine.abort(running.request_id)
    llm.update_weights(second)
    while engine.has_unfinished():
        engine.step()
    assert fingerprint(engine.output(waiting)) == fingerprint(fresh)
    llm.shutdown()


def test_weight_versions_are_each_samples_own(checkpoints):
    """A request of two samples: the first runs a chunk, the weights change, the second (which
    waited for the first's prompt blocks) starts after: (1, 0) and (1, 1), the request (1, 0).
    A request that finished before the update keeps (0, 0) when read after it (the engine's
    version now was stamped on every output)."""
    first, second = checkpoints
    llm = LLM(
        {
            "model": {"path": first},
            "scheduler": {"max_model_len": 256, "max_num_batched_tokens": 16},
        }
    )
    engine = llm.engine
    done = engine.add_request([7, 8, 9], SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    pair = engine.add_request(list(range(1, 41)), SamplingParams(n=2, max_tokens=3, seed=4))
    engine.step()  # the first sample's first 16 prompt tokens; the second waits
    assert pair.samples[1].first_weight_version is None  # engagement: it had not started
    engine.update_weights(second)
    while engine.has_unfinished():
        engine.step()
    whole = engine.output(pair)
    versions = [(s.weight_version, s.first_weight_version) for s in whole.outputs]
    assert versions == [(1, 0), (1, 1)]
    assert (whole.weight_version, whole.first_weight_version) == (1, 0)
    before = engine.output(done)
    assert (before.weight_version, before.first_weight_version) == (0, 0)
    assert before.outputs[0].weight_version == 0
    llm.shutdown()


def test_a_state_dict_of_views_into_one_buffer_ships_each_tensor_alone(checkpoints):
    """A trainer's state dict of views into one flat buffer (a usual layout of its parameters),
    at world size 2: Ray pickled each view with its whole storage, once a rank, so an update
    shipped the buffer once per tensor (133 views of the 1.3 MB model: 179 MB a rank, 20x the
    plain update's time; a real model's buffer times its tensor count does not fit in memory).
    Now each tensor ships alone, once for all ranks, with the plain state dict's bits."""
    import time

    from safetensors.torch import load_file

    first, second = checkpoints
    state = load_file(f"{second}/model.safetensors")
    filler = torch.zeros(6 * 2**20 // 4)  # the buffer's other contents: 6 MB behind each view
    flat = torch.cat([t.reshape(-1) for t in state.values()] + [filler])
    views, start = {}, 0
    for name, tensor in state.items():
        views[name] = flat[start : start + tensor.numel()].view(tensor.shape)
        start += tensor.numel()
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
    config = {"model": {"path": first}, "scheduler": {"max_model_len": 256}}
    llm = LLM(config, **{"parallel.world_size": 2})
    try:
        original = _generate(llm, prompts)
        started = time.perf_counter()
        llm.update_weights(state)
        plain_s = time.perf_counter() - started
        expected = _generate(llm, prompts)
        assert expected != original  # control: the update changed the weights
        llm.update_weights(first)
        started = time.perf_counter()
        llm.update_weights(views)
        views_s = time.perf_counter() - started
        assert _generate(llm, prompts) == expected
        assert views_s < 3 * plain_s + 0.5, f"views {views_s:.2f} s, plain {plain_s:.2f} s"
    finally:
        llm.shutdown()


def _record_dict_puts(monkeypatch) -> list[dict]:
    """Every dict ray.put from here on (over Ray: the state-dict parts shipped to the ranks)."""
    import ray

    puts: list[dict] = []
    real_put = ray.put

    def put(value, *args, **kwargs):
        if isinstance(value, dict):
            puts.append(value)
        return real_put(value, *args, **kwargs)

    monkeypatch.setattr(ray, "put", put)
    return puts


def test_each_rank_is_sent_only_its_own_experts_of_a_state_dict(checkpoints, monkeypatch):
    """At world size R every rank was sent the whole state dict, every routed expert of it,
    and read and checked all of it: R copies of the model in host memory at once (V2-Lite at
    R=8: 8 x 31 GB). Now a rank is sent the tensors it holds: every other tensor, its own
    slots' experts; the bits are those of the whole state dict at world size 1, a bad tensor
    of any expert is still refused, and after a rebalance (and in a rebuild) each rank is sent
    the experts it holds then."""
    from safetensors.torch import load_file

    from moe_runtime.model.weight_checks import EXPERT_KEY

    first, second = checkpoints
    state = load_file(f"{second}/model.safetensors")
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
    config = {"model": {"path": first}, "scheduler": {"max_model_len": 256}}
    alone = LLM(config)
    alone.update_weights(state)
    expected = _generate(alone, prompts)
    alone.shutdown()
    puts = _record_dict_puts(monkeypatch)

    def shipped() -> tuple[list[set[str]], list[int]]:
        """Of the dicts put since the last call: the experts of each holding only experts (a
        rank's own), in order, and how many other tensors each other one carried."""
        parts = list(puts)
        puts.clear()
        keys = [{k for k in part if EXPERT_KEY.match(k)} for part in parts]
        pairs = list(zip(parts, keys, strict=True))
        return [k for p, k in pairs if len(k) == len(p)], [
            len(p) - len(k) for p, k in pairs if len(k) < len(p)
        ]

    llm = LLM(config, **{"parallel.world_size": 2})
    try:
        llm.update_weights(state)
        sent, common_puts = shipped()
        num_experts = sum(1 for k in state if EXPERT_KEY.match(k))
        assert len(sent) == 2 and all(len(keys) == num_experts // 2 for keys in sent), [
            len(keys) for keys in sent
        ]
        assert sent[0] | sent[1] == {k for k in state if EXPERT_KEY.match(k)}
        # The tensors every rank reads are serialized once for both ranks, not once a rank.
        assert common_puts == [len(state) - num_experts], common_puts
        assert _generate(llm, prompts) == expected
        bad = dict(state)
        name = "model.layers.2.mlp.experts.15.down_proj.weight"
        bad[name] = state[name].clone().fill_(float("nan"))
        with pytest.raises(ValueError, match=r"experts\.15\.down_proj\.weight holds"):
            llm.update_weights(bad)
        assert _generate(llm, prompts) == expected  # refused: nothing changed
        llm.generate([[7, 7, 7, 7, 7, 7, 7, 7, 7]] * 8, SamplingParams(max_tokens=8))
        assert llm.rebalance()["experts_moved"] > 0  # engagement: the ranks' experts changed
        placement = llm.engine.balancer.placement.physical_to_logical
        puts.clear()
        llm.update_weights(state)
        sent, common_puts = shipped()
        assert len(sent) == 2 and len(common_puts) == 1, (len(sent), common_puts)
        for rank, keys in enumerate(sent):
            slots = placement[:, rank * 8 : rank * 8 + 8]
            held = {(1 + layer, int(e)) for layer in range(2) for e in slots[layer]}
            assert {(int(k.split(".")[2]), int(k.split(".")[5])) for k in keys} == held
        assert _generate(llm, prompts) == expected
        llm.engine.restart()  # a rebuild sends each rank its part of the state dict again
        assert _generate(llm, prompts) == expected
    finally:
        llm.shutdown()


def test_an_update_is_logged_with_its_version_source_and_time(checkpoints, caplog):
    """A server's log said nothing of a weight update (a rebalance is logged): which weights
    served a request, and how long the swap took, could be read from no record."""
    first, second = checkpoints
    llm = LLM({"model": {"path": first}, "scheduler": {"max_model_len": 256}})
    try:
        with caplog.at_level(logging.INFO, logger="moe_runtime"):
            assert llm.update_weights(second) == 1
    finally:
        llm.shutdown()
    updates = [r.getMessage() for r in caplog.records if "weights updated" in r.getMessage()]
    assert len(updates) == 1, updates
    assert updates[0].startswith(f"weights updated to version 1 from {str(second)!r} in "), updates


def test_a_ctrl_c_while_the_ranks_read_an_update_does_not_spend_the_restart_budget(checkpoints):
    """A Ctrl-C while the ranks read an update's weights (phase 1: seconds to minutes for a
    large checkpoint) kills the engine, and the next call rebuilds it with the old weights.
    That rebuild counted against parallel.max_restarts, as a crash's does, so with the
    default 3 an hour a notebook's fourth interrupted update left the LLM refusing every
    call ('gave up after ... restarts'); a Ctrl-C inside a step does not count. Now neither
    does one inside an update: with max_restarts 0 the LLM comes back, with the old bits."""
    first, second = checkpoints
    config = {"model": {"path": first}, "scheduler": {"max_model_len": 256}}
    llm = LLM(config, **{"parallel.max_restarts": 0})
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6]]
    try:
        original = _generate(llm, prompts)
        engine = llm.engine
        for _ in range(2):
            call_all = engine.executor.call_all

            def interrupted(method, *args, _call_all=call_all, **kwargs):
                if method == "prepare_weights":
                    raise KeyboardInterrupt
                return _call_all(method, *args, **kwargs)

            engine.executor.call_all = interrupted
            with pytest.raises(KeyboardInterrupt):
                llm.update_weights(second)
            assert engine.error is not None  # the ranks may be out of step: rebuilt next
            assert _generate(llm, prompts) == original  # the old weights, rebuilt
        assert engine.num_restarts == 2 and engine.weight_version == 0  # engagement
    finally:
        llm.shutdown()


def _slow_reads(llm: LLM, delay_s: float) -> None:
    """Each Ray rank's reads of a checkpoint directory take delay_s longer, as from slow storage
    (patched inside its process); the rank stays alive and answers pings meanwhile."""
    import ray

    def patch(worker, delay_s: float) -> None:
        import moe_runtime.worker.worker as worker_module

        read = worker_module.read_checkpoint

        def slow_read(*args, **kwargs):
            time.sleep(delay_s)
            return read(*args, **kwargs)

        worker_module.read_checkpoint = slow_read

    ray.get([rank.__ray_call__.remote(patch, delay_s) for rank in llm.engine.executor.workers])


@pytest.mark.slow
def test_a_read_slower_than_the_step_bound_finishes_with_nothing_rebuilt(
    checkpoints, caplog, monkeypatch
):
    """Reading an update's checkpoint from slow storage (V2-Lite's 31 GB, V3's ~700 GB over a
    network file system) was bounded as a step is, by parallel.timeout_s + 30 s: past it the
    ranks, alive and reading, were taken for stalled, the update failed and the engine was
    rebuilt (a restart spent). Now the read has its own bound, parallel.weight_read_timeout_s:
    a read past the steps' bound finishes, nothing is rebuilt, the watchdog pinging meanwhile
    finds every rank answering, and the read is logged while it runs."""
    import moe_runtime.executor.ray_executor as ray_executor

    monkeypatch.setattr(ray_executor, "_PROGRESS_EVERY_S", 10.0)
    first, second = checkpoints
    timeout_s = 5
    overrides = {
        "parallel.world_size": 2,
        "parallel.timeout_s": timeout_s,
        "parallel.weight_read_timeout_s": 120,
        "parallel.max_restarts": 0,
        "server.health_check_interval_s": 2.0,
    }
    llm = LLM({"model": {"path": first}, "scheduler": {"max_model_len": 256}}, **overrides)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
    probes, probe = [], llm.engine.silent_ranks

    def spy(timeout_s):
        probes.append(probe(timeout_s))
        return probes[-1]

    monkeypatch.setattr(llm.engine, "silent_ranks", spy)
    try:
        before = _generate(llm, prompts)
        _slow_reads(llm, timeout_s + 30 + 3)  # past the steps' bound (README: + 30 s)
        started = time.monotonic()
        with caplog.at_level(logging.INFO, logger="moe_runtime"):
            assert llm.update_weights(second) == 1
        assert time.monotonic() - started > timeout_s + 30
        assert llm.engine.num_restarts == 0 and llm.engine.error is None
        assert _generate(llm, prompts) != before  # the new weights serve
        assert probes and all(silent == [] for silent in probes), probes  # pinged, all alive
        notes = [r.getMessage() for r in caplog.records if "still running" in r.getMessage()]
        assert notes and notes[0].startswith("prepare_weights: ranks [0, 1] still running after")
        assert "of 120s (parallel.weight_read_timeout_s)" in notes[0], notes
    finally:
        llm.shutdown()


def test_a_read_past_its_own_bound_fails_naming_the_setting(checkpoints):
    """A read that outlasts parallel.weight_read_timeout_s fails with an error naming the key
    and how long it waited; the next call rebuilds the ranks with the old weights."""
    first, second = checkpoints
    overrides = {"parallel.world_size": 2, "parallel.weight_read_timeout_s": 2}
    llm = LLM({"model": {"path": first}, "scheduler": {"max_model_len": 256}}, **overrides)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6]]
    try:
        before = _generate(llm, prompts)
        _slow_reads(llm, 10)
        started = time.monotonic()
        late = r"ranks \[0, 1\] did not finish prepare_weights within 2s"
        with pytest.raises(WorkerError, match=rf"{late} \(parallel\.weight_read_timeout_s\)"):
            llm.update_weights(second)
        assert time.monotonic() - started < 10  # at the read's bound, not the read's end
        assert _generate(llm, prompts) == before  # rebuilt, serving the old weights
        assert llm.engine.num_restarts == 1 and llm.engine.weight_version == 0
    finally:
        llm.shutdown()


def test_a_rank_frozen_while_reading_is_still_killed_at_the_second_check(checkpoints):
    """The read's long bound keeps the liveness checks: a rank stopped (SIGSTOP) while reading
    answers no ping, and the watchdog kills it at its second check, long before
    parallel.weight_read_timeout_s; its peer, reading too, answers and is left alone."""
    import contextlib
    import os
    import signal
    import threading

    first, second = checkpoints
    overrides = {
        "parallel.world_size": 2,
        "parallel.weight_read_timeout_s": 600,
        "server.health_check_interval_s": 1.0,
    }
    llm = LLM({"model": {"path": first}, "scheduler": {"max_model_len": 256}}, **overrides)
    pids = llm.engine.executor.call_all("pid")
    stop = threading.Timer(1.0, os.kill, (pids[1], signal.SIGSTOP))
    try:
        _slow_reads(llm, 60)
        started = time.monotonic()
        stop.start()
        with pytest.raises(WorkerError, match=r"rank 1 died during prepare_weights: killed"):
            llm.update_weights(second)
        assert time.monotonic() - started < 45  # the second check's kill, not the bound
    finally:
        stop.join()
        with contextlib.suppress(ProcessLookupError):  # killed already
            os.kill(pids[1], signal.SIGCONT)
        llm.shutdown()
