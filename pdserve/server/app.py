"""The OpenAI-compatible HTTP API (FastAPI) over a `ServingBackend`: one engine or a cluster.

The HTTP process owns text: it applies chat templates and tokenizes (a large input off
the event loop, `server/prompts.py`: it delays only itself), streams the client's
detokenized deltas as Server-Sent Events, and turns every failure into the one error
body of `server/errors.py`. The engine core runs in its own process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from pdserve.cluster.flip import Flip
from pdserve.cluster.scaling import Scaling
from pdserve.cluster.watcher import Watcher
from pdserve.errors import EngineDeadError, InvalidRequestError, PdserveError
from pdserve.grammar.requests import Constraint
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.protocol.validation import check_prompt_length
from pdserve.server import errors
from pdserve.server.admission import Admission, AdmissionGate
from pdserve.server.backend import F, ServingBackend
from pdserve.server.chat import plan_chat
from pdserve.server.errors import APIError
from pdserve.server.grammars import GrammarConfig, Grammars
from pdserve.server.metrics import ServerMetrics
from pdserve.server.prompts import Encoded, PromptConfig, PromptEncoder
from pdserve.server.protocol import ChatCompletionRequest, CompletionRequest, RoleChange
from pdserve.server.render import ChoiceRender, Renderer
from pdserve.text.outputs import RequestOutput
from pdserve.version import __version__

_DISCONNECT_POLL_S = 0.05


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    # GET /debug/engine: the core's counters and a KV-pool integrity check (tests, ops).
    debug_endpoints: bool = False
    # POST /admin/instances/{name}/role: instance flip (cluster/flip.py); POST
    # /admin/instances, DELETE /admin/instances/{name}: scaling (cluster/scaling.py).
    # Keyed like /v1/.
    admin_endpoints: bool = True
    # Request bodies above this are refused with 413.
    max_body_bytes: int = 4 * 1024 * 1024
    # Tokenization: the thread pool for large prompts, what is small enough to stay inline.
    prompts: PromptConfig = field(default_factory=PromptConfig)
    # Structured outputs: the grammar checks' pool and time limit.
    grammars: GrammarConfig = field(default_factory=GrammarConfig)


def build_app(
    client: ServingBackend, config: ServerConfig, admission: Admission | None = None
) -> FastAPI:
    """The routes over `client`; `admission` (body limit, drain) is shared with the
    shutdown sequence of `launch.py`."""
    admission = admission or Admission(config.max_body_bytes, config.api_key)
    api = _Api(client, config, admission)
    app = FastAPI(title="pdserve", version=__version__, lifespan=api.lifespan)
    app.add_exception_handler(APIError, errors.on_api_error)
    app.add_exception_handler(InvalidRequestError, errors.on_invalid_request)
    app.add_exception_handler(PdserveError, errors.on_engine_error)
    app.add_exception_handler(RequestValidationError, errors.on_validation_error)
    app.add_exception_handler(HTTPException, errors.on_http_error)
    app.add_middleware(AdmissionGate, admission=admission)
    # Outermost of ours: an unexpected exception becomes the 500 error body and the
    # connection stays usable (Starlette's own handler re-raises, and uvicorn then
    # drops the keep-alive connection under the client's next request).
    app.add_middleware(errors.UnexpectedErrorGuard)

    app.get("/health")(api.health)
    # HEAD answers as GET; one route for both gave two OpenAPI operations of one id.
    app.head("/health", include_in_schema=False)(api.health)
    app.get("/version")(api.version)
    app.get("/metrics")(api.prometheus)
    app.get("/v1/models")(api.models)
    app.get("/cluster/status")(api.cluster_status)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat)
    if config.debug_endpoints:
        app.get("/debug/engine")(api.debug_engine)
        app.get("/debug/cluster")(api.debug_cluster)
    if config.admin_endpoints:
        app.post("/admin/instances/{name}/role")(api.flip)
        app.post("/admin/instances")(api.add_instance)
        app.delete("/admin/instances/{name}")(api.remove_instance)
    return app


_MAX_STATS_TIMEOUT_S = 30.0  # /debug/cluster?stats_timeout=


class _Api:
    def __init__(self, client: ServingBackend, config: ServerConfig, admission: Admission) -> None:
        self.client = client
        self.config = config
        self.admission = admission
        assert client.tokenizer is not None
        self.render = Renderer(client.tokenizer)
        self.encoder = PromptEncoder(client.tokenizer, config.prompts)
        self.grammars = Grammars(client.tokenizer, config.grammars)
        self.metrics = ServerMetrics()
        self.metrics.watch_faults(client.faults)
        self.metrics.watch_cache(client.router)
        self.metrics.watch_predictions(client.predictions)
        self.watcher = _feature(client, Watcher)
        if self.watcher is not None:
            self.metrics.watch_elastic(self.watcher)
        self.metrics.describe_weights(client.weights)

    @contextlib.asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        self.grammars.warm()
        try:
            yield
        finally:
            self.encoder.close()
            self.grammars.close()

    async def health(self) -> JSONResponse:
        if not self.client.is_alive:
            return errors.error_response(500, "the engine process is not running")
        if self.admission.draining:
            return errors.error_response(503, "the server is shutting down")
        return JSONResponse({"status": "ok"})

    async def debug_engine(self) -> dict[str, Any]:
        try:
            stats = await self.client.stats(check_integrity=True)
        except EngineDeadError as e:
            raise APIError(500, f"the engine is not available: {e}") from None
        return msgspec.to_builtins(stats)

    async def debug_cluster(self, stats_timeout: float = 0.08) -> dict[str, Any]:
        """Per instance (role, pid, liveness, load, counters, integrity); one row for a
        single-engine server. Answered within `stats_timeout` seconds (?stats_timeout=S,
        at most 30) whatever an instance does: an instance whose counters have not come
        by then (inside a long step, hung) gets `stats_error` instead of `stats`."""
        if not 0 < stats_timeout <= _MAX_STATS_TIMEOUT_S:
            raise APIError(
                400,
                f"stats_timeout must be in (0, {_MAX_STATS_TIMEOUT_S:g}] seconds, "
                f"got {stats_timeout:g}",
                "stats_timeout",
            )
        counters: dict[str, Any] = dict(self.client.faults.as_dict())
        counters["caching"] = self.client.router.summary()
        counters["length_prediction"] = self.client.predictions.summary()
        if self.watcher is not None:
            counters["elastic"] = self.watcher.summary()
        rows = await self.client.instance_stats(stats_timeout)
        return {"instances": rows, "controller": counters}

    async def flip(self, name: str, body: RoleChange) -> dict[str, Any]:
        """Instance flip by hand: answers once `name` serves in its new role (its report),
        404 for no such instance, 409 when the flip is refused (cluster/flip.py)."""
        flip = _feature(self.client, Flip)
        if flip is None:
            raise APIError(404, "this server has no instance flip")
        return (await flip.flip(name, body.role)).as_dict()

    async def add_instance(self, body: RoleChange) -> dict[str, Any]:
        """Scale out by hand: answers once the new instance serves (its report); 409 when
        refused (no room, a role the cluster does not run, one engine)."""
        return (await self._scaling().add(body.role)).as_dict()

    async def remove_instance(self, name: str) -> dict[str, Any]:
        """Scale in by hand: drains `name` (its requests move; none is lost) and stops
        it; 404 for no such instance, 409 when refused (its role's last, flipping)."""
        return (await self._scaling().remove(name)).as_dict()

    def _scaling(self) -> Scaling:
        scaling = _feature(self.client, Scaling)
        if scaling is None:
            raise APIError(404, "this server does not scale")
        return scaling

    async def cluster_status(self) -> dict[str, Any]:
        """Nodes, instances, roles and load (`pdserve cluster status`); asks no instance,
        so it answers while they are busy or dying."""
        return self.client.status()

    async def prometheus(self) -> Response:
        stats = None
        with contextlib.suppress(EngineDeadError, TimeoutError):
            stats = await self.client.stats(timeout=5.0)
        return Response(self.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    async def version(self) -> dict[str, str]:
        return {"version": __version__}

    async def models(self) -> dict[str, Any]:
        card = {
            "id": self.config.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "pdserve",
            "max_model_len": self.client.max_model_len,
            "quantization": self.client.weights.quantization,
            "weight_formats": self.client.weights.formats,
            "activations": self.client.weights.activations,
            "kv_cache_dtype": self.client.weights.kv_cache_dtype,
        }
        return {"object": "list", "data": [card]}

    # ---- completions ---------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        body.check()
        self._check_model(body.model)
        prompts = body.prompt_list()
        params = body.sampling_params(16)
        if body.echo and params.logprobs is not None:
            raise APIError(400, "echo with logprobs is not supported (no prompt logprobs)", "echo")
        params = await self._constrained(params, body.constraint())
        encoded = await self.encoder.prompts(prompts)
        ids = [self._within_context(e, params) for e in encoded]
        return await self._respond(
            request,
            body,
            ids,
            params,
            "text_completion",
            lambda: self.render.completion_choice,
            prompts if body.echo else None,
        )

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Any:
        body.check()
        self._check_model(body.model)
        tokenizer = self.client.tokenizer
        plan = plan_chat(body, tokenizer is not None and tokenizer.template_knows_tools)
        for grammar, param in plan.tool_schemas:
            await self.grammars.check(grammar, param)
        encoded = await self.encoder.chat(plan.messages, plan.tools)
        default_max = max(1, self.client.max_model_len - len(encoded))
        with _field_named("max_tokens", body.max_tokens_field):
            params = body.sampling_params(default_max)
            params = await self._constrained(params, plan.constraint)
            ids = self._within_context(encoded, params)
            choice = self.render.chat_choices(plan.tool_names)
            return await self._respond(request, body, [ids], params, "chat.completion", choice)

    async def _constrained(
        self, params: SamplingParams, constraint: Constraint | None
    ) -> SamplingParams:
        """`params` with the request's grammar, once it compiled (400 naming its field)."""
        if constraint is None:
            return params
        with _field_named("grammar", constraint.param):  # its size limit names the field
            constrained = dataclasses.replace(params, grammar=constraint.grammar)
        await self.grammars.check(constraint.grammar, constraint.param)
        return constrained

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.served_model_name:
            raise APIError(404, f"the model {name!r} does not exist", "model")

    def _within_context(self, encoded: Encoded, params: SamplingParams) -> list[int]:
        """The prompt's ids, unless it fills the context by itself: then the engine's own
        refusal, from the length alone (its ids are never built)."""
        check_prompt_length(len(encoded), params, self.client.max_model_len)
        return encoded.ids()

    async def _respond(
        self,
        request: Request,
        body: Any,
        prompts: list[list[int]],
        params: SamplingParams,
        kind: str,
        choice: Callable[[], ChoiceRender],
        echo: list[str | list[int]] | None = None,
    ) -> Any:
        """Run n choices of every prompt; choice k = prompt k // n, sample k % n.
        `choice()`: a new renderer of one choice's outputs (`ChoiceRender`).
        `echo`: the prompts as given, to be sent back before each choice's text."""
        if not 1 <= body.n <= MAX_CHOICES:
            raise APIError(400, f"n must be between 1 and {MAX_CHOICES}, got {body.n}", "n")
        rid = f"{'cmpl' if kind == 'text_completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        jobs = [(ids, i) for ids in prompts for i in range(body.n)]
        session = request.headers.get("x-session-id") or body.user
        streams = [
            self.client.generate(ids, _choice_params(params, i), f"{rid}-{k}", session)
            for k, (ids, i) in enumerate(jobs)
        ]
        firsts = await _first_outputs(streams, request)  # refusals: before any byte is sent
        if firsts is None:
            return Response(status_code=499)  # client closed the connection; requests aborted
        meta = {"id": rid, "created": int(time.time()), "model": self.config.served_model_name}
        prefixes = None
        if echo is not None:  # decoded only now: the engine has checked the ids
            texts = [p if isinstance(p, str) else self.render.text(p) for p in echo]
            prefixes = [texts[k // body.n] for k in range(len(jobs))]
        if body.stream:
            render = _Render(meta, kind, choice, prefixes)
            usage_of = prompts if body.include_usage else None
            sse = _sse(streams, firsts, render, usage_of, self.metrics)
            return StreamingResponse(sse, media_type="text/event-stream")
        finals = await asyncio.gather(
            *(_until_done_or_gone(s, f, request) for s, f in zip(streams, firsts, strict=True))
        )
        if any(f is None for f in finals):
            return Response(status_code=499)  # client closed the connection; requests aborted
        done = [f for f in finals if f is not None]
        for f in done:
            self.metrics.finished(f)
        choices = [{**choice()(f, False), "index": k} for k, f in enumerate(done)]
        if prefixes is not None:
            for c, prefix in zip(choices, prefixes, strict=True):
                c["text"] = prefix + c["text"]
        usage = _usage(prompts, done)
        body_out = {**meta, "object": kind, "choices": choices, "usage": usage}
        return {**body_out, "pdserve_timings": _timings(done[0])}


MAX_CHOICES = 16


def _feature(client: ServingBackend, kind: type[F]) -> F | None:
    """The backend's feature of class `kind`, None when it has none."""
    try:
        return client.feature(kind)
    except KeyError:
        return None


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice i of n: the request's seed + i (modulo 2**64, the seed's range), so seeded
    choices differ but reproduce."""
    if index == 0 or params.seed is None:
        return params
    seed = params.seed + index
    return dataclasses.replace(params, seed=seed - 2**64 if seed >= 2**64 else seed)


@contextlib.contextmanager
def _field_named(engine_name: str, client_name: str) -> Iterator[None]:
    """Errors about `engine_name` name the field the client sent (`client_name`)."""
    try:
        yield
    except InvalidRequestError as e:
        if e.param != engine_name or client_name == engine_name:
            raise
        raise InvalidRequestError(e.message.replace(engine_name, client_name), client_name) from e


async def _first_outputs(
    streams: list[AsyncGenerator[RequestOutput, None]], request: Request
) -> list[RequestOutput] | None:
    """Every stream's first output, all requests submitted at once (one engine step
    can admit them together). If any is refused, all are aborted and it is raised. None
    if the client disconnected first - while its requests queued or their prompts were
    prefilled, which can take long: they are aborted then, not when the first token
    comes (`_until_done_or_gone` watches the rest of a whole answer)."""
    firsts = asyncio.ensure_future(
        asyncio.gather(*(s.__anext__() for s in streams), return_exceptions=True)
    )
    try:
        while not firsts.done():
            await asyncio.wait({firsts}, timeout=_DISCONNECT_POLL_S)
            if not firsts.done() and await request.is_disconnected():
                return None
        results = firsts.result()
    finally:
        if not firsts.done():  # cancelling a stream's first step aborts its request
            firsts.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await firsts
            for s in streams:
                await s.aclose()
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    if failure is None:
        return [r for r in results if isinstance(r, RequestOutput)]
    for s in streams:
        await s.aclose()
    raise failure


async def _until_done_or_gone(
    stream: AsyncGenerator[RequestOutput, None], first: RequestOutput, request: Request
) -> RequestOutput | None:
    """The final output, or None if the client disconnected first (then the request
    is aborted: closing the stream sends the abort to the engine)."""
    if first.finished:
        return first

    async def last() -> RequestOutput:
        final = first
        async for out in stream:
            final = out
        return final

    task = asyncio.create_task(last())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                return None
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await stream.aclose()


def _timings(out: RequestOutput) -> dict[str, float | None] | None:
    """Engine-side seconds per phase (clients that don't know the field ignore it), and
    the predicted output length (`predicted_output_low` inclusive, `_high` exclusive,
    null for the open last bucket) where a length predictor runs."""
    m = out.metrics
    if m is None:
        return None
    disaggregated = {"transfer": m.transfer_time, "decode_queue": m.decode_queue_time}
    timings: dict[str, float | None] = {
        "queue": m.queue_time,
        "prefill": m.prefill_time,
        **{k: v for k, v in disaggregated.items() if v is not None},
        "decode": m.decode_time,
        "ttft": m.ttft,
        "e2e": m.e2e,
    }
    p = out.prediction
    if p is not None:
        timings["predicted_output_low"] = p.low
        timings["predicted_output_high"] = p.high
    return timings


def _usage(prompts: list[list[int]], outs: list[RequestOutput]) -> dict[str, Any]:
    """OpenAI usage. A prompt is counted once however many choices it has, and so are
    its cached tokens: those of its first choice (what the instance that prefilled it
    served from its prefix cache, fetched blocks included)."""
    p, c = sum(len(ids) for ids in prompts), sum(len(o.token_ids) for o in outs)
    n = len(outs) // len(prompts)
    cached = sum(outs[k * n].num_cached_tokens for k in range(len(prompts)))
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@dataclass(frozen=True)
class _Render:
    """How one response's stream chunks look."""

    meta: dict[str, Any]
    kind: str  # "text_completion" | "chat.completion"
    choice: Callable[[], ChoiceRender]  # a new renderer of one choice's outputs
    echo: list[str] | None  # per choice: the prompt text sent first (completions echo)
    choices: dict[int, ChoiceRender] = field(default_factory=dict)  # by index, as used

    @property
    def chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat.completion" else "text_completion"

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {**self.meta, "object": self.chunk_kind, "choices": choices}

    def output(self, k: int, out: RequestOutput) -> dict[str, Any] | None:
        """Choice k's chunk for `out`; None when it carries nothing (a token a tool-call
        block holds back)."""
        render = self.choices.get(k)
        if render is None:
            render = self.choices[k] = self.choice()
        piece = render(out, True)
        if piece.get("delta") == {} and piece["finish_reason"] is None and not piece["logprobs"]:
            return None
        c = self.chunk([{**piece, "index": k}])
        if out.finished:
            c["pdserve_timings"] = _timings(out)
        return c

    def opening(self, n: int) -> dict[str, Any] | None:
        """Chat: the role first. Completions with echo: each prompt's text first."""
        if self.kind == "chat.completion":
            delta = {"role": "assistant", "content": ""}
            return self.chunk(
                [{"index": k, "delta": delta, "finish_reason": None} for k in range(n)]
            )
        if self.echo is not None:
            return self.chunk(
                [
                    {"index": k, "text": t, "finish_reason": None, "logprobs": None}
                    for k, t in enumerate(self.echo)
                ]
            )
        return None


async def _sse(
    streams: list[AsyncGenerator[RequestOutput, None]],
    firsts: list[RequestOutput],
    render: _Render,
    usage_of: list[list[int]] | None,
    metrics: ServerMetrics,
) -> AsyncIterator[str]:
    """The SSE body; a failure after the first byte is an error event, then [DONE].
    `usage_of`: the request's prompts, when a final usage chunk was asked for."""
    finals: dict[int, RequestOutput] = {}
    try:
        opening = render.opening(len(streams))
        if opening is not None:
            yield _event(opening)
        async for k, out in _merge(streams, firsts):
            if out.finished:
                finals[k] = out
                metrics.finished(out)
            chunk = render.output(k, out)
            if chunk is not None:
                yield _event(chunk)
        if usage_of is not None:
            usage = _usage(usage_of, [finals[k] for k in sorted(finals)])
            yield _event(render.chunk([]) | {"usage": usage})
    except Exception as e:
        yield _event(errors.error_body(*errors.status_of(e)))
    finally:
        for s in streams:
            await s.aclose()  # a client that went away aborts its requests
    yield "data: [DONE]\n\n"


async def _merge(
    streams: list[AsyncGenerator[RequestOutput, None]], firsts: list[RequestOutput]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:  # the common case: no pump task and queue hop per token
        yield 0, firsts[0]
        if not firsts[0].finished:
            async for out in streams[0]:
                yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()

    async def pump(i: int) -> None:
        await queue.put((i, firsts[i]))
        if firsts[i].finished:
            return
        try:
            async for out in streams[i]:
                await queue.put((i, out))
        except Exception as e:
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(streams))]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            remaining -= item.finished
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
