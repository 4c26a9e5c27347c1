"""Token ids -> text for each request: incremental detokenization and stop strings.

Runs in the front end: beside the core in `Engine`/`LLM`, in the HTTP process in
the serving front end (`Cluster`). It consumes `EngineOutput` messages only. When a
stop string appears, the processor reports it so the caller can end the request in
the core (an abort: the text is already final); outputs for a request it already
finished (the core may have run one more step meanwhile) are dropped.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from pdserve.protocol.core import EngineOutput
from pdserve.protocol.prediction import LengthPrediction
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.text.detokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.text.outputs import RequestOutput, TokenLogprob


class LoopBudget:
    """Cooperative time slicing for per-token work on an event loop.

    A front end turns a batch of core outputs into text on the event loop that also
    serves `/health` and every other stream; a batch of thousands of sequences would
    hold it for as long as it takes. `checkpoint()` after each output yields the loop
    once `budget_s` of work has run since the last yield, so no other task waits much
    longer than that.
    """

    def __init__(self, budget_s: float = 0.002) -> None:
        self.budget_s = budget_s
        self._since = time.perf_counter()

    async def checkpoint(self) -> None:
        now = time.perf_counter()
        if now - self._since >= self.budget_s:
            await asyncio.sleep(0)
            self._since = time.perf_counter()

    def reset(self) -> None:
        """Start a new slice (call when the loop was just yielded anyway)."""
        self._since = time.perf_counter()


@dataclass
class _State:
    prompt_token_ids: list[int]
    detok: IncrementalDetokenizer
    logprobs: list[TokenLogprob] | None
    token_ids: list[int] = field(default_factory=list)
    prediction: LengthPrediction | None = None  # as the first output said


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _State] = {}

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
        logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self._states[request_id] = _State(prompt_token_ids, detok, logprobs)

    def discard(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def process(self, out: EngineOutput) -> tuple[RequestOutput | None, str | None]:
        """Returns the request's output and, if a stop string ended it, that string.

        A returned stop string means the caller must finish the request in the core.
        A token that stopped the request in the core (EOS, a stop token id) is kept in
        `token_ids` but not rendered into the text, as OpenAI servers do. An output of
        several tokens (a decode burst) whose stop string ends before its last token
        keeps the tokens up to the one that completed it, as one token an output would.
        Returns (None, None) for a request that is no longer tracked.
        """
        st = self._states.get(out.request_id)
        if st is None:
            return None, None
        new = out.new_tokens
        to_render = new[:-1] if out.stopped_by_token else new
        parts = []
        for i, t in enumerate(to_render):
            parts.append(st.detok.add_token(t.token_id))
            if st.detok.stopped:  # a stop string: the tokens after it are not output
                new = new[: i + 1]
                break
        delta = "".join(parts)
        new_ids = [t.token_id for t in new]
        st.token_ids.extend(new_ids)
        if out.prediction is not None:
            st.prediction = out.prediction
        if st.logprobs is not None:
            st.logprobs.extend(
                TokenLogprob(t.token_id, t.logprob, t.top_logprobs)
                for t in new
                if t.logprob is not None
            )
        if out.finish_reason is not None and not st.detok.stopped:
            delta += st.detok.finish()  # releases held-back text; may still complete a stop
        stop_string = st.detok.stop_reason
        finish_reason = "stop" if stop_string is not None else out.finish_reason
        stop_reason = stop_string if stop_string is not None else out.stop_reason
        result = RequestOutput(
            request_id=out.request_id,
            prompt_token_ids=st.prompt_token_ids,
            text=st.detok.output_text,
            token_ids=list(st.token_ids),
            delta_text=delta,
            delta_token_ids=new_ids,
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            stop_reason=stop_reason if finish_reason is not None else None,
            logprobs=list(st.logprobs) if st.logprobs is not None else None,
            num_cached_tokens=out.num_cached_tokens,
            metrics=out.metrics,
            prediction=st.prediction,
        )
        if result.finished:
            del self._states[out.request_id]
        return result, (stop_string if out.finish_reason is None else None)
