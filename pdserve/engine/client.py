"""`EngineClient`: the frontend of an engine core that runs in its own process.

The frontend tokenizes, detokenizes and watches stop strings (`OutputProcessor`);
the core process (`engine_process.py`) only sees token ids. They exchange the
msgspec messages of `messages.py` over two ZeroMQ IPC sockets that the client
binds in a private temporary directory.

Contract
--------
* `generate` yields `RequestOutput`s; the last has `finished=True`. A request the
  core refuses raises `InvalidRequestError` (or `EngineOverloadedError` when its
  waiting queue is full) from the first iteration; nothing was allocated for it.
* A consumer that stops iterating (client gone, task cancelled) aborts its request;
  the core applies the abort before its next step, so the request's KV blocks are
  back in the pool within one step.
* If the core process dies or reports a failure, every open request raises
  `EngineDeadError` (a watchdog polls the process every 0.2 s), `is_alive` turns
  False, and new requests are refused with the same error.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import shutil
import tempfile
import time
from collections.abc import AsyncGenerator, Sequence
from multiprocessing.process import BaseProcess

import msgspec
import zmq
import zmq.asyncio

from pdserve.config import EngineConfig
from pdserve.engine.engine_process import run_engine_process
from pdserve.engine.output_processor import LoopBudget, OutputProcessor
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.validation import check_request
from pdserve.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from pdserve.model.loader import resolve_model
from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.core import (
    AbortRequests,
    AddRequest,
    EngineFailed,
    EngineReady,
    EngineStats,
    OutputBatch,
    RequestRejected,
    Shutdown,
    StatsRequest,
)
from pdserve.protocol.wire import EngineInput, EngineMessage, encode_input

_WATCHDOG_S = 0.2

Item = RequestOutput | BaseException


class EngineClient:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer: Tokenizer | None = None
        self.max_model_len = 0
        self.vocab_size = 0
        self.num_retries = 0  # one engine: nothing to retry on (the `ServingBackend` counters)
        self.num_failed = 0
        self._dir = tempfile.mkdtemp(prefix="pdserve-")
        self._ctx = zmq.asyncio.Context()
        self._to_core = self._ctx.socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.SNDHWM, 0)  # never block a send on a full queue
        self._from_core = self._ctx.socket(zmq.PULL)
        self._to_core.bind(f"ipc://{self._dir}/in")
        self._from_core.bind(f"ipc://{self._dir}/out")
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineMessage)
        self._queues: dict[str, asyncio.Queue[Item]] = {}
        self._stats: dict[int, asyncio.Future[EngineStats]] = {}
        self._processor: OutputProcessor | None = None
        self._budget = LoopBudget()
        self._dead: EngineDeadError | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._ids = itertools.count()
        self.process: BaseProcess = multiprocessing.get_context("spawn").Process(
            target=run_engine_process,
            args=(config, f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"),
            name="pdserve-engine-core",
            daemon=True,
        )

    # ---- life cycle ------------------------------------------------------------

    @classmethod
    async def start(cls, config: EngineConfig, timeout: float = 600.0) -> EngineClient:
        """Spawn the core process and wait until it is ready (or failed)."""
        client = cls(config)
        client.process.start()
        try:
            tokenizer = asyncio.to_thread(Tokenizer.from_model_path, resolve_model(config.model))
            client.tokenizer = await tokenizer
            client._processor = OutputProcessor(client.tokenizer)
            await asyncio.wait_for(client._await_ready(), timeout)
        except BaseException:
            await client.shutdown(timeout=5)
            raise
        client._tasks = [
            asyncio.create_task(client._output_loop()),
            asyncio.create_task(client._watchdog()),
        ]
        return client

    async def _await_ready(self) -> None:
        while True:
            if await self._from_core.poll(int(_WATCHDOG_S * 1000)):
                msg = self._decoder.decode(await self._from_core.recv())
                if isinstance(msg, EngineReady):
                    self.max_model_len, self.vocab_size = msg.max_model_len, msg.vocab_size
                    return
                if isinstance(msg, EngineFailed):
                    raise EngineDeadError(msg.message)
            elif not self.process.is_alive():
                raise EngineDeadError(f"engine process exited with code {self.process.exitcode}")

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self.process.is_alive()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core process (Shutdown, then terminate, then kill) and clean up."""
        if self.process.is_alive():
            with contextlib.suppress(EngineDeadError):
                await self._send(Shutdown())
            await asyncio.to_thread(self.process.join, timeout)
        if self.process.is_alive():
            self.process.terminate()
            await asyncio.to_thread(self.process.join, 5)
        if self.process.is_alive():
            self.process.kill()
            await asyncio.to_thread(self.process.join, 5)
        self._fail_all(EngineDeadError("the engine was shut down"))
        for task in self._tasks:
            task.cancel()
        self._to_core.close(0)
        self._from_core.close(0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- requests --------------------------------------------------------------

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream one request's outputs (see the module contract)."""
        if self._dead is not None:
            raise self._dead
        assert self._processor is not None and self.tokenizer is not None
        token_ids = self._tokenize(prompt)
        check_request(token_ids, params, self.vocab_size, self.max_model_len)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._queues:
            raise InvalidRequestError(f"request id {rid!r} is already in use", "request_id")
        queue: asyncio.Queue[Item] = asyncio.Queue()
        self._queues[rid] = queue
        self._processor.add(rid, token_ids, params)
        finished = False
        try:
            await self._send(AddRequest(rid, token_ids, params, time.monotonic()))
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item  # the finally below aborts it in the core if it is there
                finished = item.finished
                yield item
        finally:
            self._queues.pop(rid, None)
            self._processor.discard(rid)
            if not finished and self._dead is None:
                with contextlib.suppress(EngineDeadError):
                    await self._send(AbortRequests([rid]))

    def cancel_all(self, error: Exception) -> int:
        """End every open request with `error` (each consumer then aborts its request
        in the core, freeing its KV). Returns how many were open."""
        for queue in self._queues.values():
            queue.put_nowait(error)
        return len(self._queues)

    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        assert self.tokenizer is not None
        return self.tokenizer.prompt_ids(prompt)

    async def stats(self, check_integrity: bool = False, timeout: float = 10.0) -> EngineStats:
        """Counters of the core (and, on request, its KV pool integrity check)."""
        if self._dead is not None:
            raise self._dead
        sid = next(self._ids)
        reply = self._stats[sid] = asyncio.get_running_loop().create_future()
        try:
            await self._send(StatsRequest(sid, check_integrity))
            return await asyncio.wait_for(reply, timeout)
        finally:
            self._stats.pop(sid, None)

    async def instance_stats(self, timeout: float = 5.0) -> list[dict[str, object]]:
        """One row: the engine process."""
        return [{"name": "engine", "role": "colocated", "alive": self.is_alive}]

    async def _send(self, msg: EngineInput) -> None:
        """Queue a message for the core; never blocks (EngineDeadError if no core is
        connected: it has not started yet, or it is gone)."""
        try:
            await self._to_core.send(encode_input(self._encoder, msg), zmq.NOBLOCK)
        except zmq.Again:
            raise EngineDeadError("the engine process is not connected") from None

    # ---- background tasks --------------------------------------------------------

    async def _output_loop(self) -> None:
        while True:
            msg = self._decoder.decode(await self._from_core.recv())
            self._budget.reset()
            if isinstance(msg, OutputBatch):
                await self._dispatch(msg)
            elif isinstance(msg, RequestRejected):
                self._put(msg.request_id, _rejection(msg))
            elif isinstance(msg, EngineStats):
                reply = self._stats.get(msg.request_id)
                if reply is not None and not reply.done():
                    reply.set_result(msg)
            elif isinstance(msg, EngineFailed):
                self._fail_all(EngineDeadError(msg.message))

    async def _dispatch(self, batch: OutputBatch) -> None:
        assert self._processor is not None
        for out in batch.outputs:
            result, stop_string = self._processor.process(out)
            if stop_string is not None:
                await self._send(AbortRequests([out.request_id]))
            if result is not None:
                self._put(out.request_id, result)
            await self._budget.checkpoint()

    def _put(self, request_id: str, item: Item) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(item)

    async def _watchdog(self) -> None:
        while self.process.is_alive() and self._dead is None:
            await asyncio.sleep(_WATCHDOG_S)
        code = self.process.exitcode
        self._fail_all(EngineDeadError(f"the engine process exited (exit code {code})"))

    def _fail_all(self, error: EngineDeadError) -> None:
        if self._dead is None:
            self._dead = error
        for queue in self._queues.values():
            queue.put_nowait(self._dead)
        for reply in self._stats.values():
            if not reply.done():
                reply.set_exception(self._dead)


def _rejection(msg: RequestRejected) -> Exception:
    if msg.overloaded:
        return EngineOverloadedError(msg.message)
    return InvalidRequestError(msg.message, msg.param)
