"""Serve the runtime over an OpenAI-compatible HTTP API (the Ray job's entry point).

    python launch/serve_ep.py --config launch/configs/tiny_cpu.yaml [--host H] [--port P] \
        [--set section.key=value ...] [--drain-timeout-s 30]
    ray job submit --working-dir . -- python launch/serve_ep.py --config ...

Listens first (/health answers 503 while the engine loads), loads the engine and starts its
AsyncEngine thread, prints "ready on http://host:port", then serves until SIGTERM or SIGINT: new
connections are refused, requests in flight are answered (up to the drain timeout; the rest end
with an error response; a second SIGINT or SIGTERM ends them at once), the engine shuts down
(bounded even with a stalled rank) and the process exits 0. An engine that fails to load, or
that gives up (its restarts exhausted) while serving, exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import socket
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # the checkout on the path, not launch/ (whose openai/ would shadow)
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import uvicorn  # noqa: E402

from launch.cli import (  # noqa: E402
    add_override_argument,
    configure_logging,
    connect_ray,
    parse_overrides,
)
from launch.fingerprint import system_fingerprint  # noqa: E402
from launch.generation import Backend  # noqa: E402
from launch.server_app import create_app  # noqa: E402
from moe_runtime import heap  # noqa: E402
from moe_runtime.config import load_config  # noqa: E402
from moe_runtime.engine import LLMEngine  # noqa: E402
from moe_runtime.engine.async_engine import AsyncEngine  # noqa: E402

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
STOP_POLL_S = 0.1  # uvicorn's own tick for should_exit
# After the drain timeout, how long the requests the engine ended have to send their error
# before the connections still sending are closed (a client that stopped reading).
RESPONSE_GRACE_S = 2
# uvicorn's own graceful timeout, past that close: a backstop that cancels what is left, each
# cancelled response an "Exception in ASGI application" traceback in the log.
UVICORN_BACKSTOP_S = 2 * RESPONSE_GRACE_S
# uvicorn's levels: another word was a KeyError traceback from inside uvicorn.Config.
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


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
    parser.add_argument(
        "--log-level",
        default="warning",
        type=str.lower,  # as uvicorn reads it: INFO is info
        choices=LOG_LEVELS,
        help="uvicorn's log level",
    )
    return parser.parse_args(argv)


class StoppingServer(uvicorn.Server):
    """uvicorn's Server, where a stop signal while it stops already (a second SIGINT or SIGTERM)
    cuts the drain short (`drain_cut_by`: that signal's name): the requests in flight end now
    with an error saying so.

    Why not uvicorn's own force_exit, which its log offers ("CTRL+C to force quit"): it only
    stopped waiting for the connections, so the engine's drain still ran its whole course, and
    it skipped the app's shutdown, whose task was then cancelled with an ERROR traceback. Why
    SIGTERM too: uvicorn ignores a second one, so a supervisor's second SIGTERM (or a `kill`
    sent again) left a client that stopped reading holding the exit until the drain timeout."""

    drain_cut_by: str | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit:
            self.drain_cut_by = signal.Signals(sig).name
            return
        super().handle_exit(sig, frame)


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


async def connect_ray_first(config) -> None:
    """Join the Ray cluster RAY_ADDRESS names (or start a local one) before the engine loads, on
    a worker thread, then take the stop signals back at once: a SIGTERM during a long load must
    meet our handler (drain, exit 0), not Ray's (a stack dump and an abort 3 s later)."""
    if config.parallel.world_size > 1:
        try:
            await asyncio.to_thread(connect_ray, config)
        finally:
            reclaim_stop_signals()  # here, on the main thread: only it may set handlers


async def load_engine(config) -> tuple[LLMEngine, str]:
    """LLMEngine(config) and its system_fingerprint, on a worker thread, so that the server
    answers meanwhile. The fingerprint asks every rank for its device: a rank that fails then
    fails the load (the engine shut down), not the server's start."""
    try:
        return await asyncio.to_thread(_engine_and_fingerprint, config)
    finally:
        reclaim_stop_signals()  # a Ray started by the load itself (the rebuild path's too)


def _engine_and_fingerprint(config) -> tuple[LLMEngine, str]:
    engine = LLMEngine(config)
    try:
        return engine, system_fingerprint(engine)
    except BaseException:
        engine.shutdown()
        raise


