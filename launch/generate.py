"""Generate from prompts on one rank: the README's first command until the Ray job lands.

    python launch/generate.py --config launch/configs/tiny_cpu.yaml --prompt "Hello" \
        [--max-tokens 32] [--temperature 0] [--seed 0] [--logprobs 5] [--set kernels.mode=fast]

Prints one JSON line per prompt: token ids, text, chosen-token logprobs, top logprobs,
finish_reason and stop_reason (as a rollout row's), in strict JSON (launch/strict_json.py: a
-inf logprob as -9999.0). A prompt whose sample ended with finish_reason "error" (its logits
were not finite) or whose output holds a NaN is named on stderr instead, the other lines
printed, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # the checkout on the path, not launch/ (whose openai/ would shadow)
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from launch import cli, strict_json  # noqa: E402
from moe_runtime import LLM, SamplingParams  # noqa: E402
from moe_runtime.config import load_config  # noqa: E402
from moe_runtime.executor import WorkerError  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument(
        "--prompt", action="append", default=None, help="a text prompt (repeatable)"
    )
    cli.add_sampling_arguments(parser, max_tokens=32, temperature=0.0, logprobs=5)
    parser.add_argument("--seed", type=int, default=0)
    cli.add_override_argument(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cli.check_sampling_flags({"seed": args.seed, **cli.sampling_args(args)})
        params = SamplingParams(seed=args.seed, **cli.sampling_args(args))
        started = time.perf_counter()
        config = load_config(args.config, cli.parse_overrides(args.set))
        cli.connect_ray(config)
        llm = LLM(config)
        print(f"loaded {args.config} in {time.perf_counter() - started:.1f}s", file=sys.stderr)
        prompts = args.prompt or ["The quick brown fox"]
        started = time.perf_counter()
        outputs = llm.generate(prompts, params)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (ConnectionError, WorkerError) as exc:  # no Ray cluster answers; a rank failed
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: one line, as rollout.py and serve_ep.py end
        print("generate: interrupted (SIGINT); nothing was printed", file=sys.stderr)
        return 128 + signal.SIGINT
    elapsed = time.perf_counter() - started
    num_tokens = sum(len(o.token_ids) for o in outputs)
    unwritten = 0
    for index, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        row = {
            "prompt": prompt,
            "text": out.text,
            "token_ids": out.token_ids,
            "logprobs": out.logprobs,
            "top_logprobs": cli.json_top_logprobs(out.top_logprobs),
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
        }
        if out.finish_reason == "error":  # its logits were not finite: out.error says where
            print(f"error: prompt {index} not printed: {out.error}", file=sys.stderr)
            unwritten += 1
            continue
        try:
            print(strict_json.dumps(row))
        except strict_json.NonFiniteError as exc:  # the model's logits held a NaN for it
            print(f"error: prompt {index} not printed: {exc}", file=sys.stderr)
            unwritten += 1
    print(
        f"generated {num_tokens} tokens for {len(prompts)} prompt(s) in {elapsed:.2f}s",
        file=sys.stderr,
    )
    llm.shutdown()
    return 1 if unwritten else 0


if __name__ == "__main__":
    cli.configure_logging()  # here, not in main(): a caller of main() keeps its logging
    sys.exit(main())
