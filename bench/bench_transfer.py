"""KV transfer bandwidth: every transport against the machine's memcpy, in one run.

    .venv/bin/python bench/bench_transfer.py [--tokens 128 1024 8192] [--repeats 7]
        [--threads N] [--json out.json]

KV of the shipped SmolLM2-135M (30 layers, 3 KV heads, head_dim 64, fp32: 46,080 bytes per
token), block size 16; each request's blocks are scattered at random over pools of 1024
blocks (755 MiB) on both sides. For 128 / 1024 / 8192 tokens it measures:

* memcpy: torch `copy_` and numpy `copyto` of one contiguous buffer of the same bytes;
  every ratio is against the faster of the two (torch's uses its intra-op threads,
  numpy's one), measured again just before and after the row's own measurement (the
  faster of those), since a shared VM's memory bandwidth drifts with its neighbours;
* raw TCP: the same bytes from one contiguous buffer over loopback sockets to the peer
  process, no protocol (1 and 2 connections): the ceiling any TCP transport here has;
* fetch (pull, the receiver copies) and flush (push) for each transport: inproc (two
  pools in this process), shm and tcp (the peer pool in a second process);
* aggregated (MemServe): gather into a contiguous buffer + ONE contiguous transfer into a
  staging region of the peer + scatter from it; gather and scatter are timed on this side
  (the same work the sender and the receiver would do) and the three times are added.

Every figure is the median of `--repeats` runs (more for calls under 30 ms, so that each
figure spans >= 0.2 s) after one warm-up run. Also reported: the
per-call overhead (a one-token, one-layer fetch) and the machine's load average, since a
2-core machine shares its cores with whatever else runs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from pdserve.kv.layout import KVLayout, RegionHandle
from pdserve.kv.transfer import (
    TransferPlan,
    Transport,
    gather,
    make_transport,
    scatter,
    stream_in,
    stream_out,
)

LAYERS, HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
POOL_BLOCKS = 1024
POOL = KVLayout(LAYERS, POOL_BLOCKS, BLOCK, HEADS, HEAD_DIM, "float32")


def staging(tokens: int) -> KVLayout:
    """A contiguous buffer of `tokens` tokens as a pool: block size 1, blocks 0..n-1."""
    return KVLayout(LAYERS, tokens, 1, HEADS, HEAD_DIM, "float32")


@dataclass
class Row:
    tokens: int
    path: str  # "memcpy", "raw-tcp", a transport kind
    op: str  # "torch", "numpy", "1 stream", "fetch", "flush", "aggregated", ...
    nbytes: int
    seconds: float  # median
    chunks: int = 1  # contiguous pieces moved (per side)
    memcpy_gbps: float = 0.0  # the memcpy reference measured around this row

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9

    @property
    def ratio(self) -> float:
        return self.gbps / self.memcpy_gbps


def median_time(fn: Callable[[], object], repeats: int, min_total_s: float = 0.2) -> float:
    """Median seconds of `fn` over at least `repeats` runs after a warm-up run; quick calls
    are repeated until they took `min_total_s` in all (at most 500 runs)."""
    fn()  # warm-up
    times: list[float] = []
    while len(times) < repeats or (sum(times) < min_total_s and len(times) < 500):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---- the peer process --------------------------------------------------------------------


def _peer(commands: Any, results: Any, threads: int) -> None:
    """Holds the remote regions (shm, tcp) and a raw TCP sink; answers until "quit"."""
    torch.set_num_threads(threads)
    transports: dict[str, Transport] = {}
    while True:
        cmd, *args = commands.get()
        if cmd == "region":
            kind, name, layout = args
            transport = transports.setdefault(kind, make_transport(kind))
            region = transport.create_region(name, layout)
            region.tensor.normal_()
            results.put(region.handle)
        elif cmd == "close":
            transports.pop(args[0]).close()
            results.put(None)
        elif cmd == "ping":
            results.put("pong")
        elif cmd == "sink":
            results.put(_start_sink(args[0]))
        elif cmd == "quit":
            for t in transports.values():
                t.close()
            results.put(None)
            return


def _start_sink(nbytes: int) -> int:
    """A loopback server that reads length-prefixed payloads into one buffer and acks."""
    server = socket.create_server(("127.0.0.1", 0))
    buf = memoryview(bytearray(nbytes))

    def serve(conn: socket.socket) -> None:
        with conn:
            while True:
                head = conn.recv(8, socket.MSG_WAITALL)
                if len(head) < 8:
                    return
                (n,) = struct.unpack("!Q", head)
                got = 0
                while got < n:
                    got += conn.recv_into(buf[got:n])
                conn.sendall(b"k")

    def accept() -> None:
        while True:
            conn, _ = server.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return int(server.getsockname()[1])


class Peer:
    def __init__(self, threads: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.commands, self.results = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=_peer, args=(self.commands, self.results, threads))
        self.process.start()

    def ask(self, *cmd: Any) -> Any:
        self.commands.put(cmd)
        return self.results.get(timeout=300)

    def quit(self) -> None:
        self.ask("quit")
        self.process.join(60)


# ---- measurements ------------------------------------------------------------------------


class Memcpy:
    """Contiguous copies of each size, measured again around every group of rows: the
    memory bandwidth of a shared VM drifts with its neighbours' load, so each ratio uses
    the memcpy measured just before and after its row (the faster of torch and numpy, and
    of before and after: conservative ratios)."""

    def __init__(self, tokens_list: list[int], repeats: int) -> None:
        self.repeats = repeats
        self.buffers = {}
        for tokens in tokens_list:
            n = tokens * 2 * LAYERS * POOL.token_bytes // 4
            self.buffers[tokens] = (torch.randn(n), torch.empty(n))

    def rows(self, tokens: int) -> list[Row]:
        a, b = self.buffers[tokens]
        an, bn = a.numpy(), b.numpy()
        nbytes = a.numel() * a.element_size()
        rows = [
            Row(
                tokens,
                "memcpy",
                "torch copy_",
                nbytes,
                median_time(partial(b.copy_, a), self.repeats),
            ),
            Row(
                tokens,
                "memcpy",
                "numpy copyto",
                nbytes,
                median_time(partial(np.copyto, bn, an), self.repeats),
            ),
        ]
        for r in rows:
            r.memcpy_gbps = max(x.gbps for x in rows)
        return rows

    def around(self, tokens: int, measure: Callable[[], list[Row]]) -> list[Row]:
        """`measure()`'s rows, each with the memcpy reference taken around them."""
        before = self.rows(tokens)[0].memcpy_gbps
        rows = measure()
        reference = max(before, self.rows(tokens)[0].memcpy_gbps)
        for r in rows:
            r.memcpy_gbps = reference
        return rows


