"""Cluster-wide caching as a feature of the front end (docs/caching.md, docs/controller.md).

What the front end does for the prefix caches of its instances: it keeps the router's
prompt trees (cluster/routing.py: which instance holds which prefix, from their load
reports, expired after the TTL), learns how far the trees' predictions hold (each
attempt's first output says what the instance really served from its cache), and relays
KV copied into prefix caches - returns and prefix fetches (cluster/cache_copies.py, whose
`KVOffered` / `PrefixFetched` it reads). Routing by prefix itself is dispatch's
(cluster/dispatch.py), which asks the router and parks requests on copies.
"""

from __future__ import annotations

from collections.abc import Mapping

from pdserve.cluster.cache_copies import CacheCopies
from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.hub import Feature, Handler
from pdserve.cluster.instance import Instance
from pdserve.cluster.routing import Router
from pdserve.cluster.table import Record
from pdserve.config import EngineConfig
from pdserve.protocol.cache import KVOffered, PrefixFetched
from pdserve.protocol.core import EngineOutput


def returns_kv(config: ClusterConfig, engine: EngineConfig) -> bool:
    """PD-Caching-3: decode instances offer finished requests' KV to the prefill instance
    that prefilled them."""
    return config.disaggregated and config.pd_caching == 3 and engine.cache.enable_prefix_cache


class Caching(Feature):
    """The prompt trees' upkeep and the copies into prefix caches (module docstring)."""

    def __init__(self, router: Router, copies: CacheCopies) -> None:
        self.router = router
        self.copies = copies

    def handlers(self) -> Mapping[type, Handler]:
        return {KVOffered: self.copies.on_offered, PrefixFetched: self.copies.on_fetched}

    def output(self, rec: Record, inst: Instance, out: EngineOutput) -> None:
        if rec.cached_tokens is None:  # the attempt's first: the instance's own count
            self.router.observe(rec.predicted_cached, out.num_cached_tokens)

    def finished(self, rec: Record, inst: Instance, clean: bool) -> None:
        """With a return, `inst` (the decode instance) offers the full blocks whose KV it
        computed (all tokens but the last) right after this output."""
        if clean and rec.return_to is not None and inst is rec.decode:
            tokens = (rec.prompt + rec.streamed)[:-1]
            self.copies.expect_return(rec.key, inst, rec.return_to, tokens)

    def instance_dead(self, inst: Instance) -> None:
        self.router.forget(inst)
        self.copies.instance_dead(inst)

    def tick(self, now: float) -> None:
        self.router.expire(now)
        self.copies.tick(now)
