"""Structured outputs in the engine: each constrained request's grammar state, and the
mask of the tokens it allows at every token the request samples here.

A request carries its grammar as text (`SamplingParams.grammar`), never its state: the
state is rebuilt wherever the request samples, from its output so far. A fresh request
starts at the grammar's start; a decode instance's request (prefilled elsewhere, its
first token sampled there under the same grammar) and a migrated or replica-resumed
one consume the tokens they arrive with before their next mask. Rebuilding costs one
token's consumption per token carried (~10 us each), and nothing about a matcher's
internals has to cross a process or outlive its instance; preemption by swap or
recompute, prefix-cache hits and hand-offs leave the output, and so the state, as it is.

Timing: `begin_step` hands the step's sampling rows to one background thread, which
brings each matcher up to date with the tokens appended since and fills the rows'
bitmasks while the forward pass runs (llguidance drops the GIL); `token_masks` waits for
them just before sampling. No grammar is compiled on the step loop's thread: a
matcher's first compile runs in that thread too, and so does the build of llguidance's
tokenizer (~0.5-1 s, once per process, from the model's tokenizer file). That build may
hold the GIL (measured: sometimes ~1 s, sometimes never), so the first constrained
request on an instance can stall its batch once; it is not built at start, where it
stalled every instance's first stats answer past the front end's 80 ms deadline.

A matcher in its error state (a grammar that ran out of llguidance's fuel, a token it
does not accept), or one that could not be built, allows only the model's EOS ids: the
request ends with what it has ("stop").
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.numpy
import torch

from pdserve.engine.participant import Participant
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.grammar.compiler import Matchers

log = logging.getLogger(__name__)

# One row's work: request id, grammar text, tokens appended since its last mask.
_Row = tuple[str, str, list[int]]


class StructuredOutput(Participant):
    """The hooks: `begin_step` (masks start), `token_masks` (masks ready), and
    `request_ended` (state dropped). Matchers live in the mask thread only."""

    def __init__(
        self,
        build_tokenizer: Callable[[], llguidance.LLTokenizer],
        vocab: int,
        eos_token_ids: Sequence[int],
    ) -> None:
        self._matchers = Matchers(build_tokenizer)
        self._vocab = vocab
        self._eos = [t for t in eos_token_ids if t < vocab]  # a failed grammar's way out
        self._consumed: dict[str, int] = {}  # step loop's: tokens each matcher has seen
        self._states: dict[str, llguidance.LLMatcher] = {}  # the mask thread's
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pdserve-grammar")
        self._job: Future[dict[str, torch.Tensor]] | None = None
        self.num_masks = 0
        self.num_errors = 0

    def begin_step(self, seqs: Sequence[ScheduledSeq]) -> None:
        self._wait()  # a step that sampled nothing left its job
        rows: list[_Row] = []
        for s in seqs:
            req = s.request
            if req.params.grammar is None or not s.samples:
                continue
            seen = self._consumed.get(req.request_id, 0)
            rows.append((req.request_id, req.params.grammar, req.output_token_ids[seen:]))
            self._consumed[req.request_id] = len(req.output_token_ids)
        if rows:
            self._job = self._pool.submit(self._masks, rows)

    def token_masks(self, seqs: Sequence[ScheduledSeq]) -> Mapping[str, torch.Tensor]:
        return self._wait()

    def request_ended(self, req: Request, status: RequestStatus | None) -> None:
        if self._consumed.pop(req.request_id, None) is not None:
            self._pool.submit(self._states.pop, req.request_id, None)

    def stats(self) -> dict[str, int]:
        return {"grammar_masks": self.num_masks, "grammar_errors": self.num_errors}

    def check_integrity(self) -> None:
        assert self._job is None, "a mask job outlived its step"

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _wait(self) -> dict[str, torch.Tensor]:
        job, self._job = self._job, None
        return {} if job is None else job.result()

    def _masks(self, rows: list[_Row]) -> dict[str, torch.Tensor]:
        """(mask thread) Each row's matcher brought up to date, and its bitmask."""
        # llguidance's numpy helpers, not its torch ones: llguidance.torch applies
        # torch.compile at import, ~6 s of CPU in every process that loads the engine.
        bitmask = torch.from_numpy(llguidance.numpy.allocate_token_bitmask(len(rows), self._vocab))
        out: dict[str, torch.Tensor] = {}
        for i, (rid, grammar, new) in enumerate(rows):
            matcher = self._states.get(rid)
            try:
                if matcher is None:
                    matcher = self._states[rid] = self._matchers.new(grammar)
                if new:
                    matcher.consume_tokens(new)
                if matcher.is_error():
                    raise ValueError(matcher.get_error())
                llguidance.numpy.fill_next_token_bitmask(matcher, bitmask.numpy(), i)
            except Exception as e:  # a grammar or a tokenizer that fails: this request alone
                self.num_errors += 1
                log.warning("request %s: its grammar failed (%s); only EOS is allowed", rid, e)
                bitmask[i].zero_()
                for eos in self._eos:
                    bitmask[i, eos // 32] |= _bit(eos % 32)
            out[rid] = bitmask[i]
        self.num_masks += len(rows)
        return out


def _bit(i: int) -> int:
    """Bit i of an int32 word, as the signed value torch stores."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i


def engine_tokenizer(
    model: str | None, vocab: int, eos_token_ids: Sequence[int]
) -> Callable[[], llguidance.LLTokenizer]:
    """How the engine builds llguidance's tokenizer (~0.7 s, the GIL released): from the
    model's tokenizer file as text (`tokenizer_json`: an HF folder's, or a GGUF's entry in
    the tokenizer cache, which the front end writes before any instance starts), else from
    the model's tokenizer loaded whole (which holds the GIL for a while). Once per process
    and model: the engines of a process share it (it is read-only)."""
    return functools.partial(_model_tokenizer, model, vocab, tuple(eos_token_ids))


@functools.lru_cache(maxsize=4)
def _model_tokenizer(
    model: str | None, vocab: int, eos_token_ids: tuple[int, ...]
) -> llguidance.LLTokenizer:
    from pdserve.grammar.compiler import ll_tokenizer
    from pdserve.model.source import resolve_model
    from pdserve.model.tokenizer import Tokenizer, tokenizer_json

    path = resolve_model(model)
    file = tokenizer_json(path)
    if file is not None:
        eos = list(eos_token_ids) or None
        return llguidance.LLTokenizer(file.read_text(), n_vocab=vocab, eos_token=eos)
    return ll_tokenizer(Tokenizer.from_model_path(path).backend, vocab)
