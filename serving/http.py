"""The HTTP layer: OpenAI's completions API on FastAPI (Starlette) served by uvicorn. It knows nothing of models:
it checks requests (serving/api.py), asks the engine to tokenize and to submit, and streams what the scheduler's
events say.

FastAPI + uvicorn: the maintained ASGI stack that vLLM's and TGI's OpenAI front ends use, with server-sent events
(Starlette's StreamingResponse, which notices a client that goes away), a lifespan for the scheduler's thread, and
uvicorn's graceful shutdown, on which SIGTERM's drain is built (``Server``).

    GET  /health           200 when serving, 503 while shutting down (no key needed)
    GET  /v1/models        the model served
    GET  /metrics          Prometheus text (serving/metrics.py)
    POST /v1/completions   string or list prompt, max_tokens, temperature (0: greedy), top_p, top_k, seed, stop,
                           n=1, stream (SSE, then ``data: [DONE]``), usage

The engine answers ``model_id``, ``created``, ``limits`` (api.Limits), ``tokenize(text) -> ids`` (ApiError 400 for a
prompt past the limit), ``scheduler`` (serving/scheduler.py) and ``metrics``.

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
import uuid
from contextlib import asynccontextmanager
from typing import Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from serving import api
from serving.scheduler import Sequence

logger = logging.getLogger("flan_t5")
OPEN_PATHS = ("/health",)
POLL = 0.25  # seconds between checks that a client still waits for a whole completion


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key if isinstance(key, bytes) else key.encode()).digest()


class BearerAuth:
    """ASGI middleware: every path but OPEN_PATHS needs ``Authorization: Bearer KEY``."""

    def __init__(self, app, key: str, metrics):
        self.app, self.digest, self.metrics = app, _digest(key), metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(_digest(token.strip()), self.digest)):
                self.metrics.rejected.labels("401").inc()
                error = api.ApiError(401, "a valid API key is needed: pass the header Authorization: Bearer KEY",
                                     code="invalid_api_key")
                response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to pass ``limit`` bytes."""
    length = request.headers.get("content-length")
    too_big = api.ApiError(413, f"the request body is larger than {limit} bytes (--max_body_bytes)",
                           code="body_too_large")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_big
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


class _Reply:
    """One completions request in flight: its sequences, the queue their events arrive on, its id."""

    def __init__(self, engine, req: api.Completion, prompt_ids: list):
        self.engine, self.req, self.prompt_ids = engine, req, prompt_ids
        self.queue: asyncio.Queue = asyncio.Queue()
        self.seqs = [Sequence(ids, req.max_tokens, req.temperature, req.top_p, req.top_k, req.seed, req.stop,
                              req.stream, i, self.queue) for i, ids in enumerate(prompt_ids)]
        self.id, self.created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        self.texts, self.token_ids = [""] * len(self.seqs), [[] for _ in self.seqs]
        self.reasons: list = [None] * len(self.seqs)
        self.counts = [0] * len(self.seqs)

    def pending(self) -> int:
        return sum(r is None for r in self.reasons)

    def take(self, ev) -> None:
        if ev.error is not None:
            raise ev.error
        self.texts[ev.index] += ev.text
        self.token_ids[ev.index] += ev.token_ids
        self.counts[ev.index] = ev.completion_tokens
        if ev.finish_reason:
            self.reasons[ev.index] = ev.finish_reason

    def usage(self) -> dict:
        return api.usage(sum(map(len, self.prompt_ids)), sum(self.counts))

    def body(self) -> dict:
        ids = self.req.return_token_ids
        choices = [api.choice(i, self.texts[i], self.reasons[i], self.token_ids[i] if ids else None,
                              self.prompt_ids[i] if ids else None) for i in range(len(self.seqs))]
        return api.completion(self.id, self.created, self.engine.model_id, choices, self.usage())

    def chunk(self, ev) -> dict:
        ids = self.req.return_token_ids
        first = ids and self.counts[ev.index] == 0
        c = api.choice(ev.index, ev.text, ev.finish_reason, ev.token_ids if ids else None,
                       self.prompt_ids[ev.index] if first else None)
        return api.completion(self.id, self.created, self.engine.model_id, [c], None)


async def _whole(request: Request, reply: _Reply) -> JSONResponse:
    """A completion answered at its end; a client that goes away cancels it (its slots freed at the next step)."""
    while reply.pending():
        try:
            ev = await asyncio.wait_for(reply.queue.get(), POLL)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                reply.engine.scheduler.cancel(reply.seqs)
                return Response(status_code=499)
            continue
        try:
            reply.take(ev)
        except api.ApiError:
            reply.engine.scheduler.cancel(reply.seqs)
            raise
    return JSONResponse(reply.body())


