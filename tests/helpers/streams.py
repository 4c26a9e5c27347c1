"""Concurrent completions against a real server, each in its own thread with its own
HTTP connection, recorded as they arrive: the fault-tolerance tests kill an instance while
these run and then compare every text with an undisturbed run.

`Streams(url, bodies)` starts one request per body (streamed when the body says
`"stream": true`, else one JSON reply); `wait_tokens(k)` blocks until every streamed
request has received at least `k` text chunks (each carries at least one token) or ended
(non-streamed requests run alongside: a test waits on the streamed ones); `results()`
joins them (bounded) and returns one `Outcome` per body.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Outcome:
    status: int = 0
    text: str = ""
    chunks: int = 0  # streamed: text chunks received
    finish_reason: str | None = None
    usage: dict | None = None
    error: dict | None = None  # an error body, or an error event in the stream
    cancelled: bool = False  # the client went away (`Streams.disconnect`)
    arrivals: list[float] = field(default_factory=list)  # monotonic, per chunk
    timings: dict | None = None  # the reply's (or last event's) `pdserve_timings`


class Streams:
    def __init__(
        self, url: str, bodies: list[dict], timeout: float = 300.0, stagger_s: float = 0.0
    ) -> None:
        """`stagger_s`: request i is sent i * stagger_s seconds after the first."""
        self.url = url + "/v1/completions"
        self.outcomes = [Outcome() for _ in bodies]
        self.timeout = timeout
        self._threads = [
            threading.Thread(target=self._run, args=(b, o, i * stagger_s), daemon=True)
            for i, (b, o) in enumerate(zip(bodies, self.outcomes, strict=True))
        ]
        self._streamed = [bool(b.get("stream")) for b in bodies]
        for t in self._threads:
            t.start()

    def _run(self, body: dict, out: Outcome, delay_s: float) -> None:
        time.sleep(delay_s)
        try:
            if body.get("stream"):
                self._stream(body, out)
            else:
                r = httpx.post(self.url, json=body, timeout=self.timeout)
                out.status = r.status_code
                reply = r.json()
                if r.status_code == 200:
                    choice = reply["choices"][0]
                    out.text, out.finish_reason = choice["text"], choice["finish_reason"]
                    out.usage, out.timings = reply["usage"], reply.get("pdserve_timings")
                else:
                    out.error = reply
        except Exception as e:  # a broken connection is an outcome the test asserts on
            out.error = {"exception": repr(e)}

    def _stream(self, body: dict, out: Outcome) -> None:
        body = {**body, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", self.url, json=body, timeout=self.timeout) as r:
            out.status = r.status_code
            if r.status_code != 200:
                r.read()
                out.error = r.json()
                return
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if out.cancelled:
                    return  # leaving the block closes the connection: the client is gone
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    out.error = event
                    continue
                if event.get("usage"):
                    out.usage = event["usage"]
                if event.get("pdserve_timings"):
                    out.timings = event["pdserve_timings"]
                for choice in event["choices"]:
                    if choice["text"]:
                        out.text += choice["text"]
                        out.chunks += 1
                        out.arrivals.append(time.monotonic())
                    if choice.get("finish_reason"):
                        out.finish_reason = choice["finish_reason"]

    def disconnect(self) -> None:
        """Every streamed request still running drops its connection at its next event."""
        for out, streamed in zip(self.outcomes, self._streamed, strict=True):
            if streamed:
                out.cancelled = True

    def alive(self) -> list[bool]:
        return [t.is_alive() for t in self._threads]

    def wait_tokens(self, k: int, timeout: float = 300.0) -> None:
        """Until every request still running has streamed >= k chunks (bounded)."""
        deadline = time.monotonic() + timeout
        while True:
            pending = [
                o
                for o, t, streamed in zip(self.outcomes, self._threads, self._streamed, strict=True)
                if streamed and t.is_alive() and o.chunks < k
            ]
            if not pending:
                return
            assert time.monotonic() < deadline, f"{len(pending)} streams below {k} tokens"
            time.sleep(0.02)

    def wait_first(self, k: int, timeout: float = 300.0) -> None:
        """Until some request has streamed >= k chunks (bounded)."""
        deadline = time.monotonic() + timeout
        while max(o.chunks for o in self.outcomes) < k:
            assert time.monotonic() < deadline, f"no stream reached {k} tokens"
            time.sleep(0.02)

    def results(self, timeout: float | None = None) -> list[Outcome]:
        deadline = time.monotonic() + (timeout or self.timeout)
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = sum(t.is_alive() for t in self._threads)
        assert not stuck, f"{stuck} requests did not end (hung)"
        return self.outcomes
