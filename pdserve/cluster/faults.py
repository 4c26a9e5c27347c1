"""What the front end counts about failures (docs/fault-tolerance.md; how it recovers:
cluster/recovery.py)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FaultCounters:
    """The front end's failure counters (/metrics, /debug/cluster)."""

    retries: int = 0  # hand-off failures sent back to the start or resumed elsewhere
    migrations: int = 0  # requests moved off a failed instance
    resumed_from_replica: int = 0  # migrations that continued from replicated KV
    # moves whose tokens a prefill instance recomputed and handed off (a spread recompute)
    recomputed_on_prefill: int = 0
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
            "recomputed_on_prefill": self.recomputed_on_prefill,
            "recomputed_tokens": self.recomputed_tokens,
            "failed": self.failed,
            "instance_failures": dict(self.instance_failures),
            "instance_restarts": dict(self.instance_restarts),
        }
