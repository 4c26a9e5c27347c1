"""The engine core's features, in the order the core calls them (after its role).

A feature is a participant (engine/participant.py) that owns its state and its input
messages; adding one is its module and a line here. Each gets what it uses of the core
through `CoreAccess`, never the core itself.
"""

from __future__ import annotations

from pdserve.engine.features.cache_exchange import CacheExchange
from pdserve.engine.features.length_prediction import LengthPredictor
from pdserve.engine.features.replica_store import ReplicaStore
from pdserve.engine.features.replicator import Replicator
from pdserve.engine.features.role_flip import RoleFlip
from pdserve.engine.features.structured_output import StructuredOutput, engine_tokenizer
from pdserve.engine.length_head import load_length_head
from pdserve.engine.participant import CoreAccess, Participant
from pdserve.model.base import CausalLM


def assemble(core: CoreAccess, model: CausalLM) -> list[Participant]:
    """The features of a core serving `model`. Order matters only at `close`: the
    replication write in flight and cache copies end before the replica regions go."""
    config = core.config
    transfer = config.transfer
    head = None
    vocab, eos = model.config.vocab_size, model.config.eos_token_ids
    if config.length_predictor is not None:
        head = load_length_head(config.length_predictor, model)
    return [
        # DéjàVu replication, source side: running requests' KV streamed to a holder.
        Replicator(core.kv, core.transfer_link, core.post, transfer.timeout_s),
        # MemServe's cluster caching: KV offered to and fetched from peers.
        CacheExchange(config.instance_name, core.kv, core.transfer_link, core.post, transfer),
        # DéjàVu replication, holder side: other instances' replicas, resumed on death.
        ReplicaStore(core),
        # TetriInfer's output-length prediction at each fresh prompt's first token.
        LengthPredictor(head),
        # TetriInfer's instance flip: the role replaced once the drained core is idle.
        RoleFlip(core),
        # Structured outputs: each constrained request's grammar mask, every token.
        StructuredOutput(engine_tokenizer(config.model, vocab, eos), vocab, eos),
    ]
