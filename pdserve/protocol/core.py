"""The core protocol: what a front end and one engine core exchange.

The core (scheduler, model, sampler) speaks token ids; the front end (tokenizer,
detokenizer, stop strings, HTTP) speaks text. Whether the two share a process (`Engine`)
or talk over ZeroMQ (the front end's `Instance` / `engine_process`), these structs are
what crosses. `SamplingParams` (a frozen dataclass) travels as is: msgspec re-runs its
validation on decode.
"""

from __future__ import annotations

import msgspec

from pdserve.kv.layout import KVLayout
from pdserve.protocol.handoff import Handoff
from pdserve.protocol.prediction import LengthPrediction
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.protocol.timing import RequestMetrics

# ---- per-request progress -------------------------------------------------------


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
    # The output length predicted at the prompt's first token (with that output only).
    prediction: LengthPrediction | None = None


# ---- front end -> core ------------------------------------------------------------


class AddRequest(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float | None = None  # time.monotonic() at the front end (system-wide clock)
    handoff: Handoff | None = None  # prefill role: pass it on after the first token
    # A migrated request (its instance failed): the tokens already streamed to the client.
    # The instance computes their KV with the prompt's and continues after the last one;
    # a seeded generator is advanced past their draws, so the text continues unchanged.
    output_token_ids: list[int] = []
    # Its output length as predicted where it was first prefilled (a migrated request).
    prediction: LengthPrediction | None = None


class AbortRequests(msgspec.Struct, frozen=True, tag=True):
    """End requests now (client gone, stop string found, failure); their KV is freed
    before the next step."""

    request_ids: list[str]


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    pass


class StatsRequest(msgspec.Struct, frozen=True, tag=True):
    """Ask for an `EngineStats` reply (metrics, health checks, tests)."""

    request_id: int  # echoed in the reply, so concurrent askers get their own answer
    check_integrity: bool = False


# ---- core -> front end ------------------------------------------------------------


class WeightsInfo(msgspec.Struct, frozen=True):
    """How an instance holds the model's weights (pdserve/model/loader.py Quantization):
    `quantization` "none" | "gguf" | "q8_0" | "q4_0"; `formats` what the projections
    read, sorted ("Q4_1", "Q8_0"; "float32" for full-precision ones); `note` why
    `--quantization auto` chose "none" ("" otherwise); `activations` how the projections
    take activations, sorted ("fp32", "int8"; "float32" for full-precision ones);
    beside the weights, `kv_cache_dtype` what the KV pool holds (`--kv-cache-dtype`); and
    `compiled` whether the projections run on the compiled kernels (quantized ones always
    do; full-precision ones where the kernels are built: fp32 panels, else oneDNN)."""

    quantization: str
    formats: list[str]
    note: str = ""
    activations: list[str] = msgspec.field(default_factory=lambda: ["float32"])
    kv_cache_dtype: str = "float32"
    compiled: bool = False


class EngineReady(msgspec.Struct, frozen=True, tag=True):
    max_model_len: int
    vocab_size: int
    kv_layout: KVLayout  # the device pool's geometry (a replica store for it has the same)
    weights: WeightsInfo


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
    num_replicas: int = 0  # holder: replicas recorded for other instances
    num_replica_blocks: int = 0  # holder: distinct region blocks those replicas reference
    num_replicating: int = 0  # source: requests holding blocks in a holder's region
    num_replicated_tokens: int = 0  # holder: tokens its replicas hold, summed
    num_offers: int = 0  # KV pinned for another instance's cache (protocol/cache.py)
    num_prefix_fetches: int = 0  # FetchPrefix copies in flight into this pool
    num_preemptions: int = 0  # since start: running requests swapped out or recomputed
    num_admission_waits: int = 0  # since start: times the decode admission rule said wait
    num_admission_held: int = 0  # since start: requests it held back (each counted once)
    # since start: prompt scheduling batches sorted (sjf / ljf), and the pairs of a batch
    # in which the later arrival was scheduled first (engine/prefill_queue.py)
    num_prefill_batches: int = 0
    num_prefill_overtakes: int = 0
    # since start, decode role: prefilled requests taken with a predicted length, and the
    # low ends of their predicted buckets summed (what length-aware dispatch spreads)
    num_predicted_decodes: int = 0
    predicted_decode_tokens: int = 0
    busy_ms: int = 0  # since start: wall time spent in steps (resource time, TetriInfer §5)
    num_steps: int = 0  # since start: forward steps (a decode burst's one by one)
    num_burst_steps: int = 0  # since start: the steps that ran inside decode bursts
    # since start, the auto transport only (kv/transfer/auto.py): KV transfers this instance
    # sent through shared memory (a peer on its node) and over TCP (a peer on another node)
    kv_routes_shm: int = 0
    kv_routes_tcp: int = 0
    num_role_switches: int = 0  # since start: instance flips this instance made
    # since start, a pipeline instance with microbatch swapping (engine/mb_swap.py): the
    # most blocks its driver's stage held staged at once (its staging area's use)
    staged_peak_blocks: int = 0
    # since start (engine/features/structured_output.py): grammar masks computed, and
    # those that fell back to EOS alone (a grammar in llguidance's error state)
    grammar_masks: int = 0
    grammar_errors: int = 0


class Heartbeat(msgspec.Struct, frozen=True, tag=True):
    """Sent every `report_interval_s` by a thread of the instance beside its step loop, so
    a long step is not silence: only a stopped, frozen or dead process goes quiet."""

    sent_at: float  # monotonic


class LoadReport(msgspec.Struct, frozen=True, tag=True):
    """Sent every `report_interval_s` by an instance (TetriInfer's monitor); also what
    tells the front end the instance is alive between outputs."""

    sent_at: float  # monotonic
    num_waiting: int
    num_running: int
    num_waiting_tokens: int  # prompt tokens not yet prefilled
    num_obtainable_blocks: int  # free + evictable cached blocks
    num_blocks: int
    num_held: int
    num_transferring: int
    num_reserved: int
    # The prefix index's net changes since the last report (chained block hashes,
    # kv/block_hash.py): the controller's global prompt tree follows them.
    cache_stored: list[int] = []
    cache_removed: list[int] = []
    # Wall time spent in steps since the instance started (TetriInfer's resource time):
    # two reports give its utilisation between them (cluster/watcher.py).
    busy_s: float = 0.0
