"""Token ids -> text for each request: incremental detokenization and stop strings.

Runs beside the core (same process for `Engine`/`LLM`; the HTTP process later).
When a stop string appears, the processor reports it so the caller can end the
request in the core (`EngineCore.finish_request`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.core import CoreOutput
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.outputs import RequestMetrics, RequestOutput, TokenLogprob
from pdserve.engine.request import Request, RequestStatus
from pdserve.model.tokenizer import Tokenizer


@dataclass
class _State:
    detok: IncrementalDetokenizer
    logprobs: list[TokenLogprob] | None
    token_ids: list[int] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _State] = {}

    def add(self, req: Request) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.params)
        self._states[req.request_id] = _State(
            detok, [] if req.params.logprobs is not None else None
        )

    def process(self, out: CoreOutput) -> tuple[RequestOutput, str | None]:
        """Returns the request's output and, if a stop string ended it, that string.

        A returned stop string means the caller must finish the request in the core.
        A token that stopped the request in the core (EOS, a stop token id) is kept in
        `token_ids` but not rendered into the text, as OpenAI servers do.
        """
        req = out.request
        st = self._states[req.request_id]
        new_ids = [t.token_id for t in out.new_tokens]
        st.token_ids.extend(new_ids)
        if st.logprobs is not None:
            st.logprobs.extend(
                TokenLogprob(t.token_id, t.logprob, t.top_logprobs)
                for t in out.new_tokens
                if t.logprob is not None
            )
        to_render = new_ids[:-1] if out.stopped_by_token else new_ids
        delta = "".join(st.detok.add_token(t) for t in to_render if not st.detok.stopped)
        if out.status.finished and not st.detok.stopped:
            delta += st.detok.finish()  # releases held-back text; may still complete a stop
        stop_string = st.detok.stop_reason
        status = RequestStatus.FINISHED_STOPPED if stop_string is not None else out.status
        result = self._output(req, st, delta, new_ids, status, stop_string)
        if status.finished:
            del self._states[req.request_id]
        return result, (stop_string if not out.status.finished else None)

    def aborted(self, req: Request) -> RequestOutput:
        st = self._states.pop(req.request_id)
        return self._output(req, st, "", [], RequestStatus.FINISHED_ABORTED, None)

    def _output(
        self,
        req: Request,
        st: _State,
        delta: str,
        new_ids: list[int],
        status: RequestStatus,
        stop_string: str | None,
    ) -> RequestOutput:
        finished = status.finished
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            text=st.detok.output_text,
            token_ids=list(st.token_ids),
            delta_text=delta,
            delta_token_ids=new_ids,
            finished=finished,
            finish_reason=status.value if finished else None,
            stop_reason=stop_string if stop_string is not None else req.stop_reason,
            logprobs=list(st.logprobs) if st.logprobs is not None else None,
            num_cached_tokens=req.num_cached_prompt_tokens,
            metrics=_metrics(req) if finished else None,
        )


def _metrics(req: Request) -> RequestMetrics:
    t = req.times
    end = t.finished

    def span(a: float | None, b: float | None) -> float | None:
        return b - a if a is not None and b is not None else None

    return RequestMetrics(
        queue_time=span(t.arrival, t.first_scheduled),
        prefill_time=span(t.first_scheduled, t.first_token),
        decode_time=span(t.first_token, end),
        ttft=span(t.arrival, t.first_token),
        e2e=span(t.arrival, end),
        num_preemptions=req.num_preemptions,
    )
