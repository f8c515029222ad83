"""The HTTP API: an OpenAI-compatible /v1/audio/speech that streams, plus health and metrics.

Client mistakes become 4xx with an OpenAI-shaped error body here, at the edge; the rest of
the tier raises typed errors. The response starts with the first decoded audio, so a codec
or engine failure before any audio is still a proper 503, not a truncated 200.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict

from .audio_format import FORMATS, MEDIA_TYPES, STREAM_FORMATS, SAMPLE_BYTES, SAMPLE_RATE, sse_delta, sse_done, streaming_wav_header
from .body_limit import BodyLimitMiddleware
from .config import LlmServerConfig
from .runtime import Runtime
from .speech import SpeechJob, SpeechStream

log = logging.getLogger(__name__)


class SpeechBody(BaseModel):
    """POST /v1/audio/speech, as OpenAI defines it, plus an optional `seed`."""

    model_config = ConfigDict(extra="forbid")
    model: str
    input: str
    voice: str = "tara"
    response_format: str = "wav"
    speed: float = 1.0
    stream_format: str = "audio"
    instructions: str | None = None
    seed: int | None = None


class ApiError(Exception):
    """A client error with its HTTP status, OpenAI error fields, and optional headers."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def validate(body: SpeechBody, config: LlmServerConfig) -> str:
    """Check a request against this worker's limits; returns the Orpheus voice to speak."""
    if body.model not in config.model_names:
        raise ApiError(404, f"model {body.model!r} not found; this server speaks {list(config.model_names)}", "model", "model_not_found")
    if not body.input.strip():
        raise ApiError(400, "input is empty", "input")
    if len(body.input) > config.max_input_chars:
        raise ApiError(400, f"input has {len(body.input)} characters; the limit is {config.max_input_chars}", "input", "input_too_long")
    voice = config.voice_map.get(body.voice)
    if voice is None:
        raise ApiError(400, f"unknown voice {body.voice!r}; choose one of {sorted(config.voice_map)}", "voice")
    if body.response_format not in FORMATS:
        raise ApiError(400, f"response_format {body.response_format!r} is not supported; use one of {list(FORMATS)}", "response_format")
    if body.stream_format not in STREAM_FORMATS:
        raise ApiError(400, f"stream_format {body.stream_format!r} is not supported; use one of {list(STREAM_FORMATS)}", "stream_format")
    if body.speed != 1.0:
        raise ApiError(400, "speed other than 1.0 is not supported: Orpheus speaks at its own pace", "speed")
    if body.instructions:
        raise ApiError(400, "instructions are not supported; use inline tags such as <laugh> in the input", "instructions")
    return voice


def create_app(config: LlmServerConfig, runtime: Runtime | None = None) -> FastAPI:
    """The FastAPI app; the runtime (engine, codec client, tokenizer) starts in the lifespan."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.runtime = runtime or await Runtime.start(config)
        try:
            yield
        finally:
            await app.state.runtime.stop()

    app = FastAPI(title="Orpheus MegaPod", lifespan=lifespan)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', 'malformed')}")
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error_response(400, f"invalid request body: {where or 'body'}: {first.get('msg', 'malformed')}", where)

    @app.post("/v1/audio/speech")
    async def speech(body: SpeechBody, request: Request) -> Response:
        return await _speech(request.app.state.runtime, config, body, request)

    @app.get("/v1/voices")
    async def voices() -> dict:
        aliases = {k: v for k, v in config.voice_map.items() if k != v}
        return {"voices": [{"id": v, "name": v} for v in config.voices], "aliases": aliases}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "orpheus-megapod"} for m in config.model_names]}

    @app.get("/health")
    async def health(request: Request) -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        problems = await request.app.state.runtime.readiness_problems()
        if problems:
            return error_response(503, "; ".join(problems), code="not_ready")
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(request.app.state.runtime.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _speech(runtime: Runtime, config: LlmServerConfig, body: SpeechBody, request: Request) -> Response:
    voice = validate(body, config)
    if not runtime.admission.try_admit():
        runtime.metrics.requests.labels("refused").inc()
        raise ApiError(429, f"server is at its limit of {config.max_streams} concurrent streams; retry shortly",
                       code="rate_limit_exceeded", headers={"Retry-After": "1"})
    started = time.perf_counter()
    seed = body.seed if body.seed is not None else random.getrandbits(31)
    stream = runtime.pipeline.start(SpeechJob(f"speech-{uuid.uuid4().hex[:16]}", body.input, voice, seed))
    audio = stream.__aiter__()
    try:
        first = await anext(audio, b"")
    except Exception as exc:
        await audio.aclose()
        runtime.admission.release()
        runtime.metrics.requests.labels("error").inc()
        log.error("%s failed before audio: %s", stream.job.request_id, exc)
        raise ApiError(503, f"speech generation failed: {exc}", code="generation_failed") from exc
    runtime.metrics.time_to_first_audio.observe(time.perf_counter() - started)
    pcm = _serve_stream(runtime, stream, first, audio, request)
    # Started here (it yields `first`), not by the response: a started generator is always
    # finalized, so the slot and the engine request come back even if the client is gone before
    # the response is sent.
    await anext(pcm)
    media = "text/event-stream" if body.stream_format == "sse" else MEDIA_TYPES[body.response_format]
    return StreamingResponse(
        _encode(first, pcm, body.response_format, body.stream_format, stream),
        media_type=media,
        headers={"X-Request-Id": stream.job.request_id, "Cache-Control": "no-store"},
    )


async def _serve_stream(
    runtime: Runtime, stream: SpeechStream, first: bytes, rest: AsyncIterator[bytes], request: Request
) -> AsyncIterator[bytes]:
    """The audio, with the client watched for a disconnect and the admission slot always returned."""
    runtime.metrics.active_streams.inc()
    watcher = asyncio.create_task(_cancel_on_disconnect(request, stream))
    outcome = "disconnected"
    try:
        runtime.metrics.audio_seconds.inc(len(first) / (SAMPLE_BYTES * SAMPLE_RATE))
        yield first
        async for pcm in rest:
            runtime.metrics.audio_seconds.inc(len(pcm) / (SAMPLE_BYTES * SAMPLE_RATE))
            yield pcm
        outcome = "ok"
    except Exception as exc:
        outcome = "disconnected" if watcher.done() else "error"
        if outcome == "error":
            log.error("%s failed mid-stream: %s", stream.job.request_id, exc)
            raise
    finally:
        watcher.cancel()
        stream.cancel()
        await rest.aclose()
        runtime.admission.release()
        runtime.metrics.active_streams.dec()
        runtime.metrics.requests.labels(outcome).inc()


async def _cancel_on_disconnect(request: Request, stream: SpeechStream) -> None:
    """Stop generating the moment the client goes, not at the next chunk we fail to send."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            log.info("%s: client disconnected", stream.job.request_id)
            stream.cancel()
            return


async def _encode(
    first: bytes, rest: AsyncIterator[bytes], response_format: str, stream_format: str, stream: SpeechStream
) -> AsyncIterator[bytes]:
    """Wrap PCM as the client asked: raw, a streaming WAV, or SSE events."""
    try:
        if stream_format == "sse":
            if first:
                yield sse_delta(first)
            async for chunk in rest:
                yield sse_delta(chunk)
            yield sse_done(stream.prompt_tokens, stream.generated_tokens)
            return
        if response_format == "wav":
            yield streaming_wav_header()
        if first:
            yield first
        async for chunk in rest:
            yield chunk
    finally:
        await rest.aclose()
