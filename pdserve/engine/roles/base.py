"""`EngineRole`: what an instance's role adds to the engine core.

The core holds exactly one role and calls its hooks at fixed points; it never asks which
role it holds (vLLM v1's KV connector: one interface the scheduler calls). Each hook's
default here is what an instance that does not do that thing does, so `ColocatedRole` is
this class as it stands and the prefill and decode roles override what they take part in.

Call points, in `EngineCore` (all on the step loop's thread), with the default:

- `request_added(req, handoff)`: `add_request`, before `req` is queued; may raise
  InvalidRequestError (nothing is allocated yet). Default: refuses a hand-off.
- `add_prefilled(msg, build)`, `reserve(msg)`: AddPrefilled, ReserveKV. Default:
  `RequestRejected(request_id, "not a decode instance", None)`.
- `release(request_id)`: ReleaseKV, per id. Default: nothing.
- `abort(request_id)`: `abort`, before the scheduler is asked. Default: False.
- `poll(free_seq_slots)`: `poll_transfers`, between steps; returns requests that join the
  batch. Default: none.
- `begin_step(seqs)`: `step`, after `schedule` and before the forward pass.
- `end_step()`: `step`, after the forward pass and before the scheduler commits the step.
- `first_token(req)`: `step`, after the step's tokens and stop checks, once for each
  request whose first token was sampled (finished or not); True takes it out of the batch
  with its KV. Default: False.
- `busy()`: `transfers_in_flight` (the loop polls again soon). Default: False.
- `num_held`, `num_transferring`, `num_reserved`: LoadReport, EngineStats, and the idle
  check of `switch_role`. Default: 0.
- `forward_hooks`: installed on the model runner with the role. Default: None.

The role must not allocate or free KV in `begin_step` / `end_step` (the scheduler's
blocks for the step are fixed by then); between steps it may, through the `KVManager`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar

from pdserve.config import Role
from pdserve.engine.request import Request
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.errors import InvalidRequestError
from pdserve.model.base import ForwardHooks
from pdserve.protocol.core import RequestRejected
from pdserve.protocol.handoff import AddPrefilled, Handoff, ReserveKV
from pdserve.protocol.wire import EngineMessage

# Turns an AddPrefilled into a request of this core; None when the core refused it (the
# core has answered RequestRejected then).
BuildRequest = Callable[[AddPrefilled], Request | None]
# The core's decode admission rule: (request, requests whose KV is on its way) -> may join.
Admissible = Callable[[Request, Sequence[Request]], bool]


class EngineRole:
    """The hooks of a role (see the module table). Single-threaded like the step loop."""

    role: ClassVar[Role]
    forward_hooks: ForwardHooks | None = None  # per-layer callbacks of the forward pass

    def __init__(self, send: Callable[[EngineMessage], None]) -> None:
        self.send = send  # queues a message for the controller

    # ---- counters (LoadReport, EngineStats) -------------------------------------------

    @property
    def num_held(self) -> int:
        """Finished prompts whose KV waits here for a decode instance."""
        return 0

    @property
    def num_transferring(self) -> int:
        """KV moves in flight."""
        return 0

    @property
    def num_reserved(self) -> int:
        """Reservations and requests waiting for their KV."""
        return 0

    def busy(self) -> bool:
        """Background work the step loop should keep polling for."""
        return False

    # ---- inputs ---------------------------------------------------------------------

    def request_added(self, req: Request, handoff: Handoff | None) -> None:
        """`req` is about to be queued. Raises InvalidRequestError to refuse it (nothing
        is allocated yet)."""
        if handoff is not None:
            raise InvalidRequestError("this instance is not a prefill instance", "handoff")

    def add_prefilled(self, msg: AddPrefilled, build: BuildRequest) -> Request | None:
        """A request prefilled elsewhere. Returns it when its KV is in place and it may join
        the batch now; None when it waits (see `poll`) or was refused."""
        self._not_decode(msg.request_id)
        return None

    def reserve(self, msg: ReserveKV) -> None:
        """Reserve blocks for a prompt another instance will push."""
        self._not_decode(msg.request_id)

    def release(self, request_id: str) -> None:
        """Free KV kept here for a hand-off (held prompt KV, or a reservation)."""

    def abort(self, request_id: str) -> bool:
        """Drop what the role holds of the request. True: the role owned it (the scheduler
        does not); False: the core aborts it in the scheduler, if it is there."""
        return False

    # ---- the step loop --------------------------------------------------------------

    def poll(self, free_seq_slots: int, admissible: Admissible) -> list[Request]:
        """Advance background work. Returns requests whose KV is now in place, to join the
        batch; `free_seq_slots` counts the batch's free slots before they join.
        `admissible(request, incoming)`: the core's decode admission rule, asked before
        a request prefilled elsewhere takes blocks here (`incoming`: requests whose KV
        is on its way, part of the batch for the rule)."""
        return []

    def begin_step(self, seqs: Sequence[ScheduledSeq]) -> None:
        """The step's sequences are scheduled; the forward pass is next."""

    def end_step(self) -> None:
        """The forward pass is done; the scheduler commits the step next."""

    def first_token(self, req: Request) -> bool:
        """`req`'s first token was sampled this step (`req.status` says whether it
        finished). True: the role takes the request over and the core takes it out of the
        batch, its KV kept (the role frees it)."""
        return False

    # ---- internals ------------------------------------------------------------------

    def _not_decode(self, request_id: str) -> None:
        self.send(RequestRejected(request_id, "not a decode instance", None))
