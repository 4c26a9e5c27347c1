"""`AsyncEngine`: the engine's step loop on a background thread, streamed to asyncio.

Contract
--------
* Only the loop thread touches the `Engine`. Callers send commands (add, abort)
  through a queue; `add` answers through a future, so validation errors reach the
  caller as exceptions and nothing is queued for a refused request.
* Outputs are delivered to each request's asyncio queue with
  `call_soon_threadsafe`. A consumer that stops iterating (client gone, task
  cancelled) aborts its request; the abort is applied before the next step, so its
  KV blocks return to the pool within one step.
* If a step raises, the engine is marked dead: every open request ends with
  `EngineDeadError`, and new requests are refused with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass

from pdserve.engine.engine import Engine, Prompt
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import EngineDeadError


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    sink: _Sink
    done: Future[None]


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]

    def put(self, item: RequestOutput | BaseException) -> None:
        # RuntimeError: the consumer's event loop is closed; nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._cmds: queue.Queue[_Add | _Abort | None] = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    async def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request; the last one has `finished=True`."""
        if self._dead is not None:
            raise EngineDeadError("the engine has stopped") from self._dead
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())
        done: Future[None] = Future()
        self._cmds.put(_Add(request_id, prompt, params, sink, done))
        await asyncio.wrap_future(done)
        finished = False
        try:
            while not finished:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._cmds.put(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        self._cmds.put(_Abort(request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._cmds.put(None)
        self._thread.join(timeout)

    # ---- loop thread -----------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished()
                if not self._apply_commands(block=idle):
                    return
                if self.engine.has_unfinished():
                    self._deliver(self.engine.step())
        except BaseException as e:
            self._die(e)

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands; False when asked to stop."""
        while True:
            try:
                cmd = self._cmds.get(block=block)
            except queue.Empty:
                return True
            block = False
            if cmd is None:
                self._die(EngineDeadError("the engine was shut down"))
                return False
            if isinstance(cmd, _Abort):
                self._abort(cmd.request_id)
            else:
                self._add(cmd)

    def _add(self, cmd: _Add) -> None:
        try:
            self.engine.add_request(cmd.prompt, cmd.params, cmd.request_id)
        except Exception as e:
            cmd.done.set_exception(e)
            return
        self._sinks[cmd.request_id] = cmd.sink
        cmd.done.set_result(None)

    def _abort(self, request_id: str) -> None:
        sink = self._sinks.pop(request_id, None)
        out = self.engine.abort(request_id)
        if sink is not None and out is not None:
            sink.put(out)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
            sink.put(out)

    def _die(self, error: BaseException) -> None:
        self._dead = error
        dead = error if isinstance(error, EngineDeadError) else EngineDeadError(str(error))
        for sink in self._sinks.values():
            sink.put(dead)
        self._sinks.clear()
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                cmd.done.set_exception(dead)
