"""`Instance`: the controller's handle on one engine instance process.

It spawns `run_engine_process` with the instance's role, owns the two ZeroMQ sockets to
it, turns everything the instance sends into calls of the controller's `on_message`, and
decides when the instance is dead: its process exited, it reported a failure, or it has
sent nothing (outputs or load reports, every `report_interval_s`) for `timeout_s`.
A dead instance is never used again; the controller retries or fails its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from multiprocessing.process import BaseProcess

import msgspec
import zmq
import zmq.asyncio

from pdserve.config import EngineConfig, Role
from pdserve.engine.engine_process import run_engine_process
from pdserve.errors import EngineDeadError
from pdserve.protocol.core import (
    EngineFailed,
    EngineReady,
    EngineStats,
    LoadReport,
    Shutdown,
    StatsRequest,
)
from pdserve.protocol.wire import EngineInput, EngineMessage, encode_input

_ids = itertools.count()


class Instance:
    def __init__(
        self,
        config: EngineConfig,
        ctx: zmq.asyncio.Context,
        on_message: Callable[[Instance, EngineMessage], Awaitable[None]],
        timeout_s: float,
    ) -> None:
        self.config = config
        self.timeout_s = timeout_s
        self.name = config.instance_name
        self.role: Role = config.role
        self.on_message = on_message
        self.max_model_len = 0
        self.vocab_size = 0
        self.report: LoadReport | None = None
        self.last_heard = time.monotonic()
        self.dead: str | None = None  # why, once dead
        self._announced = False  # `check` has returned the reason
        # Controller-side load (what it assigned and has not seen finish).
        self.assigned_prefill_tokens = 0
        self.assigned_requests = 0
        self._dir = tempfile.mkdtemp(prefix=f"pdserve-{self.name}-")
        self._to = ctx.socket(zmq.PUSH)
        self._to.setsockopt(zmq.SNDHWM, 0)
        self._from = ctx.socket(zmq.PULL)
        self._to.bind(f"ipc://{self._dir}/in")
        self._from.bind(f"ipc://{self._dir}/out")
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineMessage)
        self._stats: dict[int, asyncio.Future[EngineStats]] = {}
        self._reader: asyncio.Task[None] | None = None
        self.process: BaseProcess = multiprocessing.get_context("spawn").Process(
            target=run_engine_process,
            args=(config, f"ipc://{self._dir}/in", f"ipc://{self._dir}/out", True),
            name=f"pdserve-{self.name}",
            daemon=True,
        )

    @property
    def alive(self) -> bool:
        return self.dead is None

    # ---- life cycle ----------------------------------------------------------------

    async def start(self, timeout: float) -> None:
        """Spawn the process and wait for EngineReady (EngineDeadError otherwise)."""
        self.process.start()
        await asyncio.wait_for(self._await_ready(), timeout)
        self.last_heard = time.monotonic()
        self._reader = asyncio.create_task(self._read())

    async def _await_ready(self) -> None:
        while True:
            if await self._from.poll(200):
                msg = self._decoder.decode(await self._from.recv())
                if isinstance(msg, EngineReady):
                    self.max_model_len, self.vocab_size = msg.max_model_len, msg.vocab_size
                    return
                if isinstance(msg, EngineFailed):
                    raise EngineDeadError(f"{self.name}: {msg.message}")
            elif not self.process.is_alive():
                raise EngineDeadError(
                    f"{self.name}: process exited with code {self.process.exitcode}"
                )

    def check(self, now: float) -> str | None:
        """Mark the instance dead if it is. Returns the reason exactly once, the first
        check after it died (whichever way: exit, silence, or a reported failure)."""
        if self.dead is None:
            if not self.process.is_alive():
                self.mark_dead(f"process exited (exit code {self.process.exitcode})")
            elif (silent := now - self.last_heard) > self.timeout_s:
                self.mark_dead(f"sent nothing for {silent:.1f} s")
        if self.dead is None or self._announced:
            return None
        self._announced = True
        return self.dead

    def mark_dead(self, reason: str) -> str:
        self.dead = reason
        for reply in self._stats.values():
            if not reply.done():
                reply.set_exception(EngineDeadError(f"{self.name}: {reason}"))
        if self.process.is_alive():
            self.process.kill()  # unresponsive: make sure it serves nobody half-way
        return reason

    async def shutdown(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                await self._to.send(self._encoder.encode(Shutdown()), zmq.NOBLOCK)
            await asyncio.to_thread(self.process.join, 10)
        if self.process.is_alive():
            self.process.kill()
            await asyncio.to_thread(self.process.join, 5)
        if self._reader is not None:
            self._reader.cancel()
        self._to.close(0)
        self._from.close(0)
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- messages ------------------------------------------------------------------

    def send(self, msg: EngineInput) -> bool:
        """Queue a message; False if the instance is dead or not connected."""
        if self.dead is not None:
            return False
        try:
            self._to.send(encode_input(self._encoder, msg), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    async def stats(self, check_integrity: bool, timeout: float) -> EngineStats:
        if self.dead is not None:
            raise EngineDeadError(f"{self.name}: {self.dead}")
        sid = next(_ids)
        reply = self._stats[sid] = asyncio.get_running_loop().create_future()
        try:
            if not self.send(StatsRequest(sid, check_integrity)):
                raise EngineDeadError(f"{self.name}: not connected")
            return await asyncio.wait_for(reply, timeout)
        finally:
            self._stats.pop(sid, None)

    async def _read(self) -> None:
        while True:
            msg = self._decoder.decode(await self._from.recv())
            self.last_heard = time.monotonic()
            if isinstance(msg, LoadReport):
                self.report = msg
            elif isinstance(msg, EngineStats):
                reply = self._stats.get(msg.request_id)
                if reply is not None and not reply.done():
                    reply.set_result(msg)
            elif isinstance(msg, EngineFailed):
                self.mark_dead(msg.message)
            await self.on_message(self, msg)
