"""A stand-in OpenAI streaming server that answers instantly, or fails on purpose.

It is the yardstick for the load generator (a server that costs next to nothing, so
the measured ceiling is the client's) and the fault injector for the tests. Raw
asyncio streams, no framework: HTTP/1.1 keep-alive, chunked SSE, one write per
response when `token_delay_s` is 0.

Every final chunk carries `pdserve_timings` with zero phases plus `stub_sent_at`, the
`time.perf_counter()` at which the response was written. On Linux that clock is
CLOCK_MONOTONIC, shared by all processes, so a client on the same machine can
subtract it from its own receive timestamp (see `pdserve bench overhead`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

Fault = Literal["none", "status", "midstream", "drop", "hang"]
FAULTS: tuple[str, ...] = ("none", "status", "midstream", "drop", "hang")


@dataclass(frozen=True)
class StubConfig:
    """What the stub answers."""

    tokens: int = 16
    """Tokens per response when the request sets no max_tokens."""
    token_delay_s: float = 0.0
    """Pause between tokens; 0 writes the whole response at once."""
    fault: Fault = "none"
    """none; status: HTTP 500; midstream: an error event after `fault_after` tokens;
    drop: the connection closes after `fault_after` tokens; hang: no answer at all."""
    fault_after: int = 1
    fault_every: int = 1
    """Every n-th request faults (1: all of them)."""
    model: str = "stub"
    num_instances: int | None = None
    """Reported in the /v1/models card when set (per-instance goodput)."""
    prompt_tokens: int = 0
    """usage.prompt_tokens of every response."""
    cached_tokens: int | None = None
    """usage.prompt_tokens_details.cached_tokens of every response; None: no details."""


class StubServer:
    """The server on a loopback port; `start()` in the running loop, or `in_thread()`."""

    def __init__(self, config: StubConfig, host: str = "127.0.0.1", port: int = 0) -> None:
        self.config = config
        self.host, self.port = host, port
        self.requests = 0
        self.session_ids: list[str | None] = []
        """The X-Session-Id header of every generation request, in arrival order."""
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._connection, self.host, self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    break
                keep_open = await self._answer(*request, writer)
                if not keep_open:
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def _answer(
        self, method: str, path: str, head: dict[str, str], body: bytes, w: asyncio.StreamWriter
    ) -> bool:
        if method == "GET" and path == "/v1/models":
            card: dict[str, Any] = {"id": self.config.model, "object": "model"}
            if self.config.num_instances is not None:
                card["num_instances"] = self.config.num_instances
            await _send_json(w, 200, {"object": "list", "data": [card]})
            return True
        if method == "GET" and path == "/health":
            await _send_json(w, 200, {"status": "ok"})
            return True
        if method != "POST" or path not in ("/v1/completions", "/v1/chat/completions"):
            await _send_json(w, 404, _error(f"no route {method} {path}", 404))
            return True
        self.requests += 1
        self.session_ids.append(head.get("x-session-id"))
        fault = self.config.fault if self.requests % self.config.fault_every == 0 else "none"
        return await self._generate(json.loads(body), path.endswith("chat/completions"), fault, w)

    async def _generate(
        self, req: dict[str, Any], chat: bool, fault: str, w: asyncio.StreamWriter
    ) -> bool:
        n = int(req.get("max_tokens") or req.get("max_completion_tokens") or self.config.tokens)
        if fault == "hang":
            await asyncio.Event().wait()  # until the client gives up and the task is cancelled
        if fault == "status":
            await _send_json(w, 500, _error("stub: injected failure", 500))
            return True
        if not req.get("stream"):
            await _send_json(w, 200, _full_response(n, chat, self._usage(n)))
            return True
        w.write(_SSE_HEAD)
        cut = self.config.fault_after if fault in ("midstream", "drop") else None
        events = _events(n, chat, cut, fault == "midstream", self._usage(n))
        if self.config.token_delay_s <= 0:
            w.write(b"".join(_chunk(e) for e in events))
        else:
            for e in events:
                w.write(_chunk(e))
                await w.drain()
                await asyncio.sleep(self.config.token_delay_s)
        if fault == "drop":
            await w.drain()
            return False  # closed without the terminating chunk
        w.write(b"0\r\n\r\n")
        await w.drain()
        return True

    def _usage(self, n: int) -> dict[str, Any]:
        c = self.config
        usage: dict[str, Any] = {
            "prompt_tokens": c.prompt_tokens,
            "completion_tokens": n,
            "total_tokens": c.prompt_tokens + n,
        }
        if c.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": c.cached_tokens}
        return usage

    def in_thread(self) -> contextlib.AbstractContextManager[StubServer]:
        """Run on a daemon thread with its own loop (for tests); a context manager."""
        return _threaded(self)


@contextlib.contextmanager
def _threaded(server: StubServer) -> Iterator[StubServer]:
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def main() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=main, name="stub-server", daemon=True)
    thread.start()
    ready.wait(10)
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"transfer-encoding: chunked\r\ncache-control: no-cache\r\n\r\n"
)


def _events(
    n: int, chat: bool, cut: int | None, error_event: bool, usage: dict[str, Any]
) -> list[bytes]:
    """The SSE events of one response; cut after `cut` tokens for a fault."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": "stub", "object": kind, "created": 0, "model": "stub"}
    out: list[bytes] = []
    if chat:
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        out.append(_data({**head, "choices": [role]}))
    for i in range(n if cut is None else min(cut, n)):
        last = i == n - 1
        choice = _choice(" tok", chat, "length" if last else None)
        body: dict[str, Any] = {**head, "choices": [choice]}
        if last:
            zero = {"queue": 0.0, "prefill": 0.0, "decode": 0.0, "ttft": 0.0, "e2e": 0.0}
            body["pdserve_timings"] = {**zero, "stub_sent_at": time.perf_counter()}
        out.append(_data(body))
    if cut is not None:
        if error_event:
            out.append(_data(_error("stub: injected mid-stream error", 500)))
            out.append(b"data: [DONE]\n\n")
        return out
    out.append(_data({**head, "choices": [], "usage": usage}))
    out.append(b"data: [DONE]\n\n")
    return out


