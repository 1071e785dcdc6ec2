"""The weight loader: random weights as a pure function of (seed, name, element index), and HF
checkpoints read straight onto the device, only this rank's experts.

- The hash matches a plain-Python splitmix64 on chosen indices (wrapping multiplies, logical
  shifts): its bits follow from integer arithmetic alone, not from a device's RNG stream.
- Bitwise on CPU: a subset of experts drawn alone equals the same experts of the full draw, in
  any slot order; chunk size changes nothing; a TP=2 rank draws exactly tp.shard of the full
  weight; bf16 weights are the cast of the fp32 ones.
- Statistics (tolerance stated): mean ~ 0, std ~ init_std; norms 1, bias inside +-0.1.
- GPU (skipped without CUDA): every parameter drawn on cuda equals the CPU draw bit for bit.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from moe_kernels import KernelConfig, build_op_table
from moe_runtime.model.layers import GatedMLP
from moe_runtime.model.loader import build_model, init_random_weights
from moe_runtime.model.random_weights import fill_uniform, uniform_from_index, weight_key
from moe_runtime.model.tensor_parallel import TensorParallel
from moe_runtime.model.weight_checks import assign_weights
from moe_runtime.model_config import ModelConfig
from tests.checkpoints import rewrite_checkpoint
from tests.invariance import in_fresh_processes

TINY = ModelConfig(q_lora_rank=24)  # 3 layers, 2 MoE layers of 16 experts, hidden 64
HAS_CUDA = torch.cuda.is_available()


def _ops(device: str = "cpu"):
    return build_op_table(KernelConfig(), device)


def _params(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().cpu() for name, p in model.named_parameters()}


def _splitmix_uniform(key: int, index: int) -> float:
    """The reference: splitmix64 on unsigned Python ints, top 24 bits -> [-1, 1)."""
    mask = (1 << 64) - 1
    z = (key + (index + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    z ^= z >> 31
    return ((z >> 40) - (1 << 23)) * 2.0**-23


@pytest.mark.parametrize("name", ["model.embed_tokens.weight", "lm_head.weight"])
@pytest.mark.parametrize("seed", [0, 7, -3])
def test_uniform_matches_splitmix64_reference(seed, name):
    key = weight_key(seed, name)
    ids = [0, 1, 2, 1000, 2**31 - 1, 2**32 + 5, 2**40, 2**62 + 12345, 2**63 - 2]
    got = uniform_from_index(key, torch.tensor(ids, dtype=torch.int64)).tolist()
    want = [_splitmix_uniform(key & ((1 << 64) - 1), i) for i in ids]
    assert got == want
    assert all(-1.0 <= x < 1.0 for x in got)


def test_keys_depend_on_seed_and_name():
    keys = {weight_key(s, n) for s in (0, 1) for n in ("a.weight", "b.weight")}
    assert len(keys) == 4
    # Equal in every process (a restarted job draws the same weights): fresh processes with
    # other str-hash salts give this process's keys (their salted hash() differs:
    # test_derive_seed_stable_and_distinct); weight_key compared with itself could not fail.
    names = [(0, "a.weight"), (1, "b.weight"), (-3, "lm_head.weight")]
    here = [weight_key(s, n) for s, n in names]
    setup = "from moe_runtime.model.random_weights import weight_key"
    assert in_fresh_processes(setup, f"[weight_key(s, n) for s, n in {names}]") == [here, here]


@pytest.mark.parametrize("subset", [[3, 7, 12, 0], [15, 1, 1, 9]], ids=["subset", "replicas"])
def test_expert_subset_equals_full_draw(subset):
    full = build_model(TINY, _ops())
    part = build_model(TINY, _ops(), local_experts=[subset, subset[::-1]])
    full_params, part_params = _params(full), _params(part)
    for name, value in part_params.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            row = subset if ".layers.1." in name else subset[::-1]
            assert torch.equal(value, full_params[name][row]), name
        else:
            assert torch.equal(value, full_params[name]), name


def test_chunk_size_changes_no_value():
    model = build_model(TINY, _ops())
    whole = _params(model)
    local_experts = [list(range(TINY.n_routed_experts))] * TINY.num_moe_layers
    init_random_weights(model, TINY.seed, TINY.init_std, local_experts, chunk_numel=7)
    for name, value in _params(model).items():
        assert torch.equal(value, whole[name]), name


def test_fill_uniform_chunking_and_column_slices():
    """A column slice drawn alone (first, full_cols) equals the slice of the full draw."""
    key = weight_key(5, "w")
    full = torch.empty(37, 24)
    fill_uniform(full, key, 1.0, chunk_numel=1 << 20)
    chunked = torch.empty(37, 24)
    fill_uniform(chunked, key, 1.0, chunk_numel=7)
    assert torch.equal(chunked, full)
    right = torch.empty(37, 8)
    fill_uniform(right, key, 1.0, chunk_numel=11, first=16, full_cols=24)
    assert torch.equal(right, full[:, 16:])
    lower = torch.empty(17, 24)
    fill_uniform(lower, key, 1.0, chunk_numel=5, first=20 * 24)
    assert torch.equal(lower, full[20:])


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_rank_draws_its_slice(rank):
    full = build_model(TINY, _ops())
    tp = TensorParallel(size=2, rank=rank)
    part = build_model(TINY, _ops(), tp=tp)
    full_params = _params(full)
    for name, value in _params(part).items():
        assert torch.equal(value, tp.shard(name, full_params[name])), name


def test_bf16_weights_are_the_fp32_weights_cast():
    fp32 = _params(build_model(TINY, _ops()))
    bf16 = _params(build_model(dataclasses.replace(TINY, dtype="bfloat16"), _ops()))
    for name, value in bf16.items():
        want = fp32[name] if value.dtype == torch.float32 else fp32[name].to(value.dtype)
        assert torch.equal(value, want), name


def test_seed_changes_every_weight():
    first = _params(build_model(TINY, _ops()))
    second = _params(build_model(dataclasses.replace(TINY, seed=1), _ops()))
    for name, value in first.items():
        assert name.endswith("norm.weight") or not torch.equal(value, second[name]), name


def test_statistics():
    """Mean within 5 standard errors of 0; std within 2% of init_std (uniform: std = b/sqrt 3)."""
    cfg = dataclasses.replace(TINY, init_std=0.05)
    params = _params(build_model(cfg, _ops()))
    weights = torch.cat(
        [
            v.flatten().double()
            for n, v in params.items()
            if not n.endswith(("norm.weight", "e_score_correction_bias"))
        ]
    )
    assert weights.numel() > 200_000
    assert abs(weights.mean().item()) < 5 * cfg.init_std / math.sqrt(weights.numel())
    assert weights.std().item() == pytest.approx(cfg.init_std, rel=0.02)
    assert weights.abs().max().item() < cfg.init_std * math.sqrt(3)
    for name, value in params.items():
        if name.endswith("norm.weight"):
            assert torch.equal(value, torch.ones_like(value)), name
        elif name.endswith("e_score_correction_bias"):
            assert value.abs().max() < 0.1 and value.std() > 0.02, name


def test_ready_line_is_logged(caplog):
    with caplog.at_level("INFO", logger="moe_runtime.loader"):
        build_model(TINY, _ops())
    assert any("weights ready in" in r.getMessage() for r in caplog.records)


# HF checkpoints ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.checkpoints import write_tiny_checkpoint

    path = tmp_path_factory.mktemp("ckpt")
    write_tiny_checkpoint(path, "v3", seed=3, q_lora_rank=None)
    return path


def _hf_config(path) -> ModelConfig:
    return ModelConfig.from_dict({"path": str(path)})


def test_hf_load_needs_only_this_ranks_experts(checkpoint, tmp_path):
    """A rank loads from a checkpoint holding its own experts only, and gets the slots the full
    load gives for them: other ranks' experts are never needed (nor read)."""
    cfg = _hf_config(checkpoint)
    local = [[5, 2, 11, 2]] * cfg.num_moe_layers
    keep = {f".experts.{e}." for e in local[0]}

    def only_local(tensors: dict) -> dict:
        return {
            k: v for k, v in tensors.items() if ".experts." not in k or any(s in k for s in keep)
        }

    rewrite_checkpoint(checkpoint, tmp_path / "local", only_local)
    full = _params(build_model(cfg, _ops()))
    part = _params(build_model(_hf_config(tmp_path / "local"), _ops(), local_experts=local))
    for name, value in part.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert torch.equal(value, full[name][local[0]]), name
        else:
            assert torch.equal(value, full[name]), name


