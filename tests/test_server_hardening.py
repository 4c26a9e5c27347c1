"""`pdserve serve` against the inputs of a careless or hostile client: stop strings built
to stall the event loop, a prompt of megabytes, compressed bodies (a gzip bomb), integers
beyond 64 bits, lone surrogates, errors on a keep-alive connection, half-sent requests,
shutdown with a half-sent body; and a sweep of bad values over every field of both
endpoints.

Every test passes alone and in any order: most share the session's keyed server
(tests/conftest.py) and leave it idle; the test that shuts the strict server down leaves
the next test a new one (`strict_server`)."""

from __future__ import annotations

import gzip
import json
import signal
import socket
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import psutil
import pytest
import uvicorn
from helpers.server import KEY, MODEL, Server, stop

from pdserve.cluster.config import ClusterConfig
from pdserve.cluster.faults import FaultCounters
from pdserve.cluster.policies import DecodeChooser
from pdserve.cluster.routing import FETCH_OVERHEAD_S, CacheCounters, Router
from pdserve.model.default import default_model_path
from pdserve.model.tokenizer import Tokenizer
from pdserve.predictor.confusion import PredictionCounters
from pdserve.protocol.core import WeightsInfo
from pdserve.server.app import ServerConfig, build_app
from pdserve.server.http import header_deadline_protocol

BIG = 2**70
AUTH = {"Authorization": f"Bearer {KEY}"}
# The longest /health may wait while another request runs: generous for a 2-core machine
# shared with other runs (the probe's median is ~2 ms, its worst ~50 ms); a request that
# holds the event loop (a prompt tokenized on it: 2 s and more) goes past it.
HEALTH_WORST_S = 1.0
_T = TypeVar("_T")


