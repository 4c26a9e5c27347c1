"""Where an attempt runs, and its KV hand-off from prefill to decode (docs/controller.md).

`Dispatch` sends an attempt that streamed nothing yet to its first instance, by the router
(cluster/routing.py) and the decode chooser (cluster/policies.py), and follows a
disaggregated attempt through its hand-off (the `Phase`s in cluster/table.py):

    pull:  PREFILL  AddRequest(handoff=pull) -> prefill instance P (shortest queue)
           P streams the first token back (forwarded at once: that is the TTFT) and
           KVHandedOff(source) -> choose decode instance D -> AddPrefilled(source) to D
           HANDOFF  D fetches when it has room -> KVReceived -> ReleaseKV to P
           DECODE   D streams the remaining tokens
    push:  RESERVING  ReserveKV -> D (chosen first) -> KVReserved(target)
           PREFILL    AddRequest(handoff=push, target) -> P; P writes into D's blocks
           HANDOFF    KVHandedOff -> AddPrefilled(no source) -> D -> KVReceived
           DECODE

With every prefill (or every decode) instance dead, a live instance of the other role runs
requests whole. A request whose prefill instance is receiving a copy of more of its prompt
is parked until the copy ends (cluster/cache_copies.py).

Ownership in push modes: an aborted attempt's decode reservation is released only once the
prefill side says it stopped writing into it (HandoffFailed after the abort, or its death):
`released` keeps such reservations as push stops.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from pdserve.cluster.cache_copies import CacheCopies
from pdserve.cluster.caching import returns_kv
from pdserve.cluster.config import DecodePolicy
from pdserve.cluster.costs import RecoveryCost
from pdserve.cluster.hub import Feature, Handler, Hub
from pdserve.cluster.instance import Instance
from pdserve.cluster.routing import Donor, Router
from pdserve.cluster.table import Phase, Record
from pdserve.cluster.transfer_policy import transfer_policy
from pdserve.config import Role
from pdserve.errors import InstanceFailedError
from pdserve.protocol.core import AbortRequests, AddRequest
from pdserve.protocol.handoff import (
    AddPrefilled,
    Handoff,
    HandoffFailed,
    KVHandedOff,
    KVReceived,
    KVReserved,
    ReleaseKV,
    ReserveKV,
)
from pdserve.protocol.prediction import remaining_tokens


class Dispatch(Feature):
    """Instance choice for attempts, and the hand-off messages (module docstring)."""

    def __init__(self, hub: Hub, router: Router, copies: CacheCopies, rates: RecoveryCost) -> None:
        self.hub = hub
        self.router = router
        self.copies = copies
        self.rates = rates  # the measured prefill rate and KV copy bandwidth
        self.transfer = transfer_policy(hub.engine.transfer.mode)  # pull or push
        self.returns_kv = returns_kv(hub.config, hub.engine)
        # Push modes: decode reservations to release once the prefill side confirms it
        # stopped writing into them (key -> (prefill, decode)).
        self._push_stops: dict[str, tuple[Instance, Instance]] = {}

    def handlers(self) -> Mapping[type, Handler]:
        return {
            KVHandedOff: self._on_handed_off,
            KVReserved: self._on_reserved,
            KVReceived: self._on_received,
            HandoffFailed: self._on_handoff_failed,
        }

    # ---- where an attempt runs -------------------------------------------------------

    def dispatch(self, rec: Record) -> None:
        """Send an attempt (new, or moved before it streamed anything) to its first
        instance. With every prefill (or every decode) instance dead, a live instance of
        the other role runs it whole: slower for everyone, but no request is refused.
        Colocated instances run it whole as well: all of them in a colocated cluster; in
        a cluster that also has a prefill and a decode instance (instances flipped or
        added to roles of the other kind: cluster/flip.py), the attempt goes to the
        colocated instance when it holds no more requests than the prefill and decode
        instances hold per instance (`_colocated_lighter`), else through them."""
        hub = self.hub
        rec.phase = Phase.PREFILL
        rec.return_to = None
        colocated = hub.live(Role.COLOCATED)
        pair = bool(hub.live(Role.PREFILL)) and bool(hub.live(Role.DECODE))
        if colocated and (not pair or self._colocated_lighter(colocated)):
            self._send_prefill(rec, colocated, None)
        elif not hub.live(Role.DECODE):
            self._send_prefill(rec, hub.of_role(Role.PREFILL), None)
        elif not hub.live(Role.PREFILL):
            self._run_whole_on_decode(rec)
        elif not self.transfer.push:
            self._send_prefill(rec, hub.of_role(Role.PREFILL), self.transfer.handoff())
        else:
            decode = self.choose_decode(rec)
            if decode is not None:
                rec.phase = Phase.RESERVING
                decode.send(ReserveKV(rec.key, rec.prompt))

    def _send_prefill(
        self, rec: Record, candidates: list[Instance], handoff: Handoff | None
    ) -> None:
        """Route the request to a prefill instance and send it there - or, while a copy
        of more of its prompt is on its way there (or worth starting: a prefix fetch),
        park it until that copy ends (cluster/cache_copies.py)."""
        choice = self.router.prefill(candidates, rec.route)
        if choice is None:
            self.hub.fail(rec, InstanceFailedError("no live prefill instance"))
            return
        inst, cached = choice.instance, choice.cached_tokens
        request = AddRequest(rec.key, rec.prompt, rec.params, rec.arrival, handoff)
        inbound = self.copies.inbound(inst, rec.prompt, rec.route.hashes)
        if inbound is not None and inbound[1] <= cached:
            inbound = None  # it brings nothing the instance lacks
        donor = None if inbound or not handoff else self._prefix_donor(rec, inst, cached)
        rec.predicted_cached = cached  # the tree's belief (a miss: it held less)
        if inbound is not None:
            cached = inbound[1]
        elif donor is not None:
            cached = rec.predicted_cached = donor.cached_tokens
        rec.credit_prefill_to(inst, len(rec.prompt) - cached)
        rec.phase = Phase.WAITING_FOR_KV
        if inbound is not None:
            self.copies.wait(inbound[0], rec.key, request)
        elif donor is not None:
            tokens = rec.prompt[: donor.cached_tokens]
            self.copies.prefetch(rec.key, donor.instance, inst, tokens, request)
        else:
            rec.phase = Phase.PREFILL
            inst.send(request)

    def _colocated_lighter(self, colocated: list[Instance]) -> bool:
        """A mixed cluster: the least loaded colocated instance holds no more requests
        than the prefill and decode instances hold per instance (every instance takes an
        even share of the requests; counted in the request table, O(requests): only a
        mixed cluster pays it)."""
        hub = self.hub
        pair = [*hub.live(Role.PREFILL), *hub.live(Role.DECODE)]
        in_pair = sum(1 for rec in hub.table if any(rec.holds(i) for i in pair))
        least = min(len(hub.table.holding(i)) for i in colocated)
        return least * len(pair) <= in_pair

    @property
    def continues_through_prefill(self) -> bool:
        """A moved request may be recomputed on a prefill instance and handed off as
        usual: pull mode (a push reservation is sized for the prompt alone)."""
        return not self.transfer.push

    def continue_through(self, rec: Record, inst: Instance) -> None:
        """A moved request's tokens so far recomputed on prefill instance `inst`, which
        samples its next token and hands the KV off to a decode instance as for any
        prompt (cluster/recovery.py spreads a dead instance's requests this way)."""
        rec.phase, rec.return_to = Phase.PREFILL, None
        recompute = len(rec.prompt) + len(rec.streamed) - 1
        rec.credit_prefill_to(inst, recompute)
        rec.predicted_cached = 0
        inst.send(
            AddRequest(
                rec.key,
                rec.prompt,
                rec.params,
                rec.arrival,
                self.transfer.handoff(),
                output_token_ids=rec.streamed,
                prediction=rec.prediction,
            )
        )

    def send_waiting(self, key: str, inst: Instance, request: AddRequest) -> None:
        """A parked request goes to its instance: the copy it waited for ended, or its
        wait did. Its prefill instance; or, for a request moved off an instance that flips
        (cluster/flip.py), the decode instance it continues on. Not when it was aborted or
        moved meanwhile."""
        rec = self.hub.table.get(key)
        if rec is None or rec.phase is not Phase.WAITING_FOR_KV or not rec.holds(inst):
            return
        rec.phase = Phase.PREFILL if inst is rec.prefill else Phase.DECODE
        inst.send(request)

    def _prefix_donor(self, rec: Record, inst: Instance, cached: int) -> Donor | None:
        """Another instance to copy a longer cached prefix from, when copying pays."""
        hub = self.hub
        if not (hub.config.prefix_fetch and hub.config.disaggregated):
            return None
        if not hub.engine.cache.enable_prefix_cache or inst.kv_layout is None:
            return None
        donor = self.router.donor(hub.instances, rec.route, inst, cached)
        if donor is None:
            return None
        layout = inst.kv_layout
        token_bytes = 2 * layout.num_layers * layout.token_bytes
        tokens, overhead = donor.cached_tokens - cached, self.router.fetch_overhead.value
        pays = self.router.fetch_pays(tokens, token_bytes, self.rates, overhead)
        return donor if pays else None

    def _run_whole_on_decode(self, rec: Record) -> None:
        """No prefill instance is alive: a decode instance prefills the prompt itself."""
        inst = self.choose_decode(rec)
        if inst is not None:
            rec.phase = Phase.DECODE
            inst.send(AddRequest(rec.key, rec.prompt, rec.params, rec.arrival))

    def choose_decode(self, rec: Record) -> Instance | None:
        """The decode instance for `rec` (its load credited); none live: `rec` fails."""
        heavy = self.is_heavy(rec)
        inst = self.router.decode(
            self.hub.of_role(Role.DECODE), rec.route, self._decode_blocks(rec), heavy
        )
        if inst is None:
            self.hub.fail(rec, InstanceFailedError("no live decode instance"))
            return None
        rec.credit_decode_to(inst, heavy)
        return inst

    def _decode_blocks(self, rec: Record) -> int:
        """Blocks a decode instance needs for `rec`: its tokens so far and the next one;
        under the length-aware policy, its predicted remaining tokens too (TetriInfer:
        room for the predicted length)."""
        tokens = len(rec.prompt) + len(rec.streamed)
        if self.hub.config.decode_policy is DecodePolicy.LENGTH_AWARE:
            left = rec.params.max_tokens - len(rec.streamed)
            tokens += remaining_tokens(rec.prediction, len(rec.streamed), left)
        else:
            tokens += 1
        return -(-tokens // self.hub.engine.cache.block_size)

    def is_heavy(self, rec: Record) -> bool:
        """A heavy decode: predicted to generate >= `heavy_decode_tokens` (its bucket lies
        there). Without a prediction, max_tokens, the client's bound, decides."""
        threshold = self.hub.config.heavy_decode_tokens
        if rec.prediction is not None:
            return rec.prediction.low >= threshold
        return rec.params.max_tokens >= threshold

    # ---- the hand-off ------------------------------------------------------------------

    def _on_handed_off(self, inst: Instance, msg: KVHandedOff) -> None:
        rec = self.hub.table.get(msg.request_id)
        if rec is None or rec.prefill is not inst or rec.phase is not Phase.PREFILL:
            inst.send(ReleaseKV([msg.request_id]))
            return
        rec.unload_prefill()
        rec.phase = Phase.HANDOFF
        if msg.source is None:
            rec.prefill = None  # pushed: the prefill side holds nothing any more
        if msg.first_scheduled is not None:
            rec.times.first_scheduled = msg.first_scheduled
        if msg.first_token is not None:
            rec.times.first_token = msg.first_token
        if msg.first_scheduled is not None and msg.first_token is not None:
            computed = len(rec.prompt) + max(len(rec.streamed) - 1, 0)  # a continuation's too
            self.rates.prefill.observe(computed, msg.first_token - msg.first_scheduled)
        rec.times.handed_off = time.monotonic()
        decode = rec.decode if msg.source is None else self.choose_decode(rec)
        if decode is None:
            return
        decode.send(
            AddPrefilled(
                rec.key,
                rec.prompt,
                rec.streamed,
                rec.params,
                rec.arrival,
                msg.source,
                msg.generator_state,
                return_to=inst.name if self.returns_kv else None,
                prediction=rec.prediction,
            )
        )
        rec.return_to = inst if self.returns_kv else None

    def _on_reserved(self, inst: Instance, msg: KVReserved) -> None:
        rec = self.hub.table.get(msg.request_id)
        if rec is None or rec.decode is not inst or rec.phase is not Phase.RESERVING:
            inst.send(ReleaseKV([msg.request_id]))
            return
        self._send_prefill(rec, self.hub.of_role(Role.PREFILL), self.transfer.handoff(msg.target))

    def _on_received(self, inst: Instance, msg: KVReceived) -> None:
        rec = self.hub.table.get(msg.request_id)
        if rec is None or rec.decode is not inst:
            inst.send(AbortRequests([msg.request_id]))
            return
        rec.phase = Phase.DECODE
        rec.times.decode_queued = msg.queued
        rec.times.transfer_start, rec.times.transfer_end = msg.transfer_start, msg.transfer_end
        self.rates.copy.observe(msg.nbytes, msg.transfer_end - msg.transfer_start)
        if rec.prefill is not None:
            rec.prefill.send(ReleaseKV([rec.key]))
        rec.prefill = None

    def _on_handoff_failed(self, inst: Instance, msg: HandoffFailed) -> None:
        """Either side gave up on the KV: a push stop it confirms is released (the
        request itself is recovery's: cluster/recovery.py)."""
        stop = self._push_stops.pop(msg.request_id, None)
        if stop is not None:
            stop[1].send(ReleaseKV([msg.request_id]))  # the prefill side stopped writing

    # ---- hooks ---------------------------------------------------------------------------

    def released(self, rec: Record, abort: bool) -> None:
        """An aborted push attempt whose prefill side may still write into the decode
        instance's blocks: keep the reservation until it confirms it stopped."""
        prefill, decode = rec.prefill, rec.decode
        if not (abort and self.transfer.push and prefill is not None):
            return
        if prefill.alive and decode is not None and rec.phase in (Phase.PREFILL, Phase.HANDOFF):
            self._push_stops[rec.key] = (prefill, decode)
            rec.decode = None  # released when the prefill side confirms

    def instance_dead(self, inst: Instance) -> None:
        for key, (prefill, decode) in list(self._push_stops.items()):
            if inst is prefill:  # a dead process writes nothing more
                del self._push_stops[key]
                decode.send(ReleaseKV([key]))
