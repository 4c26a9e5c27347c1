"""`TcpTransport`: regions served over TCP, one byte stream per request.

Every transport runs a server thread listening on (host, an ephemeral port) that serves
its regions; a `RegionHandle.address` is "host:port". Protocol, per request on a persistent
connection (cached per calling thread and peer):

    request:  header (magic, op READ | WRITE, flags, body length, payload length)
              + msgspec body (region name, plan, client dtype)
              [WRITE: + payload + crc32 trailer if flagged]
    response: header (magic, status, flags, message length, payload length)
              + error message | [READ: payload + crc32 trailer if flagged]

The payload is the plan's chunks back to back in (layer, K/V, run) order, in ONE stream: no
per-block round trips. The sender passes memoryview slices of its pool straight to
`socket.sendmsg` (scatter-gather, BATCH_VIEWS buffers per call); the receiver fills its
pool's slices with `recvmsg_into` (no intermediate buffer: two copies in all, user to
kernel and kernel to user). Payloads of at least `stream_min_bytes` are split into
`streams` sub-plans sent over parallel connections (one loopback stream is bound by one
core). Bytes cannot be cast on the wire: plans between different dtypes raise
LayoutMismatchError. A request body is at most MAX_BODY_BYTES.

Sockets are blocking, with SO_RCVTIMEO/SO_SNDTIMEO as the timeout: a call that makes no
progress for `timeout_s` fails. (Blocking calls let `recvmsg_into(MSG_WAITALL)` fill a whole
batch of pieces per call.) Idle connections wait for the next request without limit.

Errors: socket timeouts -> TransferTimeoutError; refused, reset or closed connections and
unknown regions -> PeerUnavailableError; with `verify_checksum`, a crc32 mismatch ->
ChecksumError. A connection that failed mid-request is closed (the next call reconnects);
the server drops a client that disconnects mid-request and keeps serving the others.
CPU tensors only (a CUDA pool would have to be staged through host memory).
"""

from __future__ import annotations

import contextlib
import enum
import selectors
import socket
import struct
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import msgspec
import numpy as np
import torch

from pdserve.kv.layout import KVLayout, RegionHandle
from pdserve.kv.transfer.errors import (
    ChecksumError,
    LayoutMismatchError,
    PeerUnavailableError,
    TransferError,
    TransferTimeoutError,
)
from pdserve.kv.transfer.layout import torch_dtype
from pdserve.kv.transfer.plan import TransferPlan, split_plan
from pdserve.kv.transfer.transport import (
    Region,
    Transport,
    check_plan,
    check_side,
    local_layout,
)

IOV_MAX = 1024  # buffers per sendmsg / recvmsg_into call (Linux's limit)
# Buffers per call we use. A batch's views are alive together: with ~1000 of them, each
# young-generation collection promotes a batch, and the promoted views trigger a full
# collection (~15 ms in a process that imported transformers) every 360 MiB or so; client
# CPU per 360 MiB fetch was ~50 ms with 1024, ~30 ms with 512 and 256 (more syscalls).
BATCH_VIEWS = 512
MAGIC = b"PDKV"
_HEADER = struct.Struct("!4sBBHIQ")  # magic, op | status, flags, 0, body length, payload
_CRC = struct.Struct("!I")
OP_READ, OP_WRITE = 1, 2
FLAG_CRC = 1
SOCK_BUF_BYTES = 4 << 20
MAX_BODY_BYTES = 64 << 20  # a plan of millions of runs


class Status(enum.IntEnum):
    OK = 0
    UNKNOWN_REGION = 1
    LAYOUT = 2
    CHECKSUM = 3
    ERROR = 4


class _Request(msgspec.Struct, frozen=True):
    region: str
    plan: TransferPlan
    dtype: str  # the client's pool dtype; must be the region's


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(_Request)


