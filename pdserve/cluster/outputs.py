"""An instance's outputs on their way to the clients (the hub's `OutputBatch` handler).

An output is accepted only from the instance its request's current attempt runs on (a
prefill instance's only while the attempt is in its prefill): a straggler of an earlier
attempt, or of an aborted request, is dropped. The features see each accepted output
(`Feature.output`), then it is detokenized and checked for stop strings
(`OutputProcessor`), renamed to the client's request id, and queued for `generate`. The
last one ends the attempt: the features see it (`Feature.finished`), and the hub releases
what the instances hold for it.

Single-threaded: the controller's event loop; a batch yields the loop every 2 ms of work
(`LoopBudget`), so a large batch delays no other request's stream.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import msgspec

from pdserve.cluster.hub import Feature, Hub
from pdserve.cluster.instance import Instance
from pdserve.cluster.table import Phase, Record
from pdserve.cluster.transfer_policy import transfer_policy
from pdserve.config import Role
from pdserve.predictor.confusion import PredictionCounters
from pdserve.protocol.core import EngineOutput, OutputBatch
from pdserve.text.output_processor import LoopBudget, OutputProcessor


class OutputRelay:
    def __init__(
        self, hub: Hub, features: Sequence[Feature], predictions: PredictionCounters
    ) -> None:
        self.hub = hub
        self.features = features
        self.predictions = predictions  # the length head's accuracy, by finished request
        self.transfer = transfer_policy(hub.engine.transfer.mode)
        self.processor: OutputProcessor | None = None  # once the tokenizer is loaded
        self._budget = LoopBudget()

    async def on_outputs(self, inst: Instance, msg: OutputBatch) -> None:
        self._budget.reset()
        for out in msg.outputs:
            self._accept(inst, out)
            await self._budget.checkpoint()

    def _accept(self, inst: Instance, out: EngineOutput) -> None:
        rec = self.hub.table.get(out.request_id)
        if rec is None or not rec.holds(inst):
            return
        from_prefill = inst is rec.prefill and inst.role is Role.PREFILL
        if from_prefill and rec.phase is not Phase.PREFILL:
            return
        if out.prediction is not None and rec.prediction is None:
            rec.prediction = out.prediction
        if rec.times.first_token_seen is None:
            rec.times.first_token_seen = time.monotonic()
        for feature in self.features:
            feature.output(rec, inst, out)
        if rec.cached_tokens is None:  # the instance that ran the prefill: its own count
            rec.cached_tokens = out.num_cached_tokens
        self._forward(rec, inst, out)

    def _forward(self, rec: Record, inst: Instance, out: EngineOutput) -> None:
        assert self.processor is not None
        if out.request_id != rec.request_id or out.num_cached_tokens != rec.cached_tokens:
            # a retry's key (the client knows the id); the prefill instance's cache count
            out = msgspec.structs.replace(
                out, request_id=rec.request_id, num_cached_tokens=rec.cached_tokens or 0
            )
        rec.streamed.extend(t.token_id for t in out.new_tokens)
        result, stop_string = self.processor.process(out)
        if result is None:
            return
        if result.finished:
            rec.times.finished = time.monotonic()
            reason = result.finish_reason or "stop"
            self.predictions.observe(rec.prediction, len(rec.streamed), reason)
            if self.hub.config.disaggregated:
                metrics = rec.times.handoff_metrics(pulled=not self.transfer.push)
                result = dataclasses.replace(result, metrics=metrics)
            for feature in self.features:
                feature.finished(rec, inst, clean=stop_string is None)
            self.hub.release(rec, abort=stop_string is not None)
        rec.queue.put_nowait(result)