def _choice(text: str, chat: bool, finish: str | None) -> dict[str, Any]:
    if chat:
        return {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    return {"index": 0, "text": text, "finish_reason": finish}


def _full_response(n: int, chat: bool, usage: dict[str, Any]) -> dict[str, Any]:
    text = " tok" * n
    choice = (
        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
        if chat
        else {"index": 0, "text": text, "finish_reason": "length"}
    )
    return {"id": "stub", "object": "stub", "choices": [choice], "usage": usage}


def _error(message: str, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": code}}


def _data(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _send_json(w: asyncio.StreamWriter, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    reason = {200: "OK", 404: "Not Found", 500: "Internal Server Error"}.get(status, "Error")
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    w.write(head.encode() + body)
    await w.drain()


async def _read_request(
    reader: asyncio.StreamReader,
) -> tuple[str, str, dict[str, str], bytes] | None:
    """(method, path, headers by lowercase name, body) of the next request on the
    connection, None at its end."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = raw.decode("latin-1").split("\r\n")
    method, path = lines[0].split(" ")[:2]
    head: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        head[name.strip().lower()] = value.strip()
    length = int(head.get("content-length") or 0)
    body = await reader.readexactly(length) if length else b""
    return method, path, head, body


def add_stub_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--tokens", type=int, default=16, help="tokens when max_tokens is unset")
    p.add_argument("--token-delay", type=float, default=0.0, help="seconds between tokens")
    p.add_argument("--fault", choices=FAULTS, default="none")
    p.add_argument("--fault-after", type=int, default=1, help="tokens before a mid-stream fault")
    p.add_argument("--fault-every", type=int, default=1, help="every n-th request faults")
    p.add_argument("--num-instances", type=int, default=None)
    p.add_argument("--prompt-tokens", type=int, default=0, help="usage.prompt_tokens reported")
    p.add_argument(
        "--cached-tokens", type=int, default=None, help="prompt_tokens_details.cached_tokens"
    )
    p.set_defaults(func=_serve_cli)


def _serve_cli(args: argparse.Namespace) -> int:
    config = StubConfig(
        tokens=args.tokens,
        token_delay_s=args.token_delay,
        fault=args.fault,
        fault_after=args.fault_after,
        fault_every=max(1, args.fault_every),
        num_instances=args.num_instances,
        prompt_tokens=args.prompt_tokens,
        cached_tokens=args.cached_tokens,
    )
    asyncio.run(_serve_forever(StubServer(config, args.host, args.port)))
    return 0


async def _serve_forever(server: StubServer) -> None:
    await server.start()
    print(f"stub server on {server.url}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop()
