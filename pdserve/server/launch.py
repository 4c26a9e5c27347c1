"""`pdserve serve`: start the engine process, then the HTTP server on top of it.

Shutdown (SIGTERM or Ctrl-C): new `/v1/*` requests get 503 and `/health` turns 503
at once; in-flight requests run to completion for up to `--shutdown-timeout`
seconds, then the rest are cancelled (an error body, or an SSE error event); then
uvicorn stops and the engine process is shut down. A second signal skips the wait.
The exit status is 0 after a signal and 1 when the engine process died.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import logging
import socket
import sys
from pathlib import Path
from types import FrameType

import uvicorn

from pdserve.cluster import forkserver
from pdserve.cluster.config import ClusterConfig, instance_configs
from pdserve.cluster.controller import Cluster
from pdserve.cluster.instance import Launcher
from pdserve.cluster.replanning import SplitPlanner
from pdserve.config import EngineConfig, deployment_activations
from pdserve.errors import RequestCancelledError
from pdserve.model.quantization import resolve_quantization
from pdserve.model.source import load_config, resolve_model
from pdserve.model.tokenizer import convert_into_cache, converts
from pdserve.predictor.shipped import resolve_predictor
from pdserve.protocol.core import WeightsInfo
from pdserve.runtime import freeze_startup_heap
from pdserve.server.admission import Admission
from pdserve.server.app import ServerConfig, build_app
from pdserve.server.backend import ServingBackend
from pdserve.server.grammars import GrammarConfig
from pdserve.server.http import header_deadline_protocol

_ENGINE_CHECK_S = 0.5
_CANCEL_GRACE_S = 5.0  # for cancelled requests to send their error and close


def served_name(model: str | None) -> str:
    path = resolve_model(model)
    return path.stem if path.suffix == ".gguf" else Path(path).name


def engine_config(
    args: argparse.Namespace, flags: EngineConfig, cluster: ClusterConfig
) -> EngineConfig:
    """The instances' config: `flags` (server/flags.py, which checked each parallel
    instance's layout) checked against the model file. A --quantization that does not fit
    the model, a KV cache dtype its attention cannot read, or a pipeline stage's staging
    that cannot hold a sequence, is a usage error here, before any instance starts. The
    activations are the deployment's (`deployment_activations`: `auto` is fp32 in every
    instance when one is tensor-parallel)."""
    instances = instance_configs(cluster, flags)
    activations = deployment_activations(
        flags.activations, [c.tensor_parallel_size for c in instances]
    )
    flags = dataclasses.replace(flags, activations=activations)
    # In a child of the instances' fork server, which has the kernels' modules (and
    # torch) imported: this process never loads them (cluster/forkserver.py `call`).
    quant = forkserver.call(
        resolve_quantization,
        flags.quantization,
        flags.model,
        flags.device,
        flags.activations,
        flags.dtype,
    )
    flags.kv_dtype(quant.quantized)  # bfloat16 under quantized weights: the usage error
    staged = [c for c in instances if c.microbatch_swap_blocks]  # layouts: server/flags.py
    if staged:
        from pdserve.engine.engine import check_staging_fits  # torch: only here

        model = load_config(resolve_model(flags.model))
        for instance in staged:
            check_staging_fits(instance, model, quant.quantized)
    if converts(flags.model):  # a first start: the GGUF's tokenizer is converted there too
        forkserver.call(convert_into_cache, resolve_model(flags.model))
    config = dataclasses.replace(
        flags, length_predictor=resolve_predictor(args.predictor, args.model)
    )
    return config


def predictor_line(config: EngineConfig, cluster: ClusterConfig) -> str:
    """What the length-aware policies go by (docs/scheduling.md)."""
    if config.length_predictor is not None:
        return f"pdserve: output-length predictor {config.length_predictor}"
    return (
        "pdserve: no output-length predictor: sjf/ljf sort by prompt tokens, decode dispatch "
        f"counts max_tokens >= {cluster.heavy_decode_tokens} as heavy, admission reserves "
        "up to max_tokens"
    )


async def start_backend(
    args: argparse.Namespace,
    config: EngineConfig,
    cluster: ClusterConfig,
    planner: SplitPlanner | None = None,
) -> ServingBackend:
    print(predictor_line(config, cluster), file=sys.stderr)
    if cluster.num_instances > 1:
        for cfg in instance_configs(cluster, config):
            print(
                f"pdserve: instance {cfg.instance_name}: {cfg.threads} CPU threads",
                file=sys.stderr,
            )
    launcher = await asyncio.to_thread(ray_launcher, args, cluster, config) if args.ray else None
    backend = await Cluster.start(config, cluster, launcher=launcher, planner=planner)
    print(weights_line(backend.weights), file=sys.stderr)
    if launcher is not None:
        for inst in backend.instances:
            print(f"pdserve: instance {inst.name} on Ray node {inst.node}", file=sys.stderr)
    return backend


def ray_launcher(
    args: argparse.Namespace, cluster: ClusterConfig, config: EngineConfig
) -> Launcher:
    """Join the Ray cluster and check the instances fit its nodes (cluster/ray_launch.py)."""
    try:
        from pdserve.cluster import ray_launch
    except ImportError as e:
        raise ValueError(f"--ray needs Ray: pip install 'pdserve[ray]' ({e})") from None
    return ray_launch.make_launcher(args.ray_address, cluster, instance_configs(cluster, config))


def weights_line(weights: WeightsInfo) -> str:
    """How the weights are served, and why where `auto` fell back to fp; and what the KV
    cache holds."""
    formats, kv = ", ".join(weights.formats), f"; KV cache: {weights.kv_cache_dtype}"
    if weights.formats == ["stub"]:
        return f"pdserve: weights: none ({weights.note}){kv}"
    if weights.quantization == "none":
        why = f" (--quantization auto: {weights.note})" if weights.note else ""
        how = ", by the compiled kernels" if weights.compiled else ""
        return f"pdserve: weights: {formats}{why}{how}{kv}"
    how = "int8 activations" if "int8" in weights.activations else "fp32 activations"
    return (
        f"pdserve: weights: {formats} blocks ({weights.quantization}), by the compiled kernels "
        f"({how}){kv}"
    )


def _log_to_stderr() -> None:
    """The front end's own events (an instance failed, how each of its requests
    recovered: `pdserve.recovery`) on stderr, beside the server's other lines."""
    logger = logging.getLogger("pdserve")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("pdserve: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


async def serve(
    args: argparse.Namespace,
    flags: EngineConfig,
    cluster: ClusterConfig,
    listener: socket.socket,
    planner: SplitPlanner | None = None,
) -> int:
    """Serve on `listener` (`flags.listen`: bound already) until a signal (0) or an engine's
    death (1). `flags` and `cluster` are `check_serve_flags(args)`'s: the flags were
    checked before this module was imported. `planner`: the distserve flip policy's
    (the entry point builds it from the planner, a layer above this one)."""
    config = engine_config(args, flags, cluster)
    name = args.served_model_name or served_name(args.model)
    _log_to_stderr()
    client = await start_backend(args, config, cluster, planner)
    watch: asyncio.Task[None] | None = None
    try:
        admission = Admission(args.max_body_bytes, args.api_key, args.body_timeout)
        server_config = ServerConfig(
            name,
            args.api_key,
            args.enable_debug_endpoints,
            admin_endpoints=not args.disable_admin_endpoints,
            grammars=GrammarConfig(timeout_s=args.grammar_timeout),
        )
        app = build_app(client, server_config, admission)
        uv = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="warning",
            http=header_deadline_protocol(args.header_timeout),
            timeout_graceful_shutdown=int(_CANCEL_GRACE_S),
        )
        server = _DrainingServer(uv, client, admission, args.shutdown_timeout)
        if not args.keep_running_on_engine_failure:
            watch = asyncio.create_task(_stop_when_engine_dies(client, server))
        # Starlette's streaming responses load anyio's asyncio backend on first use
        # (~0.2 s): load it now, not inside the first streamed request's TTFT.
        importlib.import_module("anyio._backends._asyncio")
        freeze_startup_heap()
        port = listener.getsockname()[1]
        print(f"pdserve: serving {name} at http://{args.host}:{port}/v1", file=sys.stderr)
        await server.serve(sockets=[listener])
        engine_died = watch is not None and watch.done()
    finally:
        if watch is not None:
            watch.cancel()  # the shutdown below ends the engines: not a death to report
        await client.shutdown()
    return 1 if engine_died else 0


