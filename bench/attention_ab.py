"""Forms of the 128-head Gluon attention kernel against the tree's, in one run on one GPU.

A form is a copy of moe_kernels/gluon_attention.py with its kernel changed (any file that
defines launch_wide_split with that module's signature). Each is swapped in as the invariant
op's split launch (mla_attention_triton: the op's own split rule, merge and buffers around it)
and timed by graph replay over caches that miss L2, in rounds of: the tree's kernel, each
form, the tree's again (drift shows as the two tree columns differing). Beside them fast
mode's decode attention with one plan a step (FlashMLA where installed). Each form's output
on one seeded input is compared with the tree's: `equal` bit for bit, else the largest
difference, so a broken form shows as a large one.

    python bench/attention_ab.py [FORM.py ...] [--ablations nocopy noxchg ...]
        [--shapes 64x1024 64x4096 ...] [--heads 128] [--rounds 3]

--ablations makes diagnostic forms from the tree's kernel (ABLATIONS: each takes one thing
out, to time what it costs; all but novbar compute wrong outputs on purpose).

Tables are as wide as the engine's decode graph for the context (--table-width: another
width, and with it the launch's split grid and merge) and every query sits at position ctx
(a context one past a block's end, as in a decode step). Why in the tree: the A/B figures
in BENCHMARKS.md came from session-local wrappers that could not be rerun.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_SHAPES = ("64x1024", "64x4096", "1x4096", "256x1024", "8x8000")
KERNEL = ROOT / "moe_kernels" / "gluon_attention.py"

# Diagnostic forms: the tree's kernel with one thing taken out, to time what it costs. Only
# novbar keeps the tree's bits; the others compute wrong outputs on purpose (finite ones: the
# stale or unmasked rows are real cache rows). Each edit is (text in the kernel, its
# replacement); a kernel that no longer holds the text fails with the ablation's name.
ABLATIONS = {
    "nocopy": (
        "no cache copies after the first pair: the loader signals each tile ready without one",
        [
            (
                "    _copy_part(tile_desc, block_id, part, (k_lo_s, k_hi_s, k_pe_s)[part]"
                ".index(stage), ready, stage)",
                "    if part == PE:\n"
                "        mbarrier.expect(ready[PE][0][stage], 0)\n"
                "    else:\n"
                "        for c in gl.static_range(4):\n"
                "            mbarrier.expect(ready[part][c][stage], 0)",
            )
        ],
    ),
    "noxchg": (
        "no max exchange between the partitions: each steps its softmax on its own block's max",
        [
            (
                "            if has_b:\n"
                "                mbarrier.wait(mx_bar[1], phase)\n"
                "                m_new = gl.maximum(m_new, mx_s[1].load(ROW))\n"
                "        else:\n"
                "            mbarrier.wait(mx_bar[0], phase)\n"
                "            m_new = gl.maximum(gl.maximum(m_run, mx_s[0].load(ROW)), mx)",
                "        else:\n            m_new = gl.maximum(m_run, mx)",
            )
        ],
    ),
    "novbar": (
        "no CTA barrier before the releases after the value products (the tree's bits)",
        [
            (
                "acc = _value_product(gl.convert_layout(p16, P_L), k_half.index(W), acc, vp, "
                "V_PARTS)\n            gl.thread_barrier()",
                "acc = _value_product(gl.convert_layout(p16, P_L), k_half.index(W), acc, vp, "
                "V_PARTS)",
            ),
            (
                "acc = _value_product(other_p, k_half.index(1 - W), acc, vp, V_PARTS)\n"
                "            gl.thread_barrier()",
                "acc = _value_product(other_p, k_half.index(1 - W), acc, vp, V_PARTS)",
            ),
        ],
    ),
    "noother": (
        "no value product of the other partition's block (its wait and release kept)",
        [
            (
                "            acc = _value_product(other_p, k_half.index(1 - W), acc, vp, "
                "V_PARTS)\n",
                "",
            )
        ],
    ),
    "nomask": (
        "no key mask on the scores",
        [('    return gl.where(kv_ok[None, :], sc, float("-inf"))', "    return sc")],
    ),
    "noexp": (
        "no exp2 of the scores: the probabilities are their scaled differences from the max, "
        "floored at -1 (a max on the ALU where each element took a special-function exp2)",
        [
            (
                "            p = gl.exp2(sc * scale - m_new[:, None])",
                "            p = gl.maximum(sc * scale - m_new[:, None], -1.0)",
            )
        ],
    ),
    "norescale": (
        "no rescale of the value accumulator by the step's alpha (128 multiplies a thread)",
        [("        acc = acc * gl.convert_layout(alpha, OROW)[:, None]\n", "")],
    ),
}


def parse_shape(text: str) -> tuple[int, int]:
    """'BxCTX' -> (B, ctx), both positive; ValueError naming the text otherwise."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"shape {text!r} is not BxCTX with positive integers (e.g. 64x1024)")
    return int(parts[0]), int(parts[1])


