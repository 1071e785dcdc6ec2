"""Serve the runtime over an OpenAI-compatible HTTP API (the Ray job's entry point).

    python launch/serve_ep.py --config launch/configs/tiny_cpu.yaml [--host H] [--port P] \
        [--set section.key=value ...] [--drain-timeout-s 30]
    ray job submit --working-dir . -- python launch/serve_ep.py --config ...

Listens first (/health answers 503 while the engine loads), loads the engine and starts its
AsyncEngine thread, prints "ready on http://host:port", then serves until SIGTERM or SIGINT: new
connections are refused, requests in flight are answered (up to the drain timeout), the engine
shuts down and the process exits 0. An engine that fails to load, or that gives up (its restarts
exhausted) while serving, exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # the checkout on the path, not launch/ (whose openai/ would shadow)
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import uvicorn  # noqa: E402

from launch.cli import add_override_argument, parse_overrides  # noqa: E402
from launch.generation import Backend  # noqa: E402
from launch.server_app import create_app  # noqa: E402
from moe_runtime.config import load_config  # noqa: E402
from moe_runtime.engine import LLMEngine  # noqa: E402
from moe_runtime.engine.async_engine import AsyncEngine  # noqa: E402

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
GIVE_UP_POLL_S = 0.5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("--host", default=None, help="overrides server.host")
    parser.add_argument("--port", type=int, default=None, help="overrides server.port (0: any)")
    add_override_argument(parser)
    parser.add_argument(
        "--drain-timeout-s",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, how long requests in flight may take to finish",
    )
    parser.add_argument("--log-level", default="warning", help="uvicorn's log level")
    return parser.parse_args(argv)


def log(message: str) -> None:
    print(f"serve_ep: {message}", flush=True)


def reclaim_stop_signals() -> None:
    """Hand SIGTERM and SIGINT back to the Python handlers registered for them (main thread).

    Why: ray.init (inside LLMEngine) installs Ray's C++ failure handler for SIGTERM over them.
    It prints a stack dump, calls the previous handler, and arms a 3 s alarm that aborts the
    process (exit 134) in the middle of any drain longer than that. Registering the same Python
    handler again puts Python's own C handler back in front of it.
    """
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.getsignal(sig))


async def load_engine(config) -> LLMEngine:
    """LLMEngine(config) on a worker thread, so that the server answers meanwhile."""
    try:
        return await asyncio.to_thread(LLMEngine, config)
    finally:
        reclaim_stop_signals()  # here, on the main thread: signal handlers can only be set there


async def exit_when_given_up(server: uvicorn.Server, engine: AsyncEngine) -> None:
    """Stop the server once the engine is dead for good (its restarts exhausted)."""
    while not server.should_exit:
        if engine.has_given_up:
            log(f"error: the engine gave up: {engine.error}; exiting")
            server.should_exit = True
            return
        await asyncio.sleep(GIVE_UP_POLL_S)


async def serve(
    server: uvicorn.Server, sock: socket.socket, url: str, app, config
) -> AsyncEngine | None:
    """Serve; load the engine meanwhile. -> its AsyncEngine, or None if the engine failed."""
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)  # uvicorn has no started event; this runs only at start-up
    log(f"listening on {url}; loading the engine (world_size={config.parallel.world_size})")
    started = time.perf_counter()
    try:
        engine = await load_engine(config)
    except Exception as exc:  # a bad checkpoint, no Ray cluster, a worker that died ...
        log(f"error: the engine failed to load: {type(exc).__name__}: {exc}")
        server.should_exit = True
        await task
        return None
    async_engine = AsyncEngine(engine)
    app.state.backend = Backend(async_engine, engine.tokenizer)
    log(f"engine loaded in {time.perf_counter() - started:.1f}s")
    if server.started and not server.should_exit:
        log(f"ready on {url}")
    watcher = asyncio.create_task(exit_when_given_up(server, async_engine))
    await task
    watcher.cancel()
    return async_engine


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = parse_overrides(args.set)
    if args.host is not None:
        overrides["server.host"] = args.host
    if args.port is not None:
        overrides["server.port"] = args.port
    try:
        config = load_config(args.config, overrides)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    host, port = config.server.host, config.server.port
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))  # fail fast on a taken port, before the (slow) model load
    except OSError as exc:
        print(f"error: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]

    app = create_app(config)
    drain_s = max(1, round(args.drain_timeout_s))
    server = uvicorn.Server(
        uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=drain_s)
    )
    # uvicorn re-raises a captured signal after its graceful shutdown; with these handlers
    # installed first, that re-raise is a no-op and we go on to drain and stop the engine.
    received: list[int] = []
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, _frame: received.append(signum))
    shown_host = f"[{host}]" if ":" in host else host
    engine = asyncio.run(serve(server, sock, f"http://{shown_host}:{port}", app, config))
    if engine is None:
        return 1
    if not engine.has_given_up:
        why = signal.Signals(received[0]).name if received else "server exit"
        log(f"{why}: draining requests in flight (up to {args.drain_timeout_s:g}s)")
    engine.shutdown(drain_timeout_s=args.drain_timeout_s)
    log("stopped")
    return 1 if engine.has_given_up else 0


if __name__ == "__main__":
    sys.exit(main())
