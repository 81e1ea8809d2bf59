"""Running the server: `rollout serve` (uvicorn in the foreground) and
`start_server` (uvicorn on a thread of the caller's process, for a trainer
that pushes weights to the cluster the server answers from)."""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

import uvicorn

from .app import create_app
from .backend import Backend, ClusterBackend, EngineBackend
from .config import DEFAULT_MAX_INFLIGHT_REQUESTS, DEFAULT_MAX_REQUEST_TOKENS, ServerConfig
from .security import check_bind

API_KEY_ENV = "ROLLOUT_API_KEY"


def build_backend(args: argparse.Namespace) -> Backend:
    """An `Engine`, or with `args.actors` a cluster (`rollout.init`: Ray is imported only then)."""
    sizes = {
        "dtype": args.dtype,
        "max_batch_size": args.max_batch_size,
        "max_seq_len": args.max_seq_len,
        "kv_cache_tokens": args.kv_cache_tokens,
        "kv_cache_dtype": args.kv_cache_dtype,
        "matmul_dtype": args.matmul_dtype,
    }
    if args.device is not None:
        sizes["device"] = args.device
    if args.actors:
        from ..cluster.api import init

        return ClusterBackend(init(args.model, num_actors=args.actors, **sizes), owned=True)
    from ..engine.engine import Engine

    return EngineBackend(Engine(args.model, **sizes))


def api_key(args: argparse.Namespace) -> str | None:
    """The key from `--api-key`, `--api-key-file` (its text, stripped) or the
    `ROLLOUT_API_KEY` variable, in that order; None when none is set. The file
    and the variable keep the key out of the command line, which `ps` shows."""
    if args.api_key is not None and args.api_key_file is not None:
        raise ValueError("give one of --api-key and --api-key-file, not both")
    if args.api_key_file is not None:
        key = args.api_key_file.read_text().strip()
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file} is empty")
        return key
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def server_config(args: argparse.Namespace, backend: Backend, key: str | None) -> ServerConfig:
    # By default one request may fill the engine's batch at full length, four such in flight;
    # a bound in flight given alone also caps one request's work.
    full_batch = max(DEFAULT_MAX_REQUEST_TOKENS, backend.max_batch_size * backend.max_seq_len)
    if args.max_request_tokens is not None:
        max_request_tokens = args.max_request_tokens
    else:
        max_request_tokens = min(full_batch, args.max_inflight_tokens or full_batch)
    # Requests in flight: four full batches of one-prompt requests, and never fewer than the default.
    inflight_requests = max(DEFAULT_MAX_INFLIGHT_REQUESTS, 4 * backend.max_batch_size)
    if args.max_inflight_requests is not None:
        inflight_requests = args.max_inflight_requests
    return ServerConfig(
        model_name=args.served_model_name or Path(args.model).resolve().name,
        max_n=args.max_n or backend.max_batch_size,
        max_tokens=args.max_tokens_limit or backend.max_seq_len,
        api_key=key,
        allow_no_key=args.allow_no_key,
        max_body_bytes=args.max_body_bytes,
        max_request_tokens=max_request_tokens,
        max_inflight_tokens=4 * max_request_tokens if args.max_inflight_tokens is None else args.max_inflight_tokens,
        max_inflight_requests=inflight_requests,
        tool_call_parser=args.tool_call_parser,
    )


def serve(args: argparse.Namespace) -> int:
    """`rollout serve`: check the key and the address, build the backend, serve
    until interrupted, close the backend."""
    key = api_key(args)
    check_bind(args.host, key, args.allow_no_key)  # before the model loads
    backend = build_backend(args)
    try:
        app = create_app(backend, server_config(args, backend, key), args.host)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=args.access_log)
    finally:
        backend.close()
    return 0


class ServerThread:
    """A server running on a thread of this process; `stop()` ends it (the backend stays open)."""

    def __init__(self, server: uvicorn.Server, thread: threading.Thread) -> None:
        self._server, self._thread = server, thread
        port = server.servers[0].sockets[0].getsockname()[1]  # the one bound when asked for port 0
        self.url = f"http://{server.config.host}:{port}"

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)


def start_server(
    backend: Backend, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, timeout: float = 30.0
) -> ServerThread:
    """Serve `backend` on a background thread; returns once it accepts connections
    (or raises `RuntimeError` if it could not start within `timeout` seconds).
    `port=0` picks a free port (`ServerThread.url` says which). A `host` other
    machines can reach needs `config.api_key` (or `config.allow_no_key`), else `ValueError`."""
    app = create_app(backend, config, host)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="rollout-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.01)
    return ServerThread(server, thread)
