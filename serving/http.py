"""The HTTP layer: OpenAI's completions and chat completions APIs on FastAPI (Starlette) served by uvicorn. It knows
nothing of models: it checks requests (serving/api.py), asks the engine (serving/engine.py) to tokenize and
``generate`` them, writes the bodies and streams of what the engine's events say, and maps every error to a status
code (here alone).

FastAPI + uvicorn: the maintained ASGI stack that vLLM's and TGI's OpenAI front ends use, with a lifespan for the
engine's threads, and uvicorn's graceful shutdown, on which SIGTERM's drain is built (``Server``). The two completions
endpoints, which every token passes through, are a lean ASGI layer in front of FastAPI (``Completions``): their
server-sent events written straight to uvicorn, a client that goes away noticed by a task waiting on ``receive``.

    GET  /health                 200 when serving, 503 while shutting down (no key needed)
    GET  /v1/models              the model served
    GET  /metrics                Prometheus text (serving/metrics.py)
    POST /v1/completions         serving/api.py's fields; SSE with stream (then ``data: [DONE]``)
    POST /v1/chat/completions    the same, from chat messages through the chat template

Status codes: 400 a bad field (``param`` names it), 401 no or a wrong key, 404 another model or path, 405 another
method, 408 a body that did not arrive in time, 413 past a size limit, 415 a body that is not JSON, 429 the queue
full (``Retry-After``), 500 a decoding call that failed (the requests it held; the server goes on), 503 shutting
down or past the open connections' limit (``Retry-After``). Every response with a status of 400 or more is counted
in ``flan_t5_rejected_requests_total{status}``.

Connections: a connection that has not sent a whole request head within ``header_timeout`` seconds (of its opening,
or of the first byte of a later request on it) is closed, a body that has not arrived within ``body_timeout`` is a
408, an idle keep-alive connection is closed after ``keep_alive`` seconds, and while more than ``max_connections``
are open a request is a 503 (``Retry-After``) and its connection closed: slow or idle clients cannot hold the
server's file handles.

Who may call: with an API key every path but /health needs ``Authorization: Bearer KEY`` (401 otherwise; the key
compared in constant time, through SHA-256 so that not even its length shows, and never logged).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from contextlib import aclosing, asynccontextmanager
from typing import Optional

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from serving import api
from serving.engine import Generation, PromptError
from serving.scheduler import Failed, QueueFull, SchedulerError, ShuttingDown

logger = logging.getLogger("flan_t5")
OPEN_PATHS = ("/health",)
RETRY_AFTER = 1  # seconds a 429 asks the client to wait


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key if isinstance(key, bytes) else key.encode()).digest()


def to_api_error(e: Exception) -> api.ApiError:
    """Any error of the layers below as the status and body a client gets."""
    if isinstance(e, api.ApiError):
        return e
    if isinstance(e, PromptError):
        return api.ApiError(400, str(e), param=e.field, code=e.code)
    if isinstance(e, QueueFull):
        return api.ApiError(429, f"{e}: the queue absorbs bursts up to --max_queue sequences; retry after "
                                 f"{RETRY_AFTER} s", code="queue_full", headers={"Retry-After": str(RETRY_AFTER)})
    if isinstance(e, ShuttingDown):
        return api.ApiError(503, str(e), code="shutting_down")
    if isinstance(e, Failed):
        return api.ApiError(503 if e.fatal else 500, str(e), code="server_error")
    return api.ApiError(500, f"internal error ({type(e).__name__})", code="server_error")


class StatusCounter:
    """ASGI middleware, the outermost: counts every response of status 400 or more by status, and answers an
    exception nothing else caught with a JSON 500 (logged once), never a dropped connection."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def counted(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] >= 400:
                    self.metrics.rejected.labels(str(message["status"])).inc()
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
    text/plain 503 without either, which the metrics never saw: this sits inside StatusCounter)."""

    def __init__(self, app, connections: Connections):
        self.app, self.connections = app, connections

    async def __call__(self, scope, receive, send):
        c = self.connections
        if scope["type"] == "http" and c.over:
            error = api.ApiError(503, f"the server has {c.open} connections open, more than it serves at once "
                                      f"(--max_connections {c.limit}): retry after {RETRY_AFTER} s",
                                 code="too_many_connections")
            headers = {"Retry-After": str(RETRY_AFTER), "Connection": "close"}
            return await JSONResponse(error.body(), 503, headers)(scope, receive, send)
        return await self.app(scope, receive, send)


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


async def _read_body(scope, receive, limit: int, timeout: float) -> bytes:
    """A JSON body, refused (413) as soon as it is known to pass ``limit`` bytes, (408) when it has not arrived in
    ``timeout`` seconds, (415) when it is not declared JSON."""
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
    chunks, n = [], 0
    # the timeout as a timer that cancels this task (no task of its own, as asyncio.wait_for would make; and
    # asyncio.timeout needs Python 3.11)
    task, fired = asyncio.current_task(), []
    timer = asyncio.get_running_loop().call_later(timeout, lambda: (fired.append(True), task.cancel()))
    try:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                client = scope.get("client")
                logger.info("a client (%s) went away while sending its request (%d bytes read)",
                            "%s:%s" % tuple(client) if client else "?", n)
                raise _Gone()
            n += len(message.get("body", b""))
            if n > limit:
                raise too_big()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks)
    except asyncio.CancelledError:
        if not fired:  # a cancellation from elsewhere (shutdown): it goes on
            raise
        if hasattr(task, "uncancel"):  # (Python 3.11+: the task is not left marked as being cancelled)
            task.uncancel()
        raise api.ApiError(408, f"the request body did not arrive within {timeout:g} s", code="timeout") from None
    finally:
        timer.cancel()


def body(reply: Generation) -> dict:
    """A whole completion's body: the chosen candidates, their usage."""
    chosen = reply.chosen()
    choices = [api.choice(reply.req, k, reply.texts[i], reply.reasons[i], reply.logprobs[i], *_ids(reply, i))
               for k, i in enumerate(chosen)]
    return api.completion(reply.req, reply.id, reply.created, reply.engine.model_id, choices, usage(reply, chosen))


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
    return api.completion(reply.req, reply.id, reply.created, reply.engine.model_id, [c], use, chunk=True)


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
                last = api.completion(reply.req, reply.id, reply.created, reply.engine.model_id, [], None, chunk=True)
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


