"""The benchmark's settings: frozen dataclasses built once from the command line.

Units: seconds everywhere inside the tool; SLOs are given in milliseconds on the
command line (as `vllm bench serve --goodput` takes them) and converted here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from pdserve.workload.arrivals import ArrivalProcess
from pdserve.workload.errors import WorkloadInputError

Endpoint = Literal["/v1/completions", "/v1/chat/completions"]
ENDPOINTS: tuple[str, ...] = ("/v1/completions", "/v1/chat/completions")


class BenchInputError(WorkloadInputError):
    """Bad input from the user (names the problem); the command exits with status 2.

    A `WorkloadInputError` from `pdserve.workload` (a length range, a burstiness) is
    the same kind of input error: the command catches that base class."""


@dataclass(frozen=True)
class SLO:
    """Latency objectives in seconds; None: not part of the objective."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def __post_init__(self) -> None:
        for name, v in (("ttft", self.ttft_s), ("tpot", self.tpot_s), ("e2el", self.e2e_s)):
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise BenchInputError(f"SLO {name} must be a positive number, got {v}")

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_s, self.tpot_s, self.e2e_s))

    def scaled(self, scale: float) -> SLO:
        """Every objective times `scale` (DistServe's SLO scale)."""

        def mul(v: float | None) -> float | None:
            return None if v is None else v * scale

        return SLO(mul(self.ttft_s), mul(self.tpot_s), mul(self.e2e_s))

    @classmethod
    def parse(cls, items: list[str] | None) -> SLO:
        """`["ttft:250", "tpot:100", "e2el:5000"]` (milliseconds) -> SLO in seconds."""
        values: dict[str, float] = {}
        for item in items or []:
            key, sep, value = item.partition(":")
            key = key.strip().lower()
            if not sep or key not in ("ttft", "tpot", "e2el"):
                raise BenchInputError(f"SLO {item!r}: expected ttft:MS, tpot:MS or e2el:MS")
            try:
                values[key] = float(value) / 1000.0
            except ValueError:
                raise BenchInputError(f"SLO {item!r}: {value!r} is not a number") from None
        return cls(values.get("ttft"), values.get("tpot"), values.get("e2el"))


@dataclass(frozen=True)
class ArrivalConfig(ArrivalProcess):
    """When requests are released (open loop): rate None means all at once. The
    arrival process (`kind`, `burstiness`) is `pdserve.workload`'s."""

    max_concurrency: int | None = None
    """At most this many requests in flight; later ones wait client-side (not counted)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise BenchInputError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")


@dataclass(frozen=True)
class Target:
    """One server under test."""

    label: str
    base_url: str
    endpoint: Endpoint = "/v1/completions"
    model: str | None = None
    """Sent as `model`; None: the first id in the server's /v1/models."""
    api_key: str | None = None
    num_instances: int | None = None
    """Instances (devices) for per-instance goodput; None: the card's, else 1."""

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint


@dataclass(frozen=True)
class RequestOptions:
    """Body fields every request carries besides prompt and length."""

    ignore_eos: bool = True
    """Send `ignore_eos` so that `max_tokens` fixes the output length (vLLM, SGLang, pdserve)."""
    temperature: float = 0.0
    timeout_s: float = 300.0
    """Whole-request limit; past it the request is failed with reason 'timeout'."""
    extra_body: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class SearchConfig:
    """Goodput search: sweep points first, then bisection between the last passing and
    the first failing rate (DistServe §6.1: the highest rate meeting the target)."""

    attainment_target: float = 0.9
    max_probes: int = 4
    """Runs the bisection (or range expansion) may add per target."""
    rel_tol: float = 0.05
    """Stop when (hi - lo) / hi is at most this."""

    def __post_init__(self) -> None:
        if not 0 < self.attainment_target <= 1:
            raise BenchInputError(
                f"--attainment-target must be in (0, 1], got {self.attainment_target}"
            )
        if self.max_probes < 0:
            raise BenchInputError(f"--search-iters must be >= 0, got {self.max_probes}")


@dataclass(frozen=True)
class PlanConfig:
    """What to run against every target: rates x repeats, then an optional search."""

    rates: tuple[float | None, ...] = (None,)
    """Requests per second per point; None: all at once."""
    repeats: int = 1
    search_goodput: bool = False
    slo_scales: tuple[float, ...] = ()
    num_warmups: int = 0

    def __post_init__(self) -> None:
        for r in self.rates:
            if r is not None and not (r > 0 and math.isfinite(r)):
                raise BenchInputError(f"request rate must be positive, got {r}")
        if self.repeats < 1:
            raise BenchInputError(f"--repeats must be >= 1, got {self.repeats}")
        if self.search_goodput and any(r is None for r in self.rates):
            raise BenchInputError("--search-goodput needs finite --request-rate(s) to start from")
        for s in self.slo_scales:
            if not s > 0:
                raise BenchInputError(f"--slo-scales must be positive, got {s}")

    def with_rates(self, rates: tuple[float | None, ...]) -> PlanConfig:
        return replace(self, rates=rates)
