"""`pdserve serve`: start the engine process, then the HTTP server on top of it."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import uvicorn

from pdserve.config import CacheConfig, EngineConfig
from pdserve.engine.client import EngineClient
from pdserve.model.loader import resolve_model
from pdserve.server.app import ServerConfig, build_app

_ENGINE_CHECK_S = 0.5


def served_name(model: str | None) -> str:
    path = resolve_model(model)
    return path.stem if path.suffix == ".gguf" else Path(path).name


async def serve(args: argparse.Namespace) -> int:
    config = EngineConfig(
        model=args.model,
        max_model_len=args.max_model_len,
        cache=CacheConfig(kv_cache_memory_gib=args.kv_cache_memory_gib),
    )
    name = args.served_model_name or served_name(args.model)
    client = await EngineClient.start(config)
    try:
        app = build_app(client, ServerConfig(name, args.api_key, args.enable_debug_endpoints))
        server = uvicorn.Server(
            uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
        )
        watch = None
        if not args.keep_running_on_engine_failure:
            watch = asyncio.create_task(_stop_when_engine_dies(client, server))
        print(f"pdserve: serving {name} at http://{args.host}:{args.port}/v1", file=sys.stderr)
        await server.serve()
        if watch is not None and watch.done():
            return 1
    finally:
        await client.shutdown()
    return 0


async def _stop_when_engine_dies(client: EngineClient, server: uvicorn.Server) -> None:
    """Without an engine the server can only fail requests: exit (non-zero) instead."""
    while client.is_alive:
        await asyncio.sleep(_ENGINE_CHECK_S)
    print("pdserve: error: the engine process died; shutting down", file=sys.stderr)
    server.should_exit = True
