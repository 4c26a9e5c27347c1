"""Load that runs beside a test's checks, and what /debug/cluster says of the elastic
cluster (tests/test_watcher.py, tests/test_replan_policy.py)."""

from __future__ import annotations

import threading
import time

import httpx

from helpers.server import Server, cluster


def elastic(server: Server) -> dict:
    return dict(cluster(server)["controller"]["elastic"])


def roles(server: Server) -> dict[str, str]:
    return {r["name"]: r["role"] for r in cluster(server)["instances"]}


class Load:
    """`clients` threads sending `body` one after another until the block ends; every
    answer must be a 200 (checked when the block ends)."""

    def __init__(self, server: Server, body: dict, clients: int) -> None:
        self.url = server.url + "/v1/completions"
        self.body = body
        self.done = threading.Event()
        self.statuses: list[int] = []
        self.threads = [threading.Thread(target=self._run) for _ in range(clients)]

    def _run(self) -> None:
        while not self.done.is_set():
            with httpx.stream("POST", self.url, json=self.body, timeout=120) as r:
                for _ in r.iter_bytes():
                    pass
                self.statuses.append(r.status_code)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        for t in self.threads:
            t.join(120)
        assert self.statuses and set(self.statuses) == {200}, self.statuses


class Paced:
    """A request of `body` every `1 / rate` seconds (each on its own thread: an open
    loop, the rate whatever the answers take) until the block ends; every answer must
    be a 200 (checked when the block ends, after each request sent has been answered)."""

    def __init__(self, server: Server, body: dict, rate: float) -> None:
        self.url = server.url + "/v1/completions"
        self.body = body
        self.gap = 1.0 / rate
        self.done = threading.Event()
        self.statuses: list[int] = []
        self.sent: list[threading.Thread] = []
        self.pacer = threading.Thread(target=self._pace)

    def _pace(self) -> None:
        next_at = time.monotonic()
        while not self.done.is_set():
            t = threading.Thread(target=self._one)
            t.start()
            self.sent.append(t)
            next_at += self.gap
            self.done.wait(max(0.0, next_at - time.monotonic()))

    def _one(self) -> None:
        r = httpx.post(self.url, json=self.body, timeout=120)
        self.statuses.append(r.status_code)

    def __enter__(self) -> Paced:
        self.pacer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.pacer.join(10)
        for t in self.sent:
            t.join(120)
        assert self.statuses and set(self.statuses) == {200}, self.statuses
