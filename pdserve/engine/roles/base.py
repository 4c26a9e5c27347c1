"""`EngineRole`: what an instance's role adds to the engine core.

The core holds exactly one role and calls its hooks at fixed points; it never asks which
role it holds (vLLM v1's KV connector: one interface the scheduler calls). Each hook's
default here is what an instance that does not do that thing does, so `ColocatedRole` is
this class as it stands and the prefill and decode roles override what they take part in.

It is the core's first participant (engine/participant.py: the hooks every participant
has, when the core calls them, and their defaults), and adds what only a role does:

- `add_prefilled(msg, build)`, `reserve(msg)`: AddPrefilled, ReserveKV. Default:
  `RequestRejected(request_id, "not a decode instance", None)`.
- `request_added(req, handoff)`: default refuses a hand-off (InvalidRequestError).
- `num_held`, `num_transferring`, `num_reserved`: LoadReport, EngineStats, and the idle
  check of `switch_role`. Default: 0.
- `forward_hooks`: installed on the model runner with the role. Default: None.

The role must not allocate or free KV in `begin_step` / `end_step` (the scheduler's
blocks for the step are fixed by then); between steps it may, through the `KVManager`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from pdserve.config import Role
from pdserve.engine.participant import Admissible as Admissible
from pdserve.engine.participant import Participant
from pdserve.engine.request import Request
from pdserve.errors import InvalidRequestError
from pdserve.model.base import ForwardHooks
from pdserve.protocol.core import RequestRejected
from pdserve.protocol.handoff import AddPrefilled, Handoff, ReserveKV
from pdserve.protocol.wire import EngineMessage

# Turns an AddPrefilled into a request of this core; None when the core refused it (the
# core has answered RequestRejected then).
BuildRequest = Callable[[AddPrefilled], Request | None]


class EngineRole(Participant):
    """A role's hooks (see the module doc). Single-threaded like the step loop."""

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

    def stats(self) -> dict[str, int]:
        return {
            "num_held": self.num_held,
            "num_transferring": self.num_transferring,
            "num_reserved": self.num_reserved,
        }

    @property
    def wants_every_step(self) -> bool:
        return self.forward_hooks is not None  # a burst runs no per-layer callbacks

    # ---- inputs ---------------------------------------------------------------------

    def request_added(self, req: Request, handoff: Handoff | None) -> None:
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

    # ---- internals ------------------------------------------------------------------

    def _not_decode(self, request_id: str) -> None:
        self.send(RequestRejected(request_id, "not a decode instance", None))
