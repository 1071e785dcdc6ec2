"""bench/hbm_floor.py's byte model against a hand count, and bench/e2e_decode.py --engine as a
CPU smoke run on the tiny config."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.hbm_floor import decode_step_bytes, expected_experts_touched, weight_bytes
from moe_runtime.config import load_config

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "launch" / "configs" / "tiny_cpu.yaml"


def test_decode_step_bytes_matches_hand_count():
    # tiny_cpu in bf16: D=64, dense I=128, expert I=32, 3 layers (1 dense, 2 MoE), q_lora 32,
    # kv_lora 32 + rope 8, 4 heads x (16 nope + 8 rope) queries, v 16, E=16 top-4, 1 shared,
    # vocab 512; the router's weight is in the model's dtype, its score-correction bias fp32.
    cfg = load_config(TINY, {"model.dtype": "bfloat16"}).model
    attention = (
        64  # input norm
        + 64 * 32  # q_a
        + 32  # q_a norm
        + 32 * 4 * 24  # q_b
        + 64 * 40  # kv_a (latent + rope key)
        + 32  # kv_a norm
        + 32 * 4 * (16 + 16)  # kv_b
        + 4 * 16 * 64  # o_proj
        + 64  # post-attention norm
    ) * 2
    dense_mlp = 3 * 64 * 128 * 2
    moe_non_expert = 16 * 64 * 2 + 16 * 4 + 3 * 64 * 32 * 2  # router + shared expert
    non_expert = 3 * attention + dense_mlp + 2 * moe_non_expert + 64 * 2 + 512 * 64 * 2
    expert = 3 * 64 * 32 * 2
    assert weight_bytes(cfg).non_expert == non_expert == 240000
    assert weight_bytes(cfg).routed_expert == expert
    step = decode_step_bytes(cfg, num_seqs=2, context=10)
    assert step.non_expert == non_expert
    assert step.embedding == 2 * 64 * 2
    assert step.routed_experts == pytest.approx(2 * 16 * (1 - (12 / 16) ** 2) * expert)  # 7 each
    assert step.kv_cache == 2 * 10 * 3 * 40 * 2
    assert step.total == pytest.approx(non_expert + 256 + 14 * expert + 4800)


def test_decode_step_bytes_v2_lite_by_hand():
    """The shipped V2-Lite config (27 layers, the first dense; 64 routed experts top-6 and 2
    shared of intermediate 1408; dense intermediate 10944; no q_lora; kv_lora 512 + rope 64;
    16 heads of nope 128 / v 128; vocab 102400; bf16) at B = 1 and 64, context 1024."""
    cfg = load_config(ROOT / "launch" / "configs" / "v2_lite_gpu.yaml").model
    d, heads = 2048, 16
    attention = (
        d * heads * (128 + 64)  # q_proj
        + d * 576  # kv_a_proj_with_mqa
        + 512  # kv_a_layernorm
        + 512 * heads * (128 + 128)  # kv_b_proj (read as the absorbed W_UK / W_UV)
        + heads * 128 * d  # o_proj
        + 2 * d  # the two residual norms
    )
    moe_non_expert = 64 * d + 3 * d * 2 * 1408  # router + the 2 shared experts as one MLP
    params = 27 * attention + 3 * d * 10944 + 26 * moe_non_expert + d + 102400 * d  # + lm_head
    expert = 3 * d * 1408 * 2
    weights = weight_bytes(cfg)
    assert weights.non_expert == 2 * params == 2_203_835_392
    assert (weights.routed_expert, weights.num_moe_layers) == (expert, 26)
    kv_per_seq = 1024 * 27 * 576 * 2
    one = decode_step_bytes(cfg, num_seqs=1, context=1024)
    assert (one.embedding, one.kv_cache) == (d * 2, kv_per_seq)
    assert one.routed_experts == pytest.approx(26 * 6 * expert)
    assert one.total == pytest.approx(4_934_724_608)  # 1.17 ms at 4.2 TB/s
    touched = 64 * (1 - (58 / 64) ** 64)  # 63.88 of 64
    many = decode_step_bytes(cfg, num_seqs=64, context=1024)
    assert (many.embedding, many.kv_cache) == (64 * d * 2, 64 * kv_per_seq)
    assert many.routed_experts == pytest.approx(26 * touched * expert)
    assert many.total == pytest.approx(32.979e9, rel=1e-4)  # 7.85 ms at 4.2 TB/s


def test_expected_experts_touched():
    assert expected_experts_touched(64, 6, 0) == 0
    assert expected_experts_touched(64, 6, 1) == pytest.approx(6)
    assert expected_experts_touched(16, 4, 2) == pytest.approx(7)  # 16 - 16 * (3/4)^2
    assert 63.9 < expected_experts_touched(64, 6, 256) < 64


def test_engine_bench_smoke_on_cpu():
    cmd = [
        sys.executable,
        "bench/e2e_decode.py",
        "--engine",
        "--config",
        str(TINY),
        "--batches",
        "1",
        "2",
        "--context",
        "16",
        "--decode-steps",
        "4",
        "--repeats",
        "5",
        "--temperature",
        "1.0",  # sampled decode: every row draws its Gumbel noise
        "--top-p",
        "0.9",  # and sorts its row for the top-p mass
    ]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "| phase | B | invariant ms/step [min, max] | fast ms/step [min, max] |" in out
    assert "| decode ctx 16 | 1 |" in out and "| decode ctx 16 | 2 |" in out
    assert "| prefill 8x16 |" in out
    assert "cpu copy ceiling" in out and "engine start: invariant" in out
    assert "objects frozen" in out and "Python's collector over the run: " in out


def test_profile_grid_table_groups_kernels_by_launch_shape():
    """bench/profile_step.py --by-grid: kernels of one name with two launch shapes get two rows,
    most time first; events that are not kernels are left out."""
    from bench.profile_step import grid_table

    def kernel(name, grid, dur):
        return {"cat": "kernel", "name": name, "dur": dur, "args": {"grid": grid, "block": [128]}}

    trace = {
        "traceEvents": [
            kernel("_linear_kernel", [32, 1, 1], 6.0),
            kernel("_linear_kernel", [32, 1, 1], 8.0),
            kernel("_linear_kernel", [64, 1, 1], 30.0),
            kernel("_linear_kernel", [64, 1, 1], 30.0),
            {"cat": "cpu_op", "name": "aten::mm", "dur": 99.0},
        ]
    }
    lines = grid_table(trace, num_steps=2, top=10)
    assert lines[2] == "| _linear_kernel | [64, 1, 1] | [128] | 1 | 30 | 30.0 |"
    assert lines[3] == "| _linear_kernel | [32, 1, 1] | [128] | 1 | 7 | 7.0 |"
    assert len(lines) == 4


def test_profile_idle_lines_split_launch_gaps_from_host_gaps():
    """bench/profile_step.py's idle split: gaps between consecutive kernels under HOST_GAP_US
    count as launch latency, longer ones as the host's; overlapping kernels leave no gap."""
    from bench.profile_step import HOST_GAP_US, idle_lines

    def kernel(ts, dur):
        return {"cat": "kernel", "name": "k", "ts": ts, "dur": dur}

    long_gap = 2 * HOST_GAP_US
    events = [kernel(0.0, 10.0), kernel(12.0, 10.0), kernel(15.0, 2.0), kernel(25.0, 5.0)]
    events.append(kernel(30.0 + long_gap, 10.0))  # after a host gap
    events.append({"cat": "cpu_op", "name": "aten::mm", "ts": 500.0, "dur": 1.0})
    (line,) = idle_lines({"traceEvents": events}, num_steps=1)
    span = 40.0 + long_gap
    # Launch gaps: 2 (10 -> 12) + 3 (22 -> 25; the kernel at 15 overlaps); host: long_gap.
    assert f"{span:.1f} us from first kernel to last" in line
    assert "idle 5.0 us in gaps" in line
    assert f"and {long_gap:.1f} us in 1.0 longer gaps" in line
    # Busy: the kernels' union, 0-10, 12-22, 25-30 and the last 10 (the overlap once).
    assert "busy 35.0 us" in line