def raw_tcp_rows(peer: Peer, memcpy: Memcpy, tokens_list: list[int], repeats: int) -> list[Row]:
    """Contiguous bytes over loopback with plain sockets: the TCP ceiling."""
    biggest = max(tokens_list) * 2 * LAYERS * POOL.token_bytes
    port = peer.ask("sink", biggest)
    data = memoryview(bytearray(os.urandom(1 << 20)) * (biggest // (1 << 20) + 1))
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    for s in socks:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rows = []
    for tokens in tokens_list:
        rows += memcpy.around(tokens, partial(_raw_tcp, socks, data, tokens, repeats))
    for s in socks:
        s.close()
    return rows


def _raw_tcp(socks: list[socket.socket], data: memoryview, tokens: int, repeats: int) -> list[Row]:
    rows = []
    nbytes = tokens * 2 * LAYERS * POOL.token_bytes
    for streams in (1, 2):
        part = nbytes // streams

        def send(i: int, part: int = part) -> None:
            socks[i].sendall(struct.pack("!Q", part))
            socks[i].sendall(data[i * part : (i + 1) * part])
            socks[i].recv(1)

        def run(streams: int = streams) -> None:
            helpers = [threading.Thread(target=send, args=(i,)) for i in range(1, streams)]
            for t in helpers:
                t.start()
            send(0)
            for t in helpers:
                t.join()

        op = f"{streams} stream{'s' if streams > 1 else ''}"
        rows.append(Row(tokens, "raw-tcp", op, part * streams, median_time(run, repeats)))
    return rows


def transport_rows(
    kind: str, peer: Peer, memcpy: Memcpy, tokens_list: list[int], repeats: int, seed: int
) -> tuple[list[Row], float]:
    """fetch / flush / aggregated rows for one transport, and its per-call overhead (s)."""
    me = make_transport(kind)
    other = make_transport(kind) if kind == "inproc" else None
    try:
        local = me.create_region("local", POOL)
        local.tensor.normal_()

        def remote_region(name: str, layout: KVLayout) -> RegionHandle:
            if other is not None:
                region = other.create_region(name, layout)
                region.tensor.normal_()
                return region.handle
            handle: RegionHandle = peer.ask("region", kind, name, layout)
            return handle

        remote = remote_region("pool", POOL)
        rng = random.Random(seed)
        rows = []
        for tokens in tokens_list:
            nb = -(-tokens // BLOCK)
            mine = rng.sample(range(POOL_BLOCKS), nb)
            theirs = rng.sample(range(POOL_BLOCKS), nb)
            pull = stream_in(POOL, theirs, POOL, mine, 0, tokens)
            push = stream_out(POOL, mine, POOL, theirs, 0, tokens)

            def measure(
                tokens: int = tokens,
                pull: TransferPlan = pull,
                push: TransferPlan = push,
                mine: list[int] = mine,
                theirs: list[int] = theirs,
            ) -> list[Row]:
                t_fetch = median_time(partial(me.fetch, remote, pull, local.tensor), repeats)
                t_flush = median_time(partial(me.flush, remote, push, local.tensor), repeats)
                return [
                    Row(tokens, kind, "fetch", pull.nbytes, t_fetch, pull.num_chunks),
                    Row(tokens, kind, "flush", push.nbytes, t_flush, push.num_chunks),
                    aggregated_row(
                        kind, me, local.tensor, mine, theirs, tokens, remote_region, repeats
                    ),
                ]

            rows += memcpy.around(tokens, measure)
        one = stream_in(POOL, [0], POOL, [0], 0, 1, layers=range(0, 1))
        overhead = median_time(lambda: me.fetch(remote, one, local.tensor), repeats)
        return rows, overhead
    finally:
        me.close()
        if other is not None:
            other.close()
        else:
            peer.ask("close", kind)


def aggregated_row(
    kind: str,
    me: Transport,
    pool: torch.Tensor,
    mine: list[int],
    theirs: list[int],
    tokens: int,
    remote_region: Callable[[str, KVLayout], RegionHandle],
    repeats: int,
) -> Row:
    """gather (sender) + one contiguous flush into a staging region + scatter (receiver)."""
    stage = staging(tokens)
    buf = torch.empty(LAYERS, 2, tokens, HEADS, HEAD_DIM)
    t_gather = median_time(lambda: gather(pool, POOL, mine, 0, tokens, out=buf), repeats)
    remote = remote_region(f"stage-{tokens}", stage)
    plan = stream_out(stage, range(tokens), stage, range(tokens), 0, tokens)
    local_stage = buf.view(stage.shape)
    t_move = median_time(lambda: me.flush(remote, plan, local_stage), repeats)
    t_scatter = median_time(lambda: scatter(buf, pool, POOL, theirs, 0), repeats)
    return Row(tokens, kind, "aggregated", plan.nbytes, t_gather + t_move + t_scatter, 1)


# ---- report ------------------------------------------------------------------------------


def table(rows: list[Row]) -> str:
    lines = [
        "| KV tokens | MiB | path | op | chunks | GB/s | memcpy GB/s | vs memcpy |",
        "|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.tokens} | {r.nbytes / 2**20:.1f} | {r.path} | {r.op} | {r.chunks} | "
            f"{r.gbps:.2f} | {r.memcpy_gbps:.2f} | {r.ratio:.0%} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 1024, 8192])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--transports", nargs="+", default=["inproc", "shm", "tcp"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()
    if args.repeats < 5:
        parser.error("--repeats must be >= 5")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    peer = Peer(args.threads)
    try:
        peer.ask("ping")  # started: its imports no longer compete for the cores
        memcpy = Memcpy(args.tokens, args.repeats)
        rows = [r for t in args.tokens for r in memcpy.rows(t)]
        rows += raw_tcp_rows(peer, memcpy, args.tokens, args.repeats)
        overheads = {}
        for kind in args.transports:
            kind_rows, overheads[kind] = transport_rows(
                kind, peer, memcpy, args.tokens, args.repeats, args.seed
            )
            rows += kind_rows
    finally:
        peer.quit()
    rows.sort(key=lambda r: r.tokens)
    header = (
        f"torch {torch.__version__}, {args.threads} torch threads, {os.cpu_count()} CPUs, "
        f"median of {args.repeats}; load average {load_before[0]:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after"
    )
    print(header)
    print()
    print(table(rows))
    print()
    print(
        "Per-call overhead (1 token, 1 layer fetch): "
        + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in overheads.items())
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "header": header,
                    "rows": [asdict(r) | {"gbps": r.gbps, "ratio": r.ratio} for r in rows],
                    "per_call_overhead_s": overheads,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