class Raw:
    """One keep-alive HTTP/1.1 connection spoken by hand, as a pooled client uses it."""

    def __init__(self, port: int, timeout: float = 60.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.buf = b""

    def close(self) -> None:
        self.sock.close()

    def send(self, method: str, path: str, body: Any = None, headers: dict | None = None) -> None:
        raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        head = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        if raw is not None:
            head += ["Content-Type: application/json", f"Content-Length: {len(raw)}"]
        self.sock.sendall("\r\n".join(head).encode() + b"\r\n\r\n" + (raw or b""))

    def response(self) -> tuple[int, dict[str, str], bytes]:
        """The next response (Content-Length framed); raises on a closed connection."""
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode().split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
        length = int(headers.get("content-length", "0"))
        while len(self.buf) < length:
            self._fill()
        body, self.buf = self.buf[:length], self.buf[length:]
        return status, headers, body

    def exchange(self, method: str, path: str, body: Any = None, headers: dict | None = None):
        self.send(method, path, body, headers)
        status, head, raw = self.response()
        return status, head, (json.loads(raw) if raw else None)

    def closed_by_server(self) -> bool:
        """True once the server closed the connection (waits up to the socket timeout)."""
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self.buf += chunk


def error(message: str, param: str | None, code: int = 400) -> dict:
    kind = {401: "authentication_error", 404: "not_found_error", 500: "internal_server_error"}
    kind.update({503: "service_unavailable_error"})
    err = {"message": message, "type": kind.get(code, "invalid_request_error")}
    return {"error": {**err, "param": param, "code": code}}


@pytest.fixture
def server(keyed_server: Server) -> Server:
    """The session's shared keyed server, debug endpoints on (tests/conftest.py)."""
    return keyed_server


def post(server: Server, path: str, body: Any) -> tuple[int, dict]:
    raw = json.dumps(body).encode()
    return server.post(path, raw)


def worst_health_wait(server: Server, action: Callable[[], _T]) -> tuple[float, _T]:
    """Run `action` while /health is probed every 10 ms: the longest a probe waited for
    its answer (a probe sent as the action began counts too) and the action's result."""
    waits: list[float] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            t = time.perf_counter()
            assert server.get("/health")[0] == 200
            waits.append(time.perf_counter() - t)
            time.sleep(0.01)

    with ThreadPoolExecutor(1) as pool:
        prober = pool.submit(probe)
        time.sleep(0.05)  # probing before the action starts
        try:
            result = action()
        finally:
            done.set()  # the prober stops whatever happened to the action
        prober.result(60)
    print(f"/health during the action: {len(waits)} probes, worst {max(waits) * 1e3:.1f} ms")
    return max(waits), result


def assert_pool_clean(server: Server) -> None:
    deadline = time.monotonic() + 30
    while True:
        stats = server.get("/debug/engine", key=KEY)[1]
        idle = stats["num_running"] + stats["num_waiting"] == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert (stats["num_running"], stats["num_waiting"], stats["num_used_blocks"]) == (0, 0, 0)
    assert stats["integrity_error"] is None


# ---- 1. stop strings cannot stall the server ---------------------------------------------

PROMPT = "Write a long story about a lighthouse keeper."


def test_the_stop_string_flood_is_refused_naming_the_limit(server: Server) -> None:
    stops = [f"{i:04d}" + "q" * 1996 for i in range(1900)] + ["x"]
    body = {"prompt": PROMPT, "max_tokens": 48, "n": 16, "stop": stops}
    assert post(server, "/v1/completions", body) == (
        400,
        error("stop may hold at most 64 strings, got 1901", "stop"),
    )
    body["stop"] = ["a" * 3000, "b" * 1200]
    assert post(server, "/v1/completions", body) == (
        400,
        error("stop strings may hold at most 4096 characters in all, got 4200", "stop"),
    )


def test_stop_strings_at_the_limits_match_every_token_and_health_stays_live(
    server: Server,
) -> None:
    """64 stop strings, 4,096 characters, each a growing beginning of the greedy output
    (so text is held back on every token) and none complete: 16 choices must give the
    undisturbed text, while /health is probed and never waits `HEALTH_WORST_S`
    (docs/benchmarks.md compares the probe with the old matcher's)."""
    plain = {"prompt": PROMPT, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    status, reply = post(server, "/v1/completions", plain)
    assert status == 200
    text = reply["choices"][0]["text"]
    assert len(text) > 100
    budget = (4096 - len(text) - 1) // 63  # characters for each of the other 63
    stops = [text + "\x00"] + [text[: min(20 + i, budget - 3)] + f"\x00{i:02d}" for i in range(63)]
    assert len(stops) == 64 and sum(map(len, stops)) <= 4096
    assert not any(s in text for s in stops)
    body = {**plain, "n": 16, "stop": stops}
    worst, (status, reply) = worst_health_wait(
        server, lambda: post(server, "/v1/completions", body)
    )
    assert status == 200
    assert [c["text"] for c in reply["choices"]] == [text] * 16
    assert {c["finish_reason"] for c in reply["choices"]} == {"length"}
    assert worst < HEALTH_WORST_S


# ---- 1b. a prompt of megabytes is tokenized off the event loop ---------------------------

HUGE_TEXT = "hello " * 500_000  # 3 MB, 500k tokens: ~2 s of the tokenizer's time
HUGE_PROMPTS = [
    ("/v1/completions", {"prompt": HUGE_TEXT, "max_tokens": 4}, 500_001, 4),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": HUGE_TEXT}]}, 500_031, 1),
]


@pytest.mark.parametrize(
    ("path", "body", "tokens", "max_tokens"), HUGE_PROMPTS, ids=["completion", "chat"]
)
def test_a_huge_prompt_delays_only_itself(
    server: Server, path: str, body: dict, tokens: int, max_tokens: int
) -> None:
    """Refused for its length, which only tokenizing it tells; /health meanwhile answers
    within `HEALTH_WORST_S` (on the event loop the tokenizing held it 2 s and more)."""
    worst, reply = worst_health_wait(server, lambda: post(server, path, body))
    message = (
        f"this model's maximum context length is 8192 tokens, but {tokens} prompt tokens "
        f"plus max_tokens={max_tokens} would need {tokens + max_tokens}"
    )
    assert reply == (400, error(message, "prompt"))
    assert worst < HEALTH_WORST_S


# ---- 2. integers beyond 64 bits -------------------------------------------------------------

CONTEXT = "this model's maximum context length is 8192 tokens, but {p} prompt tokens plus "
HUGE = [
    (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": BIG},
        CONTEXT.format(p=1) + f"max_tokens={BIG} would need {BIG + 1}",
        "max_tokens",
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "top_k": BIG},
        f"top_k must be at most {2**63 - 1}, got {BIG}",
        "top_k",
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "stop_token_ids": [1, BIG]},
        f"stop token id {BIG} is outside the vocabulary [0, 49152)",
        "stop_token_ids",
    ),
    (
        "/v1/completions",
        {"prompt": [BIG]},
        f"prompt token id {BIG} is outside the vocabulary [0, 49152)",
        "prompt",
    ),
    (
        "/v1/completions",
        {"prompt": [[1], [BIG]]},
        f"prompt token id {BIG} is outside the vocabulary [0, 49152)",
        "prompt",
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "seed": BIG},
        f"seed must be between {-(2**63)} and {2**64 - 1}, got {BIG}",
        "seed",
    ),
    ("/v1/completions", {"prompt": "hi", "n": BIG}, f"n must be between 1 and 16, got {BIG}", "n"),
    (
        "/v1/completions",
        {"prompt": "hi", "logprobs": BIG},
        f"logprobs must be between 0 and 20, got {BIG}",
        "logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": BIG},
        CONTEXT.format(p=31) + f"max_completion_tokens={BIG} would need {BIG + 31}",
        "max_completion_tokens",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": BIG},
        f"top_logprobs must be between 0 and 20, got {BIG}",
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [-BIG]},
        f"stop_token_ids must be non-negative, got {-BIG}",
        "stop_token_ids",
    ),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "body", "message", "param"), HUGE, ids=[h[3] for h in HUGE])
