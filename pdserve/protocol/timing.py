"""`RequestTimes`: the one record of a request's timestamps, and its latency breakdowns
(`RequestMetrics`, what a finished request's output reports).

Every time is `time.monotonic()`, which is system-wide on Linux, so times taken in the
front end and in instance processes on the same machine compare directly. An engine core
fills the first four for each request it runs (`Request.times`); the front end keeps a
record per request too, filled from its own clock and from the hand-off messages
(`KVHandedOff`, `KVReceived`) in disaggregated serving.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestMetrics:
    """Seconds, measured in the engine (monotonic clock)."""

    queue_time: float | None  # arrival -> first scheduled
    prefill_time: float | None  # first scheduled -> first token
    decode_time: float | None  # first token -> finished
    ttft: float | None  # arrival -> first token
    e2e: float | None  # arrival -> finished
    num_preemptions: int = 0
    # Disaggregated serving only (DistServe §6.3 breakdown); None when colocated.
    transfer_time: float | None = None  # the KV move itself
    decode_queue_time: float | None = None  # prefill done -> decode side runs it, minus transfer


@dataclass
class RequestTimes:
    arrival: float  # the request reached the front end
    first_scheduled: float | None = None  # a step first computed part of its prompt
    first_token: float | None = None  # its first token was sampled
    finished: float | None = None
    # Disaggregated serving, kept by the front end:
    first_token_seen: float | None = None  # the first token reached the front end
    handed_off: float | None = None  # the prefill side said the KV is ready (KVHandedOff)
    decode_queued: float | None = None  # the decode instance received the request
    transfer_start: float | None = None  # the KV move (pulled) or commit (pushed)
    transfer_end: float | None = None

    def metrics(self, num_preemptions: int = 0) -> RequestMetrics:
        """One instance ran the request: queue, prefill, decode as that engine saw them."""
        return RequestMetrics(
            queue_time=_span(self.arrival, self.first_scheduled),
            prefill_time=_span(self.first_scheduled, self.first_token),
            decode_time=_span(self.first_token, self.finished),
            ttft=_span(self.arrival, self.first_token),
            e2e=_span(self.arrival, self.finished),
            num_preemptions=num_preemptions,
        )

    def handoff_metrics(self, pulled: bool) -> RequestMetrics:
        """DistServe §6.3: prefill queueing, prefill, transfer, decode queueing, decode.
        Clocks of two processes meet here, so every span is clamped at zero. Pushed KV
        was mostly written during the prefill: its transfer is what was left to move
        after the first token."""
        if pulled:
            transfer = _clamped(self.transfer_start, self.transfer_end)
            decode_queue = _clamped(self.decode_queued, self.transfer_start)
        else:
            transfer = _clamped(self.first_token, self.handed_off)
            decode_queue = _clamped(self.handed_off, self.transfer_end)
        return RequestMetrics(
            queue_time=_clamped(self.arrival, self.first_scheduled),
            prefill_time=_clamped(self.first_scheduled, self.first_token),
            decode_time=_clamped(self.transfer_end, self.finished),
            ttft=_clamped(self.arrival, self.first_token_seen),
            e2e=_clamped(self.arrival, self.finished),
            transfer_time=transfer,
            decode_queue_time=decode_queue,
        )


def _span(a: float | None, b: float | None) -> float | None:
    return b - a if a is not None and b is not None else None


def _clamped(a: float | None, b: float | None) -> float | None:
    span = _span(a, b)
    return None if span is None else max(0.0, span)
