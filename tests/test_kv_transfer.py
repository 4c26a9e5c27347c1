"""KV transfer library: plans, scatter/gather, transports, fault injection, the worker.

Every move is checked bit-exactly against a token-by-token reference (`reference_move`)
over the whole destination pool, so slots a transfer must not touch are checked too. The
shared-memory and TCP transports are also exercised with the peer in a real separate
process (multiprocessing spawn).
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec
import pytest
import torch

from pdserve.kv.layout import DTYPE_SIZES, KVLayout, RegionHandle
from pdserve.kv.transfer import (
    ChecksumError,
    FaultConfig,
    FaultyTransport,
    InProcessTransport,
    LayoutMismatchError,
    PeerUnavailableError,
    SharedMemoryTransport,
    TcpTransport,
    TokenRun,
    TransferError,
    TransferPlan,
    TransferState,
    TransferTimeoutError,
    TransferWorker,
    Transport,
    dtype_name,
    gather,
    layout_of,
    make_transport,
    plan_runs,
    scatter,
    split_plan,
    stream_in,
    stream_out,
    torch_dtype,
)
from pdserve.kv.transfer import aggregate as aggregate_module
from pdserve.kv.transfer import tcp as tcp_module
from pdserve.kv.transfer.shm import segment_path

HEADS, HEAD_DIM = 2, 4
KINDS = ["inproc", "shm", "tcp"]


def layout(
    num_layers: int = 3,
    num_blocks: int = 12,
    block_size: int = 4,
    dtype: str = "float32",
    first_layer: int = 0,
) -> KVLayout:
    return KVLayout(num_layers, num_blocks, block_size, HEADS, HEAD_DIM, dtype, first_layer)


def filled(lay: KVLayout, seed: int) -> torch.Tensor:
    """A pool of distinct pseudo-random values (deterministic: same in every process)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(lay.shape, generator=gen).to(torch_dtype(lay))


def reference_move(
    src: torch.Tensor,
    src_layout: KVLayout,
    src_blocks: Sequence[int],
    dst: torch.Tensor,
    dst_layout: KVLayout,
    dst_blocks: Sequence[int],
    start: int,
    end: int,
    layers: range | None = None,
) -> torch.Tensor:
    """`dst` after moving tokens [start, end) of the common layers, one token at a time."""
    out = dst.clone()
    sbs, dbs = src_layout.block_size, dst_layout.block_size
    for g in src_layout.layers:
        if g not in dst_layout.layers or (layers is not None and g not in layers):
            continue
        sl, dl = g - src_layout.first_layer, g - dst_layout.first_layer
        for i in range(start, end):
            token = src[sl, :, src_blocks[i // sbs], i % sbs]
            out[dl, :, dst_blocks[i // dbs], i % dbs] = token
    return out


def raises_exactly(exc: type[BaseException], message: str, fn: Callable[[], object]) -> None:
    with pytest.raises(exc) as info:
        fn()
    assert str(info.value) == message


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Transport, Transport]]:
    """Two transports of the parametrized kind (as two instances would have)."""
    kind = request.param
    a, b = make_transport(kind), make_transport(kind)
    yield a, b
    a.close()
    b.close()


# ---- layout --------------------------------------------------------------------------------


def test_layout_geometry_of_smollm2() -> None:
    lay = KVLayout(30, 64, 16, 3, 64, "float32")
    assert lay.shape == (30, 2, 64, 16, 3, 64)
    assert lay.token_bytes == 768 and 2 * lay.num_layers * lay.token_bytes == 46080
    assert lay.nbytes == 64 * 16 * 46080
    assert torch_dtype(lay) is torch.float32 and lay.elem_size == 4
    half = KVLayout(3, 4, 16, 3, 64, "bfloat16", first_layer=6)
    assert half.layers == range(6, 9) and half.token_bytes == 384
    pool = torch.zeros(half.shape, dtype=torch.bfloat16)
    assert layout_of(pool, first_layer=6) == half


def test_one_dtype_table_for_sizes_and_torch_dtypes() -> None:
    assert list(DTYPE_SIZES) == ["float32", "bfloat16", "float16"]
    for name, size in DTYPE_SIZES.items():
        lay = layout(dtype=name)
        assert lay.elem_size == size == torch_dtype(lay).itemsize
        assert dtype_name(torch_dtype(lay)) == name
    raises_exactly(
        LayoutMismatchError,
        "KV pool dtype must be one of float32, bfloat16, float16, got torch.int8",
        lambda: layout_of(torch.zeros(1, 2, 1, 1, 1, 1, dtype=torch.int8)),
    )


def test_layout_rejects_bad_values() -> None:
    raises_exactly(
        ValueError,
        "KVLayout.dtype must be one of float32, bfloat16, float16, got 'int8'",
        lambda: layout(dtype="int8"),
    )
    raises_exactly(ValueError, "KVLayout.num_blocks must be > 0, got 0", lambda: layout(0 + 3, 0))
    raises_exactly(
        LayoutMismatchError,
        "a KV pool tensor has shape [num_layers, 2, num_blocks, block_size, num_kv_heads, "
        "head_dim], got (2, 3, 4)",
        lambda: layout_of(torch.zeros(2, 3, 4)),
    )


def test_layout_and_plan_travel_as_msgpack() -> None:
    plan = stream_out(layout(), [1, 2], layout(), [3, 4], 0, 8)
    handle = RegionHandle("tcp", "127.0.0.1:5", "prefill", layout(first_layer=3))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(plan), type=TransferPlan) == plan
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(handle), type=RegionHandle) == handle


