"""Cluster-wide context caching: KV moving between instances to be cached, not decoded.

MemServe's `transfer_with_insert` (§4.3, §5.1 PD-Caching-3), as messages. The front end
relays every message; instances only touch each other's pools through the KV transport.

Decode -> prefill return (after a request finishes on a decode instance):

    AddPrefilled(return_to=P) -> decode instance D ... the request finishes there
    D: pins the full blocks of prompt + answer (its prefix index holds them), then
       KVOffered(offer_id, RETURN, to=P, token_ids, source) -> front end
    front end: P alive and not busy (its returns in flight below the bound)?
       yes: FetchPrefix(offer_id, source_instance=D, token_ids, source) -> P
       no:  ReleaseKV([offer_id]) -> D (the return is dropped, never retried)
    P: matches its own index; fetches only the blocks it lacks, on its transfer thread
       (never on the step loop); commits them into its index (the insert); frees them
       (they stay cached); PrefixFetched(offer_id, source_instance=D, ...) -> front end
    front end: ReleaseKV([offer_id]) -> D (the pin is dropped; D's blocks stay cached)

Prefix fetch (before a prefill, MemServe §5.3: "instances storing extra historical KV"):
the router chose prefill instance P for a request, and instance X (prefill or decode)
holds a longer prefix of its prompt; when copying that part is cheaper than computing
it (the cost rule in cluster/routing.py), the request waits while

    OfferPrefix(offer_id, token_ids, to=P) -> X
    X: KVOffered(offer_id, PREFETCH, ...) (as above), or PrefixFetched(error) when it
       holds none of it any more
    FetchPrefix -> P ... PrefixFetched -> front end: ReleaseKV -> X; AddRequest -> P

and P's prefill then finds those blocks in its prefix cache. Any failure only means P
computes them; the request is never failed by a fetch.

Ordering and ownership: D's pinned blocks are read-only until ReleaseKV or the lease
(`KVSource.lease_deadline`) ends, so P never reads a block D reused. P owns the blocks it
allocated for the fetch until it has committed or freed them; a failed or late fetch frees
them and reports `error` - the request the KV came from was finished long before, so
nothing a client waits for depends on any of this.
"""

from __future__ import annotations

from enum import StrEnum

import msgspec

from pdserve.protocol.handoff import KVSource


class OfferKind(StrEnum):
    """Why KV is offered."""

    RETURN = "return"  # a finished request's prompt + answer, decode -> its prefill instance
    PREFETCH = "prefetch"  # a cached prefix, donor -> the instance about to prefill it
    # a running request's KV, off an instance that flips -> the one it continues on
    MOVE = "move"


def offer_id(kind: OfferKind, request_key: str) -> str:
    """The id of the `kind` offer made for a request: the key of the pin at the source,
    which no request id takes (the `@`)."""
    return f"{request_key}@{kind}"


class KVOffered(msgspec.Struct, frozen=True, tag=True):
    """An instance pinned the KV of `token_ids` (full blocks, all of them computed) for
    instance `to` to copy into its prefix cache. `offer_id` names the pin: ReleaseKV with
    it unpins. `token_ids` has `source.num_tokens` tokens."""

    offer_id: str
    kind: OfferKind
    to: str  # the instance name the KV is offered to
    token_ids: list[int]
    source: KVSource


class OfferPrefix(msgspec.Struct, frozen=True, tag=True):
    """Pin the indexed full-block prefix of `token_ids` and offer it to instance `to`
    (KVOffered); PrefixFetched with an error when none of it is indexed here."""

    offer_id: str
    token_ids: list[int]
    to: str
    kind: OfferKind = OfferKind.PREFETCH


class FetchPrefix(msgspec.Struct, frozen=True, tag=True):
    """Copy the blocks of `token_ids` this instance lacks from `source` (on instance
    `source_instance`) into its prefix cache; answer PrefixFetched."""

    offer_id: str
    source_instance: str
    token_ids: list[int]
    source: KVSource


class PrefixFetched(msgspec.Struct, frozen=True, tag=True):
    """A FetchPrefix ended. `num_fetched` tokens moved (0 when this instance held them
    all); `error` says why nothing was kept (no room, transfer failure, lease ran out)."""

    offer_id: str
    source_instance: str
    num_tokens: int  # tokens of the prefix now cached here (0 on error)
    num_fetched: int
    nbytes: int
    error: str | None = None