async def _stream(reply: _Reply):
    """Server-sent events: a chunk per sequence per step with new text, the last with its finish_reason, the usage
    (stream_options.include_usage), ``[DONE]``. A client that goes away cancels the stream (Starlette), and with
    it the sequences."""
    try:
        while reply.pending():
            ev = await reply.queue.get()
            if ev.error is not None:
                yield _sse(ev.error.body())
                break
            body = reply.chunk(ev)
            reply.take(ev)
            if ev.text or ev.finish_reason or (reply.req.return_token_ids and ev.token_ids):
                yield _sse(body)
        else:
            if reply.req.include_usage:
                yield _sse({**api.completion(reply.id, reply.created, reply.engine.model_id, [], None),
                            "usage": reply.usage()})
        yield "data: [DONE]\n\n"
    finally:
        if reply.pending():
            reply.engine.scheduler.cancel(reply.seqs)


def make_app(engine, api_key: Optional[str] = None) -> FastAPI:
    """The ASGI application over ``engine`` (see the module docstring)."""

    @asynccontextmanager
    async def lifespan(app):
        loop = asyncio.get_running_loop()

        def route(batch):
            for sink, ev in batch:
                sink.put_nowait(ev)

        engine.scheduler.start(lambda batch: loop.call_soon_threadsafe(route, batch))
        yield
        engine.scheduler.stop()

    app = FastAPI(title="flan-t5 server", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    metrics = engine.metrics

    @app.exception_handler(api.ApiError)
    async def refused(request, e: api.ApiError):
        metrics.rejected.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return JSONResponse(api.error_body(str(e.detail), "invalid_request_error"), status_code=e.status_code)

    @app.get("/health")
    async def health():
        if not engine.scheduler.admitting or engine.scheduler.failure is not None:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return api.models(engine.model_id, engine.created)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = api.parse_completion(await _read_body(request, engine.limits.max_body_bytes), engine.limits,
                                   engine.model_id)
        reply = _Reply(engine, req, [engine.tokenize(p) for p in req.prompts])
        engine.scheduler.submit(reply.seqs)
        if req.stream:
            return StreamingResponse(_stream(reply), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _whole(request, reply)

    if api_key:
        app.add_middleware(BearerAuth, key=api_key, metrics=metrics)
    return app


class Server(uvicorn.Server):
    """uvicorn, with SIGTERM (or Ctrl-C) as a drain: no new requests (503), the held ones finished, those still held
    after ``grace`` seconds ended with an error, then the process exits normally (exit 0). A second signal ends
    the held requests at once. The line saying where it serves is printed once it listens."""

    def __init__(self, config: uvicorn.Config, engine, grace: float, banner):
        super().__init__(config)
        self.engine, self.grace, self.banner = engine, grace, banner
        self.deadline: Optional[float] = None
        self.aborted = False

    def handle_exit(self, sig, frame) -> None:  # not re-raised at the end, as uvicorn's own is: the exit is clean
        if self.deadline is None:
            self.engine.scheduler.stop_admitting()
            self.deadline = time.monotonic() + self.grace
            logger.info("signal %d: no new requests; finishing the %d held (grace period %g s)", sig,
                        self.engine.scheduler.held(), self.grace)
        else:
            self.deadline = time.monotonic()
        if time.monotonic() >= self.deadline:  # no grace: the held requests end at the next decoding call, not tick
            self._abort()

    def _abort(self) -> None:
        """Every request still held ends with an error (once)."""
        held = self.engine.scheduler.held()
        if held and not self.aborted:
            logger.warning("grace period over: ending the %d requests still held with an error", held)
            self.engine.scheduler.abort_all(api.ApiError(
                503, "the server shut down before this request finished", code="shutting_down"))
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
            if not self.engine.scheduler.held():
                self.should_exit = True
        return await super().on_tick(counter)


def serve(engine, host: str, port: int, api_key: Optional[str], grace: float, banner) -> None:
    """Serves ``engine`` until a signal (see ``Server``); ``banner(host, port)`` once it listens."""
    # keep-alive 30 s (uvicorn's 5): pooled client connections (the openai client's) are closed under them less
    # often, the race where a request starts on a connection the server is closing
    config = uvicorn.Config(make_app(engine, api_key), host=host, port=port, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=10, timeout_keep_alive=30, lifespan="on")
    Server(config, engine, grace, banner).run()