async def stop_engine_with_server(
    server: StoppingServer, engine: AsyncEngine, drain_timeout_s: float
) -> None:
    """Stop the server once the engine is dead for good (its restarts exhausted). Once the server
    is stopping (a signal, or that), drain the engine alongside uvicorn's own graceful shutdown
    and shut it down: requests still running at the drain timeout end with an error that their
    responses send (a stream's error chunk and [DONE], a 503) before uvicorn's longer timeout
    would cut them. A second stop signal meanwhile ends the drain at once."""
    while not server.should_exit:
        if engine.has_given_up:
            log(f"error: the engine gave up: {engine.error}; exiting")
            server.should_exit = True
            break
        await asyncio.sleep(STOP_POLL_S)
    if not engine.has_given_up:
        log(f"draining requests in flight (up to {drain_timeout_s:g}s)")
    closing = asyncio.create_task(close_unsent(server, drain_timeout_s + RESPONSE_GRACE_S))
    stopped = asyncio.create_task(asyncio.to_thread(engine.shutdown, drain_timeout_s))
    while not stopped.done() and server.drain_cut_by is None:
        await asyncio.sleep(STOP_POLL_S)
    if server.drain_cut_by is not None and not stopped.done():
        cut = f"a second stop signal ({server.drain_cut_by}): the drain was cut short"
        log(f"{cut}, ending the requests in flight now")
        engine.cut_drain()
    await stopped
    await closing


async def close_unsent(server: uvicorn.Server, after_s: float) -> None:
    """Close the connections still open `after_s` after the server began stopping: responses
    their clients stopped reading (a full socket buffer), which no drain can finish. Each is
    aborted (its unsent bytes dropped: the client sees the connection close) with one line
    here. Why not uvicorn's graceful timeout: it cancels such a response's task, and each logs
    an "Exception in ASGI application" traceback. Aborted, the response's writes return and it
    ends as for a client that left. `server_state.connections` holds uvicorn's open connections
    (its protocols, each with its asyncio transport)."""
    deadline = time.monotonic() + after_s
    while server.server_state.connections and time.monotonic() < deadline:
        await asyncio.sleep(STOP_POLL_S)
    for connection in list(server.server_state.connections):
        transport = getattr(connection, "transport", None)  # (not uvicorn's documented API)
        if transport is None or transport.is_closing():
            continue
        host, port = transport.get_extra_info("peername", ("?", "?"))[:2]
        unsent = transport.get_write_buffer_size()
        log(
            f"closed the connection to {host}:{port}, still open {after_s:g}s after the stop "
            f"with {unsent} bytes unsent (a client that stopped reading)"
        )
        transport.abort()


async def serve(
    server: StoppingServer, sock: socket.socket, url: str, app, config, drain_timeout_s: float
) -> AsyncEngine | None:
    """Serve; load the engine meanwhile; drain and stop it with the server. -> its (stopped)
    AsyncEngine, or None if the engine failed."""
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)  # uvicorn has no started event; this runs only at start-up
    started = time.perf_counter()
    try:
        await connect_ray_first(config)
        log(f"listening on {url}; loading the engine (world_size={config.parallel.world_size})")
        engine, fingerprint = await load_engine(config)
    except Exception as exc:  # a bad checkpoint, no Ray cluster, a worker that died ...
        log(f"error: the engine failed to load: {type(exc).__name__}: {exc}")
        server.should_exit = True
        await task
        return None
    async_engine = AsyncEngine(engine)
    app.state.backend = Backend(async_engine, engine.tokenizer, fingerprint)
    # Start-up's objects out of the cyclic collector: no full collection of them stalls the
    # requests (moe_runtime/heap.py; a rebuild thaws them and freezes again).
    num_frozen = heap.freeze()
    log(f"engine loaded in {time.perf_counter() - started:.1f}s ({num_frozen} objects frozen)")
    if server.started and not server.should_exit:
        log(f"ready on {url}")
    stopping = asyncio.create_task(stop_engine_with_server(server, async_engine, drain_timeout_s))
    try:
        await task
    finally:
        server.should_exit = True  # also when uvicorn ended by itself: the engine stops too
        await stopping
    return async_engine


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not (math.isfinite(args.drain_timeout_s) and args.drain_timeout_s >= 0):
        print(
            f"error: --drain-timeout-s must be a finite number >= 0, got {args.drain_timeout_s}",
            file=sys.stderr,
        )
        return 2
    configure_logging()
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
    graceful_s = math.ceil(args.drain_timeout_s) + RESPONSE_GRACE_S + UVICORN_BACKSTOP_S
    server = StoppingServer(
        uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=graceful_s)
    )
    # uvicorn re-raises a captured signal after its graceful shutdown; with these handlers
    # installed first, that re-raise is a no-op and we go on to exit (the engine stopped with it).
    received: list[int] = []
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, _frame: received.append(signum))
    shown_host = f"[{host}]" if ":" in host else host
    url = f"http://{shown_host}:{port}"
    engine = asyncio.run(serve(server, sock, url, app, config, args.drain_timeout_s))
    if engine is None:
        return 1
    log(f"stopped ({signal.Signals(received[0]).name if received else 'server exit'})")
    return 1 if engine.has_given_up else 0


if __name__ == "__main__":
    sys.exit(main())