# ---- plan_runs -----------------------------------------------------------------------------


def test_plan_runs_coalesces_adjacent_blocks() -> None:
    # blocks 4, 5 are adjacent (slots 16..23); 9 is not; the destination is all adjacent
    assert plan_runs([4, 5, 9], 4, [0, 1, 2], 4, 0, 12) == [(16, 0, 8), (36, 8, 4)]
    assert plan_runs([4, 5, 6], 4, [7, 8, 9], 4, 0, 12) == [TokenRun(16, 28, 12)]
    # a break on either side breaks the run
    assert plan_runs([0, 1, 2], 4, [5, 3, 4], 4, 0, 12) == [(0, 20, 4), (4, 12, 8)]
    assert plan_runs([0, 1], 4, [0, 1], 4, 3, 3) == []


def test_plan_runs_different_block_sizes() -> None:
    # 16 -> 32: one destination block takes two scattered source blocks
    assert plan_runs([3, 7], 16, [2], 32, 0, 32) == [(48, 64, 16), (112, 80, 16)]
    # 16 -> 8: destination blocks 5, 6 adjacent -> one run; 6, 5 -> two
    assert plan_runs([1], 16, [5, 6], 8, 0, 16) == [(16, 40, 16)]
    assert plan_runs([1], 16, [6, 5], 8, 0, 16) == [(16, 48, 8), (24, 40, 8)]
    # 16 -> 5: source contiguous (blocks 2, 3), destination breaks every 5 tokens
    assert plan_runs([2, 3], 16, [0, 7, 1, 9], 5, 0, 20) == [
        (32, 0, 5),
        (37, 35, 5),
        (42, 5, 5),
        (47, 45, 5),
    ]
    # 5 -> 16, tail of a partial block
    assert plan_runs([0, 7], 5, [4], 16, 0, 7) == [(0, 64, 5), (35, 69, 2)]


def test_plan_runs_start_not_block_aligned() -> None:
    # tokens 5..13: source blocks (bs 8) [2, 8] -> slots 21..23, 64..69; destination 5..13
    assert plan_runs([2, 8], 8, [0, 1, 2, 3], 4, 5, 14) == [(21, 5, 3), (64, 8, 6)]
    # the first block of a table is never read when start skips it (its id is irrelevant)
    assert plan_runs([99, 1], 4, [0, 3], 4, 5, 7) == [(5, 13, 2)]


# ---- stream_out / stream_in ----------------------------------------------------------------


def test_stream_out_plan_fields() -> None:
    plan = stream_out(layout(), [4, 5, 9], layout(block_size=8), [1, 3], 2, 12)
    assert plan.src_layers == (0, 3) and plan.dst_layers == (0, 3)
    assert plan.runs == ((18, 10, 6), (36, 24, 4))
    assert plan.num_tokens == 10 and plan.token_bytes == HEADS * HEAD_DIM * 4
    assert plan.nbytes == 2 * 3 * 10 * 32 and plan.num_chunks == 2 * 3 * 2
    assert stream_in(layout(), [4, 5, 9], layout(block_size=8), [1, 3], 2, 12) == plan


def test_stream_out_layer_split_across_stages() -> None:
    sender = layout(num_layers=6)
    first, second = layout(first_layer=0), layout(first_layer=3)
    p0 = stream_out(sender, [1], first, [2], 0, 4)
    p1 = stream_out(sender, [1], second, [2], 0, 4)
    assert (p0.src_layers, p0.dst_layers) == ((0, 3), (0, 3))
    assert (p1.src_layers, p1.dst_layers) == ((3, 6), (0, 3))
    one = stream_out(sender, [1], second, [2], 0, 4, layers=range(4, 5))
    assert (one.src_layers, one.dst_layers) == ((4, 5), (1, 2))


def test_stream_out_errors_name_field_and_values() -> None:
    a = layout()
    other_heads = KVLayout(3, 12, 4, 1, HEAD_DIM, "float32", first_kv_head=2)
    other_dim = KVLayout(3, 12, 4, HEADS, 8, "float32")
    cases: list[tuple[Callable[[], object], str]] = [
        (
            lambda: stream_out(a, [0], other_heads, [0], 0, 4),
            "no common KV heads: source holds [0, 2), destination holds [2, 3)",
        ),
        (
            lambda: stream_out(a, [0], other_dim, [0], 0, 4),
            "head_dim differs: source has 4, destination has 8",
        ),
        (
            lambda: stream_out(a, [0, 1], a, [0, 1, 2], 0, 10),
            "source block table is too short: 10 tokens with block_size 4 need 3 blocks, got 2",
        ),
        (
            lambda: stream_out(a, [0, 1, 2], layout(block_size=8), [0], 0, 10),
            "destination block table is too short: 10 tokens with block_size 8 need 2 "
            "blocks, got 1",
        ),
        (
            lambda: stream_out(a, [0], a, [0], 3, 2),
            "token range out of order: start 3, end 2 (need 0 <= start <= end)",
        ),
        (
            lambda: stream_out(a, [0], layout(first_layer=3), [0], 0, 4),
            "no common layers: source holds [0, 3), destination holds [3, 6)",
        ),
        (
            lambda: stream_out(a, [0], a, [0], 0, 4, layers=range(5, 7)),
            "no common layers: source holds [0, 3), destination holds [0, 3), requested [5, 7)",
        ),
        (
            lambda: stream_out(a, [12], a, [0], 0, 4),
            "source block id 12 is out of range for a pool of 12 blocks",
        ),
    ]
    for fn, message in cases:
        raises_exactly(LayoutMismatchError, message, fn)
    assert issubclass(LayoutMismatchError, ValueError)


