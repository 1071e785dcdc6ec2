"""Helpers for the HTTP server tests: an in-process server on loopback, serve_ep as a
subprocess, and SSE parsing."""

from __future__ import annotations

import contextlib
import json
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import uvicorn

from launch.fingerprint import system_fingerprint
from launch.generation import Backend
from launch.server_app import create_app
from moe_runtime.config import load_config
from moe_runtime.engine import LLMEngine
from moe_runtime.engine.async_engine import AsyncEngine
from tests.checkpoints import write_tiny_checkpoint
from tests.invariance import TINY_CONFIG

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def running_server(overrides: dict | None = None, headers: dict | None = None, config=TINY_CONFIG):
    """An in-process server (uvicorn in a thread) on a free loopback port, and an HTTP client
    (sending `headers` with every request)."""
    config = load_config(config, overrides)
    engine = LLMEngine(config)
    fingerprint = system_fingerprint(engine)
    async_engine = AsyncEngine(engine)
    app = create_app(config, Backend(async_engine, engine.tokenizer, fingerprint))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not uv.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        limits = httpx.Limits(max_connections=64)
        with httpx.Client(base_url=url, timeout=60, limits=limits, headers=headers) as http:
            yield SimpleNamespace(
                url=url,
                http=http,
                async_engine=async_engine,
                engine=engine,
                model=config.server.model_name,
            )
    finally:
        uv.should_exit = True
        thread.join(timeout=10)
        async_engine.shutdown(drain_timeout_s=5)


def num_running(async_engine) -> int:
    """Sequences running now, read on the engine thread (`stats()` is as of the last step, and
    no step follows an abort of the last request)."""
    return async_engine.call(lambda engine: engine.stats().num_running).result(timeout=30)


def sse_events(http: httpx.Client, path: str, body: dict) -> list[dict]:
    """POST with stream=true; the parsed `data:` payloads up to [DONE] (asserted present)."""
    events = []
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return events
            events.append(json.loads(line[len("data: ") :]))
    raise AssertionError("the stream ended without data: [DONE]")


def merge_completion_chunks(chunks: list[dict]) -> dict[int, dict]:
    """{choice index: choice with text, token_ids and logprobs concatenated over its chunks}."""
    merged: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            m = merged.setdefault(
                c["index"],
                {
                    "text": "",
                    "token_ids": [],
                    "finish_reason": None,
                    "stop_reason": None,
                    "logprobs": None,
                },
            )
            m["text"] += c["text"]
            m["token_ids"] += c["token_ids"]
            m["finish_reason"] = c["finish_reason"] or m["finish_reason"]
            if c["stop_reason"] is not None:  # the final chunk's: null before it
                assert m["finish_reason"] == "stop" and m["stop_reason"] is None, (c, m)
                m["stop_reason"] = c["stop_reason"]
            if c["logprobs"] is not None:
                lp = m["logprobs"] = m["logprobs"] or {
                    "tokens": [],
                    "token_logprobs": [],
                    "top_logprob_ids": [],
                }
                for key in lp:
                    lp[key] += c["logprobs"][key]
    return merged


def write_checkpoint(path, seed: int) -> str:
    """A random tiny DeepSeek-V3 checkpoint written by transformers into `path`."""
    write_tiny_checkpoint(path, "v3", seed=seed, q_lora_rank=None)
    return str(path)


class ServeEp:
    """launch/serve_ep.py as a subprocess on a free loopback port, its stdout and stderr read
    line by line on threads (`wait_for`); `url` once it said it is ready."""

    def __init__(self, *args: str, config=TINY_CONFIG) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "launch/serve_ep.py", "--config", str(config), "--port", "0", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines = {"stdout": queue.Queue(), "stderr": queue.Queue()}
        self.seen: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._readers = [
            threading.Thread(target=self._read, args=(name,), daemon=True) for name in self.lines
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, name: str) -> None:
        for line in getattr(self.proc, name):
            self.lines[name].put(line)

    def wait_for(self, text: str, timeout_s: float, stream: str = "stdout") -> str:
        """The first line of `stream` holding `text` (the lines read meanwhile kept in seen)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines[stream].get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                tail = "".join(self.seen[stream][-40:])
                raise AssertionError(f"no {stream} line with {text!r} in:\n{tail}") from None
            self.seen[stream].append(line)
            if text in line:
                return line

    def ready_url(self, timeout_s: float = 60) -> str:
        return self.wait_for("ready on ", timeout_s).split("ready on ", 1)[1].strip()

    def rest(self, stream: str) -> list[str]:
        """Every line of `stream` once the process has exited (seen, then the unread)."""
        for reader in self._readers:
            reader.join(timeout=10)  # the pipes are at their end
        while not self.lines[stream].empty():
            self.seen[stream].append(self.lines[stream].get())
        return self.seen[stream]

    def kill(self) -> None:
        """Kill it if it still runs (a test's finally)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
