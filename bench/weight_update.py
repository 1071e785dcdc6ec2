"""An RL trainer's weight sync: `LLM.update_weights` timed from a state dict on the host and
one on the model's device, at one rank (the model in this process).

The update's sources are the running model's own weights in HF names (the routed experts in
transformers' fused form, which the runtime takes), so every update leaves the bits as they
were: a few greedy completions are compared before and after (engagement: weight_version
counts every update). Per source, `--repeats` updates timed with perf_counter to a
synchronize after the call (a copy from a device source is queued, not waited for), the median
[min, max], GB/s of the model's bytes, and on CUDA the peak device memory an update allocates
above what was allocated before it (the stacked copy of the experts, for a source on the
device, before SlotRows: 75503d1). A source that does not fit (a device copy of the model
beside it) is reported as such and the rest still run.

    PYTHONUNBUFFERED=1 python bench/weight_update.py [--sources host device] [--repeats 5]
    python bench/weight_update.py --config launch/configs/tiny_cpu.yaml   # CPU smoke test
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launch.cli import add_override_argument, parse_overrides  # noqa: E402
from moe_runtime import LLM, SamplingParams  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "launch" / "configs" / "v2_lite_gpu.yaml"
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [2, 7, 1, 8, 2, 8, 1, 8]]


def own_weights(llm: LLM) -> dict[str, torch.Tensor]:
    """The running model's parameters by name: HF names, the routed experts fused (one row a
    slot; at one rank without redundant experts, slot e is logical expert e)."""
    placement = llm.engine.balancer.placement.physical_to_logical
    n = llm.engine.config.model.n_routed_experts
    if placement.shape[1] != n or not torch.equal(placement, torch.arange(n).expand_as(placement)):
        raise SystemExit("weight_update.py needs the identity placement (no rebalance, no extras)")
    model = llm.engine.executor.worker.runner.model
    return {name: param.detach() for name, param in model.named_parameters()}


def completions(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params, use_tqdm=False)]


def time_updates(llm: LLM, source, repeats: int, on_cuda: bool) -> tuple[list[float], int]:
    """Seconds of each of `repeats` updates from source, and the peak bytes allocated above
    the start (CUDA; 0 elsewhere). Each update is checked to count (weight_version)."""
    seconds, peak = [], 0
    for _ in range(repeats):
        version = llm.engine.weight_version
        if on_cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        llm.update_weights(source)
        if on_cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        if on_cuda:
            peak = max(peak, torch.cuda.max_memory_allocated() - base)
        assert llm.engine.weight_version == version + 1, "the update did not count"
    return seconds, peak


def make_source(kind: str, weights: dict) -> dict[str, torch.Tensor]:
    """A trainer's state dict of the same weights: copies on the model's device, or on the
    host."""
    device = next(iter(weights.values())).device if kind == "device" else "cpu"
    return {name: value.to(device, copy=True) for name, value in weights.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(CONFIG))
    add_override_argument(parser)
    parser.add_argument("--sources", nargs="+", default=["host", "device"],
                        choices=["host", "device"])  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    llm = LLM(args.config, **parse_overrides(args.set))
    try:
        on_cuda = llm.engine.config.parallel.device == "cuda"
        weights = own_weights(llm)
        num_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        print(
            f"model {num_bytes / 1e9:.2f} GB in {len(weights)} tensors, "
            f"device {llm.engine.config.parallel.device}"
            + (f" ({torch.cuda.get_device_name()})" if on_cuda else "")
        )
        before = completions(llm)
        for kind in args.sources:
            try:
                source = make_source(kind, weights)
                seconds, peak = time_updates(llm, source, args.repeats, on_cuda)
            except torch.OutOfMemoryError as exc:
                print(f"  {kind}: out of device memory ({str(exc).splitlines()[0]})")
                continue
            finally:
                source = None
                llm.update_weights(weights)  # drop the engine's hold on the source
                if on_cuda:
                    torch.cuda.empty_cache()
            med = statistics.median(seconds)
            print(
                f"  {kind}: {med:.3f} s [{min(seconds):.3f}, {max(seconds):.3f}] "
                f"({num_bytes / 1e9 / med:.1f} GB/s of the model) over {len(seconds)} updates"
                + (f", peak {peak / 1e9:.2f} GB allocated above the start" if on_cuda else "")
            )
        assert completions(llm) == before, "an update with the same weights changed the bits"
        print("completions after every update: the same tokens as before")
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