def test_hf_load_errors_name_the_tensor(checkpoint, tmp_path):
    def bad_shape(tensors: dict) -> dict:
        return {**tensors, "model.norm.weight": torch.ones(3)}

    def int_dtype(tensors: dict) -> dict:
        return {**tensors, "model.norm.weight": torch.ones(64, dtype=torch.int64)}

    def no_expert(tensors: dict) -> dict:
        return {k: v for k, v in tensors.items() if ".layers.1.mlp.experts.4." not in k}

    def extra(tensors: dict) -> dict:
        return {**tensors, "model.layers.0.mlp.surprise.weight": torch.ones(2)}

    for edit, match in (
        (bad_shape, r"model\.norm\.weight is \(3,\)"),
        (int_dtype, r"model\.norm\.weight is \(64,\) torch\.int64"),
        (no_expert, r"lacks model\.layers\.1\.mlp\.experts\.4"),
        (extra, r"unexpected \['model\.layers\.0\.mlp\.surprise\.weight'\]"),
    ):
        path = tmp_path / edit.__name__
        rewrite_checkpoint(checkpoint, path, edit)
        with pytest.raises(ValueError, match=match):
            build_model(_hf_config(path), _ops())


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_parallel_rank_checks_the_whole_tensor(checkpoint, tmp_path, rank):
    """kv_b_proj one row short (127 of 128) at tp_size 2: rank 0's cut of 64 rows fit, so it
    loaded the wrong weight, and rank 1 named a (63, 32) no file holds. Each rank now refuses
    the whole tensor's shape."""
    key = "model.layers.0.self_attn.kv_b_proj.weight"
    path = rewrite_checkpoint(
        checkpoint, tmp_path / "short", lambda state: {**state, key: state[key][:-1]}
    )
    with pytest.raises(
        ValueError,
        match=rf"{key} is \(127, 32\) torch\.float32, the model "
        r"expects \(128, 32\)",
    ):
        build_model(_hf_config(path), _ops(), tp=TensorParallel(size=2, rank=rank))


