"""A bounded load run on loopback: good and bad requests mixed, nothing may be lost.

    python bench/serve_load.py --config launch/configs/tiny_cpu.yaml --num-requests 400 \
        --concurrency 32 [--bad-fraction 0.25] [--max-tokens 16] [--set section.key=value ...]
    python bench/serve_load.py --url http://127.0.0.1:8000 ...   # against a running server

Starts `launch/serve_ep.py` on a free port (unless --url), fires the requests from
`concurrency` concurrent httpx clients — completions, streamed completions and chat, plus bad
ones (malformed JSON, unknown fields, out-of-range values, bad token ids, over-long prompts) —
and checks every good request is answered in full and every bad one is a 400. Prints one JSON
line: counts, throughput, p50/p99 latency. Exits 1 if any request was lost or mis-answered.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
BAD_BODIES = [
    '{"prompt": "a",',
    {"prompt": "a", "frequency_penalty": 0.5},
    {"prompt": "a", "temperature": -1},
    {"prompt": "a", "n": 0},
    {"prompt": [1, 2, 100000]},
    {"prompt": [7] * 5000},
    {"messages": [], "max_tokens": 2},
]


def make_requests(num: int, bad_fraction: float, max_tokens: int, seed: int) -> list[dict]:
    """[{"kind", "path", "body"}]: kind is completion, stream, chat or bad."""
    rng = random.Random(seed)
    requests = []
    for i in range(num):
        if rng.random() < bad_fraction:
            body = rng.choice(BAD_BODIES)
            is_chat = isinstance(body, dict) and "messages" in body
            path = "/v1/chat/completions" if is_chat else "/v1/completions"
            requests.append({"kind": "bad", "path": path, "body": body})
            continue
        common = {
            "max_tokens": rng.randint(1, max_tokens),
            "temperature": rng.choice([0.0, 0.8]),
            "seed": i,
            "ignore_eos": True,
        }
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 64))]
        kind = rng.choice(["completion", "stream", "chat"])
        if kind == "chat":
            messages = [{"role": "user", "content": "".join(chr(97 + t % 26) for t in prompt)}]
            body = {"messages": messages, "logprobs": True, "top_logprobs": 2, **common}
            requests.append({"kind": kind, "path": "/v1/chat/completions", "body": body})
        else:
            body = {"prompt": prompt, "logprobs": 2, "stream": kind == "stream", **common}
            requests.append({"kind": kind, "path": "/v1/completions", "body": body})
    return requests


async def _one(client: httpx.AsyncClient, request: dict) -> tuple[str, float, int]:
    """(outcome, latency seconds, tokens generated); outcome "ok" or a description."""
    body, started = request["body"], time.perf_counter()
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {"content-type": "application/json"}
    async with client.stream("POST", request["path"], content=content, headers=headers) as resp:
        raw = await resp.aread()
    latency = time.perf_counter() - started
    if request["kind"] == "bad":
        ok = resp.status_code == 400 and b'"message"' in raw
        return ("ok" if ok else f"bad request got {resp.status_code}", latency, 0)
    if resp.status_code != 200:
        return (f"good request got {resp.status_code}: {raw[:200]!r}", latency, 0)
    if request["kind"] == "stream":
        lines = [line for line in raw.decode().split("\n") if line.startswith("data: ")]
        if not lines or lines[-1] != "data: [DONE]":
            return ("stream without [DONE]", latency, 0)
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        num = sum(len(c["token_ids"]) for chunk in chunks for c in chunk["choices"])
    else:
        num = sum(len(c["token_ids"]) for c in json.loads(raw)["choices"])
    expected = body["max_tokens"]
    return ("ok" if num == expected else f"{num} tokens, want {expected}", latency, num)


async def run_load(url: str, requests: list[dict], concurrency: int) -> dict:
    """Fire the requests from `concurrency` workers; returns the report (see module doc)."""
    queue: asyncio.Queue = asyncio.Queue()
    for item in requests:
        queue.put_nowait(item)
    results: list[tuple[dict, tuple[str, float, int]]] = []
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                item = queue.get_nowait()
                try:
                    results.append((item, await _one(client, item)))
                except httpx.HTTPError as exc:
                    results.append((item, (f"{type(exc).__name__}: {exc}", 0.0, 0)))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    good = sorted(lat for item, (outcome, lat, _) in results if item["kind"] != "bad")
    failures = [f"{item['kind']}: {res[0]}" for item, res in results if res[0] != "ok"]
    return {
        "num_requests": len(requests),
        "num_answered": len(results),
        "num_good": sum(item["kind"] != "bad" for item in requests),
        "num_bad": sum(item["kind"] == "bad" for item in requests),
        "num_failures": len(failures),
        "failures": failures[:10],
        "seconds": round(elapsed, 3),
        "requests_per_s": round(len(results) / elapsed, 2),
        "output_tokens_per_s": round(sum(res[2] for _, res in results) / elapsed, 1),
        "p50_latency_s": round(_percentile(good, 0.50), 4),
        "p99_latency_s": round(_percentile(good, 0.99), 4),
    }


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def start_server(config: str, overrides: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "launch/serve_ep.py", "--config", config, "--port", "0"]
    for item in overrides:
        cmd += ["--set", item]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if "ready on " in line:
            return proc, line.split("ready on ", 1)[1].strip()
    raise RuntimeError(f"the server exited with {proc.wait()} before it was ready")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="launch/configs/tiny_cpu.yaml")
    parser.add_argument("--url", default=None, help="a running server; else one is started")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--bad-fraction", type=float, default=0.25)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    proc, url = (None, args.url) if args.url else start_server(args.config, args.set)
    try:
        requests = make_requests(args.num_requests, args.bad_fraction, args.max_tokens, args.seed)
        report = asyncio.run(run_load(url, requests, args.concurrency))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    print(json.dumps({"concurrency": args.concurrency, **report}))
    return 0 if report["num_failures"] == 0 and report["num_answered"] == len(requests) else 1


if __name__ == "__main__":
    sys.exit(main())