class TcpTransport(Transport):
    """Serves its regions over TCP and reaches peers' (see module doc). Thread-safe: each
    calling thread has its own connection per peer."""

    kind = "tcp"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        timeout_s: float = 30.0,
        verify_checksum: bool = False,
        streams: int = 2,
        stream_min_bytes: int = 8 << 20,
        sock_buf_bytes: int | None = SOCK_BUF_BYTES,
    ) -> None:
        """`host`/`port`: where the server listens, and the address peers are given.
        `streams`: parallel connections for one large transfer (>= `stream_min_bytes`).
        `sock_buf_bytes`: SO_SNDBUF/SO_RCVBUF (None: the kernel's autotuning)."""
        if timeout_s <= 0 or streams < 1:
            raise ValueError(f"need timeout_s > 0 and streams >= 1, got {timeout_s}, {streams}")
        self.timeout_s = timeout_s
        self.verify_checksum = verify_checksum
        self.streams = streams
        self.stream_min_bytes = stream_min_bytes
        self.sock_buf_bytes = sock_buf_bytes
        self._regions: dict[str, _Served] = {}
        self._server = _Server(host, port, self._regions, timeout_s, sock_buf_bytes)
        self.address = f"{host}:{self._server.port}"
        self._local = threading.local()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    # ---- Transport -------------------------------------------------------------

    def create_region(self, name: str, layout: KVLayout) -> Region:
        tensor = torch.zeros(layout.shape, dtype=torch_dtype(layout))
        return self.serve_region(name, tensor, layout)

    def serve_region(self, name: str, tensor: torch.Tensor, layout: KVLayout) -> Region:
        """Serve `tensor` (a pool of `layout`, allocated elsewhere: another transport's
        shared memory) as the region `name`, as if this transport had created it."""
        with self._lock:
            if self._closed:
                raise TransferError(f"tcp transport {self.address} is closed")
            if name in self._regions:
                raise ValueError(f"tcp transport {self.address} already has a region {name!r}")
            self._regions[name] = _Served(tensor, layout)
        return Region(tensor, RegionHandle(self.kind, self.address, name, layout))

    def fetch(self, remote: RegionHandle, plan: TransferPlan, local: torch.Tensor) -> None:
        layout = self._check(remote, plan, local, fetch=True)
        views = byte_view(local)
        self._in_parallel(plan, lambda p: self._read(remote, p, layout, views))

    def flush(self, remote: RegionHandle, plan: TransferPlan, local: torch.Tensor) -> None:
        layout = self._check(remote, plan, local, fetch=False)
        views = byte_view(local)
        self._in_parallel(plan, lambda p: self._write(remote, p, layout, views))

    def close(self) -> None:
        """Stop serving (dropping open connections), close this side's connections and
        withdraw the regions. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns, self._conns = self._conns, set()
            pool, self._pool = self._pool, None
        self._server.close()
        if pool is not None:
            pool.shutdown(wait=True)
        for sock in conns:
            sock.close()
        self._regions.clear()

    # ---- one request -------------------------------------------------------------

    def _read(
        self, remote: RegionHandle, plan: TransferPlan, layout: KVLayout, local: memoryview
    ) -> None:
        chunks = Chunks(local, plan, "destination", layout)
        flags = FLAG_CRC if self.verify_checksum else 0
        body = _ENCODER.encode(_Request(remote.name, plan, layout.dtype))
        crc_ok = True
        with self._connection(remote, "fetch from") as sock:
            sock.sendall(_HEADER.pack(MAGIC, OP_READ, flags, 0, len(body), 0) + body)
            status, message, payload = read_response(sock)
            if status == Status.OK:
                if payload != plan.nbytes:
                    raise EOFError(f"the peer sends {payload} bytes, expected {plan.nbytes}")
                recv_batches(sock, chunks.batches())
                if flags:
                    (want,) = _CRC.unpack(recv_exact(sock, _CRC.size))
                    crc_ok = chunks.crc32() == want
        if status != Status.OK:
            raise _error(status, f"tcp fetch from {remote.describe()}: {message}")
        if not crc_ok:
            raise ChecksumError(f"tcp fetch from {remote.describe()}: crc32 mismatch")

    def _write(
        self, remote: RegionHandle, plan: TransferPlan, layout: KVLayout, local: memoryview
    ) -> None:
        chunks = Chunks(local, plan, "source", layout)
        flags = FLAG_CRC if self.verify_checksum else 0
        body = _ENCODER.encode(_Request(remote.name, plan, layout.dtype))
        header = _HEADER.pack(MAGIC, OP_WRITE, flags, 0, len(body), plan.nbytes) + body
        trailer = _CRC.pack(chunks.crc32()) if flags else b""
        with self._connection(remote, "flush to") as sock:
            send_batches(sock, chunks.batches(header, trailer))
            status, message, _ = read_response(sock)
        if status != Status.OK:
            raise _error(status, f"tcp flush to {remote.describe()}: {message}")

    # ---- internals ----------------------------------------------------------------

    def _check(
        self, remote: RegionHandle, plan: TransferPlan, local: torch.Tensor, *, fetch: bool
    ) -> KVLayout:
        if self._closed:
            raise TransferError(f"tcp transport {self.address} is closed")
        if remote.transport != self.kind:
            raise ValueError(f"cannot reach {remote.describe()} through the tcp transport")
        if local.device.type != "cpu":
            raise ValueError(
                f"the tcp transport moves CPU tensors only, got one on {local.device} "
                "(stage a GPU pool through host memory)"
            )
        layout = local_layout(local)
        src, dst = (remote.layout, layout) if fetch else (layout, remote.layout)
        check_plan(plan, src, dst, can_cast=False)
        return layout

    def _in_parallel(self, plan: TransferPlan, run: Callable[[TransferPlan], None]) -> None:
        """Run `plan` as one request, or split over `streams` connections when large. Every
        part has ended (ok or not) before this returns or raises."""
        parts = [plan]
        if self.streams > 1 and plan.nbytes >= self.stream_min_bytes:
            parts = split_plan(plan, self.streams)
        if len(parts) == 1:
            run(plan)
            return
        futures = [self._executor().submit(run, p) for p in parts[1:]]
        error: BaseException | None = None
        try:
            run(parts[0])
        except BaseException as e:
            error = e
        for f in futures:
            e2 = f.exception()
            error = error or e2
        if error is not None:
            raise error

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.streams - 1, thread_name_prefix="kv-tcp")
            return self._pool

    @contextlib.contextmanager
    def _connection(self, remote: RegionHandle, what: str) -> Iterator[socket.socket]:
        """This thread's connection to `remote`, for one request-response exchange. Any
        exception inside closes it (its stream may be out of sync; the next call
        reconnects); socket errors become transfer errors."""
        conns: dict[str, socket.socket] = self._local.__dict__.setdefault("conns", {})
        try:
            sock = conns.get(remote.address)
            if sock is None or sock.fileno() < 0:
                sock = conns[remote.address] = self._connect(remote.address)
            yield sock
        except BaseException as e:
            self._drop(conns, remote.address)
            if isinstance(e, TimeoutError | BlockingIOError):
                raise TransferTimeoutError(
                    f"tcp {what} {remote.describe()}: no progress within {self.timeout_s} s"
                ) from None
            if isinstance(e, OSError | EOFError):
                raise PeerUnavailableError(
                    f"tcp {what} {remote.describe()}: connection failed ({type(e).__name__}: {e})"
                ) from None
            raise

    def _connect(self, address: str) -> socket.socket:
        host, _, port = address.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=self.timeout_s)
        tune(sock, self.sock_buf_bytes, self.timeout_s)
        with self._lock:
            if self._closed:
                sock.close()
                raise TransferError(f"tcp transport {self.address} is closed")
            self._conns.add(sock)
        return sock

    def _drop(self, conns: dict[str, socket.socket], address: str) -> None:
        sock = conns.pop(address, None)
        if sock is not None:
            with self._lock:
                self._conns.discard(sock)
            sock.close()


class _Served:
    """A region this transport serves, with its byte view for the socket calls."""

    def __init__(self, tensor: torch.Tensor, layout: KVLayout) -> None:
        self.tensor = tensor
        self.layout = layout
        self.bytes = byte_view(tensor)


class _Server:
    """Accepts connections and serves READ/WRITE requests on them, one thread each."""

    def __init__(
        self,
        host: str,
        port: int,
        regions: dict[str, _Served],
        timeout_s: float,
        sock_buf_bytes: int | None,
    ) -> None:
        self._regions = regions
        self._timeout_s = timeout_s
        self._sock_buf_bytes = sock_buf_bytes
        self._listener = socket.create_server((host, port), backlog=64)
        self.port: int = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(
            target=self._accept_loop, name=f"kv-tcp-server-{self.port}", daemon=True
        )
        self._acceptor.start()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
        self._wake_w.send(b"x")
        self._acceptor.join()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(self._timeout_s)
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()

    def _accept_loop(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._listener, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while True:
                ready = [key.fileobj for key, _ in sel.select()]
                if self._wake_r in ready:
                    return
                try:
                    conn, _ = self._listener.accept()
                except OSError:
                    continue
                self._start(conn)

    def _start(self, conn: socket.socket) -> None:
        tune(conn, self._sock_buf_bytes, self._timeout_s)
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._conns.add(conn)
            thread = threading.Thread(
                target=self._serve, args=(conn,), name=f"kv-tcp-conn-{self.port}", daemon=True
            )
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _serve(self, conn: socket.socket) -> None:
        """Requests on one connection until the client leaves or breaks the protocol."""
        try:
            while True:
                header = wait_header(conn)
                if header is None:
                    return
                magic, op, flags, _, body_len, payload = _HEADER.unpack(header)
                if magic != MAGIC or body_len > MAX_BODY_BYTES:
                    return
                self._handle(conn, op, flags, recv_exact(conn, body_len), payload)
        except (OSError, EOFError):
            return  # the client went away mid-request (or timed out): drop it
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _handle(self, conn: socket.socket, op: int, flags: int, body: bytes, payload: int) -> None:
        trailer = _CRC.size if flags & FLAG_CRC else 0
        try:
            req, served = self._lookup(op, body, payload)
        except _Refusal as r:
            if op == OP_WRITE:
                drain(conn, payload + trailer)
            _respond(conn, r.status, r.message)
            return
        side = "source" if op == OP_READ else "destination"
        chunks = Chunks(served.bytes, req.plan, side, served.layout)
        if op == OP_READ:
            head = _HEADER.pack(MAGIC, Status.OK, flags & FLAG_CRC, 0, 0, req.plan.nbytes)
            tail = _CRC.pack(chunks.crc32()) if trailer else b""
            send_batches(conn, chunks.batches(head, tail))
            return
        recv_batches(conn, chunks.batches())
        if trailer:
            (want,) = _CRC.unpack(recv_exact(conn, trailer))
            if chunks.crc32() != want:
                _respond(conn, Status.CHECKSUM, f"crc32 mismatch writing region {req.region!r}")
                return
        _respond(conn, Status.OK, "")

    def _lookup(self, op: int, body: bytes, payload: int) -> tuple[_Request, _Served]:
        if op not in (OP_READ, OP_WRITE):
            raise _Refusal(Status.ERROR, f"unknown operation {op}")
        try:
            req = _DECODER.decode(body)
        except msgspec.MsgspecError as e:
            raise _Refusal(Status.ERROR, f"malformed request: {e}") from None
        served = self._regions.get(req.region)
        if served is None:
            raise _Refusal(Status.UNKNOWN_REGION, f"no region {req.region!r} here")
        if req.dtype != served.layout.dtype:
            raise _Refusal(
                Status.LAYOUT,
                f"dtype differs: the request has {req.dtype}, region {req.region!r} has "
                f"{served.layout.dtype} (the tcp transport cannot cast)",
            )
        try:
            check_side(req.plan, "source" if op == OP_READ else "destination", served.layout)
        except LayoutMismatchError as e:
            raise _Refusal(Status.LAYOUT, str(e)) from None
        h0, h1 = req.plan.heads("source" if op == OP_READ else "destination", served.layout)
        if req.plan.token_bytes != (h1 - h0) * served.layout.head_bytes or (
            op == OP_WRITE and payload != req.plan.nbytes
        ):
            raise _Refusal(Status.LAYOUT, f"the plan's sizes do not fit region {req.region!r}")
        return req, served


class _Refusal(Exception):
    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# ---- byte-level helpers --------------------------------------------------------------


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A flat writable byte view of a contiguous CPU tensor's memory (no copy)."""
    # cast: slicing numpy's own memoryview costs ~15x more (this is done per chunk)
    return tensor.reshape(-1).view(torch.uint8).numpy().data.cast("B")