# GPU: the same bits on cuda as on the CPU ------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_random_weights_equal_cpu_bitwise(dtype):
    cfg = dataclasses.replace(TINY, dtype=dtype)
    local = [[9, 0, 4, 4, 15]] * cfg.num_moe_layers
    on_cpu = _params(build_model(cfg, _ops(), "cpu", local))
    on_gpu = build_model(cfg, _ops("cuda"), "cuda", local)
    assert all(p.is_cuda for p in on_gpu.parameters())
    for name, value in _params(on_gpu).items():
        assert torch.equal(value, on_cpu[name]), name


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_fill_uniform_equals_cpu_over_many_chunks():
    """Large ids (past 2^32) and chunk edges, and a TP column slice, bitwise on both devices."""
    key = weight_key(0, "big")
    first, full_cols = 2**33 + 17, 4099
    outs = []
    for device in ("cpu", "cuda"):
        out = torch.empty(4_003, 1000, device=device)  # 8 chunks
        fill_uniform(out, key, 0.0346, chunk_numel=1 << 19, first=first, full_cols=full_cols)
        outs.append(out.cpu())
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_hf_load_equals_cpu(checkpoint):
    cfg = _hf_config(checkpoint)
    on_cpu = _params(build_model(cfg, _ops(), "cpu"))
    on_gpu = build_model(cfg, _ops("cuda"), "cuda")
    assert all(p.is_cuda for p in on_gpu.parameters())
    for name, value in _params(on_gpu).items():
        assert torch.equal(value, on_cpu[name]), name