class _DrainingServer(uvicorn.Server):
    """uvicorn, but the first signal drains instead of closing the listener: requests
    that arrive meanwhile are answered 503 rather than refused at the socket."""

    def __init__(
        self, config: uvicorn.Config, client: ServingBackend, admission: Admission, timeout: float
    ) -> None:
        super().__init__(config)
        self.client = client
        self.admission = admission
        self.timeout = timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None
        self._stopping = False  # a second signal came: stopping without the drain

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs as a signal handler on the loop's thread: only schedule work here. The
        # first signal drains; the second stops now: the requests still in flight are
        # cancelled (each answered with why) and the application still shuts down - a
        # forced exit skips that, and its cancelled lifespan task printed a traceback. A
        # third forces the exit.
        if self._loop is None or self._stopping:
            self.should_exit = self.force_exit = True
            return
        if self.admission.draining:
            self._stopping = True
            self._loop.call_soon_threadsafe(self._stop_now)
            return
        self.admission.draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self.admission.start_draining()
        self._drain = asyncio.create_task(self._drain_then_exit())

    def _stop_now(self) -> None:
        if self._drain is not None:
            self._drain.cancel()
        error = RequestCancelledError("the server is shutting down: stopped by a second signal")
        cancelled = self.client.cancel_all(error)
        if cancelled:
            print(f"pdserve: shutting down: cancelled {cancelled} requests", file=sys.stderr)
        self.should_exit = True

    async def _drain_then_exit(self) -> None:
        adm = self.admission
        if adm.inflight:
            print(
                f"pdserve: shutting down: {adm.inflight} requests in flight, waiting up to "
                f"{self.timeout:g} s (signal again to stop now)",
                file=sys.stderr,
            )
        if not await adm.wait_idle(self.timeout):
            error = RequestCancelledError(
                f"the server is shutting down and the request did not finish within the "
                f"shutdown timeout of {self.timeout:g} s"
            )
            cancelled = self.client.cancel_all(error)
            print(f"pdserve: shutting down: cancelled {cancelled} requests", file=sys.stderr)
            await adm.wait_idle(_CANCEL_GRACE_S)
        self.should_exit = True


async def _stop_when_engine_dies(client: ServingBackend, server: uvicorn.Server) -> None:
    """Without an engine the server can only fail requests: exit (non-zero) instead."""
    while client.is_alive:
        await asyncio.sleep(_ENGINE_CHECK_S)
    print("pdserve: error: the engine process died; shutting down", file=sys.stderr)
    server.should_exit = True
