"""A request inside the engine: its tokens, status, timestamps and sampling generator."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from pdserve.protocol.prediction import LengthPrediction
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.protocol.timing import RequestTimes


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued; holds no KV
    RUNNING = "running"  # holds device KV; prefilling or decoding
    SWAPPED = "swapped"  # preempted; its KV lives in the host tier
    HANDING_OFF = "handing_off"  # prefill role: first token out; KV kept until moved
    WAITING_FOR_KV = "waiting_for_kv"  # decode role: prompt KV not here yet
    FINISHED_STOPPED = "stop"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context limit
    FINISHED_ABORTED = "abort"  # cancelled by the caller

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
}


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # Tokens (prompt + output) whose KV is in the cache. Owned by the scheduler.
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # PD-Caching-3: the instance offered this request's KV once it finishes (None: none).
    return_to: str | None = None
    # Predicted output length (protocol/prediction.py): this core's length head's, or the
    # one made where the request was prefilled. None: no predictor.
    prediction: LengthPrediction | None = None
    held_by_admission: bool = False  # the decode admission rule has held it back
    times: RequestTimes = field(default_factory=lambda: RequestTimes(time.monotonic()))

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Known tokens whose KV has not been computed yet."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.params.max_tokens


# ---- a seeded request's random stream, across a hand-off ----------------------------


def generator_state(gen: torch.Generator | None) -> bytes | None:
    """The state of a request's sampling generator, to send with its hand-off."""
    if gen is None:
        return None
    return bytes(gen.get_state().numpy().tobytes())


def generator_from_state(state: bytes | None) -> torch.Generator | None:
    """A sampling generator that continues the stream `generator_state` captured."""
    if state is None:
        return None
    gen = torch.Generator()
    gen.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return gen


def resumed_generator(params: SamplingParams, num_sampled: int) -> torch.Generator | None:
    """The generator of a seeded request that already sampled `num_sampled` tokens (a
    migrated request): seeded from `params.seed`, then past the draws those tokens took.
    The sampler draws exactly one float64 per sampled token of a non-greedy row and none
    for a greedy one (sampler.py's determinism contract); this replays the same calls."""
    if params.seed is None:
        return None
    gen = torch.Generator().manual_seed(params.seed)
    if not params.greedy:
        for _ in range(num_sampled):
            torch.rand(1, dtype=torch.float64, generator=gen)
    return gen
