"""What the HTTP layer needs from whatever runs the requests.

The front end, `cluster.Cluster` (one engine, or prefill / decode / colocated
instances), provides it; the routes see only this protocol: generation, counters,
per-instance rows for /debug/cluster, the failure counters and the router's.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Protocol, TypeVar

from pdserve.cluster.faults import FaultCounters
from pdserve.cluster.hub import Feature
from pdserve.cluster.routing import Router
from pdserve.model.tokenizer import Tokenizer
from pdserve.predictor.confusion import PredictionCounters
from pdserve.protocol.core import EngineStats, WeightsInfo
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.text.outputs import RequestOutput

F = TypeVar("F", bound=Feature)


class ServingBackend(Protocol):
    tokenizer: Tokenizer | None
    max_model_len: int
    weights: WeightsInfo  # how the instances hold the weights (/v1/models, /metrics)
    faults: FaultCounters  # retries, migrations, failures (cluster/recovery.py)
    router: Router  # routing, prompt trees, KV returns (cluster/routing.py)
    predictions: PredictionCounters  # length predictions vs real lengths (predictor/)

    @property
    def is_alive(self) -> bool: ...

    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        session: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]: ...

    async def stats(self, check_integrity: bool = False, timeout: float = 10.0) -> EngineStats: ...

    def status(self) -> dict[str, object]:
        """Nodes, instances, roles and load, from the front end's own records."""
        ...

    async def instance_stats(self, timeout: float = 5.0) -> list[dict[str, object]]:
        """Per instance: name, role, liveness (and, for a cluster, load and counters)."""
        ...

    def cancel_all(self, error: Exception) -> int: ...

    def feature(self, kind: type[F]) -> F:
        """The front end's feature of class `kind` (cluster/hub.py), for the operator's
        routes (instance flip: cluster/flip.py); KeyError when it has none."""
        ...

    async def shutdown(self, timeout: float = 10.0) -> None: ...
