"""The hand-off protocol: moving a prefilled request and its KV to a decode instance.

The front end relays every message (instances never talk to each other except through
the KV transport). Pull mode: AddRequest(handoff=pull) -> prefill; KVHandedOff(source)
-> AddPrefilled(source) -> decode; KVReceived -> ReleaseKV -> prefill. Push modes:
ReserveKV -> decode; KVReserved(target) -> AddRequest(handoff=push, target) -> prefill,
which writes into the reserved blocks; KVHandedOff -> AddPrefilled -> decode;
KVReceived. Either side may answer HandoffFailed (it released what it held).
See docs/request-path.md.
"""

from __future__ import annotations

from enum import StrEnum

import msgspec

from pdserve.kv.layout import RegionHandle
from pdserve.protocol.prediction import LengthPrediction
from pdserve.protocol.sampling_params import SamplingParams


class TransferMode(StrEnum):
    """How a finished prefill's KV reaches the decode instance (`--transfer-mode`; on the
    wire by value, so an unknown mode is a decode error)."""

    PULL = "pull"  # DistServe: the decode side fetches it when it has room
    LAYER_PUSH = "layer-push"  # DejaVu: each layer is pushed as soon as it has run
    REQUEST_PUSH = "request-push"  # MemServe by-req-agg: one aggregated push per request


# ---- descriptors ------------------------------------------------------------------


class PushTarget(msgspec.Struct, frozen=True):
    """Blocks a decode instance reserved for a request's prompt KV (push modes)."""

    regions: tuple[RegionHandle, ...]  # the decode instance's pools, one a rank
    blocks: list[int]  # its block table for the prompt (every rank's)
    start: int  # tokens below this are already in its prefix cache: not sent


class KVSource(msgspec.Struct, frozen=True):
    """Where a finished prefill's KV waits to be fetched (pull mode)."""

    regions: tuple[RegionHandle, ...]  # the prefill instance's pools, one a rank
    blocks: list[int]  # its block table for the prompt (every rank's)
    num_tokens: int  # tokens with KV: the prompt (and a continuation's earlier tokens)
    lease_deadline: float  # monotonic time after which the prefill side may free it


class Handoff(msgspec.Struct, frozen=True):
    """How a prefill instance passes a request on once its first token is out."""

    mode: TransferMode
    target: PushTarget | None = None  # push modes: where to write


# ---- front end -> instance ----------------------------------------------------------


class AddPrefilled(msgspec.Struct, frozen=True, tag=True):
    """Decode role: a request whose prompt was prefilled elsewhere. With `source`, the
    instance fetches the KV when it has room (pull); without, the KV was pushed into the
    blocks it reserved for the request (ReserveKV)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the first token(s), sampled by the prefill instance
    params: SamplingParams
    arrival: float
    source: KVSource | None = None
    generator_state: bytes | None = None  # seeded sampling continues the same stream
    # PD-Caching-3 (protocol/cache.py): once the request finishes, offer the KV of its
    # prompt and answer to this (prefill) instance's prefix cache.
    return_to: str | None = None
    # The output length predicted at the prefill (decode admission: engine/admission.py).
    prediction: LengthPrediction | None = None


class ReserveKV(msgspec.Struct, frozen=True, tag=True):
    """Decode role, push modes: reserve blocks for this prompt; reply `KVReserved`."""

    request_id: str
    prompt_token_ids: list[int]


class ReleaseKV(msgspec.Struct, frozen=True, tag=True):
    """Free KV kept for a hand-off: held prompt KV (prefill) or a reservation (decode)."""

    request_ids: list[str]


# ---- instance -> front end ------------------------------------------------------------


class KVHandedOff(msgspec.Struct, frozen=True, tag=True):
    """Prefill role: the request's prompt KV is ready for the decode side (pull: at
    `source`; push: already written into the reserved blocks)."""

    request_id: str
    source: KVSource | None
    generator_state: bytes | None
    first_scheduled: float | None  # monotonic; for the latency breakdown
    first_token: float | None


class KVReserved(msgspec.Struct, frozen=True, tag=True):
    """Decode role: blocks reserved for a ReserveKV request."""

    request_id: str
    target: PushTarget


class KVReceived(msgspec.Struct, frozen=True, tag=True):
    """Decode role: the prompt KV is in place; the request joins the running batch."""

    request_id: str
    queued: float  # monotonic: when AddPrefilled reached the instance
    transfer_start: float  # pushed KV: start == end == when it was committed
    transfer_end: float
    nbytes: int


class HandoffFailed(msgspec.Struct, frozen=True, tag=True):
    """The KV of a request could not be moved; every block it held here is released."""

    request_id: str
    message: str
