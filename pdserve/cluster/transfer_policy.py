"""What the transfer mode decides on the controller: one `TransferPolicy` per
`TransferMode`, chosen once from the engine config (`transfer_policy`).

- pull: the prefill instance holds the KV; the decode instance is chosen after the first
  token and fetches it (KVHandedOff(source) -> AddPrefilled(source)).
- push (layer-push, request-push): a decode instance reserves blocks first (ReserveKV ->
  KVReserved) and the prefill instance writes into them; an aborted attempt's reservation
  is released only once the prefill side stopped writing (cluster/dispatch.py).

How the prefill instance moves the KV in each mode: engine/roles/prefill.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.protocol.handoff import Handoff, PushTarget, TransferMode


@dataclass(frozen=True)
class TransferPolicy:
    mode: TransferMode
    push: bool  # a decode reservation comes first and the prefill side writes into it

    def handoff(self, target: PushTarget | None = None) -> Handoff:
        """What the prefill instance is told to do after the first token (push: `target`,
        the blocks the decode instance reserved)."""
        return Handoff(self.mode, target)


_POLICIES: dict[TransferMode, TransferPolicy] = {
    TransferMode.PULL: TransferPolicy(TransferMode.PULL, push=False),
    TransferMode.LAYER_PUSH: TransferPolicy(TransferMode.LAYER_PUSH, push=True),
    TransferMode.REQUEST_PUSH: TransferPolicy(TransferMode.REQUEST_PUSH, push=True),
}


def transfer_policy(mode: TransferMode) -> TransferPolicy:
    return _POLICIES[mode]