def load_form(path: str):
    """The launch_wide_split of the module at path (a form of gluon_attention.py)."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"form {path!r} is not a file")
    spec = importlib.util.spec_from_file_location(f"attention_form_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    launch = getattr(module, "launch_wide_split", None)
    if not callable(launch):
        raise ValueError(f"form {path!r} defines no launch_wide_split")
    return launch


def write_ablation(name: str, directory: Path) -> Path:
    """The tree's kernel module with ablation `name`'s edits, written to directory/name.py."""
    if name not in ABLATIONS:
        raise ValueError(f"ablation {name!r} is not one of {', '.join(ABLATIONS)}")
    text = KERNEL.read_text()
    for old, new in ABLATIONS[name][1]:
        if text.count(old) != 1:
            raise ValueError(
                f"ablation {name!r}: {KERNEL.name} holds its text {text.count(old)} times, not "
                f"once (the kernel changed; update the edit): {old[:60]!r}"
            )
        text = text.replace(old, new)
    path = directory / f"{name}.py"
    path.write_text(text)
    return path


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("forms", nargs="*", help="copies of moe_kernels/gluon_attention.py")
    parser.add_argument(
        "--ablations", nargs="+", default=[], choices=list(ABLATIONS),
        help="diagnostic forms made from the tree's kernel: "
        + "; ".join(f"{k}: {v[0]}" for k, v in ABLATIONS.items()),
    )  # fmt: skip
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="BxCTX")
    parser.add_argument("--heads", type=int, default=128, help="query heads (64 or more)")
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds (median, range)")
    parser.add_argument(
        "--table-width", type=int, default=None,
        help="block table entries a query (default: the engine's decode graph's for the "
        "context); the launch's split grid and its merge follow it",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        args.shapes = [parse_shape(s) for s in args.shapes]
    except ValueError as exc:
        parser.error(str(exc))
    if args.heads < 64 or args.heads % 64:
        parser.error(f"--heads {args.heads} must be a multiple of 64 (the Gluon kernel's)")
    if not args.forms and not args.ablations:
        parser.error("name at least one form file or --ablations")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds} must be at least 1")
    most = max(ctx // 64 + 1 for _, ctx in args.shapes)
    if args.table_width is not None and args.table_width < most:
        parser.error(
            f"--table-width {args.table_width} holds fewer than the {most} blocks of the "
            f"longest context"
        )
    return args


def summary(times: list[float], base: float | None = None) -> str:
    """µs median [min-max] of the rounds, and the ratio of the median to base."""
    med = statistics.median(times)
    cell = f"{med * 1e3:.1f}"
    if len(times) > 1:
        cell += f" [{min(times) * 1e3:.1f}-{max(times) * 1e3:.1f}]"
    return cell + (f" ({med / base:.3f})" if base else "")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch
    import triton

    from bench.gluon_ws_attention import _split_launch
    from bench.gpu_kernels import ATTENTION_GRAPH_CALLS, _graph_ms, engine_decode_step
    from moe_kernels.fast_attention import HAS_FLASH_MLA, mla_decode_fast
    from moe_kernels.gluon_attention import launch_wide_split
    from moe_kernels.triton_attention import mla_attention_triton

    made = Path(tempfile.mkdtemp(prefix="attention_ab_"))
    paths = [*args.forms, *(str(write_ablation(n, made)) for n in args.ablations)]
    forms = [(Path(p).stem, load_form(p)) for p in paths]
    names = ["tree", *(name for name, _ in forms), "tree again"]
    launches = [launch_wide_split, *(launch for _, launch in forms), launch_wide_split]
    print(
        f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton "
        f"{triton.__version__}  FlashMLA {'installed' if HAS_FLASH_MLA else 'not installed'}; "
        f"{args.heads} heads, {args.rounds} round(s), µs median [range] (ratio to the tree's "
        f"first column)"
    )
    print(f"| B | ctx | fast, one plan | {' | '.join(names)} | bits against the tree |")
    print("|---|---|---|" + "---|" * (len(names) + 1))
    for batch, ctx in args.shapes:
        blocks = ctx // 64 + 1
        step = engine_decode_step(batch, ctx, args.heads, args.table_width)
        read = batch * (ctx + 1) * 576 * 2

        def make(op, batch=batch, blocks=blocks, step=step, seed=None):
            if seed is not None:
                torch.manual_seed(seed)
            kv = torch.randn(batch * blocks, 64, 576, device="cuda").bfloat16()
            q = torch.randn(batch, args.heads, 576, device="cuda").bfloat16()
            return lambda: op(q, kv, *step, scale=192**-0.5, v_dim=512)

        def timed(launch, make=make, read=read):
            with _split_launch(launch):
                return _graph_ms(partial(make, mla_attention_triton), read, ATTENTION_GRAPH_CALLS)

        def output(launch, make=make, seed=batch * 7 + ctx):
            with _split_launch(launch):
                return make(mla_attention_triton, seed=seed)()

        times = [[] for _ in launches]
        fast = []
        for _ in range(args.rounds):
            fast.append(_graph_ms(partial(make, mla_decode_fast), read, ATTENTION_GRAPH_CALLS))
            for i, launch in enumerate(launches):
                times[i].append(timed(launch))
        base = statistics.median(times[0])
        reference = output(launch_wide_split)
        bits = []
        for name, launch in forms:
            out = output(launch)
            if torch.equal(out, reference):
                bits.append(f"{name} equal")
            else:
                diff = (out.float() - reference.float()).abs().max().item()
                bits.append(f"{name} max diff {diff:.3g}")
        cells = [summary(times[0]), *(summary(t, base) for t in times[1:])]
        print(
            f"| {batch} | {ctx} | {summary(fast, base)} | {' | '.join(cells)} | "
            f"{'; '.join(bits)} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
