"""Fault injection: a `Transport` wrapper that fails, delays, throttles and corrupts.

Off by default: `make_transport` wraps only when a `FaultConfig` injects something. Each
fetch/flush call, in order: waits `delay_s`; fails with TransferError("injected transfer
failure ...") with probability `failure_rate` (before moving anything); runs the inner
transport; sleeps until the call has taken at least `delay_s + nbytes / bandwidth`; and with
probability `corrupt_rate` flips one byte of the data it just wrote into the destination
and raises ChecksumError, as a transport with checksums would on detecting corruption.
The random draws come from one seeded generator behind a lock (thread-safe, reproducible
for one thread).
"""

from __future__ import annotations

import random
import threading
import time

import msgspec
import torch

from pdserve.kv.layout import KVLayout, RegionHandle
from pdserve.kv.transfer.errors import ChecksumError, TransferError
from pdserve.kv.transfer.layout import token_view
from pdserve.kv.transfer.plan import TransferPlan
from pdserve.kv.transfer.transport import Region, Transport


class FaultConfig(msgspec.Struct, frozen=True):
    """What `FaultyTransport` injects (see module doc); the defaults inject nothing."""

    failure_rate: float = 0.0  # probability a call fails before moving anything, [0, 1]
    delay_s: float = 0.0  # added to every call, >= 0
    bandwidth_bytes_per_s: float | None = None  # cap: a call takes >= nbytes / bandwidth
    corrupt_rate: float = 0.0  # probability a call corrupts one byte and fails, [0, 1]
    seed: int | None = None

    def __post_init__(self) -> None:
        for field in ("failure_rate", "corrupt_rate"):
            value = getattr(self, field)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"FaultConfig.{field} must be in [0, 1], got {value}")
        if self.delay_s < 0:
            raise ValueError(f"FaultConfig.delay_s must be >= 0, got {self.delay_s}")
        bw = self.bandwidth_bytes_per_s
        if bw is not None and not bw > 0:
            raise ValueError(f"FaultConfig.bandwidth_bytes_per_s must be > 0, got {bw}")

    @property
    def active(self) -> bool:
        """Whether this config injects anything at all."""
        return bool(
            self.failure_rate
            or self.delay_s
            or self.bandwidth_bytes_per_s is not None
            or self.corrupt_rate
        )


class FaultyTransport(Transport):
    """Wraps `inner`, injecting the faults of `config` into every fetch and flush.

    Regions, handles and `close` are the inner transport's (it is closed with the wrapper).
    """

    def __init__(self, inner: Transport, config: FaultConfig) -> None:
        self.inner = inner
        self.config = config
        self.kind = inner.kind
        self._rng = random.Random(config.seed)
        self._lock = threading.Lock()

    def create_region(self, name: str, layout: KVLayout) -> Region:
        return self.inner.create_region(name, layout)

    def routes(self) -> dict[str, int]:
        return self.inner.routes()

    def fetch(self, remote: RegionHandle, plan: TransferPlan, local: torch.Tensor) -> None:
        t0 = self._before("fetch from", remote)
        self.inner.fetch(remote, plan, local)
        self._throttle(t0, plan)
        if self._draw(self.config.corrupt_rate) and plan.runs:
            _flip_byte(local, plan.dst_layers[0], plan.runs[0][1], self._randbyte(local))
            raise ChecksumError(f"injected corruption: fetch from {remote.describe()}")

    def flush(self, remote: RegionHandle, plan: TransferPlan, local: torch.Tensor) -> None:
        t0 = self._before("flush to", remote)
        self.inner.flush(remote, plan, local)
        self._throttle(t0, plan)
        if self._draw(self.config.corrupt_rate) and plan.runs:
            self._corrupt_remote(remote, plan, local)
            raise ChecksumError(f"injected corruption: flush to {remote.describe()}")

    def close(self) -> None:
        self.inner.close()

    # ---- internals ----------------------------------------------------------------

    def _before(self, what: str, remote: RegionHandle) -> float:
        t0 = time.monotonic()
        if self.config.delay_s:
            time.sleep(self.config.delay_s)
        if self._draw(self.config.failure_rate):
            raise TransferError(f"injected transfer failure: {what} {remote.describe()}")
        return t0

    def _throttle(self, t0: float, plan: TransferPlan) -> None:
        bw = self.config.bandwidth_bytes_per_s
        if bw is None:
            return
        remaining = t0 + self.config.delay_s + plan.nbytes / bw - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)

    def _draw(self, rate: float) -> bool:
        if rate <= 0.0:
            return False
        with self._lock:
            return self._rng.random() < rate

    def _randbyte(self, pool: torch.Tensor) -> int:
        row_bytes = pool.shape[4] * pool.shape[5] * pool.element_size()
        with self._lock:
            return self._rng.randrange(row_bytes)

    def _corrupt_remote(
        self, remote: RegionHandle, plan: TransferPlan, local: torch.Tensor
    ) -> None:
        """Rewrite the first moved token (first layer) of the destination with one byte of
        its K row flipped, through the inner transport (the remote pool may be elsewhere)."""
        src_layer, src_slot = plan.src_layers[0], plan.runs[0][0]
        one = torch.empty((1, 2, 1, 1, *local.shape[4:]), dtype=local.dtype)
        token_view(one)[0, :, 0] = token_view(local)[src_layer, :, src_slot]
        _flip_byte(one, 0, 0, self._randbyte(local))
        dst_layer = plan.dst_layers[0]
        token_plan = TransferPlan(
            src_layers=(0, 1),
            dst_layers=(dst_layer, dst_layer + 1),
            runs=((0, plan.runs[0][1], 1),),
            token_bytes=plan.token_bytes,
            src_heads=plan.src_heads,
            dst_heads=plan.dst_heads,
        )
        self.inner.flush(remote, token_plan, one)


def _flip_byte(pool: torch.Tensor, layer: int, slot: int, byte: int) -> None:
    """XOR 0xFF into byte `byte` of the K row of (layer, slot)."""
    row = token_view(pool)[layer, 0, slot].view(torch.uint8)
    row[byte] ^= 0xFF