# The gated MLPs' joint gate/up weight -----------------------------------------------------------


def _gated_mlps(model) -> list[GatedMLP]:
    return [m for m in model.modules() if isinstance(m, GatedMLP)]


def _assert_gate_up_share_the_joint_storage(mlp: GatedMLP) -> None:
    joint, gate, up = mlp.gate_up_weight, mlp.gate_proj.weight, mlp.up_proj.weight
    assert gate.untyped_storage().data_ptr() == joint.untyped_storage().data_ptr()
    assert up.untyped_storage().data_ptr() == joint.untyped_storage().data_ptr()
    assert gate.data_ptr() == joint.data_ptr()
    assert up.data_ptr() == joint.data_ptr() + gate.numel() * gate.element_size()
    assert torch.equal(joint, torch.cat([gate, up]))


@pytest.mark.parametrize("tp_size", [1, 2])
def test_gate_up_weights_are_views_of_one_joint_tensor(tp_size):
    """After a load, gate_proj.weight / up_proj.weight live inside gate_up_weight (no second
    copy), and the joint linear's output is the two separate linears' side by side, bitwise."""
    model = build_model(TINY, _ops(), tp=TensorParallel(size=tp_size, rank=tp_size - 1))
    mlps = _gated_mlps(model)
    assert len(mlps) == TINY.num_hidden_layers  # the dense MLP and each MoE's shared experts
    x = torch.randn(5, TINY.hidden_size, generator=torch.Generator().manual_seed(0))
    for mlp in mlps:
        _assert_gate_up_share_the_joint_storage(mlp)
        joint = mlp.ops.linear(x, mlp.gate_up_weight, whole_out_dim=mlp.whole_gate_up_rows)
        apart = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)
        assert torch.equal(joint, apart)
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    joint_bytes = sum(m.gate_up_weight.numel() * m.gate_up_weight.element_size() for m in mlps)
    assert num_bytes > joint_bytes  # counted once, as the parameters


def test_in_place_weight_update_reaches_the_joint_linear(checkpoint):
    """A weight update copies into the parameters in place (the worker's commit path), so the
    joint tensor the forward reads has the new values, and stays the same storage."""
    model = build_model(_hf_config(checkpoint), _ops())
    mlp = _gated_mlps(model)[0]
    before = mlp.gate_up_weight.data_ptr()
    gate_name = next(n for n, p in model.named_parameters() if p is mlp.gate_proj.weight)
    up_name = gate_name.replace("gate_proj", "up_proj")
    params = _params(model)
    new_gate, new_up = params[gate_name] * 2 + 1, -params[up_name]
    assign_weights(model, {gate_name: new_gate, up_name: new_up})
    model.after_weights_loaded()
    assert mlp.gate_up_weight.data_ptr() == before
    assert torch.equal(mlp.gate_up_weight, torch.cat([new_gate, new_up]))
    _assert_gate_up_share_the_joint_storage(mlp)


def test_replaced_storage_is_joined_again():
    """Something that swaps a parameter's storage (`.data =`, `.to()`) breaks the views;
    after_weights_loaded joins them again with the new values."""
    model = build_model(TINY, _ops())
    mlp = _gated_mlps(model)[0]
    mlp.up_proj.weight.data = torch.ones_like(mlp.up_proj.weight)
    assert not mlp.is_gate_up_joined()
    model.after_weights_loaded()
    _assert_gate_up_share_the_joint_storage(mlp)
    assert torch.equal(mlp.gate_up_weight[mlp.gate_proj.weight.shape[0] :], mlp.up_proj.weight)
    assert bool((mlp.up_proj.weight == 1).all())
