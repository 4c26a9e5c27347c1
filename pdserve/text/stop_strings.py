"""Stop strings as one Aho-Corasick automaton: matching costs O(1) per output character
(amortized), whatever the number and length of the stop strings.

The detokenizer feeds the automaton every character of the output once, in order, and
keeps only the current state (an int). After each character the state tells:

* `completed(state)`: the longest stop string that ends at this character, if any. The
  first character at which any stop string is complete ends the output; among the stop
  strings ending there, the longest (the one starting earliest) is the match. So the
  match does not depend on how the text was split into tokens.
* `held(state)`: the length of the longest end of the text seen so far that is a proper
  beginning of some stop string: text the detokenizer must hold back while streaming,
  because the next characters may complete a stop string.

A `StopMatcher` is immutable after construction and shared by every request with the
same stop strings (`matcher_for`).
"""

from __future__ import annotations

import functools
from collections import deque


class StopMatcher:
    """The automaton over `stops` (non-empty strings); state 0 is the empty text."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._goto: list[dict[str, int]] = [{}]
        self._depth = [0]
        for stop in stops:
            self._insert(stop)
        n = len(self._goto)
        self._fail = [0] * n
        self._completed: list[str | None] = [None] * n
        self._held = [0] * n
        for stop in stops:
            self._mark(stop)
        self._link()

    def _insert(self, stop: str) -> None:
        state = 0
        for ch in stop:
            nxt = self._goto[state].get(ch)
            if nxt is None:
                nxt = len(self._goto)
                self._goto[state][ch] = nxt
                self._goto.append({})
                self._depth.append(self._depth[state] + 1)
            state = nxt

    def _mark(self, stop: str) -> None:
        state = 0
        for ch in stop:
            state = self._goto[state][ch]
        self._completed[state] = stop

    def _link(self) -> None:
        """Failure links breadth-first; inherit completed stops and hold lengths."""
        queue: deque[int] = deque(self._goto[0].values())
        while queue:
            state = queue.popleft()
            fail = self._fail[state]
            if self._completed[state] is None:
                self._completed[state] = self._completed[fail]
            self._held[state] = self._depth[state] if self._goto[state] else self._held[fail]
            for ch, child in self._goto[state].items():
                self._fail[child] = self._next(fail, ch) if state else 0
                queue.append(child)

    def _next(self, state: int, ch: str) -> int:
        while True:
            nxt = self._goto[state].get(ch)
            if nxt is not None:
                return nxt
            if state == 0:
                return 0
            state = self._fail[state]

    def step(self, state: int, ch: str) -> int:
        """The state after one more character."""
        return self._next(state, ch)

    def completed(self, state: int) -> str | None:
        """The longest stop string ending at the last character, or None."""
        return self._completed[state]

    def held(self, state: int) -> int:
        """Characters at the end of the text that may still begin a stop string."""
        return self._held[state]


@functools.lru_cache(maxsize=64)
def matcher_for(stops: tuple[str, ...]) -> StopMatcher:
    """The automaton for these stop strings (the n choices of a request share one)."""
    return StopMatcher(stops)