class Chunks:
    """A plan's pieces of one pool (by its byte view) in stream order: (layer, K/V, run),
    pieces adjacent in memory merged. Views are made BATCH_VIEWS at a time and dropped
    after their call: tens of thousands of live memoryviews would cost more in
    garbage-collector passes than the copy."""

    def __init__(self, data: memoryview, plan: TransferPlan, side: str, layout: KVLayout):
        self.data = data
        lo, hi = plan.src_layers if side == "source" else plan.dst_layers
        runs = np.asarray(plan.runs, dtype=np.int64).reshape(-1, 3)
        tb = layout.token_bytes
        rows = np.arange(2 * lo, 2 * hi, dtype=np.int64) * layout.num_slots  # (layer, K/V)
        slots = runs[:, 0 if side == "source" else 1]
        h0, h1 = plan.heads(side, layout)
        if (h0, h1) == (0, layout.num_kv_heads):  # whole rows: a run is one piece
            offsets = ((rows[:, None] + slots[None, :]) * tb).ravel()
            lengths = np.broadcast_to(runs[:, 2] * tb, (len(rows), len(runs))).ravel()
        else:  # some heads of each row: a piece a token
            tokens = np.repeat(slots - np.cumsum(runs[:, 2]) + runs[:, 2], runs[:, 2])
            tokens += np.arange(len(tokens), dtype=np.int64)
            offsets = ((rows[:, None] + tokens[None, :]) * tb + h0 * layout.head_bytes).ravel()
            lengths = np.full(len(offsets), (h1 - h0) * layout.head_bytes, dtype=np.int64)
        new = np.ones(len(offsets), dtype=bool)
        new[1:] = offsets[1:] != offsets[:-1] + lengths[:-1]
        starts = np.flatnonzero(new)
        self.offsets: list[int] = offsets[starts].tolist()
        self.lengths: list[int] = np.add.reduceat(lengths, starts).tolist() if len(starts) else []
        self.nbytes = int(lengths.sum())

    def __len__(self) -> int:
        return len(self.offsets)

    def batches(self, head: bytes = b"", tail: bytes = b"") -> Iterator[list[memoryview]]:
        """Lists of at most BATCH_VIEWS (<= IOV_MAX) views; `head` leads the first, `tail`
        ends the last."""
        first = [memoryview(head)] if head else []
        for i in range(0, len(self.offsets), BATCH_VIEWS - 1):
            j = i + BATCH_VIEWS - 1
            pieces = zip(self.offsets[i:j], self.lengths[i:j], strict=True)
            views = [self.data[o : o + n] for o, n in pieces]
            yield first + views
            first = []
        if first or tail:
            yield first + ([memoryview(tail)] if tail else [])

    def crc32(self) -> int:
        crc = 0
        for batch in self.batches():
            for view in batch:
                crc = zlib.crc32(view, crc)
        return crc


