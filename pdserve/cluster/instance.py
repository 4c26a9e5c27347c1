"""`Instance`: the front end's handle on one engine process; the only process handle.

It spawns `run_engine_process` with the instance's role, owns the two ZeroMQ IPC sockets
to it (bound in a private temporary directory), waits for the ready handshake, answers
stats requests, hands everything else the instance sends to the front end's
`on_message`, and decides when the instance is dead: its process exited, it reported a
failure, or (with `timeout_s`) it has sent nothing - outputs, load reports, or the
heartbeats a thread of the instance sends every `report_interval_s` whatever its step
loop does - for that long. A dead instance is never used again; the front end
moves or fails its requests.

Where the process runs is the `Launcher`'s business: a process on this machine with IPC
sockets (`LocalLauncher`, the default: forked from the fork server that has the engine
imported, cluster/forkserver.py, else spawned), or a Ray actor on any node of a Ray
cluster with TCP sockets (cluster/ray_launch.py). Everything above - handshake,
liveness, fencing, messages - is the same for both.

Silence is judged with what can be read of the process (a local one: /proc): past
`timeout_s` without a message, a stopped process (SIGSTOP) is dead; one that computed
nothing meanwhile (blocked - or idle, its heartbeats late on a machine whose cores are
shared) is given `_IDLE_SILENCE_FACTOR` times as long, and one that kept computing
`_BUSY_SILENCE_FACTOR` times. A process on another node (Ray) counts as computing
nothing. Messages waiting unread on the socket are never silence, nor is time the front
end itself did not run its checks: it was slow, not the instance.

Fencing: a dead instance that is still running (silent, e.g. SIGSTOPped) is killed when it
is marked dead, `fence` waits until its process is gone, and nothing it sent after its
death is read. The front end moves its requests only after `fence`, so a request is never
served, and no KV block written, by the dead instance and its successor at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable
from multiprocessing.process import BaseProcess
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio

from pdserve.cluster import forkserver
from pdserve.config import EngineConfig, Role, TransferConfig
from pdserve.errors import EngineDeadError
from pdserve.kv.layout import KVLayout
from pdserve.protocol.core import (
    EngineFailed,
    EngineReady,
    EngineStats,
    Heartbeat,
    LoadReport,
    Shutdown,
    StatsRequest,
    WeightsInfo,
)
from pdserve.protocol.wire import EngineInput, EngineMessage, Handlers, encode_input

_POLL_MS = 200  # while waiting for the handshake: how often to check the process
# Silence (module doc): a stopped process is dead past `timeout_s`; one that computes
# nothing (blocked; or a process whose CPU time cannot be read) past this many times it;
# one that keeps computing past `_BUSY_SILENCE_FACTOR` times it.
_IDLE_SILENCE_FACTOR = 3.0
_BUSY_SILENCE_FACTOR = 10.0
# Under this share of one core used over a silence, the instance computed nothing.
_IDLE_CPU_SHARE = 0.05
# A gap this long between two of the watchdog's checks: the front end itself stalled.
_FRONT_END_STALL_S = 0.5
_ids = itertools.count()
# The node name of instances started by `LocalLauncher`: the one node of their transfers.
LOCAL_NODE = TransferConfig.node


class EngineProcess(Protocol):
    """The process an instance's engine runs in (its `multiprocessing.Process` subset)."""

    @property
    def pid(self) -> int | None: ...

    @property
    def exitcode(self) -> int | None: ...

    @property
    def node(self) -> str:
        """The node it runs on, once started (`LOCAL_NODE` for a child of this process)."""
        ...

    def start(self) -> None: ...

    def is_alive(self) -> bool: ...

    def kill(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...

    def exit_reason(self) -> str:
        """Why it is no longer alive (it exited with a code; Ray: its actor or node died)."""
        ...

    def cpu_seconds(self) -> float | None:
        """The CPU time it has used (user + system); None where it cannot be read (a
        process on another node)."""
        ...

    def stopped(self) -> bool:
        """It is stopped (SIGSTOP, a debugger); False where that cannot be read."""
        ...


class Launcher(Protocol):
    """Makes an instance's process and says how the front end's sockets reach it."""

    kind: str  # "local" | "ray": how `pdserve cluster status` names it
    # None: IPC sockets in a private directory (same host); else TCP on this address.
    bind_host: str | None

    def process(
        self, config: EngineConfig, input_addr: str, output_addr: str, report: bool
    ) -> EngineProcess: ...

    def nodes(self) -> list[dict[str, object]]:
        """The nodes instances can run on, as `pdserve cluster status` lists them: node,
        address, alive, cpus, gpus."""
        ...

    def room(self, config: EngineConfig, running: list[EngineConfig]) -> str | None:
        """None when one more instance of `config` fits beside the `running` ones; else
        why not (what it needs, what the nodes have left). May block (Ray asks its GCS):
        call it off the event loop."""
        ...


class LocalProcess:
    """A process on this machine (the embedded launch): a multiprocessing child, forked
    from the fork server or spawned."""

    def __init__(self, process: BaseProcess) -> None:
        self._process = process

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def exitcode(self) -> int | None:
        return self._process.exitcode

    @property
    def node(self) -> str:
        return LOCAL_NODE

    def start(self) -> None:
        self._process.start()

    def is_alive(self) -> bool:
        return self._process.is_alive()

    def kill(self) -> None:
        self._process.kill()

    def join(self, timeout: float | None = None) -> None:
        self._process.join(timeout)

    def exit_reason(self) -> str:
        return f"process exited (exit code {self.exitcode})"

    def cpu_seconds(self) -> float | None:
        fields = _proc_stat(self.pid)
        return None if fields is None else (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS

    def stopped(self) -> bool:
        fields = _proc_stat(self.pid)
        return fields is not None and fields[0] in (b"T", b"t")


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _proc_stat(pid: int | None) -> list[bytes] | None:
    """The fields of /proc/PID/stat after the command name (state first, then ppid, ...:
    utime and stime are [11] and [12]); None when it cannot be read (gone, no /proc)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


class LocalLauncher:
    """Instances as children of this process, over IPC sockets: the default launch.
    `threads`: what the instances started with run together (the room for instances
    added later: this machine's cores, or that if more - an instance may take the place
    of one that left)."""

    kind = "local"
    bind_host: str | None = None

    def __init__(self, threads: int = 0) -> None:
        self.threads = threads

    def process(
        self, config: EngineConfig, input_addr: str, output_addr: str, report: bool
    ) -> EngineProcess:
        ctx = forkserver.context()
        process = ctx.Process(
            target=_run_engine,
            args=(config, input_addr, output_addr, report, dict(os.environ), os.getpid()),
            name=f"pdserve-{config.instance_name}",
            daemon=True,
        )
        return LocalProcess(process)

    def nodes(self) -> list[dict[str, object]]:
        cpus = len(os.sched_getaffinity(0))
        return [
            {"node": LOCAL_NODE, "address": "127.0.0.1", "alive": True, "cpus": cpus, "gpus": 0}
        ]

    def room(self, config: EngineConfig, running: list[EngineConfig]) -> str | None:
        """The cores this process may run on (or the threads the start ran, if more),
        less the running instances' threads."""
        cores = len(os.sched_getaffinity(0))
        budget = max(cores, self.threads)
        held = sum(c.threads for c in running)
        if held + config.threads <= budget:
            return None
        return (
            f"an instance of {config.threads} threads does not fit: the running instances "
            f"run {held} of the {budget} threads this machine's {cores} cores (or the "
            "instances started, if more) allow"
        )


class Instance:
    def __init__(
        self,
        config: EngineConfig,
        ctx: zmq.asyncio.Context,
        on_message: Callable[[Instance, EngineMessage], Awaitable[None]],
        timeout_s: float | None,
        on_report: Callable[[Instance, LoadReport], None] | None = None,
        launcher: Launcher | None = None,
    ) -> None:
        self.config = config
        # None: silence is never a death (a lone engine), and nothing needs its load
        # reports (they feed routing and the silence deadline), so it sends none.
        self.timeout_s = timeout_s
        self.name = config.instance_name
        self.role: Role = config.role
        # Instance flip (cluster/flip.py): the role it is draining toward. Meanwhile it is
        # no instance of any role to dispatch and recovery (`Cluster.of_role`, `live`).
        self.flipping_to: Role | None = None
        self.on_message = on_message
        self.on_report = on_report  # also told of every load report (prompt-tree events)
        self.max_model_len = 0
        self.vocab_size = 0
        self.kv_layout: KVLayout | None = None  # its pool's geometry, once ready
        self.weights = WeightsInfo("none", [])  # how it holds the weights, once ready
        self.report: LoadReport | None = None
        self.last_heard = time.monotonic()
        self.dead: str | None = None  # why, once dead
        self.exit_code: int | None = None  # set when the death was the process exiting
        self._announced = False  # `check` has returned the reason
        # (time, its CPU seconds) once it has been silent half of `timeout_s`
        self._silence_mark: tuple[float, float | None] | None = None
        self._last_check = time.monotonic()  # the watchdog's last look (`check`)
        # Front-end-side load (what it assigned and has not seen finish).
        self.assigned_prefill_tokens = 0
        self.assigned_requests = 0
        self.assigned_heavy = 0  # of those, predicted heavy decodes (cluster/policies.py)
        launcher = launcher or LocalLauncher()
        self._dir: str | None = None
        self._to = ctx.socket(zmq.PUSH)
        self._to.setsockopt(zmq.SNDHWM, 0)  # never block a send on a full queue
        self._from = ctx.socket(zmq.PULL)
        if launcher.bind_host is None:
            self._dir = tempfile.mkdtemp(prefix=f"pdserve-{self.name}-")
            input_addr, output_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
            self._to.bind(input_addr)
            self._from.bind(output_addr)
        else:  # an ephemeral port each, on the address the instance's node can reach
            input_addr = _bind_tcp(self._to, launcher.bind_host)
            output_addr = _bind_tcp(self._from, launcher.bind_host)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineMessage)
        self._stats: dict[int, asyncio.Future[EngineStats]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._own = Handlers[None](
            {
                LoadReport: self._on_report,
                Heartbeat: _ignore,  # reading it is the point: `last_heard`
                EngineStats: self._on_stats,
                EngineFailed: self._on_failed,
            }
        )
        self.process = launcher.process(config, input_addr, output_addr, timeout_s is not None)

    @property
    def alive(self) -> bool:
        return self.dead is None

    @property
    def node(self) -> str:
        return self.process.node

    # ---- life cycle ----------------------------------------------------------------

    async def start(self, timeout: float) -> None:
        """Spawn the process and wait for EngineReady. EngineDeadError otherwise, with
        the instance's own message ("engine failed to start: ...")."""
        await asyncio.wait_for(asyncio.to_thread(self.process.start), timeout)
        await asyncio.wait_for(self._await_ready(), timeout)
        self.last_heard = time.monotonic()
        self._reader = asyncio.create_task(self._read())

    async def _await_ready(self) -> None:
        while True:
            if await self._from.poll(_POLL_MS):
                msg = self._decoder.decode(await self._from.recv())
                if isinstance(msg, EngineReady):
                    self.max_model_len, self.vocab_size = msg.max_model_len, msg.vocab_size
                    self.kv_layout = msg.kv_layout
                    self.weights = msg.weights
                    return
                if isinstance(msg, EngineFailed):
                    raise EngineDeadError(msg.message)
            elif not self.process.is_alive():
                raise EngineDeadError(f"engine {self.process.exit_reason()}")

    def check(self, now: float) -> str | None:
        """Mark the instance dead if it is. Returns the reason exactly once, the first
        check after it died (whichever way: exit, silence, or a reported failure)."""
        if self.dead is None:
            if not self.process.is_alive():
                self.exit_code = self.process.exitcode
                self.mark_dead(self.process.exit_reason())
            elif self.timeout_s is not None and (why := self._silence(now, self.timeout_s)):
                self.mark_dead(why)
        if self.dead is None or self._announced:
            return None
        self._announced = True
        return self.dead

    def _silence(self, now: float, timeout_s: float) -> str | None:
        """Why its silence is a death, or None (module doc)."""
        if now - self._last_check > _FRONT_END_STALL_S:
            # this process did not run its checks (its own event loop, or the machine,
            # stalled): it could not hear the instance either, so the silence restarts
            self.last_heard = max(self.last_heard, now - timeout_s / 2)
        self._last_check = now
        silent = now - self.last_heard
        if silent < timeout_s / 2:
            self._silence_mark = None
            return None
        if self._silence_mark is None:
            self._silence_mark = (now, self.process.cpu_seconds())
        if silent <= timeout_s or self._unread():
            return None
        if self.process.stopped():
            return f"sent nothing for {silent:.1f} s: its process is stopped"
        since, cpu_then = self._silence_mark
        cpu_now = self.process.cpu_seconds()
        computing = (
            cpu_then is not None
            and cpu_now is not None
            and cpu_now - cpu_then >= _IDLE_CPU_SHARE * (now - since)
        )
        if not computing and silent > _IDLE_SILENCE_FACTOR * timeout_s:
            return f"sent nothing for {silent:.1f} s"
        if silent > _BUSY_SILENCE_FACTOR * timeout_s:
            return f"sent nothing for {silent:.1f} s while computing"
        return None

    def _unread(self) -> bool:
        """Messages wait on the socket that the reader has not taken yet: the front end
        was slow (a long callback on its event loop), not the instance silent."""
        try:
            return bool(int(self._from.getsockopt(zmq.EVENTS)) & zmq.POLLIN)
        except zmq.ZMQError:
            return False

    def mark_dead(self, reason: str) -> str:
        self.dead = reason
        for reply in self._stats.values():
            if not reply.done():
                reply.set_exception(EngineDeadError(f"{self.name}: {reason}"))
        if self.process.is_alive():
            self.process.kill()  # unresponsive: make sure it serves nobody half-way
        return reason

    async def fence(self, timeout: float = 10.0) -> None:
        """Once dead: wait until the process is gone (it was killed when marked dead)."""
        assert self.dead is not None
        if self.process.is_alive():
            self.process.kill()
            await asyncio.to_thread(self.process.join, timeout)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Shutdown, then kill if it does not exit within `timeout` - at once if its
        process is stopped (SIGSTOP, a debugger): it cannot read the message, let alone
        exit; close the sockets."""
        if self.process.is_alive() and not self.process.stopped():
            with contextlib.suppress(zmq.ZMQError):
                await self._to.send(self._encoder.encode(Shutdown()), zmq.NOBLOCK)
            await asyncio.to_thread(self.process.join, timeout)
        if self.process.is_alive():
            self.process.kill()
            await asyncio.to_thread(self.process.join, 5)
        if self._reader is not None:
            self._reader.cancel()
        self._to.close(0)
        self._from.close(0)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    # ---- messages ------------------------------------------------------------------

    def send(self, msg: EngineInput) -> bool:
        """Queue a message; False if the instance is dead or not connected. A message
        msgpack cannot carry raises InvalidRequestError (`encode_input`)."""
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
            if self.dead is not None:
                continue  # fenced: nothing a dead instance says counts
            self.last_heard = time.monotonic()
            if type(msg) in self._own:
                self._own(msg)
            else:
                await self.on_message(self, msg)

    def _on_report(self, msg: LoadReport) -> None:
        self.report = msg
        if self.on_report is not None:
            self.on_report(self, msg)

    def _on_stats(self, msg: EngineStats) -> None:
        reply = self._stats.get(msg.request_id)
        if reply is not None and not reply.done():
            reply.set_result(msg)

    def _on_failed(self, msg: EngineFailed) -> None:
        self.mark_dead(msg.message)


def layout_conflict(inst: Instance, instances: Iterable[Instance]) -> str | None:
    """Why ready instance `inst` cannot exchange KV with the live ones of `instances` (a
    different model or KV dtype: `KVLayout.handoff_mismatch`), naming both sides; None
    when it can. Checked as an instance registers (the server starts, an instance is added
    or started again), so a mismatch is refused there, not per request."""
    mine = inst.kv_layout
    for other in instances:
        if other is inst or not other.alive or other.kv_layout is None or mine is None:
            continue
        if why := mine.handoff_mismatch(other.kv_layout):
            return (
                f"{inst.name} ({mine.describe()}) cannot exchange KV with {other.name} "
                f"({other.kv_layout.describe()}): {why}"
            )
    return None


def _ignore(msg: Heartbeat) -> None:
    pass


def _bind_tcp(sock: zmq.asyncio.Socket, host: str) -> str:
    """Bind `sock` to an ephemeral TCP port on `host`; the address to connect to."""
    sock.bind(f"tcp://{host}:*")
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return endpoint.decode()


def _run_engine(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    report: bool,
    environ: dict[str, str],
    client: int,
) -> None:
    """The instance process's entry point. The engine (and torch) is imported there (or
    was, by the fork server it was forked from), not in the front end's process, which
    only decodes plain messages. `environ`: the front end's, when it asked for the
    process (a forked one has the fork server's until then); `client`: the front end's
    pid (a forked one's parent is the fork server): the instance exits when it ends."""
    forkserver.adopt_environment(environ)
    from pdserve.engine.engine_process import run_engine_process

    run_engine_process(config, input_addr, output_addr, report, client)