def test_backlog_bench_smoke_on_cpu():
    """bench/backlog.py on the tiny config: a job of more requests than slots finishes in both
    modes, and invariant mode's lookaheads (on here) served steps while requests waited."""
    cmd = [sys.executable, "bench/backlog.py", "--config", str(TINY), "--slots", "3"]
    cmd += ["--requests", "8", "--context", "40", "--max-tokens", "8", "--repeats", "2"]
    cmd += ["--n", "2", "--set", "scheduler.overlap_decode=true"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = {
        cells[1].strip(): cells
        for line in run.stdout.splitlines()
        if line.startswith(("| invariant", "| fast"))
        for cells in [line.split("|")]
    }
    assert set(rows) == {"invariant", "fast"}, run.stdout
    served = {mode: int(cells[5].split("/")[0]) for mode, cells in rows.items()}
    assert served["invariant"] > served["fast"], run.stdout  # fast: none while requests wait
    # n = 2: each request's second sample hits its prompt's 2 full blocks (of 16 tokens).
    assert all(int(cells[4]) == 8 * 2 for cells in rows.values()), run.stdout


def test_gc_pause_bench_smoke_on_cpu():
    """bench/gc_pause.py: a full collection's time with the engine's objects in view and frozen;
    freezing leaves the collector almost nothing to walk."""
    cmd = [sys.executable, "bench/gc_pause.py", "--config", str(TINY), "--repeats", "2"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = [line.split(" | ") for line in run.stdout.splitlines() if line.startswith("| ")]
    walked = {row[0].strip("| ").split(" ")[0]: int(row[1].replace(",", "")) for row in rows[1:]}
    assert walked["as"] > 100_000 and walked["frozen"] < 1_000, walked


class _PipelinedEngine:
    """LLMEngine.step as it runs with scheduler.overlap_decode (graphs at world size 1): each
    call launches the next decode step on a device modelled by a clock, then returns once its
    own step is done, so a step's GPU time is `step_s` and its host time ~0. `drain` is what
    torch.cuda.synchronize does to it: wait for the step launched ahead."""

    def __init__(self, step_s: float) -> None:
        from types import SimpleNamespace

        self.step_s, self.ahead_done, self.ids = step_s, None, []
        self.config = SimpleNamespace(
            scheduler=SimpleNamespace(max_num_batched_tokens=512),
            model=SimpleNamespace(vocab_size=100),
        )

    def add_requests(self, prompts, params):
        from types import SimpleNamespace

        new = [SimpleNamespace(request_id=str(len(self.ids) + i)) for i in range(len(prompts))]
        self.ids += [r.request_id for r in new]
        return new

    def step(self):
        from types import SimpleNamespace

        now = time.perf_counter()
        done = self.ahead_done if self.ahead_done is not None else now + self.step_s
        self.ahead_done = max(now, done) + self.step_s  # the next step, launched ahead
        self._sleep_until(done)
        return [SimpleNamespace(request_id=r, token_ids=[1], is_finished=False) for r in self.ids]

    def drain(self) -> None:
        if self.ahead_done is not None:
            self._sleep_until(self.ahead_done)

    @staticmethod
    def _sleep_until(t: float) -> None:
        while (left := t - time.perf_counter()) > 0:
            time.sleep(left)

    def stats(self):
        from types import SimpleNamespace

        return SimpleNamespace(num_running=len(self.ids), num_waiting=0, num_preemptions=0)

    def abort(self, request_id: str) -> None:
        self.ids.remove(request_id)


def test_engine_decode_blocks_time_every_step_of_a_pipelined_engine(monkeypatch):
    """With overlap_decode, step() returns with the next step in flight: a synchronize (or any
    wait) between timed blocks let that step finish outside every timer, so a block of S steps
    timed S - 1 steps' device work (blocks of 2 read half a step). Each block must time S."""
    from types import SimpleNamespace

    import numpy as np

    from bench import engine_bench

    step_s = 0.02
    engine = _PipelinedEngine(step_s)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: engine.drain())
    args = SimpleNamespace(
        context=16, temperature=0.0, top_p=1.0, repeats=3, decode_steps=2, warmup_steps=2
    )
    run = engine_bench.bench_engine_decode(engine, 2, args, np.random.default_rng(0))
    assert len(run.block_ms) == 3
    assert all(0.9 * step_s * 1e3 <= ms <= 1.5 * step_s * 1e3 for ms in run.block_ms), run


def test_engine_bench_raises_the_cache_for_the_admission_reserve():
    """engine_config raised cache.num_blocks to B sequences' blocks exactly, as if a waiting
    sequence whose blocks are free were admitted; scheduler.admission_reserve (default 1)
    keeps a block free for each running sequence, so with no spare block in a sequence's
    last one (8 x 96-token prompts, 6 more tokens, blocks of 16) the last prompts waited and
    the fill took 9 steps against its bound of 3 (AssertionError). The raised cache now holds
    the reserve too, and every sequence starts within the bound."""
    from types import SimpleNamespace

    import numpy as np

    from bench import engine_bench
    from moe_runtime.engine import LLMEngine

    args = SimpleNamespace(
        config=str(TINY),
        set=["cache.num_blocks=16", "scheduler.max_model_len=256"],
        prefill_prompts=2,
        batches=[8],
        context=96,
        warmup_steps=1,
        repeats=1,
        decode_steps=4,
        temperature=0.0,
        top_p=1.0,
    )
    cfg, notes = engine_bench.engine_config(args, "invariant")
    assert cfg.scheduler.admission_reserve == 1 and notes
    engine = LLMEngine(cfg)
    try:
        run = engine_bench.bench_engine_decode(engine, 8, args, np.random.default_rng(0))
    finally:
        engine.shutdown()
    assert len(run.block_ms) == 1


def test_engine_bench_names_fast_modes_decode_attention(monkeypatch):
    """The header says whether fast mode's baseline has FlashMLA (an optional wheel whose
    absence silently leaves it on the split-KV kernel)."""
    from types import SimpleNamespace

    from bench.engine_bench import fast_decode_attention
    from moe_kernels import fast_attention

    monkeypatch.setattr(fast_attention, "HAS_FLASH_MLA", False)
    assert fast_decode_attention().startswith("FlashMLA not importable")
    monkeypatch.setattr(fast_attention, "HAS_FLASH_MLA", True)
    monkeypatch.setattr(fast_attention, "flash_mla", SimpleNamespace(__version__="1.0.0"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert fast_decode_attention().startswith("FlashMLA 1.0.0 (dense bf16 decode")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert "needs SM90" in fast_decode_attention()
