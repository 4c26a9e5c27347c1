"""What each side of an instance's sockets decodes, and dispatch by message type.

`EngineInput` is everything a front end sends an instance, `EngineMessage` everything an
instance sends back (core, hand-off, replication and caching protocols together: one
socket each way). A receiver keeps a `Handlers` table from message type to handler
rather than a chain of isinstance tests; a message without a handler there is a bug and
raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec

from pdserve.errors import InvalidRequestError
from pdserve.protocol import cache, core, handoff, replica, role

EngineInput = (
    core.AddRequest
    | core.AbortRequests
    | core.Shutdown
    | core.StatsRequest
    | handoff.AddPrefilled
    | handoff.ReserveKV
    | handoff.ReleaseKV
    | replica.OpenReplicaStore
    | replica.StoreReplicas
    | replica.DropReplicas
    | replica.ResumeFromReplica
    | replica.ReplicateTo
    | cache.FetchPrefix
    | cache.OfferPrefix
    | role.SwitchRole
)

EngineMessage = (
    core.EngineReady
    | core.OutputBatch
    | core.RequestRejected
    | core.EngineFailed
    | core.EngineStats
    | core.LoadReport
    | core.Heartbeat
    | handoff.KVHandedOff
    | handoff.KVReserved
    | handoff.KVReceived
    | handoff.HandoffFailed
    | replica.ReplicaStoreOpened
    | replica.KVReplicated
    | replica.ReplicasStored
    | cache.KVOffered
    | cache.PrefixFetched
    | role.RoleSwitched
)


def encode_input(encoder: msgspec.msgpack.Encoder, msg: EngineInput) -> bytes:
    """`msg` as bytes for the core. A value msgpack cannot carry (an integer beyond 64
    bits that slipped past validation) is the request's fault: InvalidRequestError."""
    try:
        return encoder.encode(msg)
    except (OverflowError, TypeError, ValueError) as e:
        raise InvalidRequestError(f"the request cannot be sent to the engine: {e}") from None


R = TypeVar("R")


class Handlers(Generic[R]):
    """Message type -> handler. `handlers(msg, *context)` calls the handler of `type(msg)`
    as `handler(*context, msg)` (e.g. the instance it came from) and returns its result."""

    def __init__(self, table: dict[type[Any], Callable[..., R]]) -> None:
        self._table = table

    def __call__(self, msg: object, *context: object) -> R:
        try:
            handler = self._table[type(msg)]
        except KeyError:
            raise TypeError(f"no handler for message {type(msg).__name__}") from None
        return handler(*context, msg)

    def __contains__(self, kind: object) -> bool:
        return kind in self._table
