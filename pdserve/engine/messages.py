"""Everything that crosses the boundary between the engine core and its frontend.

The core (scheduler, model, sampler) speaks token ids; the frontend (tokenizer,
detokenizer, stop strings, HTTP) speaks text. These msgspec structs are the only
types exchanged, whether the two sides share a process (`Engine`) or talk over
ZeroMQ (`EngineClient` / `engine_process`). `SamplingParams` (a frozen dataclass)
travels as is: msgspec re-runs its validation on decode.
"""

from __future__ import annotations

import msgspec

from pdserve.engine.outputs import RequestMetrics
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidRequestError
from pdserve.kv.transfer import RegionHandle

# ---- core -> frontend: per-request progress ------------------------------------


class NewToken(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


class EngineOutput(msgspec.Struct, frozen=True):
    """New tokens of one request in one step."""

    request_id: str
    new_tokens: tuple[NewToken, ...]
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id that ended it
    stopped_by_token: bool = False  # the last new token is EOS / a stop id (not rendered)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None  # set when finished


# ---- KV hand-off descriptors (disaggregated roles) ------------------------------


class PushTarget(msgspec.Struct, frozen=True):
    """Blocks a decode instance reserved for a request's prompt KV (push modes)."""

    region: RegionHandle  # the decode instance's pool
    blocks: list[int]  # its block table for the prompt
    start: int  # tokens below this are already in its prefix cache: not sent


class KVSource(msgspec.Struct, frozen=True):
    """Where a finished prefill's KV waits to be fetched (pull mode)."""

    region: RegionHandle  # the prefill instance's pool
    blocks: list[int]  # its block table for the prompt
    num_tokens: int  # prompt tokens with KV
    lease_deadline: float  # monotonic time after which the prefill side may free it


class Handoff(msgspec.Struct, frozen=True):
    """How a prefill instance passes a request on once its first token is out."""

    mode: str  # a TransferMode value
    target: PushTarget | None = None  # push modes: where to write


# ---- frontend -> core process --------------------------------------------------


class AddRequest(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float | None = None  # time.monotonic() at the frontend (system-wide clock)
    handoff: Handoff | None = None  # prefill role: set by the cluster controller


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


class ReserveKV(msgspec.Struct, frozen=True, tag=True):
    """Decode role, push modes: reserve blocks for this prompt; reply `KVReserved`."""

    request_id: str
    prompt_token_ids: list[int]


class ReleaseKV(msgspec.Struct, frozen=True, tag=True):
    """Free KV kept for a hand-off: held prompt KV (prefill) or a reservation (decode)."""

    request_ids: list[str]


class AbortRequests(msgspec.Struct, frozen=True, tag=True):
    request_ids: list[str]


class FinishRequest(msgspec.Struct, frozen=True, tag=True):
    """The frontend found a stop string: end the request as 'stop'."""

    request_id: str
    stop_reason: str


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    pass


class StatsRequest(msgspec.Struct, frozen=True, tag=True):
    """Ask for an `EngineStats` reply (metrics, health checks, tests)."""

    request_id: int  # echoed in the reply, so concurrent askers get their own answer
    check_integrity: bool = False


EngineInput = (
    AddRequest
    | AbortRequests
    | FinishRequest
    | Shutdown
    | StatsRequest
    | AddPrefilled
    | ReserveKV
    | ReleaseKV
)


def encode_input(encoder: msgspec.msgpack.Encoder, msg: EngineInput) -> bytes:
    """`msg` as bytes for the core. A value msgpack cannot carry (an integer beyond 64
    bits that slipped past validation) is the request's fault: InvalidRequestError."""
    try:
        return encoder.encode(msg)
    except (OverflowError, TypeError, ValueError) as e:
        raise InvalidRequestError(f"the request cannot be sent to the engine: {e}") from None


# ---- core process -> frontend --------------------------------------------------


class EngineReady(msgspec.Struct, frozen=True, tag=True):
    max_model_len: int
    vocab_size: int


class OutputBatch(msgspec.Struct, frozen=True, tag=True):
    outputs: list[EngineOutput]


class RequestRejected(msgspec.Struct, frozen=True, tag=True):
    """`add_request` refused it; nothing was allocated. `overloaded`: the waiting
    queue was full (EngineOverloadedError), else the request was invalid."""

    request_id: str
    message: str
    param: str | None
    overloaded: bool = False


class EngineFailed(msgspec.Struct, frozen=True, tag=True):
    """The core hit an unrecoverable error and is exiting."""

    message: str


class EngineStats(msgspec.Struct, frozen=True, tag=True):
    request_id: int  # of the StatsRequest this answers
    num_running: int
    num_waiting: int
    num_swapped: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    prefix_cache_hits: int  # tokens
    prefix_cache_queries: int  # tokens
    integrity_error: str | None = None  # set when a requested check failed
    num_held: int = 0  # prefill: finished prompts whose KV waits for a decode instance
    num_transferring: int = 0  # KV moves in flight (either side)
    num_reserved: int = 0  # decode: reservations and requests waiting for KV


# ---- instance -> cluster controller (disaggregated roles) ----------------------


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


class LoadReport(msgspec.Struct, frozen=True, tag=True):
    """Sent every `report_interval_s` by a cluster instance (TetriInfer's monitor)."""

    sent_at: float  # monotonic
    num_waiting: int
    num_running: int
    num_waiting_tokens: int  # prompt tokens not yet prefilled
    num_obtainable_blocks: int  # free + evictable cached blocks
    num_blocks: int
    num_held: int
    num_transferring: int
    num_reserved: int


EngineMessage = (
    EngineReady
    | OutputBatch
    | RequestRejected
    | EngineFailed
    | EngineStats
    | KVHandedOff
    | KVReserved
    | KVReceived
    | HandoffFailed
    | LoadReport
)
