"""`RoleFlip`: the instance's side of instance flip (protocol/role.py, docs/elastic.md).

The front end drains the instance before it asks (no new work is routed to it; its
requests finish or move), so by the time `SwitchRole` arrives the core is idle or about to
be: a copy into its prefix cache may still be committing, an offered prefix still pinned
until its reader lets go. The switch waits for that here - checked again each time the
loop polls its participants, never inside a step - and replaces the role the moment the
core holds nothing (`EngineCore.switch_role`). The prefix cache is not touched. A switch
with `leave` (the instance leaves the cluster) waits the same way and changes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from pdserve.engine.participant import Admissible, CoreAccess, Handler, Participant
from pdserve.engine.request import Request
from pdserve.protocol.role import RoleSwitched, SwitchRole


class RoleFlip(Participant):
    """Holds the one switch asked for until the core is idle (module docstring)."""

    def __init__(self, core: CoreAccess) -> None:
        self.core = core
        self._pending: SwitchRole | None = None
        self._asked = 0.0  # monotonic: when the pending switch arrived
        self.num_switches = 0

    def handlers(self) -> Mapping[type, Handler]:
        return {SwitchRole: self.switch}

    def switch(self, msg: SwitchRole) -> None:
        """Switch now if idle, else once idle; replaces a switch still waiting. A switch to
        the role the core holds is done at once (it cancels one waiting)."""
        self._pending, self._asked = msg, time.monotonic()
        if msg.role is self.core.config.role and not msg.leave:
            self._pending = None
            self.core.post(RoleSwitched(msg.flip_id, msg.role))
            return
        self._try()

    def poll(self, free_seq_slots: int, admissible: Admissible) -> list[Request]:
        if self._pending is not None:
            self._try()
        return []

    def busy(self) -> bool:
        return self._pending is not None  # the loop polls again soon

    def stats(self) -> dict[str, int]:
        return {"num_role_switches": self.num_switches}

    def _try(self) -> None:
        msg = self._pending
        assert msg is not None
        if self.core.holdings() is not None:
            return
        self._pending = None
        waited = time.monotonic() - self._asked
        if msg.leave:
            self.core.post(RoleSwitched(msg.flip_id, msg.role, None, waited))
            return
        t0 = time.perf_counter()
        try:
            self.core.switch_role(msg.role, msg.max_num_batched_tokens)
        except ValueError as e:  # a role this instance's config refuses
            self.core.post(RoleSwitched(msg.flip_id, self.core.config.role, error=str(e)))
            return
        switch_s = time.perf_counter() - t0
        self.num_switches += 1
        self.core.post(RoleSwitched(msg.flip_id, msg.role, None, waited, switch_s))
