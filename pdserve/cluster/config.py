"""`ClusterConfig`: how many instances of each role, and how the controller routes."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class DecodePolicy(StrEnum):
    LEAST_LOADED = "least-loaded"  # fewest requests assigned (DistServe)
    POWER_OF_TWO = "power-of-two"  # two random instances with room, the less loaded (TetriInfer)


@dataclass(frozen=True)
class ClusterConfig:
    # Instances started on this machine. prefill + decode > 0 means disaggregated serving;
    # otherwise `colocated` instances each run both phases (data parallel).
    num_prefill: int = 0
    num_decode: int = 0
    num_colocated: int = 0
    decode_policy: DecodePolicy = DecodePolicy.LEAST_LOADED
    # An instance that has sent nothing (outputs or load reports) for this long is marked
    # dead: new requests avoid it and its requests are retried or failed.
    instance_timeout_s: float = 10.0
    # A request whose KV hand-off failed (both instances alive) is run again at most this
    # often: from its prompt, or after its streamed tokens (cluster/recovery.py).
    max_retries: int = 1
    # A request whose instance died is moved to a live one at most this often (--max-migrations).
    max_migrations: int = 2
    # DéjàVu KV replication (--kv-replication): every instance that decodes streams its
    # requests' KV to a peer, so a lost request resumes from the replica (cluster/replication.py).
    replicate: bool = False
    # Seed of the power-of-two choice (tests); None: random.
    seed: int | None = None
    # Prefill instances: tokens per prefill-only chunk (TetriInfer ChunkSize); None: the
    # engine's max_num_batched_tokens.
    prefill_chunk_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_prefill", "num_decode", "num_colocated", "max_retries", "max_migrations"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.disaggregated:
            if self.num_prefill < 1 or self.num_decode < 1:
                raise ValueError(
                    "disaggregated serving needs at least one prefill and one decode instance, "
                    f"got --prefill {self.num_prefill} --decode {self.num_decode}"
                )
            if self.num_colocated:
                raise ValueError("--colocated cannot be combined with --prefill/--decode")
        elif self.num_colocated < 1:
            raise ValueError(
                "at least one instance is needed (--colocated K or --prefill/--decode)"
            )
        if self.prefill_chunk_size is not None and self.prefill_chunk_size < 1:
            raise ValueError(f"chunk size must be >= 1, got {self.prefill_chunk_size}")
        if self.instance_timeout_s <= 0:
            raise ValueError(f"instance_timeout_s must be > 0, got {self.instance_timeout_s}")

    @property
    def disaggregated(self) -> bool:
        return bool(self.num_prefill or self.num_decode)

    @property
    def num_instances(self) -> int:
        return self.num_prefill + self.num_decode + self.num_colocated
