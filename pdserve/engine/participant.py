"""`Participant`: what a feature adds to the engine core, at fixed points of a step.

The core (engine/core.py) holds an ordered list of participants - its role first (the
one part that is replaced, by `switch_role`), then the features `engine/features/`
assembles (replication's source and holder sides, the cache exchange, the length head)
- and calls each hook on every participant in that order. It knows none of them by
name: a feature is a module that owns its state and its input messages and plugs in with
one line in `features.assemble`. A hook's default here is what a participant that does
not take part in that point does.

Call points, all on the step loop's thread, in `EngineCore`:

- `handlers()`: read once at start (the role's when it is taken): the input messages the
  participant owns, type -> handler. The process loop (engine_process.py) and tests send
  them through `EngineCore.handle`. One owner per type.
- `request_added(req, handoff)`: a request is about to be queued (`add_request`, or a
  request resumed from a replica); may raise InvalidRequestError (nothing is allocated
  yet). The role refuses a hand-off it cannot make.
- `poll(free_seq_slots, admissible)`: between steps; background work advances. Returns
  requests whose KV is now in place, to join the batch (the decode role's fetched KV).
- `begin_step(seqs)` / `end_step()`: around the forward pass (after `schedule`, before
  the scheduler commits the step). No KV may be allocated or freed between them.
- `token_masks(seqs)`: the step's sampling rows, just before the tokens are drawn: the
  tokens each row this participant constrains may take (a packed bitmask, `SamplingRow.
  allowed`), by request id; work started in `begin_step` overlaps the forward pass.
- `sampled(seqs, hidden)`: the step's rows that sample a token and their final hidden
  states, before the tokens are drawn (the length head predicts from a fresh prompt's).
- `first_token(req)`: once per request whose first token this step sampled, after the
  step's stop checks. True takes it out of the batch with its KV (prefill: the hand-off).
- `request_ended(req, status)`: `req` leaves the core - finished (`status`), aborted
  (FINISHED_ABORTED), or taken over with its KV kept (None) - before its blocks are
  freed: KV to keep past the request is pinned here.
- `step_ended(running)`: the step's KV is committed and ended requests are gone.
- `release(request_id)`: ReleaseKV, per id; True when this participant held it (the
  next ones are not asked).
- `abort(request_id)`: before the scheduler is asked; True when the participant owned
  the request (the scheduler does not).
- `busy()`: background work in flight (the loop polls again soon).
- `wants_every_step`: True while the participant must see every step one by one (no
  decode burst may run several in one call).
- `stats()`: its EngineStats fields, by name. `check_integrity()`: AssertionError
  unless its accounting holds. `close()`: shutdown, in order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.protocol.handoff import Handoff
from pdserve.protocol.wire import EngineMessage

if TYPE_CHECKING:
    from pdserve.config import EngineConfig, Role
    from pdserve.engine.roles.transfer import TransferLink
    from pdserve.kv.cache import KVCache
    from pdserve.kv.manager import KVManager
    from pdserve.protocol.sampling_params import SamplingParams

# The core's decode admission rule: (request, requests whose KV is on its way) -> may join.
Admissible = Callable[[Request, Sequence[Request]], bool]
# An input message's handler (a participant's bound method).
Handler = Callable[[Any], None]


class Participant:
    """The hooks (see the module table). Single-threaded like the step loop."""

    def handlers(self) -> Mapping[type, Handler]:
        return {}

    def request_added(self, req: Request, handoff: Handoff | None) -> None:
        pass

    def poll(self, free_seq_slots: int, admissible: Admissible) -> list[Request]:
        return []

    def begin_step(self, seqs: Sequence[ScheduledSeq]) -> None:
        pass

    def end_step(self) -> None:
        pass

    def token_masks(self, seqs: Sequence[ScheduledSeq]) -> Mapping[str, torch.Tensor]:
        return {}

    def sampled(self, seqs: Sequence[ScheduledSeq], hidden: torch.Tensor) -> None:
        pass

    def first_token(self, req: Request) -> bool:
        return False

    def request_ended(self, req: Request, status: RequestStatus | None) -> None:
        pass

    def step_ended(self, running: Sequence[Request]) -> None:
        pass

    def release(self, request_id: str) -> bool:
        return False

    def abort(self, request_id: str) -> bool:
        return False

    def busy(self) -> bool:
        return False

    @property
    def wants_every_step(self) -> bool:
        return False

    def stats(self) -> dict[str, int]:
        return {}

    def check_integrity(self) -> None:
        pass

    def close(self) -> None:
        pass


class CoreAccess(Protocol):
    """What a participant may use of the core it is part of (EngineCore is one). A
    participant gets it at construction; it never reaches past it into the core."""

    config: EngineConfig
    kv: KVManager

    @property
    def cache(self) -> KVCache:
        """The pool (its `device_tensor` moves into a transfer region when one opens)."""
        ...

    def post(self, msg: EngineMessage) -> None:
        """Queue a message for the controller (sent after the step's outputs)."""
        ...

    def transfer_link(self) -> TransferLink:
        """The core's transfer link, opened on first use (the pool moves into its region)."""
        ...

    def new_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        arrival: float | None,
        output_token_ids: Sequence[int],
    ) -> Request:
        """A validated request, not queued anywhere (raises as `add_request` does)."""
        ...

    def queue(self, req: Request) -> None:
        """Queue `req` as `add_request` does (EngineOverloadedError when the queue is full;
        the participants' `request_added` first)."""
        ...

    def join_batch(self, req: Request) -> None:
        """`req`, its KV in place and committed, joins the running batch (the
        participants' `request_added` first)."""
        ...

    def has_room(self) -> bool:
        """The running batch has a free slot."""
        ...

    def holdings(self) -> str | None:
        """None when the core is idle (a role switch may run), else what it holds."""
        ...

    def switch_role(self, role: Role, max_num_batched_tokens: int | None) -> None:
        """Replace the role (instance flip); the core must be idle (RuntimeError)."""
        ...