GONE_RESPONSE = Response(status_code=499)  # nginx's "client closed request": written nowhere, counted in the metrics


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

    async def __call__(self, scope, receive, send):
        parse = self.paths.get(scope["path"].rstrip("/")) if scope["type"] == "http" else None
        if parse is None:
            return await self.app(scope, receive, send)
        if scope["method"] != "POST":
            return await JSONResponse(api.error_body("Method Not Allowed", "invalid_request_error"), 405,
                                      {"Allow": "POST"})(scope, receive, send)
        try:
            raw = await _read_body(scope, receive, self.engine.limits.max_body_bytes, self.body_timeout)
            req, prompts = parse(raw)
            reply = self.engine.generate(req, prompts)
        except _Gone:
            return await GONE_RESPONSE(scope, receive, send)
        except (api.ApiError, PromptError, SchedulerError) as e:  # refusals (anything else: StatusCounter's 500)
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
                    await (GONE_RESPONSE if whole is None else JSONResponse(whole))(scope, receive, send)
        finally:
            watch.cancel()

    def _completion(self, raw: bytes) -> tuple:
        engine = self.engine
        req = api.parse_completion(raw, engine.limits, engine.model_id)
        return req, [(engine.tokenize(p), engine.prompt_text(p) if req.echo else None) for p in req.prompts]

    def _chat(self, raw: bytes) -> tuple:
        engine = self.engine
        req = api.parse_chat(raw, engine.limits, engine.model_id)
        text = engine.render_chat(req.messages, req.add_generation_prompt)
        last = req.messages[-1]  # vLLM's chat echo: the last message, where the answer continues its role's
        return req, [(engine.tokenize(text), last["content"] if last["role"] == "assistant" else None)]


