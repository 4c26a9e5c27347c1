"""An instance's role, and instance flip: changing it in place (TetriInfer §3.5).

A flip changes what a running instance does - prefill <-> decode, or either <-> colocated -
without a new process or a weight reload (docs/elastic.md). The front end stops routing new
work to the instance, drains what it holds (a prefill instance finishes its prompts; a
decode instance's requests move to others with their KV), and then asks it to switch:

    SwitchRole(flip_id, role, ...) -> instance
    instance: once idle between steps (no request, nothing held, moving or reserved, no
       block in use; its prefix cache stays), replaces its role object;
       RoleSwitched(flip_id, role, error=None, waited_s, switch_s) -> front end
    a later SwitchRole replaces one still waiting (one to the role it has cancels it:
       RoleSwitched at once for the new id; the replaced one is never answered)

An instance that leaves the cluster (a scale-in, cluster/scaling.py) is drained the same
way and then asked `SwitchRole(flip_id, its role, ..., leave=True)`: it answers
`RoleSwitched` with its role unchanged once it is idle (nothing it offered is still being
copied out of it), and the front end then shuts it down.

`waited_s` is how long the instance waited to be idle after the message came, `switch_s`
how long replacing the role took (the flip's own cost: TetriInfer reports 5-7 ms). An
`error` (a role the instance's config refuses) means nothing changed.
"""

from __future__ import annotations

from enum import StrEnum

import msgspec


class Role(StrEnum):
    """What an engine instance does with prompts and generation (DistServe §3)."""

    COLOCATED = "colocated"  # both phases, chunked prefill + continuous batching
    PREFILL = "prefill"  # prompts only, in chunks; produces the first token, hands KV off
    DECODE = "decode"  # generation only, from KV received from a prefill instance


class SwitchRole(msgspec.Struct, frozen=True, tag=True):
    """Become a `role` instance once idle. `max_num_batched_tokens`: the scheduler's token
    budget per step in the new role (a prefill instance's chunk size may differ).
    `leave`: keep the role, only answer once idle (the instance is about to be shut down)."""

    flip_id: int
    role: Role
    max_num_batched_tokens: int
    leave: bool = False


class RoleSwitched(msgspec.Struct, frozen=True, tag=True):
    """The instance holds `role` now (or, with `error`, still its old one)."""

    flip_id: int
    role: Role
    error: str | None = None
    waited_s: float = 0.0
    switch_s: float = 0.0
