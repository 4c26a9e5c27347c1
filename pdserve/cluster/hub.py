"""How a feature plugs into the controller (docs/controller.md).

The controller (`controller.Cluster`) is a small hub: it owns the request table, the
instances, the public API and the dispatch of new requests. Everything else the front end
does - moving requests off dead instances, replication, cluster-wide caching, the KV
hand-off between prefill and decode - is a `Feature`: a module that owns its state, reads
the messages it registers (`handlers`), and is called at fixed points of a request's and an
instance's life (the hooks below). The hub calls its features in the order it lists them
and knows none of them by name; a feature reaches the rest of the cluster only through
`Hub`.

Where the hub calls each hook, and what a feature that does not take part does (the
defaults here: nothing):

- `handlers()`: once, at construction. Message type -> handler(instance, message); several
  features may read one type (each is called, in feature order, with the same message).
- `output(rec, inst, out)`: every output of a request the hub accepted (from the instance
  the attempt runs on), before it is forwarded: `rec.cached_tokens` is still None on the
  attempt's first.
- `finished(rec, inst, clean)`: the request's last output came from `inst`; `clean`: it
  ended there by itself (length or a stop token), not cut by a stop string.
- `released(rec, abort)`: the attempt is over (ended, failed, or about to move); called
  before the hub aborts it on its instances and releases its load. `abort`: it may still
  run somewhere. A feature that takes over releasing one side clears that side
  (`rec.decode = None`) so the hub leaves it alone.
- `instance_dead(inst)`: `inst` died and is fenced (its process is gone, nothing it sent
  later is read), before its requests are moved.
- `instances_changed()`: after the instances started, after a death's requests moved,
  after a dead instance's replacement joined, when an instance leaves its role to
  flip and takes its new one (cluster/flip.py), and when one joins or leaves the cluster
  (cluster/scaling.py).
- `tick(now)`: every watchdog period (`now`: time.monotonic()).
- `describe(inst)`: what the feature knows of `inst`, added to its /debug/cluster row.
- `close()`: the server is shutting down (before open requests fail); stop what runs.

Single-threaded: every hook runs on the controller's event loop and must not block it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.faults import FaultCounters
from pdserve.cluster.instance import Instance, Launcher
from pdserve.cluster.table import Record, RequestTable
from pdserve.config import EngineConfig, Role
from pdserve.protocol.core import EngineOutput

# A handler of one message type: (the instance it came from, the message).
Handler = Callable[[Instance, Any], Awaitable[None] | None]


class Hub(Protocol):
    """What a feature may read and call on the controller."""

    config: ClusterConfig
    engine: EngineConfig
    table: RequestTable
    instances: list[Instance]
    launcher: Launcher  # where instances' processes run (cluster/scaling.py asks it for room)
    faults: FaultCounters  # failure counters (/metrics), written by the hub and features

    @property
    def closed(self) -> bool:
        """The server is shutting down: nothing new starts."""
        ...

    def instance(self, name: str) -> Instance | None: ...

    def of_role(self, role: Role) -> list[Instance]:
        """The instances that take new work as `role` (not one that is flipping)."""
        ...

    def live(self, role: Role) -> list[Instance]:
        """`of_role`'s live ones."""
        ...

    def dispatch(self, rec: Record) -> None:
        """Send an attempt that streamed nothing yet to its first instance."""
        ...

    def release(self, rec: Record, abort: bool) -> None:
        """Make sure no instance keeps anything for the attempt (features' `released`
        first); `abort`: it may still run somewhere."""
        ...

    def fail(self, rec: Record, error: Exception) -> None:
        """End the request with `error` (released, aborted)."""
        ...

    def replace(self, dead: Instance, fresh: Instance) -> None:
        """`fresh`, started from `dead`'s config, takes its place."""
        ...

    def new_instance(self, config: EngineConfig) -> Instance:
        """An instance of `config` (not started), wired to this hub."""
        ...

    def admit(self, inst: Instance) -> None:
        """`inst`, new and ready, joins the instances (cluster/scaling.py)."""
        ...

    def retire(self, inst: Instance) -> None:
        """`inst`, drained and idle, leaves the instances (its process is the caller's
        to shut down)."""
        ...

    def instances_changed(self) -> None:
        """Tell every feature (`instances_changed`): an instance left or took a role."""
        ...


class Feature:
    """A feature of the front end; every hook's default is what a feature that does not
    take part does (the module docstring says where each is called)."""

    def handlers(self) -> Mapping[type, Handler]:
        return {}

    def output(self, rec: Record, inst: Instance, out: EngineOutput) -> None:
        pass

    def finished(self, rec: Record, inst: Instance, clean: bool) -> None:
        pass

    def released(self, rec: Record, abort: bool) -> None:
        pass

    def instance_dead(self, inst: Instance) -> None:
        pass

    def instances_changed(self) -> None:
        pass

    def tick(self, now: float) -> None:
        pass

    def describe(self, inst: Instance) -> dict[str, object]:
        return {}

    async def close(self) -> None:
        pass


class MessageBus:
    """Message type -> the features' handlers of it, in feature order."""

    def __init__(self, tables: list[Mapping[type, Handler]]) -> None:
        self._handlers: dict[type, list[Handler]] = {}
        for table in tables:
            for kind, handler in table.items():
                self._handlers.setdefault(kind, []).append(handler)

    async def deliver(self, inst: Instance, msg: object) -> None:
        """Every handler of `msg`'s type, in order; a type nobody reads is a bug."""
        handlers = self._handlers.get(type(msg))
        if handlers is None:
            raise TypeError(f"no handler for {type(msg).__name__}")
        for handler in handlers:
            pending = handler(inst, msg)
            if pending is not None:
                await pending