def make_app(engine, api_key: Optional[str] = None, body_timeout: float = 30.0, on_fatal=lambda error: None,
             connections: Optional[Connections] = None):
    """The ASGI application over ``engine`` (see the module docstring); ``connections``: the open connections that
    ``header_timeout_protocol`` counts, and their limit."""

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
    outer = Completions(app, engine, body_timeout)
    if api_key:
        outer = BearerAuth(outer, key=api_key)
    if connections is not None:
        outer = ConnectionLimit(outer, connections)
    return StatusCounter(outer, metrics=engine.metrics)


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
        return api.models(engine.model_id, engine.created)

    @app.get("/metrics")
    async def prometheus():
        return Response(engine.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")


def header_timeout_protocol(timeout: float, connections: Optional[Connections] = None):
    """uvicorn's HTTP protocol, closing a connection that has not sent a whole request head within ``timeout``
    seconds: of opening, for its first request; of the first byte of the next, for each later one. (uvicorn's
    keep-alive timeout closes a connection idle after a response, but only until a byte arrives: a connection that
    sent one byte of its next request and then nothing was held open for good.) ``connections``: counts the open
    ones."""
    counted = connections or Connections()

    class Protocol(AutoHTTPProtocol):
        def connection_made(self, transport) -> None:
            counted.open += 1
            super().connection_made(transport)
            self.header_timer = self.loop.call_later(timeout, self.header_timeout)

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            if self.header_timer is None and (cycle is None or cycle.response_complete):  # a next request begins
                self.header_timer = self.loop.call_later(timeout, self.header_timeout)
            super().data_received(data)
            if self.cycle is not cycle and self.header_timer is not None:  # a whole head came: its request runs
                self.header_timer.cancel()
                self.header_timer = None

        def header_timeout(self) -> None:
            self.header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc) -> None:
            counted.open -= 1
            if self.header_timer is not None:
                self.header_timer.cancel()
            super().connection_lost(exc)

    return Protocol


class Server(uvicorn.Server):
    """uvicorn, with SIGTERM (or Ctrl-C) as a drain: no new requests (503), the held ones finished, those still held
    after ``grace`` seconds ended with an error, then the process exits normally (exit 0). A second signal ends
    the held requests at once. The line saying where it serves is printed once it listens. A decoding loop that
    stopped for good (``fatal``) stops the server too, for a non-zero exit."""

    def __init__(self, config: uvicorn.Config, engine, grace: float, banner):
        super().__init__(config)
        self.engine, self.grace, self.banner = engine, grace, banner
        self.deadline: Optional[float] = None
        self.aborted = False
        self.fatal: Optional[Exception] = None

    def handle_exit(self, sig, frame) -> None:  # not re-raised at the end, as uvicorn's own is: the exit is clean
        if self.deadline is None:
            self.engine.drain()
            self.deadline = time.monotonic() + self.grace
            logger.info("signal %d: no new requests; finishing the %d held (grace period %g s)", sig,
                        self.engine.held(), self.grace)
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
        held = self.engine.held()
        if held and not self.aborted:
            logger.warning("grace period over: ending the %d requests still held with an error", held)
            self.engine.abort(ShuttingDown("the server shut down before this request finished"))
            self.aborted = True

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.banner(host, port)

    async def on_tick(self, counter: int) -> bool:
        if self.deadline is not None:
            if time.monotonic() >= self.deadline:
                self._abort()
            if not self.engine.held():
                self.should_exit = True
        return await super().on_tick(counter)


def serve(engine, host: str, port: int, api_key: Optional[str], grace: float, banner, header_timeout: float = 10.0,
          body_timeout: float = 30.0, keep_alive: int = 30, max_connections: Optional[int] = 1024) -> None:
    """Serves ``engine`` until a signal (see ``Server``); ``banner(host, port)`` once it listens. SystemExit(1) when
    the decoding loop stopped for good."""
    holder: list = []
    connections = Connections(max_connections)
    app = make_app(engine, api_key, body_timeout, on_fatal=lambda error: holder[0].stop_fatally(error),
                   connections=connections)
    # keep-alive 30 s (uvicorn's 5): pooled client connections (the openai client's) are closed under them less
    # often, the race where a request starts on a connection the server is closing. The connection limit is the
    # app's (ConnectionLimit), not uvicorn's limit_concurrency
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=10, timeout_keep_alive=keep_alive, lifespan="on",
                            http=header_timeout_protocol(header_timeout, connections))
    server = Server(config, engine, grace, banner)
    holder.append(server)
    server.run()
    if server.fatal is not None:
        logger.error("%s", server.fatal)
        raise SystemExit(1)