def test_integers_beyond_64_bits_are_400_naming_the_field(
    server: Server, path: str, body: dict, message: str, param: str, stream: bool
) -> None:
    assert post(server, path, {**body, "stream": stream}) == (400, error(message, param))


# ---- 3. invalid Unicode ------------------------------------------------------------------------

SURROGATE = [
    ("/v1/completions", {"prompt": "hi\ud800"}, "prompt", "U+D800", 2),
    ("/v1/completions", {"prompt": ["ok", "\udfff"]}, "prompt.1", "U+DFFF", 0),
    ("/v1/completions", {"prompt": "hi", "stop": "\ud800x"}, "stop", "U+D800", 0),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b\udc00"]}, "stop.1", "U+DC00", 1),
    ("/v1/completions", {"prompt": "hi", "user": "\ud800"}, "user", "U+D800", 0),
    ("/v1/completions", {"prompt": "hi", "model": "m\ud800"}, "model", "U+D800", 1),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x\udbff"}]},
        "messages.0.content",
        "U+DBFF",
        1,
    ),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("path", "body", "param", "code", "at"), SURROGATE, ids=[s[2] for s in SURROGATE]
)
def test_lone_surrogates_are_400_naming_the_field(
    server: Server, path: str, body: dict, param: str, code: str, at: int, stream: bool
) -> None:
    message = f"{param} is not valid Unicode: a lone surrogate ({code}) at character {at}"
    assert post(server, path, {**body, "stream": stream}) == (400, error(message, param))


UNPARSABLE = (
    "request body is not valid JSON (invalid UTF-8, nesting deeper than the parser's limit, "
    "or an integer of more than 4300 digits)"
)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "\xff"}',
        b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}",
    ],
    ids=["latin-1", "deep", "long-int"],
)
def test_bodies_json_cannot_parse_are_400(server: Server, raw: bytes) -> None:
    assert server.post("/v1/completions", raw) == (400, error(UNPARSABLE, None))


def test_a_lone_surrogate_in_a_field_name_is_400(server: Server) -> None:
    raw = b'{"prompt": "hi", "\\ud800": 1}'
    message = "a field name is not valid Unicode: it holds a lone surrogate"
    assert server.post("/v1/completions", raw) == (400, error(message, None))


# ---- 4. errors keep the connection usable --------------------------------------------------

ERRORS = [
    ("POST", "/v1/completions", b"{bad", AUTH, 400),
    ("POST", "/v1/completions", {"prompt": 5}, AUTH, 400),
    ("POST", "/v1/completions", {"prompt": [BIG]}, AUTH, 400),
    ("POST", "/v1/completions", {"prompt": "\ud800"}, AUTH, 400),
    ("POST", "/v1/completions", {"prompt": "hi"}, {}, 401),
    ("GET", "/v1/nothing", None, AUTH, 404),
    ("POST", "/v1/completions", {"prompt": "hi", "model": "nope"}, AUTH, 404),
    ("GET", "/v1/completions", None, AUTH, 405),
    ("POST", "/v1/completions", {"prompt": "x" * (4 * 1024 * 1024)}, AUTH, 413),
]


