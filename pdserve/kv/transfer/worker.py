"""Transfers off the step loop: `TransferWorker` threads run them, `TransferTask` reports.

A task's state is explicit and only moves forward:

    WAITING ("waiting-for-destination"): submitted, not started (queued behind other
        transfers, so the destination cannot have been touched yet);
    TRANSFERRING: its function is running;
    DONE: it returned, the data is in place;
    FAILED: it raised (`error` says why), or its deadline passed while it was still waiting
        (it then never runs), or the worker was closed before it started.

Engines poll tasks from their step loops (`poll` never blocks) and may `wait` on them.
A running task is never abandoned: it may still be reading or writing pool memory, so it
stays TRANSFERRING until its function returns; the transports' own timeouts bound that.
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from collections.abc import Callable

from pdserve.kv.transfer.errors import TransferTimeoutError


class TransferState(enum.StrEnum):
    WAITING = "waiting-for-destination"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


_FINAL = (TransferState.DONE, TransferState.FAILED)


class TransferTask:
    """One submitted transfer. Read `state`, `error`, `nbytes`, `submitted`, `started`,
    `finished` (time.monotonic) from any thread: a state is published only after the fields
    it implies (`error` and `finished` before FAILED/DONE, `started` before TRANSFERRING)."""

    def __init__(self, fn: Callable[[], object], nbytes: int, deadline: float | None) -> None:
        self.fn = fn
        self.nbytes = nbytes
        self.deadline = deadline  # time.monotonic() by which it must have started
        self.submitted = time.monotonic()
        self.started: float | None = None
        self.finished: float | None = None
        self.error: str | None = None
        self.state = TransferState.WAITING
        self._lock = threading.Lock()
        self._done = threading.Event()

    def poll(self) -> TransferState:
        """The current state, without blocking (fails a WAITING task past its deadline)."""
        state = self.state
        deadline = self.deadline
        if state is TransferState.WAITING and deadline is not None and time.monotonic() > deadline:
            self._expire()
            state = self.state
        return state

    def wait(self, timeout: float | None = None) -> TransferState:
        """Block until DONE or FAILED, or for `timeout` seconds; return the state then."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            state = self.poll()
            now = time.monotonic()
            if state in _FINAL or (end is not None and now >= end):
                return state
            step = None if end is None else end - now
            if state is TransferState.WAITING and self.deadline is not None:
                until_deadline = max(self.deadline - now, 0.0) + 1e-3
                step = until_deadline if step is None else min(step, until_deadline)
            self._done.wait(step)

    @property
    def done(self) -> bool:
        """DONE or FAILED."""
        return self.poll() in _FINAL

    def cancel(self, reason: str = "cancelled") -> bool:
        """Fail the task if it has not started; True when it will never run."""
        return self._fail_if_waiting(f"TransferError: {reason}")

    def __repr__(self) -> str:
        return (
            f"TransferTask(state={self.state.value!r}, nbytes={self.nbytes}, error={self.error!r})"
        )

    # ---- worker side ----------------------------------------------------------

    def _claim(self) -> bool:
        """WAITING -> TRANSFERRING; False when it already failed (deadline, cancel)."""
        self.poll()
        with self._lock:
            if self.state is not TransferState.WAITING:
                return False
            self.started = time.monotonic()
            self.state = TransferState.TRANSFERRING
            return True

    def _run(self) -> None:
        if not self._claim():
            return
        error: str | None = None
        try:
            self.fn()
        except Exception as e:  # reported through the task
            error = f"{type(e).__name__}: {e}"
        finally:
            self._finish(error)

    def _finish(self, error: str | None) -> None:
        self.error = error
        self.finished = time.monotonic()
        self.state = TransferState.FAILED if error is not None else TransferState.DONE
        self.fn = _noop  # drop references (tensors, handles) held by the closure
        self._done.set()

    def _expire(self) -> None:
        waited = time.monotonic() - self.submitted
        self._fail_if_waiting(
            f"{TransferTimeoutError.__name__}: the transfer waited {waited:.3f} s "
            "and did not start before its deadline"
        )

    def _fail_if_waiting(self, error: str) -> bool:
        with self._lock:
            if self.state is not TransferState.WAITING:
                return False
            self.error = error
            self.finished = time.monotonic()
            self.state = TransferState.FAILED
        self.fn = _noop
        self._done.set()
        return True


def _noop() -> None:
    pass


class TransferWorker:
    """Background threads running transfer functions in submission order (FIFO).

    `submit` is thread-safe and never blocks. With several threads, transfers overlap.
    """

    def __init__(self, num_threads: int = 1, name: str = "kv-transfer") -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self.name = name
        self._queue: queue.SimpleQueue[TransferTask | None] = queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True)
            for i in range(num_threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(
        self, fn: Callable[[], object], nbytes: int = 0, deadline_s: float | None = None
    ) -> TransferTask:
        """Queue `fn` (WAITING); a worker thread runs it (TRANSFERRING), then DONE, or
        FAILED with `error = f"{type(e).__name__}: {e}"`. A task still WAITING
        `deadline_s` seconds after submission fails with a TransferTimeoutError text and is
        never run. RuntimeError after `close`."""
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        task = TransferTask(fn, nbytes, deadline)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"transfer worker {self.name!r} is closed")
            self._queue.put(task)
        return task

    def close(self, timeout: float | None = None) -> None:
        """Stop the threads after the transfer each is running (queued ones FAIL as
        "worker closed"); wait up to `timeout` for them. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in self._threads:
                self._queue.put(None)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout)

    def _loop(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                break
            if self._closed:
                task._fail_if_waiting(f"TransferError: transfer worker {self.name!r} closed")
            else:
                task._run()