def tune(sock: socket.socket, buf_bytes: int | None, timeout_s: float) -> None:
    """TCP_NODELAY, buffer sizes, and blocking mode with kernel timeouts: a call blocked
    for `timeout_s` without progress fails with EAGAIN (BlockingIOError)."""
    sock.settimeout(None)
    sec = int(timeout_s)
    timeval = struct.pack("ll", sec, int((timeout_s - sec) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buf_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buf_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buf_bytes)


def send_batches(sock: socket.socket, batches: Iterable[list[memoryview]]) -> None:
    """Send every view, in order: one scatter-gather `sendmsg` per batch when it all fits."""
    for batch in batches:
        left = sum(v.nbytes for v in batch)
        while left:
            sent = sock.sendmsg(batch)
            left -= sent
            if left:
                batch = batch[_advance(batch, sent) :]


def recv_batches(sock: socket.socket, batches: Iterable[list[memoryview]]) -> None:
    """Fill every view, in order, straight from the socket (`recvmsg_into`)."""
    for batch in batches:
        left = sum(v.nbytes for v in batch)
        while left:
            got = sock.recvmsg_into(batch, 0, socket.MSG_WAITALL)[0]
            if got == 0:
                raise EOFError("the peer closed the connection mid-transfer")
            left -= got
            if left:
                batch = batch[_advance(batch, got) :]


def _advance(views: list[memoryview], nbytes: int) -> int:
    """Consume `nbytes` from the front of `views`, trimming a partly done view; the index
    of the first view not done."""
    i = 0
    while nbytes:
        size = views[i].nbytes
        if nbytes < size:
            views[i] = views[i][nbytes:]
            return i
        nbytes -= size
        i += 1
    return i


def wait_header(conn: socket.socket) -> bytes | None:
    """The next request header; None when the client has left. Waits indefinitely
    (an idle persistent connection), unlike the request's other reads."""
    buf = bytearray(_HEADER.size)
    got = 0
    while got < len(buf):
        try:
            k = conn.recv_into(memoryview(buf)[got:])
        except (BlockingIOError, TimeoutError):
            if got:
                raise
            continue
        if k == 0:
            if got:
                raise EOFError("the peer closed the connection")
            return None
        got += k
    return bytes(buf)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly `n` bytes; EOFError when the connection closes first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("the peer closed the connection")
        got += k
    return bytes(buf)


def drain(sock: socket.socket, n: int) -> None:
    """Read and discard `n` bytes (a refused write's payload) to keep the stream in sync."""
    scratch = memoryview(bytearray(min(n, 1 << 20) or 1))
    while n:
        k = sock.recv_into(scratch, min(n, len(scratch)))
        if k == 0:
            raise EOFError("the peer closed the connection")
        n -= k


def _respond(conn: socket.socket, status: Status, message: str) -> None:
    msg = message.encode()
    conn.sendall(_HEADER.pack(MAGIC, status, 0, 0, len(msg), 0) + msg)


def read_response(sock: socket.socket) -> tuple[int, str, int]:
    """A response header and its message: (status, message, payload length)."""
    magic, status, _, _, msg_len, payload = _HEADER.unpack(recv_exact(sock, _HEADER.size))
    if magic != MAGIC:
        raise EOFError("the peer does not speak this protocol")
    message = recv_exact(sock, msg_len).decode(errors="replace") if msg_len else ""
    return status, message, payload


def _error(status: int, message: str) -> Exception:
    """The exception a non-OK response status stands for."""
    if status == Status.UNKNOWN_REGION:
        return PeerUnavailableError(message)
    if status == Status.LAYOUT:
        return LayoutMismatchError(message)
    if status == Status.CHECKSUM:
        return ChecksumError(message)
    return TransferError(message)
