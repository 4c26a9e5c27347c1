"""What the front end counts about failures, and how it moves a request that lost its
instance (docs/fault-tolerance.md).

A request is *moved* when an instance it was on dies (a migration, at most
`ClusterConfig.max_migrations` per request) or when its KV hand-off fails with both
instances alive (a retry, at most `max_retries`). A request that streamed nothing yet
starts again from its prompt; one that streamed tokens continues after them: by
recompute (`AddRequest.output_token_ids`) on a live instance that decodes, or from its
replica on the instance that holds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FaultCounters:
    """The front end's failure counters (/metrics, /debug/cluster)."""

    retries: int = 0  # hand-off failures sent back to the start or resumed elsewhere
    migrations: int = 0  # requests moved off a failed instance
    resumed_from_replica: int = 0  # migrations that continued from replicated KV
    recomputed_tokens: int = 0  # tokens whose KV a move computed again (cache hits excluded)
    failed: int = 0  # requests ended by an instance or transfer failure
    instance_failures: dict[str, int] = field(default_factory=dict)  # by role
    instance_restarts: dict[str, int] = field(default_factory=dict)  # by role (--ray-restart)

    def instance_failed(self, role: str) -> None:
        self.instance_failures[role] = self.instance_failures.get(role, 0) + 1

    def instance_restarted(self, role: str) -> None:
        self.instance_restarts[role] = self.instance_restarts.get(role, 0) + 1

    def as_dict(self) -> dict[str, object]:
        return {
            "retries": self.retries,
            "migrations": self.migrations,
            "resumed_from_replica": self.resumed_from_replica,
            "recomputed_tokens": self.recomputed_tokens,
            "failed": self.failed,
            "instance_failures": dict(self.instance_failures),
            "instance_restarts": dict(self.instance_restarts),
        }
