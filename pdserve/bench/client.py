"""The HTTP side: request bodies, one streamed request timed into a record, the model card.

aiohttp, chosen by measurement (docs/bench.md): 2,200-5,700 streamed requests/s on
one core of this machine against the stub, httpx 350-400. Timestamps are
`time.perf_counter()`, taken as each SSE line is read: lines that arrive in one
socket read share (almost) one timestamp, which is what the client really saw.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from pdserve.bench.config import RequestOptions, Target
from pdserve.bench.records import RequestRecord


def request_body(
    target: Target,
    model: str | None,
    prompt: str | list[dict[str, Any]],
    max_tokens: int,
    options: RequestOptions,
) -> bytes:
    """The JSON body: a completions prompt, or chat messages; always streamed, usage in
    the last chunk; ignore_eos so that max_tokens fixes the length."""
    body: dict[str, Any] = {
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": options.temperature,
    }
    if model is not None:
        body["model"] = model
    if target.endpoint == "/v1/chat/completions":
        body["messages"] = prompt
        body["max_completion_tokens"] = max_tokens
    else:
        body["prompt"] = prompt
        body["max_tokens"] = max_tokens
    if options.ignore_eos:
        body["ignore_eos"] = True
    body.update(options.extra_body)
    return json.dumps(body).encode()


def headers(target: Target, session_id: str | None = None) -> dict[str, str]:
    """JSON, the bearer key, and the request's session as `X-Session-Id` (what pdserve's
    session routing reads; other servers ignore an unknown header)."""
    h = {"Content-Type": "application/json"}
    if target.api_key:
        h["Authorization"] = f"Bearer {target.api_key}"
    if session_id is not None:
        h["X-Session-Id"] = session_id
    return h


def new_session(max_concurrency: int | None) -> aiohttp.ClientSession:
    """Keep-alive connections, as many as requests in flight (none refused client-side).
    No session-wide time limit: each request has its own (`send`'s `timeout_s`,
    `--request-timeout`); aiohttp's default of 300 s in all would cut a long request
    short whatever the user asked for."""
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, enable_cleanup_closed=True)
    unlimited = aiohttp.ClientTimeout(total=None)
    return aiohttp.ClientSession(connector=connector, trust_env=False, timeout=unlimited)


async def send(
    session: aiohttp.ClientSession,
    target: Target,
    body: bytes,
    rec: RequestRecord,
    t0: float,
    timeout_s: float,
    session_id: str | None = None,
) -> str:
    """Send one streamed request and fill `rec`; returns the generated text. Never
    raises for the server's faults: they end up in `rec.error`."""
    parts: list[str] = []
    start = time.perf_counter()
    rec.sent_at = start - t0
    try:
        async with asyncio.timeout(timeout_s):
            await _stream(session, target, headers(target, session_id), body, rec, start, parts)
    except TimeoutError:
        rec.fail(
            f"timeout: no complete response within {timeout_s:g} s", time.perf_counter() - start
        )
    except aiohttp.ClientConnectorError as e:
        rec.fail(f"connect: {e}", time.perf_counter() - start)
    except (aiohttp.ClientError, ConnectionError) as e:
        rec.fail(f"connection: {type(e).__name__}: {e}", time.perf_counter() - start)
    except _Refused as e:
        rec.fail(str(e), time.perf_counter() - start)
    except (ValueError, AttributeError, TypeError) as e:
        rec.fail(f"stream: malformed response: {e}", time.perf_counter() - start)
    return "".join(parts)


class _Refused(Exception):
    """The server answered with an error (status or an error event)."""


async def _stream(
    session: aiohttp.ClientSession,
    target: Target,
    head: dict[str, str],
    body: bytes,
    rec: RequestRecord,
    start: float,
    parts: list[str],
) -> None:
    async with session.post(target.url, data=body, headers=head) as resp:
        if resp.status != 200:
            raise _Refused(f"http {resp.status}: {_error_message(await resp.read())}")
        last = start
        chunks = 0
        async for line in resp.content:
            now = time.perf_counter()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                rec.e2e = now - start
                rec.success = True
                if rec.output_tokens == 0:
                    rec.output_tokens = chunks
                return
            text = _consume(json.loads(data), rec)
            if text:
                if rec.ttft is None:
                    rec.ttft = now - start
                else:
                    rec.itl.append(now - last)
                last = now
                chunks += 1
                parts.append(text)
    raise _Refused("stream: ended without [DONE]")


def _consume(chunk: dict[str, Any], rec: RequestRecord) -> str:
    """The chunk's generated text; usage and server timings go into the record."""
    if "error" in chunk:
        err = chunk["error"]
        message = err.get("message") if isinstance(err, dict) else err
        raise _Refused(f"stream: error event: {message}")
    usage = chunk.get("usage")
    if usage:
        rec.output_tokens = int(usage.get("completion_tokens") or 0)
        rec.server_prompt_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        rec.cached_tokens = int(cached) if isinstance(cached, int | float) else None
    timings = chunk.get("pdserve_timings")
    if timings:
        rec.server_timings = {k: float(v) for k, v in timings.items() if isinstance(v, int | float)}
    choices = chunk.get("choices")
    if not choices:
        return ""
    c = choices[0]
    delta = c.get("delta")
    text = delta.get("content") if delta is not None else c.get("text")
    return text or ""


def _error_message(raw: bytes) -> str:
    try:
        err = json.loads(raw).get("error")
        if isinstance(err, dict):
            return str(err.get("message"))
        return str(err)
    except (ValueError, AttributeError):
        return raw[:200].decode("utf-8", "replace")


async def model_card(session: aiohttp.ClientSession, target: Target) -> dict[str, Any] | None:
    """The first card of GET /v1/models, None when the server doesn't answer it."""
    url = target.base_url.rstrip("/") + "/v1/models"
    try:
        async with asyncio.timeout(10):
            async with session.get(url, headers=headers(target)) as resp:
                if resp.status != 200:
                    return None
                data = await resp.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, ConnectionError, ValueError):
        return None
    cards = data.get("data") if isinstance(data, dict) else None
    return cards[0] if isinstance(cards, list) and cards and isinstance(cards[0], dict) else None
