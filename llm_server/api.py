"""The worker's HTTP app: the eight front doors (doors/: OpenAI, Cartesia, Deepgram, ElevenLabs, Baseten, Together,
vLLM-Omni, SLNG; WebSockets and HTTP), voices and models, health, readiness and metrics, behind the edge's guards (edge/).

Every front door is a thin adapter over a SpeechSession (speech/session.py). Client mistakes become 4xx
with an OpenAI-shaped error body here, at the edge; the rest of the tier raises typed errors.
"""

from __future__ import annotations

import asyncio
import gc
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orpheus_common import connections
from orpheus_common.http import CAPACITY_FREE, LOADED_VOICES, error_response, voices_header
from orpheus_common.playground import playground

from . import clones
from .config import LlmServerConfig
from .doors import baseten, cartesia, deepgram, elevenlabs, models, openai, slng, together, vllm_omni
from .edge import request_ids
from .edge.auth import ApiKeyMiddleware, ApiKeys
from .edge.body_limit import BodyLimitMiddleware
from .edge.errors import ApiError
from .runtime import Runtime


class CapacityHeaderMiddleware:
    """Pure ASGI: CAPACITY_FREE (and LOADED_VOICES where there are LoRA voices) on every response and WebSocket
    accept past the API-key check, read as it is sent (after the request's own admission)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        state = scope["app"].state  # its runtime is set in the lifespan, before any request

        async def send_with_capacity(message: Message) -> None:
            if message["type"] in ("http.response.start", "websocket.accept"):
                free = str(state.runtime.admission.free).encode()
                message["headers"] = [*message.get("headers", ()), (CAPACITY_FREE.encode(), free)]
                if loaded := state.runtime.voices.loaded_lora_voices():  # the front prefers these workers for them
                    message["headers"].append((LOADED_VOICES.encode(), voices_header(loaded)))
            await send(message)

        await self.app(scope, receive, send_with_capacity)


class SpeechApp(FastAPI):
    """FastAPI with the request-id and connection layers outside even Starlette's error handler, so every
    response, a 500 included, carries X-Request-Id, and any response can be cut on purpose."""

    def build_middleware_stack(self) -> ASGIApp:
        return request_ids.RequestIdMiddleware(connections.ConnectionMiddleware(super().build_middleware_stack()))


def create_app(config: LlmServerConfig, runtime: Runtime | None = None) -> FastAPI:
    """The FastAPI app; the runtime (engine, codec client, tokenizer) starts in the lifespan.

    A broken `api_keys_file` raises ApiKeysError here, before the engine starts.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.runtime = runtime or await Runtime.start(config)
        if app.state.runtime.voices_dir is not None:  # it takes clone uploads: their decoder's process, started now
            await asyncio.to_thread(app.state.runtime.reference_decoder.warm)
        # Everything loaded so far (torch, transformers, vLLM's client) lives as long as the process:
        # out of the collector's sight, a full collection no longer walks it. Unfrozen, each one
        # stalled every stream of the worker for 300+ ms (benchmarks/serving_cpu.py, 256 streams).
        # vLLM's own API server does the same after start-up.
        gc.collect()
        gc.freeze()
        watching = [asyncio.create_task(app.state.runtime.watch_capacity()),
                    asyncio.create_task(app.state.runtime.watch_voices()),
                    asyncio.create_task(app.state.runtime.metrics.loop_lag.watch())]
        try:
            yield
        finally:
            for task in watching:
                task.cancel()
            await asyncio.gather(*watching, return_exceptions=True)
            await app.state.runtime.stop()

    app = SpeechApp(title="Orpheus MegaPod", lifespan=lifespan)
    app.state.draining = False  # set on SIGTERM (server.py): /ready says 503 from then on
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes,
                       larger={"/v1/voices": config.max_reference_bytes})  # a clone's recording
    app.add_middleware(CapacityHeaderMiddleware)
    if config.api_keys_file:
        keys = ApiKeys(config.api_keys_file)
        app.add_middleware(ApiKeyMiddleware, keys=keys, on_refused=lambda: app.state.runtime.metrics.unauthorized.inc())
    connections.quiet_deliberate_aborts()

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Starlette's own refusals (unknown path, wrong method, an unparseable body) in our error shape.
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', 'malformed')}")
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error_response(400, f"invalid request body: {where or 'body'}: {first.get('msg', 'malformed')}", where)

    for routes in (openai, cartesia, deepgram, elevenlabs, baseten, together, vllm_omni, slng, models, clones):
        app.include_router(routes.router)

    @app.get("/v1/voices")
    async def voices(request: Request) -> dict:
        return request.app.state.runtime.voices.listing()

    app.add_api_route("/", playground, methods=["GET"], include_in_schema=False)

    @app.get("/health")
    async def health(request: Request) -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        if request.app.state.draining:
            return error_response(503, "draining: finishing in-flight streams before exit", code="not_ready")
        problems = await request.app.state.runtime.readiness_problems()
        if problems:
            return error_response(503, "; ".join(problems), code="not_ready")
        return JSONResponse({"status": "ready", "engine": request.app.state.runtime.engine.describe()})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        # On a thread: vLLM's histograms make it milliseconds of work, and prometheus_client collects thread-safely.
        exposition = await asyncio.to_thread(generate_latest, request.app.state.runtime.metrics.registry)
        return Response(exposition, media_type=CONTENT_TYPE_LATEST)

    return app
