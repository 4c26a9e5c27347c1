"""How the front end moves a request that lost its instance (docs/fault-tolerance.md).

A request is *moved* when an instance it was on dies (a migration, at most
`ClusterConfig.max_migrations` per request) or when its KV hand-off fails with both
instances alive (a retry, at most `max_retries`). A request that streamed nothing yet
starts again from its prompt; one that did continues after its last streamed token on a
live instance that decodes (`AddRequest.output_token_ids`: the KV of prompt and tokens is
recomputed there; a seeded generator skips the draws already taken), so the client's stream
only pauses - or, when the cost rule says so (cluster/replication.py), from its replica on
the instance that holds it. With no live instance of a role left the other role runs
requests whole. Past the bound, or with no live instance at all, the request ends with
`InstanceFailedError` (HTTP 503).

A dead instance is fenced by the hub before `instance_dead` is called: its process is gone
and nothing it sent after its death is read. Every path releases what the other side holds
(the hub's `release`), so no block stays allocated for a request that is gone. With
`--ray-restart` a dead instance's config is started again and takes its place, empty.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from pdserve.cluster.costs import RecoveryCost
from pdserve.cluster.dispatch import Dispatch
from pdserve.cluster.hub import Feature, Handler, Hub
from pdserve.cluster.instance import Instance, layout_conflict
from pdserve.cluster.replication import Replica, take_replica
from pdserve.cluster.table import Phase, Record
from pdserve.config import Role
from pdserve.errors import InstanceFailedError
from pdserve.protocol.core import AddRequest, EngineOutput
from pdserve.protocol.handoff import HandoffFailed
from pdserve.protocol.replica import ResumeFromReplica

_RESTART_TRIES = 5  # --ray-restart: starts tried for one dead instance
_RESTART_WAIT_S = 2.0  # between them
log = logging.getLogger("pdserve.recovery")


class Recovery(Feature):
    """Migration, retries, resume from replicas, restarts (module docstring)."""

    def __init__(self, hub: Hub, dispatch: Dispatch, rates: RecoveryCost) -> None:
        self.hub = hub
        self.dispatch = dispatch  # where a moved request continues
        self.rates = rates
        self._restarts: set[asyncio.Task[None]] = set()  # --ray-restart: starts in flight

    def handlers(self) -> Mapping[type, Handler]:
        return {HandoffFailed: self._on_handoff_failed}

    async def close(self) -> None:
        """Stop restarting instances."""
        for task in self._restarts:
            task.cancel()
        await asyncio.gather(*self._restarts, return_exceptions=True)

    # ---- hooks ---------------------------------------------------------------------------

    def output(self, rec: Record, inst: Instance, out: EngineOutput) -> None:
        """The first output after a move: what it really recomputed (cache hits excluded)."""
        if rec.recompute:
            cached = out.num_cached_tokens
            self.hub.faults.recomputed_tokens += max(0, rec.recompute - cached)
            rec.recompute = 0

    def instance_dead(self, inst: Instance) -> None:
        """Move every request `inst` held; then, with `--ray-restart`, start it again."""
        why = f"instance {inst.name} failed: {inst.dead}"
        held = self.hub.table.holding(inst)
        log.warning("%s; moving its %d requests", why, len(held))
        for rec in held:
            replica = take_replica(rec) if rec.replica_source is inst else None
            if inst is rec.prefill:
                rec.prefill = None
            else:
                rec.decode = None
            self.hub.release(rec, abort=True)
            self.move(rec, why, migration=True, replica=replica)
        if self.hub.config.restart_dead and not self.hub.closed:
            task = asyncio.create_task(self._restart(inst))
            self._restarts.add(task)
            task.add_done_callback(self._restarts.discard)

    # ---- moving a request ----------------------------------------------------------------

    def _on_handoff_failed(self, inst: Instance, msg: HandoffFailed) -> None:
        """Either side gave up on the KV (and released what it held for it): retry."""
        rec = self.hub.table.get(msg.request_id)
        if rec is None:
            return
        if inst is rec.prefill:
            rec.prefill = None
        elif inst is rec.decode:
            rec.decode = None
        self.hub.release(rec, abort=True)
        self.move(rec, f"{inst.name}: {msg.message}", migration=False)

    def move(self, rec: Record, why: str, migration: bool, replica: Replica | None = None) -> None:
        """Run `rec` again elsewhere, or fail it past its bound. `migration`: its instance
        died (bounded by `max_migrations`), else its hand-off failed (`max_retries`).
        `replica`: the KV replicated before the death."""
        config, faults = self.hub.config, self.hub.faults
        done, bound = (
            (rec.migrations, config.max_migrations)
            if migration
            else (rec.attempts - rec.migrations - rec.drains, config.max_retries)
        )
        if done >= bound or self.hub.closed:
            moves = "migrations" if migration else "retries"
            tries = f" (after {done} {moves})" if done else ""
            self.hub.fail(rec, InstanceFailedError(f"the request failed{tries}: {why}"))
            return
        self.hub.table.next_attempt(rec, migration)
        if migration:
            faults.migrations += 1
        else:
            faults.retries += 1
        if rec.streamed and replica is not None and self._resume_from_replica(rec, replica):
            return
        if rec.streamed:
            self._resume(rec)
        else:
            self.hub.dispatch(rec)

    def _resume_from_replica(self, rec: Record, replica: Replica) -> bool:
        """The cost rule (`RecoveryCost`): resume on the holder from the replica when that
        is cheaper than recomputing every token; the choice is logged with its numbers.
        `rec` has been re-keyed already; the replica is known by the previous key."""
        holder, layout = replica.holder, replica.holder.kv_layout
        assert layout is not None
        total = len(rec.prompt) + len(rec.streamed) - 1
        through = min(replica.tokens, total)
        choice = self.rates.choose(through, total, 2 * layout.num_layers * layout.token_bytes)
        log.info("request %s: %s", rec.request_id, choice.describe())
        if not choice.resume:
            return False
        request = self.continue_on(rec, holder)
        holder.send(ResumeFromReplica(request, replica.source, replica.key, through))
        self.hub.faults.resumed_from_replica += 1
        self.hub.faults.recomputed_tokens += total - through
        return True

    def _resume(self, rec: Record) -> None:
        """Continue `rec` after its last streamed token: an instance computes the KV of
        prompt + streamed tokens again (prefix-cache hits excepted) and samples the next
        token - the decode instance it continues on, or a prefill instance that hands it
        off to one, whichever has the fewest tokens to recompute before it
        (`recompute_on`): a dead instance's requests are spread over every instance
        that can take a share."""
        inst = self.continuation_instance(rec)
        if inst is None:
            error = InstanceFailedError("no live instance to continue the request on")
            self.hub.fail(rec, error)
            return
        recompute = len(rec.prompt) + len(rec.streamed) - 1
        inst = self.recompute_on(rec, inst)
        rec.recompute = recompute
        if inst.role is Role.PREFILL and self.dispatch.continues_through_prefill:
            self.hub.faults.recomputed_on_prefill += 1
            self.dispatch.continue_through(rec, inst)
            return
        inst.send(self.continue_on(rec, inst))

    def recompute_on(self, rec: Record, decode: Instance) -> Instance:
        """Where `rec`'s tokens are recomputed: `decode` (the instance it continues on)
        or a live prefill instance (pull mode, with a decode instance to hand off to),
        the one with the fewest tokens queued to compute - a prefill instance's prompt
        tokens assigned, a decode instance's continuations not yet computed - ties to a
        prefill instance (it computes without decode steps beside)."""
        if decode.role is not Role.DECODE or not self.dispatch.continues_through_prefill:
            return decode
        queued = sum(r.recompute for r in self.hub.table.holding(decode) if r.recompute)
        prefills = self.hub.live(Role.PREFILL)
        least = min(prefills, key=lambda i: i.assigned_prefill_tokens, default=None)
        if least is None or least.assigned_prefill_tokens > queued:
            return decode
        return least

    def continue_on(self, rec: Record, inst: Instance) -> AddRequest:
        """Make `inst` the instance `rec` decodes on (its load credited) and return the
        request that continues it there after its streamed tokens."""
        rec.credit_decode_to(inst, self.dispatch.is_heavy(rec))
        rec.prefill, rec.phase, rec.return_to = None, Phase.DECODE, None
        return AddRequest(
            rec.key,
            rec.prompt,
            rec.params,
            rec.arrival,
            output_token_ids=rec.streamed,
            prediction=rec.prediction,
        )

    def continuation_instance(self, rec: Record) -> Instance | None:
        """Where a moved request continues: a live decode instance (by the decode policy,
        preferring room for its tokens), else a colocated one, else - no instance that
        decodes is left - a prefill instance, which runs it to the end."""
        block_size = self.hub.engine.cache.block_size
        need = -(-(len(rec.prompt) + len(rec.streamed) + 1) // block_size)
        for role in (Role.DECODE, Role.COLOCATED, Role.PREFILL):
            live = self.hub.live(role)
            if live:
                return self.dispatch.router.decode_chooser.choose(live, need)
        return None

    # ---- restarts (--ray-restart) ----------------------------------------------------------

    async def _restart(self, dead: Instance, timeout: float = 600.0) -> None:
        """Start `dead`'s config again as a new instance (the launcher places it) and, once
        ready, put it in `dead`'s place: it rejoins empty (no cache, no requests) and the
        router, the decode chooser and replication see it from then on. A failed start
        is tried again `_RESTART_TRIES` times, `_RESTART_WAIT_S` apart (a node that just
        died may still be offered by Ray for a few seconds); then the instance stays dead."""
        for attempt in range(1, _RESTART_TRIES + 1):
            fresh = await self._start_again(dead, timeout)
            if fresh is not None:
                await dead.shutdown(0)  # its process is gone (fenced); this closes its sockets
                self.hub.replace(dead, fresh)
                self.hub.faults.instance_restarted(fresh.role.value)
                log.warning("instance %s restarted on node %s, empty", fresh.name, fresh.node)
                return
            if self.hub.closed:
                return
            if attempt < _RESTART_TRIES:
                await asyncio.sleep(_RESTART_WAIT_S)
        log.warning("instance %s stays dead: %d restarts failed", dead.name, _RESTART_TRIES)

    async def _start_again(self, dead: Instance, timeout: float) -> Instance | None:
        """A ready new instance of `dead`'s config; None if its start failed (logged)."""
        fresh = self.hub.new_instance(dead.config)
        try:
            await fresh.start(timeout)
        except asyncio.CancelledError:  # the server is shutting down
            await fresh.shutdown()
            raise
        except Exception as e:  # its start failed (Ray could not place it, it died, ...)
            log.warning("instance %s could not be restarted: %s", dead.name, e)
            await fresh.shutdown()
            return None
        if self.hub.closed:
            await fresh.shutdown()
            return None
        if why := layout_conflict(fresh, self.hub.instances):
            log.warning("instance %s refused: %s", dead.name, why)
            await fresh.shutdown()
            return None
        return fresh
