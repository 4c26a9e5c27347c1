"""How a request enters an engine core, when it stops and what it says, as plain
functions of the request: built from a prompt (fresh or migrated, validated against the
model) or from a prefill instance's hand-off, its stop check after each sampled token,
and the output that carries the token to the front end."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.request import (
    Request,
    RequestStatus,
    generator_from_state,
    resumed_generator,
)
from pdserve.engine.sampler import SampledToken
from pdserve.errors import InvalidRequestError
from pdserve.protocol.core import EngineOutput, NewToken
from pdserve.protocol.handoff import AddPrefilled
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.protocol.validation import check_request


def new_request(
    request_id: str,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    arrival: float | None,
    output_token_ids: Sequence[int],
    vocab_size: int,
    max_model_len: int,
) -> Request:
    """A validated request (`EngineCore.add_request` says what each argument means).
    Raises InvalidRequestError naming the field and the limit."""
    prompt = list(prompt_token_ids)
    check_request(prompt, params, vocab_size, max_model_len)
    outputs = list(output_token_ids)
    if len(outputs) >= params.max_tokens:
        raise InvalidRequestError(
            f"a migrated request carries {len(outputs)} generated tokens, which leaves "
            f"nothing to generate under max_tokens={params.max_tokens}",
            "output_token_ids",
        )
    gen = resumed_generator(params, len(outputs))
    req = Request(request_id, prompt, params, gen, output_token_ids=outputs)
    if arrival is not None:
        req.times.arrival = arrival
    if outputs:
        req.times.first_token = req.times.arrival  # not a first token: no hand-off
    return req


def prefilled_request(msg: AddPrefilled, vocab_size: int, max_model_len: int) -> Request:
    """The request an AddPrefilled describes, its generator where the prefill left it.
    Raises InvalidRequestError as `new_request` does."""
    check_request(list(msg.prompt_token_ids), msg.params, vocab_size, max_model_len)
    gen = generator_from_state(msg.generator_state)
    req = Request(msg.request_id, list(msg.prompt_token_ids), msg.params, gen)
    req.output_token_ids = list(msg.output_token_ids)
    req.times.arrival = msg.arrival
    req.return_to = msg.return_to
    req.prediction = msg.prediction
    return req


def stop_status(
    req: Request, token: int, eos_token_ids: frozenset[int], max_model_len: int
) -> RequestStatus:
    """RUNNING, or why `req` stops after `token` (just appended): EOS or a stop token
    once min_tokens are out (FINISHED_STOPPED; `req.stop_reason` names a stop token),
    max_tokens or the context limit (FINISHED_LENGTH). A grammar's EOS ends its request
    even with ignore_eos: its output is complete, and nothing but EOS may follow."""
    p = req.params
    n = len(req.output_token_ids)
    if n > p.min_tokens or n == p.max_tokens:
        if (not p.ignore_eos or p.grammar is not None) and token in eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in p.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if n >= p.max_tokens or req.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return RequestStatus.RUNNING


def token_output(
    req: Request, tok: SampledToken, status: RequestStatus, first: bool
) -> EngineOutput:
    """The output that carries `tok` (just appended; `status` from `stop_status`). The
    first token's also carries the request's predicted output length, if it has one; a
    finished request's, why it finished and its metrics."""
    new = (NewToken(tok.token_id, tok.logprob, tok.top_logprobs),)
    prediction = req.prediction if first else None  # said once, with the first token
    if status is RequestStatus.RUNNING:
        return EngineOutput(
            req.request_id,
            new,
            num_cached_tokens=req.num_cached_prompt_tokens,
            prediction=prediction,
        )
    return EngineOutput(
        req.request_id,
        new,
        finish_reason=status.value,
        stop_reason=req.stop_reason,
        stopped_by_token=status is RequestStatus.FINISHED_STOPPED,
        num_cached_tokens=req.num_cached_prompt_tokens,
        metrics=req.times.metrics(req.num_preemptions),
        prediction=prediction,
    )