def test_every_error_leaves_the_keep_alive_connection_usable(server: Server) -> None:
    conn = Raw(server.port)
    try:
        for method, path, body, headers, status in ERRORS:
            got, head, reply = conn.exchange(method, path, body, headers)
            assert (got, reply["error"]["code"]) == (status, status), (path, body)
            assert head.get("connection") != "close"
            got, _, reply = conn.exchange("GET", "/v1/models", None, AUTH)
            assert got == 200 and reply["data"][0]["id"] == MODEL
    finally:
        conn.close()


class _FailingBackend:
    """A backend whose generate fails the way a bug would (a unit test of the guard)."""

    def __init__(self) -> None:
        self.tokenizer = Tokenizer.from_model_path(default_model_path())
        self.max_model_len = 8192
        self.is_alive = True
        self.faults = FaultCounters()
        config = ClusterConfig(num_colocated=1)
        self.router = Router(config, 16, DecodeChooser(config.decode_policy))
        self.predictions = PredictionCounters(None)
        self.weights = WeightsInfo("none", ["float32"])

    async def generate(
        self, prompt: Any, params: Any, request_id: str | None = None, session: str | None = None
    ):
        raise RuntimeError("a bug")
        yield  # an async generator, like the real backends

    def cancel_all(self, error: Exception) -> int:
        return 0

    def feature(self, kind: type) -> Any:
        raise KeyError(kind.__name__)  # a backend with no features


def test_an_unexpected_exception_is_a_500_body_on_a_connection_that_stays_usable() -> None:
    app = build_app(_FailingBackend(), ServerConfig("m"))  # type: ignore[arg-type]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="critical", http=header_deadline_protocol(5)
    )
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    conn = Raw(port)
    try:
        for _ in range(2):
            status, head, reply = conn.exchange("POST", "/v1/completions", {"prompt": "hi"})
            assert (status, reply) == (500, error("internal server error", None, 500))
            assert head.get("connection") != "close"
            assert conn.exchange("GET", "/health")[::2] == (200, {"status": "ok"})
    finally:
        conn.close()
        uv.should_exit = True
        thread.join(30)


# ---- 4b. compressed bodies ----------------------------------------------------------------


def _peak_rss_reset(pid: int) -> None:
    """Start the process's peak resident size (VmHWM) over from its present size."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def _rss(pid: int, field: str) -> int:
    """VmRSS or VmHWM of a process, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        line = next(ln for ln in f if ln.startswith(field + ":"))
    return int(line.split()[1]) * 1024


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
def test_a_compressed_body_gives_the_plain_bodys_reply(server: Server, coding: str) -> None:
    raw = json.dumps({"prompt": PROMPT, "max_tokens": 8, "temperature": 0}).encode()
    packed = gzip.compress(raw) if coding == "gzip" else zlib.compress(raw)
    conn = Raw(server.port)
    try:
        plain = conn.exchange("POST", "/v1/completions", raw, AUTH)
        sent = conn.exchange(
            "POST", "/v1/completions", packed, {"Content-Encoding": coding, **AUTH}
        )
    finally:
        conn.close()
    assert plain[0] == sent[0] == 200
    a, b = plain[2], sent[2]
    assert a["choices"] == b["choices"]
    assert (a["usage"]["prompt_tokens"], a["usage"]["completion_tokens"]) == (
        b["usage"]["prompt_tokens"],
        b["usage"]["completion_tokens"],
    )


