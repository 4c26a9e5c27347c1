"""Colocated role: both phases on this instance (chunked prefill + continuous batching).

No KV crosses instances, so every hook is `EngineRole`'s default: nothing to hand off,
nothing to take in; AddPrefilled / ReserveKV and a hand-off are refused.
"""

from __future__ import annotations

from pdserve.config import Role
from pdserve.engine.roles.base import EngineRole


class ColocatedRole(EngineRole):
    role = Role.COLOCATED
