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


# ---- frontend -> core process --------------------------------------------------


class AddRequest(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float | None = None  # time.monotonic() at the frontend (system-wide clock)


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


EngineInput = AddRequest | AbortRequests | FinishRequest | Shutdown | StatsRequest

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


EngineMessage = EngineReady | OutputBatch | RequestRejected | EngineFailed | EngineStats
