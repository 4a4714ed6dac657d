"""The HTTP layer: OpenAI's completions and chat completions APIs on FastAPI (Starlette) served by uvicorn. It knows
nothing of models: it checks requests (serving/api.py), asks the engine (serving/engine.py) to tokenize and
``generate`` them, writes the bodies and streams of what the engine's events say, and maps every error to a status
code (here alone).

FastAPI + uvicorn: the maintained ASGI stack that vLLM's and TGI's OpenAI front ends use, with a lifespan for the
engine's threads, and uvicorn's graceful shutdown, on which SIGTERM's drain is built (``Server``). The two completions
endpoints, which every token passes through, are a lean ASGI layer in front of FastAPI (``Completions``): their
server-sent events written straight to uvicorn, a client that goes away noticed by a task waiting on ``receive``.

    GET  /health                 200 when serving, 503 while shutting down (no key needed)
    GET  /v1/models              the model served, and each LoRA adapter served over it (``parent``: the base)
    GET  /metrics                Prometheus text (serving/metrics.py)
    POST /v1/completions         serving/api.py's fields; SSE with stream (then ``data: [DONE]``)
    POST /v1/chat/completions    the same, from chat messages through the chat template
    POST /v1/load_lora_adapter   vLLM's {"lora_name", "lora_path"}: a LoRA adapter served from now on
    POST /v1/unload_lora_adapter vLLM's {"lora_name"}: no longer served (the requests holding it finish first)

Status codes: 400 a bad field (``param`` names it) or a request that is not HTTP, 401 no or a wrong key, 404 another
model or path, 405 another method, 408 a body that did not arrive in time, 413 past a size limit, 415 a body that is
not JSON, 429 the queue full (``Retry-After``), 431 a request head past its bound, 500 a decoding call that failed
(the requests it held; the server goes on), 503 shutting down (a body still arriving is answered at once) or past the
open connections' limit (``Retry-After``). Every response with a status of 400 or more, whichever layer wrote it, is
OpenAI's error body, counted in ``flan_t5_rejected_requests_total{status}`` and logged in one line at
``--log_requests``' level (``Refusals``).

Connections: a connection that has not sent a whole request head within ``header_timeout`` seconds (of its opening,
or of the first byte of a later request on it) is closed, a body that has not arrived within ``body_timeout`` is a
408, an idle keep-alive connection is closed after ``keep_alive`` seconds, and while more than ``max_connections``
are open a request is a 503 (``Retry-After``) and its connection closed: slow or idle clients cannot hold the
server's file handles. /health and /metrics keep a small reserve past that limit (``ConnectionLimit``).

Who may call: with an API key every path but /health needs ``Authorization: Bearer KEY`` (401 otherwise; the key
compared in constant time, through SHA-256 so that not even its length shows, and never logged).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import http
import json
import logging
import socket
import time
from contextlib import aclosing, asynccontextmanager
from typing import Optional

import httptools
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from serving import api
from serving.engine import AdapterRequestError, Generation, PromptError
from serving.scheduler import Failed, QueueFull, SchedulerError, ShuttingDown
from utils.errors import ConfigError

logger = logging.getLogger("flan_t5")
OPEN_PATHS = ("/health",)
MONITOR_PATHS = ("/health", "/metrics")
MONITOR_RESERVE = 4  # /health and /metrics requests answered at once past --max_connections (a probe's, a scraper's)
RETRY_AFTER = 1  # seconds a 429 asks the client to wait
MAX_HEADER_BYTES = 16384  # a request's head (its line and headers) by default: h11's bound (httptools has none)
LOG_LEVELS = {"off": None, "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key if isinstance(key, bytes) else key.encode()).digest()


def to_api_error(e: Exception) -> api.ApiError:
    """Any error of the layers below as the status and body a client gets."""
    if isinstance(e, api.ApiError):
        return e
    if isinstance(e, PromptError):
        return api.ApiError(400, str(e), param=e.field, code=e.code)
    if isinstance(e, AdapterRequestError):  # (a request naming an adapter unloaded meanwhile too)
        return api.ApiError(404 if e.code == "model_not_found" else 400, str(e), code=e.code)
    if isinstance(e, QueueFull):
        return api.ApiError(429, f"{e}: the queue absorbs bursts up to --max_queue sequences; retry after "
                                 f"{RETRY_AFTER} s", code="queue_full", headers={"Retry-After": str(RETRY_AFTER)})
    if isinstance(e, ShuttingDown):
        return api.ApiError(503, str(e), code="shutting_down")
    if isinstance(e, Failed):
        return api.ApiError(503 if e.fatal else 500, str(e), code="server_error")
    return api.ApiError(500, f"internal error ({type(e).__name__})", code="server_error")


class Refusals:
    """Every response of status 400 or more: counted in ``flan_t5_rejected_requests_total{status}`` (``metrics``: the
    engine's; None: not counted) and, at ``level`` (--log_requests'; None: not logged), one log line saying what was
    refused, whose, and why (the error body's message), so that an operator finds the reason a client was given."""

    def __init__(self, metrics, level: Optional[int] = logging.INFO):
        self.metrics, self.level = metrics, level

    def __call__(self, status: int, why: str, what: str) -> None:
        if self.metrics is not None:
            self.metrics.rejected.labels(str(status)).inc()
        if self.level is not None:
            logger.log(self.level, "refused %s: %d %s", what, status, why)


def _request_of(scope) -> str:
    """A request as a refusal's log line names it: method, path, client."""
    client = scope.get("client")
    return "%s %s from %s" % (scope.get("method", "?"), scope.get("path", "?"),
                              "%s:%s" % tuple(client) if client else "?")


def _why(status: int, body: bytes) -> str:
    """A refusal's reason: its error body's message, else its status's name."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        try:
            return http.HTTPStatus(status).phrase
        except ValueError:
            return ""


class StatusCounter:
    """ASGI middleware, the outermost: every response of status 400 or more counted and logged (``Refusals``), and an
    exception nothing else caught answered with a JSON 500 (logged once), never a dropped connection. ``reading``:
    the bodies being read (``Completions``'), which ``Server`` refuses at shutdown."""

    def __init__(self, app, refusals: Refusals, reading: Optional["Reading"] = None):
        self.app, self.refusals, self.reading = app, refusals, reading

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status, body = False, 0, []

        async def counted(message):
            nonlocal started, status
            if message["type"] == "http.response.start":
                started, status = True, message["status"]
            elif status >= 400 and message["type"] == "http.response.body":
                body.append(message.get("body", b""))
                if not message.get("more_body", False):
                    self.refusals(status, _why(status, b"".join(body)), _request_of(scope))
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception as e:  # noqa: BLE001
            logger.exception("a request failed")
            if not started:
                error = to_api_error(e)
                await JSONResponse(error.body(), status_code=error.status)(scope, receive, counted)


class Connections:
    """The open connections (counted by the HTTP protocol: ``header_timeout_protocol``) and their limit (None:
    none)."""

    def __init__(self, limit: Optional[int] = None):
        self.limit, self.open = limit, 0

    @property
    def over(self) -> bool:
        return self.limit is not None and self.open > self.limit


class ConnectionLimit:
    """ASGI middleware: while more than ``--max_connections`` connections are open, a request is answered 503 with
    OpenAI's error body and ``Retry-After``, and its connection closed (what uvicorn's own limit answered was a
    text/plain 503 without either, which the metrics never saw: this sits inside StatusCounter). /health and /metrics
    keep a reserve of their own: up to ``reserve`` of them answered at once past the limit (their connections closed
    after), so that health checks and monitoring still see a flooded server."""

    def __init__(self, app, connections: Connections, reserve: int = MONITOR_RESERVE):
        self.app, self.connections, self.reserve = app, connections, reserve
        self.monitoring = 0  # /health and /metrics requests being answered past the limit

    async def __call__(self, scope, receive, send):
        c = self.connections
        if scope["type"] == "http" and c.over:
            if scope["path"] in MONITOR_PATHS and self.monitoring < self.reserve:
                return await self._monitor(scope, receive, send)
            error = api.ApiError(503, f"the server has {c.open} connections open, more than it serves at once "
                                      f"(--max_connections {c.limit}): retry after {RETRY_AFTER} s",
                                 code="too_many_connections")
            headers = {"Retry-After": str(RETRY_AFTER), "Connection": "close"}
            return await JSONResponse(error.body(), 503, headers)(scope, receive, send)
        return await self.app(scope, receive, send)

    async def _monitor(self, scope, receive, send):
        async def closing(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        self.monitoring += 1
        try:
            await self.app(scope, receive, closing)
        finally:
            self.monitoring -= 1


class BearerAuth:
    """ASGI middleware: every path but OPEN_PATHS needs ``Authorization: Bearer KEY``."""

    def __init__(self, app, key: str):
        self.app, self.digest = app, _digest(key)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(_digest(token.strip()), self.digest)):
                error = api.ApiError(401, "a valid API key is needed: pass the header Authorization: Bearer KEY",
                                     code="invalid_api_key")
                response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


class _Gone(Exception):
    """The client went away while sending its body."""


GONE = object()  # put on a reply's queue when its client goes away
TIMED_OUT, CLOSING = "timed out", "closing"  # why _read_body's task was cancelled by this layer


class Reading:
    """The requests whose bodies are being read (their tasks, each with its list of why it was cancelled). At shutdown
    (``refuse``) each is answered 503 at once, and a body that begins after is not read: none can be admitted. (Left
    to uvicorn's shutdown, they were waited for, then cancelled: a text/plain 500 and a 26-line traceback each.)"""

    def __init__(self):
        self.tasks: dict = {}
        self.closing = False

    def refuse(self) -> None:
        self.closing = True
        for task, why in list(self.tasks.items()):
            if not why:
                why.append(CLOSING)
                task.cancel()


async def _read_body(scope, receive, limit: int, timeout: float, reading: Optional[Reading] = None) -> bytes:
    """A JSON body, refused (413) as soon as it is known to pass ``limit`` bytes, (408) when it has not arrived in
    ``timeout`` seconds, (415) when it is not declared JSON, (503: ShuttingDown) when the server shuts down before it
    has arrived (``reading``: where it is registered meanwhile)."""
    headers = Headers(scope=scope)
    kind = headers.get("content-type", "")
    if kind.split(";")[0].strip().lower() != "application/json":
        raise api.ApiError(415, f"the body must be JSON, sent with Content-Type: application/json (got "
                                f"{kind[:60]!r})", code="unsupported_media_type")
    length = headers.get("content-length")

    def too_big():  # (made only when raised, not for every request)
        return api.ApiError(413, f"the request body is larger than {limit} bytes (--max_body_bytes)",
                            code="body_too_large")

    if length is not None and length.isdigit() and int(length) > limit:
        raise too_big()
    reading = reading or Reading()
    if reading.closing:
        raise ShuttingDown("the server is shutting down: no new requests")
    chunks, n = [], 0
    # the timeout as a timer that cancels this task (no task of its own, as asyncio.wait_for would make; and
    # asyncio.timeout needs Python 3.11)
    task, fired = asyncio.current_task(), []
    timer = asyncio.get_running_loop().call_later(
        timeout, lambda: fired or (fired.append(TIMED_OUT), task.cancel()))
    reading.tasks[task] = fired
    try:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Gone(f"the client went away while sending its request ({n} bytes read)")
            n += len(message.get("body", b""))
            if n > limit:
                raise too_big()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks)
    except asyncio.CancelledError:
        if not fired:  # a cancellation from elsewhere: it goes on
            raise
        if hasattr(task, "uncancel"):  # (Python 3.11+: the task is not left marked as being cancelled)
            task.uncancel()
        if fired[0] == CLOSING:
            raise ShuttingDown("the server shut down before this request's body arrived") from None
        raise api.ApiError(408, f"the request body did not arrive within {timeout:g} s", code="timeout") from None
    finally:
        timer.cancel()
        reading.tasks.pop(task, None)


def body(reply: Generation) -> dict:
    """A whole completion's body: the chosen candidates, their usage."""
    chosen = reply.chosen()
    choices = [api.choice(reply.req, k, reply.texts[i], reply.reasons[i], reply.logprobs[i], *_ids(reply, i))
               for k, i in enumerate(chosen)]
    return api.completion(reply.req, reply.id, reply.created, _model(reply), choices, usage(reply, chosen))


def chunk(reply: Generation, ev) -> dict:
    """A streamed event's chunk (before ``take`` counts it); with vLLM's ``continuous_usage_stats`` its usage: its
    prompt's tokens and its choice's tokens so far, this event's included."""
    first = reply.counts[ev.index] == 0 and not reply.texts[ev.index]
    ids, prompt = _ids(reply, ev.index)
    c = api.choice(reply.req, ev.index, ev.text, ev.finish_reason, ev.logprobs, ev.token_ids if ids is not None
                   else None, prompt if first else None, delta=first if reply.req.chat else None)
    use = None
    if reply.req.continuous_usage_stats:
        use = api.usage(len(reply.prompt_ids[ev.index // reply.req.best_of]), ev.completion_tokens)
    return api.completion(reply.req, reply.id, reply.created, _model(reply), [c], use, chunk=True)


def _model(reply: Generation) -> str:
    """The model id a completion names: the one its request named (the base's, or a LoRA adapter's)."""
    return reply.req.model or reply.engine.model_id


def usage(reply: Generation, seqs: list) -> dict:
    return api.usage(sum(map(len, reply.prompt_ids)), sum(reply.counts[i] for i in seqs))


def _ids(reply: Generation, i: int) -> tuple:
    return (reply.token_ids[i], reply.prompt_ids[i // reply.req.best_of]) if reply.req.return_token_ids else (None,
                                                                                                            None)


def _ended(reply: Generation, error: api.ApiError) -> api.ApiError:
    """A request that an error ended (a failed decoding call, a shutdown's grace period over): one line, no
    traceback (the error is the scheduler's, the same for every request it ended; what failed is logged once, where
    it failed), whatever the number of requests it ends."""
    logger.warning("%s ended with an error (%d %s): %s", reply.id, error.status, error.code, error.message)
    return error


async def _whole(reply: Generation):
    """A completion's body at its end, or the ApiError that ended it; None when its client went away (its sequences
    cancelled: their slots freed before the next call)."""
    try:
        while reply.pending():
            ev = await reply.queue.get()
            if ev is GONE:
                return None
            if ev.error is not None:
                return _ended(reply, to_api_error(ev.error))
            reply.take(ev)
        return body(reply)
    finally:
        reply.cancel()  # (gone, failed, or the task cancelled: the slots freed before the next call)


async def _stream(reply: Generation):
    """Server-sent events: a chunk per sequence with something new (the events that came while the last write was
    made go out in one write), the last with its finish_reason, the usage
    (stream_options.include_usage), ``[DONE]``; an error as an error event. A client that goes away (``GONE``)
    ends the stream, and cancels its sequences."""
    try:
        failed = False
        while reply.pending() and not failed:
            events, out = [await reply.queue.get()], []
            while not reply.queue.empty():  # the events that came meanwhile go in the same write (fewer sends)
                events.append(reply.queue.get_nowait())
            for ev in events:
                if ev is GONE:
                    return
                if ev.error is not None:
                    out.append(_sse(_ended(reply, to_api_error(ev.error)).body()))
                    failed = True
                    break
                piece = chunk(reply, ev)
                reply.take(ev)
                out.append(_sse(piece))
            if not reply.pending() and reply.req.include_usage:  # (an error leaves its sequence pending)
                last = api.completion(reply.req, reply.id, reply.created, _model(reply), [], None, chunk=True)
                out.append(_sse({**last, "usage": usage(reply, list(range(len(reply.seqs))))}))
            if not reply.pending() or failed:
                out.append("data: [DONE]\n\n")
            yield "".join(out)
    finally:
        reply.cancel()


SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


def _watched(f: asyncio.Future, reply: Generation) -> None:
    """The task waiting on ``receive`` after the body ended: a disconnect (or an error reading) is the client gone."""
    if f.cancelled():
        return
    if f.exception() is not None or f.result()["type"] == "http.disconnect":
        reply.gone = True
        reply.queue.put_nowait(GONE)


def _gone(why: str) -> JSONResponse:
    """nginx's "client closed request", 499: written nowhere, counted and logged (StatusCounter) with ``why``."""
    return JSONResponse(api.ApiError(499, why, code="client_gone").body(), 499)


class Completions:
    """ASGI: POST /v1/completions and /v1/chat/completions, answered here, in front of FastAPI (which serves the
    other paths, and their 404s and 405s). A request is its body read, checked, tokenized and submitted, then its
    answer written straight to uvicorn: none of FastAPI's request machinery or Starlette's streaming response (a
    task group and a task a request) on the path every token takes; a task waiting on ``receive`` notices a client
    that goes away (``GONE`` on its reply's queue). On this project's 2-core CPU machine the HTTP thread's CPU time
    a request fell by about a third (docs/serving.md)."""

    def __init__(self, app, engine, body_timeout: float):
        self.app, self.engine, self.body_timeout = app, engine, body_timeout
        self.paths = {"/v1/completions": self._completion, "/v1/chat/completions": self._chat}
        self.reading = Reading()

    async def __call__(self, scope, receive, send):
        parse = self.paths.get(scope["path"].rstrip("/")) if scope["type"] == "http" else None
        if parse is None:
            return await self.app(scope, receive, send)
        if scope["method"] != "POST":
            return await JSONResponse(api.error_body("Method Not Allowed", "invalid_request_error"), 405,
                                      {"Allow": "POST"})(scope, receive, send)
        try:
            raw = await _read_body(scope, receive, self.engine.limits.max_body_bytes, self.body_timeout,
                                   self.reading)
            req, prompts = parse(raw)
            reply = self.engine.generate(req, prompts)
        except _Gone as e:
            return await _gone(str(e))(scope, receive, send)
        except (api.ApiError, PromptError, AdapterRequestError, SchedulerError) as e:  # refusals (else: a 500)
            error = to_api_error(e)
            return await JSONResponse(error.body(), error.status, error.headers)(scope, receive, send)
        watch = asyncio.ensure_future(receive())  # the body is read: the next message says the client went away
        watch.add_done_callback(lambda f: _watched(f, reply))
        try:
            if req.stream:
                await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
                async with aclosing(_stream(reply)) as writes:  # (its cancels run now, whatever ends it)
                    async for data in writes:
                        await send({"type": "http.response.body", "body": data.encode(), "more_body": True})
                if not reply.gone:  # (a client gone gets nothing more)
                    await send({"type": "http.response.body", "body": b""})
            else:
                whole = await _whole(reply)
                if isinstance(whole, api.ApiError):
                    await JSONResponse(whole.body(), whole.status, whole.headers)(scope, receive, send)
                else:
                    await (_gone("the client went away before its answer") if whole is None else
                           JSONResponse(whole))(scope, receive, send)
        finally:
            watch.cancel()

    def _completion(self, raw: bytes) -> tuple:
        engine = self.engine
        req = api.parse_completion(raw, engine.limits, engine.model_ids)
        return req, [(engine.tokenize(p), engine.prompt_text(p) if req.echo else None) for p in req.prompts]

    def _chat(self, raw: bytes) -> tuple:
        engine = self.engine
        req = api.parse_chat(raw, engine.limits, engine.model_ids)
        text = engine.render_chat(req.messages, req.add_generation_prompt)
        last = req.messages[-1]  # vLLM's chat echo: the last message, where the answer continues its role's
        return req, [(engine.tokenize(text), last["content"] if last["role"] == "assistant" else None)]


def make_app(engine, api_key: Optional[str] = None, body_timeout: float = 30.0, on_fatal=lambda error: None,
             connections: Optional[Connections] = None, refusals: Optional[Refusals] = None):
    """The ASGI application over ``engine`` (see the module docstring); ``connections``: the open connections that
    ``header_timeout_protocol`` counts, and their limit; ``refusals``: where a refusal is counted and logged (the
    engine's metrics, at INFO, by default)."""

    @asynccontextmanager
    async def lifespan(app):
        loop = asyncio.get_running_loop()

        def route(events):
            for sink, ev in events:
                sink.put_nowait(ev)

        engine.start(lambda events: loop.call_soon_threadsafe(route, events), on_fatal)
        yield
        engine.stop()

    app = FastAPI(title="flan-t5 server", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    _error_handlers(app)
    _info_routes(app, engine)
    _adapter_routes(app, engine, body_timeout)
    outer = Completions(app, engine, body_timeout)
    reading = outer.reading
    if api_key:
        outer = BearerAuth(outer, key=api_key)
    if connections is not None:
        outer = ConnectionLimit(outer, connections)
    return StatusCounter(outer, refusals or Refusals(engine.metrics), reading)


def _error_handlers(app) -> None:
    @app.exception_handler(Exception)
    async def failed(request, e: Exception):  # (Starlette's last resort: a JSON 500, not its text; StatusCounter logs)
        error = to_api_error(e)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(api.ApiError)
    async def refused(request, e: api.ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return JSONResponse(api.error_body(str(e.detail), "invalid_request_error"), status_code=e.status_code,
                            headers=getattr(e, "headers", None))


def _info_routes(app, engine) -> None:
    @app.get("/health")
    async def health():
        if not engine.healthy:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return api.models(engine.model_id, engine.created, engine.models())

    @app.get("/metrics")
    async def prometheus():
        return Response(engine.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _adapter_routes(app, engine, body_timeout: float) -> None:
    """vLLM's routes that load and unload LoRA adapters while the server runs (behind the API key, as every path but
    /health): 200 with a line of text, or OpenAI's error body (400 a bad body or an adapter refused: its reason; 404
    an unload of an adapter not served)."""

    async def body(request: Request) -> bytes:
        return await _read_body(request.scope, request.receive, engine.limits.max_body_bytes, body_timeout)

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request):
        name, path = api.parse_load_adapter(await body(request))
        try:
            await engine.load_adapter(name, path)
        except AdapterRequestError as e:
            raise to_api_error(e) from None
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request):
        name = api.parse_unload_adapter(await body(request))
        try:
            await engine.unload_adapter(name)
        except AdapterRequestError as e:
            raise to_api_error(e) from None
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")


class Protocol(HttpToolsProtocol):
    """uvicorn's HTTP protocol (httptools'), closing a connection that has not sent a whole request head within
    ``timeout`` seconds: of opening, for its first request; of the first byte of the next, for each later one.
    (uvicorn's keep-alive timeout closes a connection idle after a response, but only until a byte arrives: a
    connection that sent one byte of its next request and then nothing was held open for good.) ``counted``: the open
    connections. What the application never sees is answered as it answers: a head past ``max_header_bytes`` (its
    request line and headers; httptools has no bound, and held a 69 MB header) a 431, and a request that is not HTTP
    (``Content-Length: -5``, TLS on the plain port) a 400, each OpenAI's error body, counted and logged by
    ``refusals`` (uvicorn's own were a text/plain 400, uncounted, its line without a time). ``header_timeout_protocol``
    makes one with its settings."""

    timeout: float = 10.0
    counted: Connections = Connections()
    refusals: Optional[Refusals] = None
    max_header_bytes: int = MAX_HEADER_BYTES

    def connection_made(self, transport) -> None:
        self.counted.open += 1
        super().connection_made(transport)
        self.header_timer = self.loop.call_later(self.timeout, self.header_timeout)
        self.head_bytes = 0  # bytes read while the head being read was incomplete

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        # a next request begins (not the rest of a body its request's early answer, a 413, did not wait for)
        if self.header_timer is None and (cycle is None or cycle.response_complete and not cycle.more_body):
            self.header_timer = self.loop.call_later(self.timeout, self.header_timeout)
            self.head_bytes = 0
        if self.header_timer is not None:
            self.head_bytes += len(data)
        if not self._parse(data):
            return
        if self.cycle is not cycle and self.header_timer is not None:  # a whole head came: its request runs
            self.header_timer.cancel()
            self.header_timer = None
        elif self.header_timer is not None and self.head_bytes > self.max_header_bytes:  # a head that goes on
            self._too_large()

    def _parse(self, data: bytes) -> bool:
        """uvicorn's parsing (HttpToolsProtocol.data_received), a malformed request refused as the application
        refuses one -> whether the connection goes on."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError as e:
            if self.head_bytes > self.max_header_bytes:  # (raised by on_headers_complete)
                self._too_large()
            else:
                self.refuse(400, f"a malformed HTTP request ({str(e)[:100]}): this server reads plain HTTP/1.1",
                            "malformed_request")
            return False
        return True

    def on_headers_complete(self) -> None:
        size = len(self.url) + sum(len(k) + len(v) for k, v in self.headers)
        if size > self.max_header_bytes:
            self.head_bytes = size
            raise ValueError("head too large")  # (the parser stops: _parse refuses it)
        super().on_headers_complete()

    def _too_large(self) -> None:
        self.refuse(431, f"the request's head (its line and headers) is larger than {self.max_header_bytes} bytes "
                         "(--max_header_bytes)", "header_too_large")

    def refuse(self, status: int, message: str, code: str) -> None:
        """Answers ``status`` with OpenAI's error body and closes the connection."""
        body = json.dumps(api.ApiError(status, message, code=code).body()).encode()
        head = [STATUS_LINE[status]] + [b"%s: %s\r\n" % kv for kv in self.server_state.default_headers]
        head += [b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)]
        self.transport.write(b"".join(head) + body)
        self.transport.close()
        if self.refusals is not None:
            self.refusals(status, message, "a request from %s" % ("%s:%s" % tuple(self.client) if self.client else "?"))

    def header_timeout(self) -> None:
        self.header_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self.counted.open -= 1
        if self.header_timer is not None:
            self.header_timer.cancel()
        super().connection_lost(exc)


def header_timeout_protocol(timeout: float, connections: Optional[Connections] = None,
                            refusals: Optional[Refusals] = None, max_header_bytes: int = MAX_HEADER_BYTES):
    """``Protocol`` with these settings (uvicorn's ``http``): a head within ``timeout`` seconds and
    ``max_header_bytes``, the open connections counted in ``connections``, refusals counted and logged by
    ``refusals``."""
    return type("Protocol", (Protocol,), dict(timeout=timeout, counted=connections or Connections(),
                                              refusals=refusals, max_header_bytes=max_header_bytes))


class Server(uvicorn.Server):
    """uvicorn, with SIGTERM (or Ctrl-C) as a drain: no new requests (503), the held ones finished, those still held
    after ``grace`` seconds ended with an error, then the process exits normally (exit 0). A second signal ends
    the held requests at once. The line saying where it serves is printed once it listens. A decoding loop that
    stopped for good (``fatal``) stops the server too, for a non-zero exit."""

    def __init__(self, config: uvicorn.Config, engine, grace: float, banner):
        super().__init__(config)
        self.engine, self.grace, self.banner = engine, grace, banner
        self.reading: Optional[Reading] = getattr(config.app, "reading", None)  # (make_app's)
        self.deadline: Optional[float] = None
        self.aborted = False
        self.fatal: Optional[Exception] = None

    def handle_exit(self, sig, frame) -> None:  # not re-raised at the end, as uvicorn's own is: the exit is clean
        if self.deadline is None:
            self.engine.drain()
            self.deadline = time.monotonic() + self.grace
            logger.info("signal %d: no new requests; finishing the %d requests held (grace period %g s)", sig,
                        self.engine.held_requests(), self.grace)
        else:
            self.deadline = time.monotonic()
        if time.monotonic() >= self.deadline:  # no grace: the held requests end at the next decoding call, not tick
            self._abort()

    def stop_fatally(self, error: Exception) -> None:
        """The decoding loop's ``on_fatal`` (from its thread): the server stops, the process exits non-zero."""
        self.fatal = error
        self.should_exit = True

    def _abort(self) -> None:
        """Every request still held ends with an error (once)."""
        if self.engine.held() and not self.aborted:
            logger.warning("grace period over: ending the %d requests still held with an error",
                           self.engine.held_requests())
            self.engine.abort(ShuttingDown("the server shut down before this request finished"))
            self.aborted = True

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.banner(host, port)

    async def on_tick(self, counter: int) -> bool:
        if self.deadline is not None:
            if self.reading is not None:  # the bodies still arriving: 503 at once (none can be admitted)
                self.reading.refuse()
            if time.monotonic() >= self.deadline:
                self._abort()
            if not self.engine.held():
                self.should_exit = True
        return await super().on_tick(counter)


def check_port(host: str, port: int) -> None:
    """ConfigError (one line) when ``port`` on ``host`` cannot be listened on (another process holds it), found
    before the model is loaded and compiled: uvicorn found it after them (Errno 98, exit 3). Bound as uvicorn binds
    (SO_REUSEADDR), then released; port 0 (any free one) is never taken."""
    if not port:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ConfigError(f"--host {host} is no address of this machine ({e.strerror}): pass one it has (127.0.0.1, "
                          "0.0.0.0)") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as e:
            raise ConfigError(f"port {port} on {host} cannot be listened on ({e.strerror}: another server holds "
                              "it?): stop it, or pass another --port (0: any free one)") from None


def serve(engine, host: str, port: int, api_key: Optional[str], grace: float, banner, header_timeout: float = 10.0,
          body_timeout: float = 30.0, keep_alive: int = 30, max_connections: Optional[int] = 1024,
          max_header_bytes: int = MAX_HEADER_BYTES, log_requests: Optional[int] = logging.INFO,
          access_log: bool = False) -> None:
    """Serves ``engine`` until a signal (see ``Server``); ``banner(host, port)`` once it listens. SystemExit(1) when
    the decoding loop stopped for good. ``log_requests``: the level of a refusal's line (None: none); ``access_log``:
    uvicorn's line a request. uvicorn's own lines go through this process's logging (its format, with the time)."""
    holder: list = []
    connections = Connections(max_connections)
    refusals = Refusals(engine.metrics, log_requests)
    app = make_app(engine, api_key, body_timeout, on_fatal=lambda error: holder[0].stop_fatally(error),
                   connections=connections, refusals=refusals)
    # keep-alive 30 s (uvicorn's 5): pooled client connections (the openai client's) are closed under them less
    # often, the race where a request starts on a connection the server is closing. The connection limit is the
    # app's (ConnectionLimit), not uvicorn's limit_concurrency
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=access_log, log_config=None,
                            timeout_graceful_shutdown=10, timeout_keep_alive=keep_alive, lifespan="on",
                            http=header_timeout_protocol(header_timeout, connections, refusals, max_header_bytes))
    if access_log:
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    server = Server(config, engine, grace, banner)
    holder.append(server)
    server.run()
    if server.fatal is not None:
        logger.error("%s", server.fatal)
        raise SystemExit(1)