def test_split_plan_covers_the_plan_exactly() -> None:
    plan = TransferPlan((0, 5), (1, 6), ((0, 10, 7), (20, 2, 3)), 32)
    by_layers = split_plan(plan, 2)
    assert [(p.src_layers, p.dst_layers) for p in by_layers] == [
        ((0, 2), (1, 3)),
        ((2, 5), (3, 6)),
    ]
    assert all(p.runs == plan.runs for p in by_layers)
    one_layer = TransferPlan((2, 3), (0, 1), ((0, 10, 7), (20, 2, 3)), 32)
    assert [p.runs for p in split_plan(one_layer, 3)] == [
        ((0, 10, 3),),
        ((3, 13, 3),),
        ((6, 16, 1), (20, 2, 3)),
    ]
    assert split_plan(plan, 1) == [plan]


# ---- gather / scatter ----------------------------------------------------------------------


def test_gather_scatter_round_trip_across_block_sizes() -> None:
    a, b = layout(block_size=4), layout(block_size=5, num_blocks=10)
    src, dst = filled(a, 1), filled(b, 2)
    src_blocks, dst_blocks = [7, 2, 3, 11, 0, 5, 6, 9], [4, 9, 0, 1, 2, 8, 3]
    buf = gather(src, a, src_blocks, 3, 29)
    assert buf.shape == (3, 2, 26, HEADS, HEAD_DIM) and buf.is_contiguous()
    for i in range(3, 29):
        assert torch.equal(buf[:, :, i - 3], src[:, :, src_blocks[i // 4], i % 4])
    want = reference_move(src, a, src_blocks, dst, b, dst_blocks, 3, 29)
    scatter(buf, dst, b, dst_blocks, 3)
    assert torch.equal(dst, want)
    assert torch.equal(gather(dst, b, dst_blocks, 3, 29), buf)


def test_gather_layer_subset_and_scatter_cast() -> None:
    a = layout(num_layers=4, first_layer=2)
    src = filled(a, 3)
    buf = gather(src, a, [5, 1], 0, 8, layers=range(3, 5))
    assert torch.equal(buf, gather(src, a, [5, 1], 0, 8)[1:3])
    half = layout(num_layers=4, first_layer=2, dtype="bfloat16")
    dst = torch.zeros(half.shape, dtype=torch.bfloat16)
    scatter(buf, dst, half, [0, 2], 0, layers=range(3, 5))
    want = reference_move(src, a, [5, 1], dst, half, [0, 2], 0, 8, layers=range(3, 5))
    assert torch.equal(dst, want)
    raises_exactly(
        LayoutMismatchError,
        "layers [1, 3) are not within the pool's [2, 6)",
        lambda: gather(src, a, [5, 1], 0, 8, layers=range(1, 3)),
    )


# ---- transports: fetch and flush -----------------------------------------------------------


@pytest.mark.parametrize("pair", KINDS, indirect=True)
def test_fetch_and_flush_are_bit_exact(pair: tuple[Transport, Transport]) -> None:
    sender, receiver = pair
    a, b = layout(block_size=4), layout(block_size=8, num_blocks=8)
    src = sender.create_region("prefill", a)
    dst = receiver.create_region("decode", b)
    src.tensor.copy_(filled(a, 1))
    dst.tensor.copy_(filled(b, 2))
    src_blocks, dst_blocks = [3, 4, 9, 0, 1, 2, 10], [6, 0, 1, 5]
    plan = stream_in(a, src_blocks, b, dst_blocks, 5, 27)
    want = reference_move(src.tensor, a, src_blocks, dst.tensor, b, dst_blocks, 5, 27)
    receiver.fetch(src.handle, plan, dst.tensor)
    assert torch.equal(dst.tensor, want)

    dst.tensor.copy_(filled(b, 3))
    want = reference_move(src.tensor, a, src_blocks, dst.tensor, b, dst_blocks, 5, 27)
    sender.flush(dst.handle, stream_out(a, src_blocks, b, dst_blocks, 5, 27), src.tensor)
    assert torch.equal(dst.tensor, want)
    assert torch.equal(src.tensor, filled(a, 1))  # the source is only read


@pytest.mark.parametrize("pair", KINDS, indirect=True)
def test_layer_split_receivers_get_their_layers(pair: tuple[Transport, Transport]) -> None:
    sender, receiver = pair
    full = layout(num_layers=6)
    src = sender.create_region("prefill", full)
    src.tensor.copy_(filled(full, 4))
    for first in (0, 3):
        stage = layout(first_layer=first)
        dst = receiver.create_region(f"stage{first}", stage)
        plan = stream_in(full, [2, 7, 1], stage, [0, 1, 5], 0, 10)
        want = reference_move(src.tensor, full, [2, 7, 1], dst.tensor, stage, [0, 1, 5], 0, 10)
        receiver.fetch(src.handle, plan, dst.tensor)
        assert torch.equal(dst.tensor, want)
        assert dst.tensor.abs().sum() > 0


@pytest.mark.parametrize("pair", ["inproc", "shm"], indirect=True)
def test_dtype_cast_in_memory_transports(pair: tuple[Transport, Transport]) -> None:
    sender, receiver = pair
    a, b = layout(), layout(dtype="bfloat16")
    src = sender.create_region("prefill", a)
    dst = receiver.create_region("decode", b)
    src.tensor.copy_(filled(a, 5))
    plan = stream_in(a, [1, 2], b, [3, 0], 0, 8)
    want = reference_move(src.tensor, a, [1, 2], dst.tensor, b, [3, 0], 0, 8)
    receiver.fetch(src.handle, plan, dst.tensor)
    assert torch.equal(dst.tensor, want)
    back = torch.zeros(a.shape)
    receiver.fetch(dst.handle, stream_in(b, [3, 0], a, [1, 2], 0, 8), back)
    assert torch.equal(back, reference_move(dst.tensor, b, [3, 0], back, a, [1, 2], 0, 8))


def test_tcp_refuses_to_cast() -> None:
    with TcpTransport() as sender, TcpTransport() as receiver:
        a, b = layout(), layout(dtype="bfloat16")
        src = sender.create_region("prefill", a)
        dst = receiver.create_region("decode", b)
        raises_exactly(
            LayoutMismatchError,
            "dtype differs: source has float32, destination has bfloat16 "
            "(this transport moves bytes and cannot cast)",
            lambda: receiver.fetch(src.handle, stream_in(a, [1], b, [1], 0, 4), dst.tensor),
        )


@pytest.mark.parametrize("pair", KINDS, indirect=True)
def test_concurrent_fetches_from_threads(pair: tuple[Transport, Transport]) -> None:
    sender, receiver = pair
    a = layout(num_blocks=32)
    src = sender.create_region("prefill", a)
    dst = receiver.create_region("decode", a)
    src.tensor.copy_(filled(a, 6))
    tables = [([i, 8 + i], [31 - i, 16 + i]) for i in range(8)]
    errors: list[BaseException] = []

    def fetch(src_blocks: list[int], dst_blocks: list[int]) -> None:
        try:
            for _ in range(5):
                plan = stream_in(a, src_blocks, a, dst_blocks, 0, 8)
                receiver.fetch(src.handle, plan, dst.tensor)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=fetch, args=t) for t in tables]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    want = dst.tensor.clone().zero_()
    for s, d in tables:
        want = reference_move(src.tensor, a, s, want, a, d, 0, 8)
    assert torch.equal(dst.tensor, want)


def test_tcp_parallel_streams_and_checksum() -> None:
    a = layout(num_layers=5, num_blocks=20)
    with (
        TcpTransport(streams=3, stream_min_bytes=0, verify_checksum=True) as sender,
        TcpTransport(streams=3, stream_min_bytes=0, verify_checksum=True) as receiver,
    ):
        src = sender.create_region("prefill", a)
        dst = receiver.create_region("decode", a)
        src.tensor.copy_(filled(a, 7))
        blocks, dst_blocks = [4, 5, 6, 11, 0], [19, 18, 1, 2, 3]
        want = reference_move(src.tensor, a, blocks, dst.tensor, a, dst_blocks, 1, 19)
        receiver.fetch(src.handle, stream_in(a, blocks, a, dst_blocks, 1, 19), dst.tensor)
        assert torch.equal(dst.tensor, want)
        dst.tensor.zero_()
        one = range(2, 3)  # a single layer: split by tokens
        want = reference_move(src.tensor, a, blocks, dst.tensor, a, dst_blocks, 0, 20, one)
        sender.flush(dst.handle, stream_out(a, blocks, a, dst_blocks, 0, 20, one), src.tensor)
        assert torch.equal(dst.tensor, want)


def test_tcp_checksum_mismatch_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    counter = itertools.count()
    monkeypatch.setattr(tcp_module.Chunks, "crc32", lambda self: next(counter))
    a = layout()
    with TcpTransport(verify_checksum=True) as sender, TcpTransport() as receiver:
        src = sender.create_region("prefill", a)
        dst = receiver.create_region("decode", a)
        plan = stream_out(a, [1], a, [2], 0, 4)
        with pytest.raises(ChecksumError, match="crc32 mismatch writing region 'decode'"):
            sender.flush(dst.handle, plan, src.tensor)
        with pytest.raises(ChecksumError, match="crc32 mismatch"):
            sender.fetch(dst.handle, stream_in(a, [2], a, [1], 0, 4), src.tensor)
        # the connection is usable afterwards: the stream stayed in sync
        monkeypatch.setattr(tcp_module.Chunks, "crc32", lambda self: 0)
        sender.flush(dst.handle, plan, src.tensor)


@pytest.mark.parametrize("threads", [2, 3])
def test_parallel_copies_are_bit_exact(monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    monkeypatch.setattr(aggregate_module, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(aggregate_module, "ITEM_BYTES", 1000)  # a few runs / rows each
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for num_layers, dst_blocks in (
            (5, [11, 3, 4, 5, 0, 9, 1, 2, 6, 7, 8]),
            (1, list(range(11))),
        ):
            a = layout(num_layers=num_layers)
            src, dst = filled(a, 15), filled(a, 16)
            src_blocks = [7, 2, 3, 11, 0, 5, 6, 9, 1, 4, 8]  # many runs / one layer, few runs
            want = reference_move(src, a, src_blocks, dst, a, dst_blocks, 1, 43)
            aggregate_module.apply_plan(stream_in(a, src_blocks, a, dst_blocks, 1, 43), src, dst)
            assert torch.equal(dst, want)
            contiguous = stream_in(a, range(12), a, range(12), 0, 48)  # one run: by layers
            aggregate_module.apply_plan(contiguous, src, dst)
            assert torch.equal(dst, src)
    finally:
        torch.set_num_threads(before)


def test_parallel_copy_items_cover_every_row_and_run_once() -> None:
    runs = [(0, 5, 2), (9, 0, 40), (3, 70, 1), (50, 90, 3), (80, 40, 7)]
    for item_bytes in (1, 100, 500, 10_000):
        items = aggregate_module._work_items(runs, 6, 8, item_bytes)
        covered = sorted(
            (row, run) for lo, hi, group in items for run in group for row in range(lo, hi)
        )
        assert covered == sorted((row, run) for run in runs for row in range(6))
        if item_bytes == 10_000:
            assert items == [(0, 6, runs)]


# ---- transports: failures ------------------------------------------------------------------


def bounded(fn: Callable[[], object], limit_s: float = 20.0) -> BaseException | None:
    """Run fn on a thread; the exception it raised (the test fails if it hangs)."""
    box: list[BaseException | None] = [None]

    def run() -> None:
        try:
            fn()
        except BaseException as e:
            box[0] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive(), "the call hung"
    return box[0]


def test_tcp_closed_peer_is_unavailable_not_a_hang() -> None:
    a = layout()
    peer = TcpTransport()
    src = peer.create_region("prefill", a)
    with TcpTransport(timeout_s=10) as me:
        local = me.create_region("decode", a).tensor
        plan = stream_in(a, [1], a, [1], 0, 4)
        me.fetch(src.handle, plan, local)  # a cached connection now exists
        peer.close()
        for _ in range(2):  # the cached connection breaks, then the connect is refused
            error = bounded(lambda: me.fetch(src.handle, plan, local))
            assert isinstance(error, PeerUnavailableError), error
            assert f"tcp fetch from tcp region 'prefill' at {peer.address}" in str(error)


def test_tcp_silent_peer_times_out() -> None:
    a = layout()
    with socket.create_server(("127.0.0.1", 0)) as silent, TcpTransport(timeout_s=0.2) as me:
        handle = RegionHandle("tcp", f"127.0.0.1:{silent.getsockname()[1]}", "prefill", a)
        local = me.create_region("decode", a).tensor
        t0 = time.monotonic()
        error = bounded(lambda: me.fetch(handle, stream_in(a, [1], a, [1], 0, 4), local))
        assert isinstance(error, TransferTimeoutError), error
        assert str(error) == (
            f"tcp fetch from tcp region 'prefill' at {handle.address}: no progress within 0.2 s"
        )
        assert time.monotonic() - t0 >= 0.2


def test_make_transport_rejects_unknown_kind() -> None:
    raises_exactly(
        ValueError,
        "transport must be one of inproc, shm, tcp, auto, got 'rdma'",
        lambda: make_transport("rdma"),
    )


def test_unknown_region_is_unavailable() -> None:
    a = layout()
    for kind in KINDS:
        with make_transport(kind) as peer, make_transport(kind) as me:
            local = me.create_region("decode", a).tensor
            handle = peer.create_region("prefill", a).handle
            ghost = msgspec.structs.replace(handle, name="ghost")
            if kind == "shm":
                ghost = msgspec.structs.replace(handle, address="pdkv-ghost-segment")
            with pytest.raises(PeerUnavailableError):
                me.fetch(ghost, stream_in(a, [1], a, [1], 0, 4), local)


def test_tcp_server_survives_client_leaving_mid_request() -> None:
    a = layout()
    with TcpTransport() as peer, TcpTransport() as me:
        dst = peer.create_region("decode", a)
        host, _, port = peer.address.rpartition(":")
        plan = stream_out(a, [1], a, [2], 0, 4)
        body = msgspec.msgpack.encode(tcp_module._Request("decode", plan, "float32"))
        header = tcp_module._HEADER.pack(
            tcp_module.MAGIC, tcp_module.OP_WRITE, 0, 0, len(body), plan.nbytes
        )
        with socket.create_connection((host, int(port))) as rogue:
            rogue.sendall(header + body + b"\x01" * 10)  # then leaves mid-payload
        with socket.create_connection((host, int(port))) as rogue:
            rogue.sendall(struct.pack("!4s", b"JUNK") + b"\x00" * 30)  # not the protocol
        local = me.create_region("prefill", a)
        local.tensor.copy_(filled(a, 8))
        want = reference_move(local.tensor, a, [1], dst.tensor, a, [2], 0, 4)
        me.flush(dst.handle, plan, local.tensor)
        assert torch.equal(dst.tensor, want)


def test_shm_close_unlinks_segments_and_is_idempotent() -> None:
    a = layout()
    peer, me = SharedMemoryTransport(), SharedMemoryTransport()
    region = peer.create_region("prefill", a)
    path = segment_path(region.handle.address)
    assert os.path.exists(path) and peer.segments == [region.handle.address]
    region.tensor.fill_(1.5)
    local = me.create_region("decode", a).tensor
    me.fetch(region.handle, stream_in(a, [0], a, [0], 0, 4), local)
    peer.close()
    peer.close()
    assert not os.path.exists(path) and peer.segments == []
    assert float(region.tensor.sum()) == 1.5 * region.tensor.numel()  # still mapped
    with pytest.raises(PeerUnavailableError, match="is gone"):
        me.fetch(region.handle, stream_in(a, [0], a, [0], 0, 4), local)
    mine = me.segments
    me.close()
    me.close()
    assert not any(os.path.exists(segment_path(s)) for s in mine)
    with pytest.raises(TransferError, match="closed"):
        me.fetch(region.handle, stream_in(a, [0], a, [0], 0, 4), local)


_OWNER = """
import sys, time
from pdserve.kv.layout import KVLayout
from pdserve.kv.transfer.shm import SharedMemoryTransport
t = SharedMemoryTransport()
r = t.create_region(sys.argv[1], KVLayout(2, 4, 4, 2, 8, "float32"))
print(r.handle.address, flush=True)
time.sleep(60)
"""


def _segment_owner(name: str) -> subprocess.Popen[str]:
    """A process (its own process group) that created a segment and holds it."""
    return subprocess.Popen(
        [sys.executable, "-c", _OWNER, name], stdout=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip


def test_segments_of_dead_owners_are_removed_by_the_next_transport() -> None:
    """An owner killed with its whole process group (its resource tracker too, as Ray
    does with a lost node's workers) leaves its segment behind; the next transport to
    create a region unlinks it, and leaves a live owner's segment alone."""
    dead, alive = _segment_owner("decode-0"), _segment_owner("decode-1")
    try:
        dead_seg, alive_seg = (p.stdout.readline().strip() for p in (dead, alive))  # type: ignore[union-attr]
        os.killpg(dead.pid, signal.SIGKILL)
        dead.wait(timeout=30)
        time.sleep(0.5)
        assert os.path.exists(segment_path(dead_seg))  # leaked: nobody left to unlink it
        t = SharedMemoryTransport()
        t.create_region("prefill", layout())
        assert not os.path.exists(segment_path(dead_seg))
        assert os.path.exists(segment_path(alive_seg))
        t.close()
    finally:
        for p in (dead, alive):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=30)
    # the live owner's tracker unlinks its segment once the owner is gone
    deadline = time.monotonic() + 10
    while os.path.exists(segment_path(alive_seg)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(segment_path(alive_seg))


def test_close_is_idempotent_for_every_transport() -> None:
    for kind in KINDS:
        t = make_transport(kind)
        t.create_region("x", layout())
        t.close()
        t.close()
    inproc = InProcessTransport()
    handle = inproc.create_region("x", layout()).handle
    inproc.close()
    with pytest.raises(PeerUnavailableError):
        InProcessTransport().fetch(
            handle, stream_in(layout(), [0], layout(), [0], 0, 1), torch.zeros(layout().shape)
        )


# ---- peers in a separate process ----------------------------------------------------------


def _peer_main(commands: Any, results: Any) -> None:
    """A separate process holding regions: answers commands until "quit"."""
    transports: dict[str, Transport] = {}
    regions: dict[str, Any] = {}
    while True:
        cmd, *args = commands.get()
        try:
            if cmd == "create":
                kind, name, lay, seed = args  # kind "auto@NODE": the auto transport on NODE
                base, _, node = kind.partition("@")
                transport = transports.setdefault(kind, make_transport(base, node=node))
                region = transport.create_region(name, lay)
                region.tensor.copy_(filled(lay, seed))
                regions[name] = region
                results.put(region.handle)
            elif cmd == "expect":  # does region `name` hold exactly `want`?
                name, want = args
                results.put(bool(torch.equal(regions[name].tensor, want)))
            elif cmd == "close":
                transports.pop(args[0]).close()
                results.put(None)
            elif cmd == "quit":
                for t in transports.values():
                    t.close()
                results.put(None)
                return
        except Exception as e:
            results.put(e)


class Peer:
    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.commands, self.results = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=_peer_main, args=(self.commands, self.results))
        self.process.start()

    def ask(self, *cmd: Any) -> Any:
        self.commands.put(cmd)
        answer = self.results.get(timeout=60)
        if isinstance(answer, Exception):
            raise answer
        return answer


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    p = Peer()
    yield p
    p.ask("quit")
    p.process.join(30)


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_peer_in_another_process(peer: Peer, kind: str) -> None:
    a, b = layout(block_size=4), layout(block_size=8, num_blocks=8)
    remote: RegionHandle = peer.ask("create", kind, "prefill", a, 11)
    with make_transport(kind) as me:
        local = me.create_region("decode", b)
        local.tensor.copy_(filled(b, 12))
        src_blocks, dst_blocks = [3, 4, 9, 0, 1], [6, 0, 1]
        want = reference_move(filled(a, 11), a, src_blocks, local.tensor, b, dst_blocks, 2, 19)
        me.fetch(remote, stream_in(a, src_blocks, b, dst_blocks, 2, 19), local.tensor)
        assert torch.equal(local.tensor, want)

        # flush back into the peer's region, other blocks; the peer checks
        target: RegionHandle = peer.ask("create", kind, "decode-target", b, 13)
        want = reference_move(local.tensor, b, [5, 2], filled(b, 13), b, [7, 3], 0, 16)
        me.flush(target, stream_out(b, [5, 2], b, [7, 3], 0, 16), local.tensor)
        assert peer.ask("expect", "decode-target", want) is True

    peer.ask("close", kind)
    if kind == "shm":
        assert not os.path.exists(segment_path(remote.address))
    with make_transport(kind, timeout_s=10) as me:
        local = me.create_region("decode", b)
        plan = stream_in(a, [0], b, [0], 0, 4)
        error = bounded(lambda: me.fetch(remote, plan, local.tensor))
        assert isinstance(error, PeerUnavailableError), error


def test_auto_transport_routes_by_node(peer: Peer) -> None:
    """The auto transport (serve --ray): a peer process's region, reached from the same
    node through its shared-memory segment and from another node over TCP, bit-exact
    both ways, each transfer counted on the route it took."""
    a, b = layout(block_size=4), layout(block_size=8, num_blocks=8)
    remote: RegionHandle = peer.ask("create", "auto@node-a", "prefill", a, 21)
    assert (remote.transport, remote.node) == ("auto", "node-a")
    assert remote.address.startswith("pdkv-") and remote.tcp_address.startswith("127.0.0.1:")
    for node, route in (("node-a", "shm"), ("node-b", "tcp")):
        with make_transport("auto", node=node) as me:
            local = me.create_region("decode", b)
            local.tensor.copy_(filled(b, 22))
            want = reference_move(filled(a, 21), a, [3, 4, 9], local.tensor, b, [6, 0], 1, 11)
            me.fetch(remote, stream_in(a, [3, 4, 9], b, [6, 0], 1, 11), local.tensor)
            assert torch.equal(local.tensor, want)
            target: RegionHandle = peer.ask("create", "auto@node-a", f"target-{node}", b, 23)
            want = reference_move(local.tensor, b, [5, 2], filled(b, 23), b, [7, 3], 0, 16)
            me.flush(target, stream_out(b, [5, 2], b, [7, 3], 0, 16), local.tensor)
            assert peer.ask("expect", f"target-{node}", want) is True
            assert me.routes() == {"shm": 0, "tcp": 0} | {route: 2}
    peer.ask("close", "auto@node-a")
    # A peer that cannot be reached over either route fails as unavailable, not a hang.
    with make_transport("auto", node="node-b", timeout_s=10) as me:
        local = me.create_region("decode", b)
        error = bounded(lambda: me.fetch(remote, stream_in(a, [0], b, [0], 0, 4), local.tensor))
        assert isinstance(error, PeerUnavailableError), error


def test_auto_transport_needs_a_node_and_refuses_plain_handles() -> None:
    raises_exactly(
        ValueError, "the auto transport needs the name of its node", lambda: make_transport("auto")
    )
    with make_transport("auto", node="n") as me, make_transport("tcp") as tcp:
        handle = tcp.create_region("x", layout()).handle
        raises_exactly(
            ValueError,
            f"cannot reach tcp region 'x' at {tcp.address} through the auto transport",
            lambda: me.fetch(
                handle, stream_in(layout(), [0], layout(), [0], 0, 1), torch.zeros(layout().shape)
            ),
        )


# ---- fault injection -----------------------------------------------------------------------


def test_fault_config_validation() -> None:
    raises_exactly(
        ValueError,
        "FaultConfig.failure_rate must be in [0, 1], got 1.5",
        lambda: FaultConfig(failure_rate=1.5),
    )
    raises_exactly(
        ValueError, "FaultConfig.delay_s must be >= 0, got -1.0", lambda: FaultConfig(delay_s=-1.0)
    )
    raises_exactly(
        ValueError,
        "FaultConfig.bandwidth_bytes_per_s must be > 0, got 0.0",
        lambda: FaultConfig(bandwidth_bytes_per_s=0.0),
    )
    raises_exactly(
        ValueError,
        "FaultConfig.corrupt_rate must be in [0, 1], got -0.1",
        lambda: FaultConfig(corrupt_rate=-0.1),
    )
    assert not FaultConfig().active and FaultConfig(delay_s=0.1).active
    plain = make_transport("inproc", faults=FaultConfig())
    assert isinstance(plain, InProcessTransport)
    plain.close()


def faulty_pair(config: FaultConfig) -> tuple[FaultyTransport, Any, Any]:
    transport = make_transport("inproc", faults=config)
    assert isinstance(transport, FaultyTransport)
    a = layout()
    src = transport.create_region("prefill", a)
    dst = transport.create_region("decode", a)
    src.tensor.copy_(filled(a, 9))
    return transport, src, dst


def test_failure_rate_one_always_fails_and_zero_never() -> None:
    transport, src, dst = faulty_pair(FaultConfig(failure_rate=1.0, seed=0))
    a = src.handle.layout
    plan = stream_in(a, [1, 2], a, [3, 4], 0, 8)
    for _ in range(20):
        with pytest.raises(TransferError) as info:
            transport.fetch(src.handle, plan, dst.tensor)
        assert str(info.value) == f"injected transfer failure: fetch from {src.handle.describe()}"
    assert not dst.tensor.any()  # it failed before moving anything
    transport.close()
    never = FaultyTransport(InProcessTransport(), FaultConfig(failure_rate=0.0, seed=0))
    src2 = never.create_region("prefill", a)
    dst2 = never.create_region("decode", a)
    for _ in range(50):
        never.fetch(src2.handle, plan, dst2.tensor)
        never.flush(dst2.handle, plan, src2.tensor)
    never.close()


def test_delay_and_bandwidth_are_lower_bounds() -> None:
    transport, src, dst = faulty_pair(FaultConfig(delay_s=0.05))
    a = src.handle.layout
    plan = stream_in(a, [1, 2], a, [3, 4], 0, 8)
    t0 = time.monotonic()
    transport.fetch(src.handle, plan, dst.tensor)
    assert time.monotonic() - t0 >= 0.05
    transport.close()
    bw = plan.nbytes / 0.1  # the plan should take >= 0.1 s
    transport, src, dst = faulty_pair(FaultConfig(delay_s=0.02, bandwidth_bytes_per_s=bw))
    t0 = time.monotonic()
    transport.flush(dst.handle, plan, src.tensor)
    assert time.monotonic() - t0 >= 0.12
    assert torch.equal(gather(dst.tensor, a, [3, 4], 0, 8), gather(src.tensor, a, [1, 2], 0, 8))
    transport.close()


@pytest.mark.parametrize("kind", KINDS)
def test_corruption_is_detected(kind: str) -> None:
    a = layout()
    with make_transport(kind, faults=FaultConfig(corrupt_rate=1.0, seed=1)) as transport:
        src = transport.create_region("prefill", a)
        dst = transport.create_region("decode", a)
        src.tensor.copy_(filled(a, 10))
        clean = reference_move(src.tensor, a, [1, 2], dst.tensor, a, [3, 4], 0, 8)
        for op in ("fetch", "flush"):
            dst.tensor.zero_()
            plan = stream_in(a, [1, 2], a, [3, 4], 0, 8)
            with pytest.raises(ChecksumError, match=f"injected corruption: {op}"):
                if op == "fetch":
                    transport.fetch(src.handle, plan, dst.tensor)
                else:
                    transport.flush(dst.handle, plan, src.tensor)
            got, want = dst.tensor.view(torch.uint8), clean.view(torch.uint8)
            assert int((got != want).sum()) == 1  # exactly one byte flipped


# ---- the worker ----------------------------------------------------------------------------


def test_worker_states_and_errors() -> None:
    worker = TransferWorker(num_threads=1, name="t")
    gate = threading.Event()
    running = threading.Event()

    def blocked() -> None:
        running.set()
        gate.wait(10)

    first = worker.submit(blocked, nbytes=123)
    second = worker.submit(lambda: None)
    failing = worker.submit(lambda: (_ for _ in ()).throw(ValueError("boom")))
    assert running.wait(10)
    assert first.poll() is TransferState.TRANSFERRING and first.started is not None
    assert second.poll() is TransferState.WAITING and second.started is None
    assert second.poll() == "waiting-for-destination"
    assert first.wait(0.01) is TransferState.TRANSFERRING  # times out, still running
    gate.set()
    assert first.wait(10) is TransferState.DONE and first.error is None
    assert first.nbytes == 123 and first.finished is not None
    assert first.submitted <= first.started <= first.finished
    assert second.wait(10) is TransferState.DONE
    assert failing.wait(10) is TransferState.FAILED
    assert failing.error == "ValueError: boom"
    worker.close()
    worker.close()
    with pytest.raises(RuntimeError, match="closed"):
        worker.submit(lambda: None)


def test_worker_deadline_fails_a_task_that_never_started() -> None:
    worker = TransferWorker(num_threads=1)
    gate = threading.Event()
    ran: list[bool] = []
    blocker = worker.submit(lambda: gate.wait(10))
    late = worker.submit(lambda: ran.append(True), deadline_s=0.05)
    time.sleep(0.1)
    assert late.poll() is TransferState.FAILED
    assert late.error is not None and late.error.startswith("TransferTimeoutError: ")
    gate.set()
    assert blocker.wait(10) is TransferState.DONE
    worker.close()
    assert ran == []


def test_worker_close_fails_queued_tasks_and_runs_transfers() -> None:
    a = layout()
    with InProcessTransport() as transport:
        src = transport.create_region("prefill", a)
        dst = transport.create_region("decode", a)
        src.tensor.copy_(filled(a, 14))
        worker = TransferWorker(num_threads=2)
        plan = stream_in(a, [1, 2], a, [3, 4], 0, 8)
        task = worker.submit(lambda: transport.fetch(src.handle, plan, dst.tensor), plan.nbytes)
        assert task.wait(10) is TransferState.DONE
        assert torch.equal(
            dst.tensor, reference_move(src.tensor, a, [1, 2], dst.tensor, a, [3, 4], 0, 8)
        )
        gate = threading.Event()
        blockers = [worker.submit(lambda: gate.wait(10)) for _ in range(2)]
        queued = worker.submit(lambda: None)
        deadline = time.monotonic() + 10
        while any(b.poll() is TransferState.WAITING for b in blockers):
            assert time.monotonic() < deadline
            time.sleep(0.001)
        closer = threading.Thread(target=worker.close)
        closer.start()
        time.sleep(0.05)
        gate.set()
        closer.join(10)
        assert all(b.poll() is TransferState.DONE for b in blockers)
        assert queued.poll() is TransferState.FAILED and "closed" in (queued.error or "")
        failing = TransferWorker()
        bad = failing.submit(lambda: transport.fetch(src.handle, plan, torch.zeros(3)))
        assert bad.wait(10) is TransferState.FAILED
        assert (bad.error or "").startswith("LayoutMismatchError: ")
        failing.close()
