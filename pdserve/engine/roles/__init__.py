"""The role of an engine instance (DistServe §3): colocated, prefill or decode.

`EngineCore` holds one `EngineRole` and calls its hooks at fixed points of its step loop
(`base.py`); `switch_role` replaces it between steps. `transfer.py` holds what the prefill
and decode roles share: the instance's region, transport and transfer thread.
"""

from __future__ import annotations

from pdserve.engine.roles.base import EngineRole
from pdserve.engine.roles.colocated import ColocatedRole
from pdserve.engine.roles.decode import DecodeRole
from pdserve.engine.roles.prefill import PrefillRole
from pdserve.engine.roles.transfer import TransferLink, TransferRole, open_link

__all__ = [
    "ColocatedRole",
    "DecodeRole",
    "EngineRole",
    "PrefillRole",
    "TransferLink",
    "TransferRole",
    "open_link",
]