def test_a_gzip_bomb_is_413_naming_the_limit_without_being_inflated(server: Server) -> None:
    """1 GiB of zeros in 1 MB of gzip: refused once 4 MiB are decoded; the server's peak
    resident size grows by far less than the bomb (it was never inflated whole), and the
    connection stays usable."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(1 << 20)
    bomb = b"".join(packer.compress(zeros) for _ in range(1024)) + packer.flush()
    assert len(bomb) < 4 * 1024 * 1024  # within the limit as sent
    pid = server.proc.pid
    _peak_rss_reset(pid)
    before = _rss(pid, "VmRSS")
    conn = Raw(server.port)
    try:
        status, head, reply = conn.exchange(
            "POST", "/v1/completions", bomb, {"Content-Encoding": "gzip", **AUTH}
        )
        message = (
            "request body is larger than the limit of 4194304 bytes once decoded "
            "(Content-Encoding: gzip)"
        )
        assert (status, reply) == (413, error(message, None, 413))
        assert head.get("connection") != "close"
        assert conn.exchange("GET", "/v1/models", None, AUTH)[0] == 200
    finally:
        conn.close()
    assert _rss(pid, "VmHWM") - before < 256 * 1024 * 1024


@pytest.mark.parametrize(
    ("coding", "raw", "status", "message"),
    [
        (
            "br",
            b'{"prompt": "hi"}',
            415,
            "Content-Encoding 'br' is not supported; send the body plain, as gzip or as deflate",
        ),
        (
            "gzip, br",
            b'{"prompt": "hi"}',
            415,
            "Content-Encoding 'gzip, br' is not supported; send the body plain, as gzip or "
            "as deflate",
        ),
        (
            "gzip",
            b'{"prompt": "hi"}',
            400,
            "request body is not valid gzip data (Content-Encoding: gzip)",
        ),
        (
            "deflate",
            zlib.compress(b'{"prompt": "hi"}')[:-4],
            400,
            "request body is not valid deflate data (Content-Encoding: deflate)",
        ),
    ],
    ids=["br", "stacked", "not-gzip", "cut-deflate"],
)
def test_a_body_not_of_a_decoded_coding_is_refused_naming_it(
    server: Server, coding: str, raw: bytes, status: int, message: str
) -> None:
    conn = Raw(server.port)
    try:
        got = conn.exchange("POST", "/v1/completions", raw, {"Content-Encoding": coding, **AUTH})
        assert (got[0], got[2]) == (status, error(message, None, status))
        assert got[1].get("connection") != "close"
        assert conn.exchange("GET", "/v1/models", None, AUTH)[0] == 200
    finally:
        conn.close()


# ---- 6. quirks --------------------------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
QUIRKS = [
    (
        "/v1/chat/completions",
        {**CHAT, "stream_options": {"include_usage": True}},
        "stream_options is only allowed when stream is true",
        "stream_options",
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}},
        "stream_options.include_usage: Input should be a valid boolean",
        "stream_options.include_usage",
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "stream": True, "stream_options": {"usage": True}},
        "unknown field 'stream_options.usage'",
        "stream_options.usage",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "logprobs": True, "top_logprobs": 50},
        "top_logprobs must be between 0 and 20, got 50",
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "top_logprobs": 2},
        "top_logprobs requires logprobs to be true",
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "max_completion_tokens": 0},
        "max_completion_tokens must be at least 1, got 0",
        "max_completion_tokens",
    ),
]


@pytest.mark.parametrize(("path", "body", "message", "param"), QUIRKS, ids=[q[3] for q in QUIRKS])
def test_quirks_are_refused_naming_the_field(
    server: Server, path: str, body: dict, message: str, param: str
) -> None:
    assert post(server, path, body) == (400, error(message, param))


def test_the_largest_seed_with_n_choices_wraps_and_reproduces(server: Server) -> None:
    body = {"prompt": "My favourite animal is", "max_tokens": 6, "seed": 2**64 - 1, "n": 2}
    status, a = post(server, "/v1/completions", body)
    assert status == 200, a
    _, b = post(server, "/v1/completions", body)
    _, zero = post(server, "/v1/completions", {**body, "seed": 0, "n": 1})
    texts = [c["text"] for c in a["choices"]]
    assert texts == [c["text"] for c in b["choices"]]
    assert texts[1] == zero["choices"][0]["text"]  # choice 1: seed 2**64 - 1 + 1 = 0 (mod 2**64)


def test_debug_cluster_of_one_engine_is_its_single_row(server: Server) -> None:
    """A single engine is a cluster of one instance: its row is a cluster row."""
    assert post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})[0] == 200
    status, reply = server.get("/debug/cluster", key=KEY)
    assert status == 200
    caching = reply["controller"].pop("caching")
    # The shipped length head (docs/scheduling.md): a 2-token completion is cut by
    # max_tokens, so it counts as truncated, not in the matrix.
    assert reply["controller"].pop("elastic") == {
        "policy": "none",
        "flips": [],
        "last_keep": None,
        "scaling": [],
        "decisions": [],
    }
    lengths = reply["controller"].pop("length_prediction")
    assert (lengths["granularity"], lengths["num_buckets"]) == (32, 9)
    assert lengths["truncated"] >= 1 and lengths["unpredicted"] == 0
    assert sum(map(sum, lengths["confusion"])) == lengths["counted"]
    assert reply["controller"] == FaultCounters().as_dict()
    # A lone engine sends no load reports, so its prompt trees stay empty.
    empty = {"entries": 0, "by_instance": {}, "approx_bytes": 0, "expired": 0, "evicted": 0}
    trees = {role: empty for role in ("prefill", "decode", "colocated")}
    # No copy measured: the fetch rule's overhead is still its starting guess.
    overhead = {"fetch_overhead_s": FETCH_OVERHEAD_S, "fetch_overhead_samples": 0}
    routing = {"routing": "prefix", **CacheCounters().as_dict(), **overhead, "sessions": 0}
    assert caching == {**routing, "trees": trees}
    (row,) = reply["instances"]
    stats = row.pop("stats")
    (fork_server,) = [  # the engine's parent (cluster/forkserver.py)
        p
        for p in psutil.Process(server.proc.pid).children()
        if "forkserver" in " ".join(p.cmdline())
    ]
    (engine,) = fork_server.children()
    assert row == {
        "name": "engine",
        "role": "colocated",
        "flipping_to": None,
        "node": "local",
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "pid": engine.pid,
        "alive": True,
        "dead_reason": None,
        "assigned_prefill_tokens": 0,
        "assigned_requests": 0,
        "replicating_to": None,
        "replicated_tokens": 0,
    }
    free, cached = stats.pop("num_free_blocks"), stats.pop("num_cached_blocks")
    # The shared server's 0.5 GiB of KV (tests/conftest.py) for SmolLM2-135M: 2 x 30 layers
    # x 3 heads x 64 x 16 tokens a block, 2 B each in fp16 (auto's, under the default
    # quantized weights), 4 B in fp32 (auto's where the kernels are off and the weights fp32).
    assert server.args[-2:] == ("--kv-cache-memory-gib", "0.5")
    _, models = server.get("/v1/models", key=KEY)
    kv = models["data"][0]["kv_cache_dtype"]
    blocks = {
        "float16": 2**29 // (2 * 30 * 3 * 64 * 2 * 16),
        "float32": 2**29 // (2 * 30 * 3 * 64 * 4 * 16),
    }
    assert blocks == {"float16": 1456, "float32": 728}
    assert free + cached == blocks[kv]
    hits, queries = stats.pop("prefix_cache_hits"), stats.pop("prefix_cache_queries")
    assert stats.pop("busy_ms") > 0  # it ran steps
    steps, in_bursts = stats.pop("num_steps"), stats.pop("num_burst_steps")
    assert steps > 0 and 0 <= in_bursts < steps  # a prefill step is never a burst's
    assert 0 <= hits <= queries
    idle = ("num_running", "num_waiting", "num_swapped", "num_used_blocks", "num_held")
    idle += ("num_transferring", "num_reserved", "num_replicas", "num_replica_blocks")
    idle += ("num_replicating", "num_replicated_tokens", "num_offers", "num_prefix_fetches")
    idle += ("num_preemptions", "num_admission_waits")  # its pool never ran short
    idle += ("num_admission_held", "num_prefill_batches", "num_prefill_overtakes")  # fcfs, greedy
    idle += ("num_predicted_decodes", "predicted_decode_tokens")  # decodes nothing prefilled
    idle += ("num_role_switches",)  # never flipped
    idle += ("kv_routes_shm", "kv_routes_tcp")  # a lone engine moves no KV
    idle += ("staged_peak_blocks",)  # one stage: no microbatch swapping
    idle += ("grammar_errors",)  # every grammar it was sent compiled and held
    stats.pop("grammar_masks")  # one a constrained token the tests before this one asked for
    assert stats == {**dict.fromkeys(idle, 0), "integrity_error": None}


def test_docs_need_the_key_and_health_answers_head(server: Server) -> None:
    """The API docs behind the key; HEAD /health answers 200 with no body, and building
    the OpenAPI schema logs no duplicate operation (one route for GET and HEAD did)."""
    for path in ("/docs", "/openapi.json", "/redoc"):
        status, body = server.get(path)
        message = "invalid or missing API key (send 'Authorization: Bearer KEY')"
        assert (status, body) == (401, error(message, None, 401))
    assert server.get("/openapi.json", key=KEY)[0] == 200  # the schema is built now
    conn = Raw(server.port)
    try:
        conn.send("HEAD", "/health")
        while b"\r\n\r\n" not in conn.buf:
            conn._fill()
        head, conn.buf = conn.buf.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 200 ")
        # No body follows: the next response on the connection is the GET's.
        assert conn.exchange("GET", "/health")[::2] == (200, {"status": "ok"})
    finally:
        conn.close()
    assert "Duplicate Operation ID" not in server.stderr(wait=False)


# ---- the sweep: bad values in every field ------------------------------------------------------

_FIELDS: dict[str, list[Any]] = {
    "max_tokens": ["8", 1.5, True, [1], {}, -1, 0, -BIG],
    "temperature": ["0", True, [0], -1, 1e309],
    "top_p": ["1", False, 0, -0.5, 1.01, {}],
    "top_k": ["1", 1.5, -2, -BIG, BIG],
    "min_p": ["0", -0.1, 1.5, []],
    "seed": ["1", 1.5, True, -BIG, BIG],
    "stop": [1, [1], [""], {}, True, ["\ud800"], ["s"] * 65],
    "stop_token_ids": [1, ["1"], [-1], [1.5], [BIG], {}],
    "ignore_eos": ["yes", 1],
    "presence_penalty": ["0", 2.5, -2.5, []],
    "frequency_penalty": ["0", 2.5, -2.5, True],
    "repetition_penalty": [0, -1, "1"],
    "n": ["2", 0, 17, 1.5, -1, BIG],
    "stream": ["true", 1],
    "stream_options": ["x", [], {"include_usage": 1}, {"bogus": True}],
    "user": [1, [], {}, "\udfff"],
    "model": [1, [], "nope", "\ud800"],
    "logit_bias": ["x", [1], {"a": 1}, {"1": 101}, {"1": "x"}, {str(BIG): 1}],
    "response_format": ["json", {"type": "xml"}, {"type": "json_schema"}, {"type": "text", "x": 1}],
    "structured_outputs": ["x", {}, {"regex": "a", "choice": ["b"]}, {"bogus": 1}],
    "guided_json": [{"type": "nope"}, "{", 1],
    "guided_regex": [1, "a(", ""],
    "guided_choice": ["a", [], [1], [""]],
    "guided_grammar": ['root ::= "a', "start: nope", 1],
}
_COMPLETION_ONLY: dict[str, list[Any]] = {
    "prompt": [5, None, [], "", [[]], ["a", 1], [1.5], [-1], [BIG], "\ud800", [True], {}],
    "logprobs": ["1", -1, 21, 1.5, BIG],
    "echo": ["yes", 1],
}
_CHAT_ONLY: dict[str, list[Any]] = {
    "messages": [
        [],
        "hi",
        [{"role": "user"}],
        [{"role": "robot", "content": "x"}],
        [{"role": "user", "content": 1}],
        [{"role": "user", "content": "x", "bogus": "n"}],
        [{"role": "assistant", "content": None}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "tool", "content": [{"type": "text"}]}],
        [{"role": "user", "content": "\ud800"}],
        None,
    ],
    "max_completion_tokens": [0, -1, "5", BIG],
    "logprobs": ["yes", 1],
    "top_logprobs": [-1, 21, "2", BIG],
    "tools": [
        "x",
        [{"type": "function"}],
        [{"type": "function", "function": {"name": ""}}],
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
    ],
    "tool_choice": ["maybe", "required", {"type": "function", "function": {"name": "none_such"}}],
    "parallel_tool_calls": ["yes", 1],
}


def _sweep() -> list[tuple[str, str, Any]]:
    cases = []
    for path, own in (("/v1/completions", _COMPLETION_ONLY), ("/v1/chat/completions", _CHAT_ONLY)):
        for field, values in {**_FIELDS, **own}.items():
            cases += [(path, field, v) for v in values]
    return cases


def test_every_bad_value_of_every_field_is_a_400_naming_it(server: Server) -> None:
    """One keep-alive connection for the whole sweep: every answer is the exact error
    shape naming the field, the connection survives each, and no KV block is left."""
    base = {"/v1/completions": {"prompt": "hi"}, "/v1/chat/completions": CHAT}
    conn = Raw(server.port)
    seen = 0
    try:
        for path, field, value in _sweep():
            body = {**base[path], "max_tokens": 2, field: value}
            if field == "top_logprobs":
                body["logprobs"] = True
            status, _, reply = conn.exchange("POST", path, body, AUTH)
            want = 404 if (field, value) == ("model", "nope") else 400
            assert status == want, (path, field, value, reply)
            err = reply["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == want
            if want == 400:
                assert str(err["param"]).split(".")[0] == field, (field, value, err)
            assert err["message"] and "Traceback" not in err["message"]
            seen += 1
    finally:
        conn.close()
    assert seen == len(_sweep()) > 150
    assert_pool_clean(server)


# ---- 5. slow clients and shutdown ---------------------------------------------------------


STRICT = ("--header-timeout", "1", "--body-timeout", "5", "--shutdown-timeout", "60")


@pytest.fixture(scope="module")
def strict_servers() -> Iterator[list[Server]]:
    """Every strict server the module started; stopped at its end."""
    started: list[Server] = []
    yield started
    for s in started:
        stop(s)


@pytest.fixture
def strict_server(strict_servers: list[Server]) -> Server:
    """A running strict server: the module's, or a new one if a test shut it down (the
    SIGTERM test does), so no test depends on running before that one."""
    if not strict_servers or strict_servers[-1].proc.poll() is not None:
        strict_servers.append(Server(*STRICT))
    return strict_servers[-1]


@pytest.mark.parametrize(
    ("sent", "message"),
    [
        (b"", "the request headers did not arrive within 1 s"),
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
            "the request headers did not arrive within 1 s",
        ),
        (
            b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"pro',
            "the request body did not arrive within the body timeout of 5 s",
        ),
    ],
    ids=["nothing", "half-headers", "half-body"],
)
def test_half_sent_requests_get_408_and_the_connection_closes(
    strict_server: Server, sent: bytes, message: str
) -> None:
    conn = Raw(strict_server.port)
    try:
        conn.sock.sendall(sent)
        status, head, raw = conn.response()
        assert (status, json.loads(raw)) == (408, error(message, None, 408))
        assert head["connection"] == "close" and conn.closed_by_server()
    finally:
        conn.close()


def test_sigterm_with_a_half_sent_body_exits_without_waiting_for_it(strict_server: Server) -> None:
    """It shuts its server down: the next test to ask for `strict_server` gets a new one."""
    s = strict_server
    conn = Raw(s.port)
    try:
        conn.sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt": '
        )
        for _ in range(3):  # round trips on the same loop: the half request is read by now
            assert s.get("/health")[0] == 200
        s.proc.send_signal(signal.SIGTERM)
        status, head, raw = conn.response()
        message = "the server is shutting down; no new requests are accepted"
        assert (status, json.loads(raw)) == (503, error(message, None, 503))
        assert head["connection"] == "close"
        assert s.proc.wait(30) == 0  # not the 60 s drain: the request never got in
        stderr = s.stderr()
        assert "in flight" not in stderr and "died" not in stderr, stderr
    finally:
        conn.close()


def test_a_clean_sigterm_of_a_disaggregated_server_reports_no_death() -> None:
    s = Server("--prefill", "1", "--decode", "1")
    try:
        status, reply = s.post("/v1/completions", b'{"prompt": "hi", "max_tokens": 2}', key=None)
        assert status == 200, reply
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 0
        stderr = s.stderr()
        assert "died" not in stderr, stderr
    finally:
        stop(s)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
