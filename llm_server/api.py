"""The HTTP API: an OpenAI-compatible /v1/audio/speech that streams, plus health and metrics.

Client mistakes become 4xx with an OpenAI-shaped error body here, at the edge; the rest of
the tier raises typed errors. The response starts with the first decoded audio, so a codec
or engine failure before any audio is still a proper 503, not a truncated 200. A failure after
audio has started ends the stream deliberately: an SSE `error` event, or for raw audio a body cut
short (the connection closes without the final chunk), which is how HTTP says "incomplete".

A client that reads far slower than real time is cut off once it is `max_client_lag_s` of audio
behind; while it keeps us waiting we read nothing more from the codec, so gRPC flow control
holds the rest of the pipeline back and memory per stream stays bounded.
"""

from __future__ import annotations

import asyncio
import json
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
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from . import request_log
from .admission import KEY
from .audio_format import FORMATS, MEDIA_TYPES, STREAM_FORMATS, SAMPLE_BYTES, SAMPLE_RATE, sse_delta, sse_done, streaming_wav_header
from .auth import ApiKey, ApiKeyMiddleware, ApiKeys
from .body_limit import BodyLimitMiddleware
from .errors import error_response
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
    seed: int | None = Field(None, ge=0, le=2**64 - 1)  # the codec's noise seed is a uint64


class ApiError(Exception):
    """A client error with its HTTP status, OpenAI error fields, and optional headers."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def validate(body: SpeechBody, config: LlmServerConfig) -> str:
    """Check a request against this worker's limits; returns the Orpheus voice to speak."""
    if body.model not in config.model_names:
        raise ApiError(404, f"model {body.model!r} not found; this server speaks {list(config.model_names)}", "model", "model_not_found")
    if not body.input.strip():
        raise ApiError(400, "input is empty", "input")
    if not body.input.isascii():
        try:
            body.input.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate from a \ud800 escape: no tokenizer takes it
            raise ApiError(400, "input is not valid Unicode text (lone surrogate)", "input") from None
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


class SpeechApp(FastAPI):
    """FastAPI with the request-id layer outside even Starlette's error handler, so every
    response, a 500 included, carries X-Request-Id."""

    def build_middleware_stack(self) -> ASGIApp:
        return request_log.RequestIdMiddleware(super().build_middleware_stack())


def create_app(config: LlmServerConfig, runtime: Runtime | None = None) -> FastAPI:
    """The FastAPI app; the runtime (engine, codec client, tokenizer) starts in the lifespan.

    A broken `api_keys_file` raises ApiKeysError here, before the engine starts.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.runtime = runtime or await Runtime.start(config)
        try:
            yield
        finally:
            await app.state.runtime.stop()

    app = SpeechApp(title="Orpheus MegaPod", lifespan=lifespan)
    app.state.draining = False  # set on SIGTERM (server.py): /ready says 503 from then on
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    if config.api_keys_file:
        keys = ApiKeys(config.api_keys_file)
        app.add_middleware(ApiKeyMiddleware, keys=keys, on_refused=lambda: app.state.runtime.metrics.unauthorized.inc())
    request_log.quiet_deliberate_aborts()

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

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
        if request.app.state.draining:
            return error_response(503, "draining: finishing in-flight streams before exit", code="not_ready")
        problems = await request.app.state.runtime.readiness_problems()
        if problems:
            return error_response(503, "; ".join(problems), code="not_ready")
        return JSONResponse({"status": "ready", "engine": request.app.state.runtime.engine.describe()})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(request.app.state.runtime.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class StreamFailed(Exception):
    """Generation failed after audio went out (already logged); the response ends early."""


class ClientTooSlow(Exception):
    """The client fell more than max_client_lag_s of audio behind; the connection is dropped."""


class ClientPace:
    """How far behind a client is, counted only while it keeps us waiting.

    `blocked_s` sums the time each chunk took to be taken (from our yield to our resumption);
    `accepted_s` is the audio taken. A client reading at real-time pace can keep us waiting at
    most about the audio it took plus what its buffer holds, so blocked - accepted stays near
    zero for it, and it is exactly zero for a server slower than real time (never kept waiting).
    """

    def __init__(self, max_lag_s: float) -> None:
        self.max_lag_s = max_lag_s
        self.blocked_s = 0.0
        self.accepted_s = 0.0
        self.cut_off = False
        self._since: float | None = None

    def handing_over(self) -> None:
        """A chunk was yielded: the client now has us waiting."""
        self._since = time.monotonic()

    def taken(self, audio_s: float) -> None:
        """The chunk was taken (the response asked for the next one)."""
        if self._since is not None:
            self.blocked_s += time.monotonic() - self._since
        self._since = None
        self.accepted_s += audio_s

    def kept_waiting_s(self) -> float:
        """All the time the client has kept us waiting, the current wait included."""
        return self.blocked_s + (time.monotonic() - self._since if self._since is not None else 0.0)

    def time_left(self) -> float | None:
        """How much longer the current wait may last before the client is over its lag; None when not waiting."""
        if self._since is None:
            return None
        return self.max_lag_s + self.accepted_s - self.kept_waiting_s()


class SpeechResponse(StreamingResponse):
    """A StreamingResponse that ends deliberately: a stream that failed mid-way closes the
    connection without the final chunk, and a send a too-slow client keeps waiting past its
    lag allowance drops the connection (never a traceback; the reason was logged once)."""

    def __init__(self, content: AsyncIterator[bytes], pace: ClientPace, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.pace = pace

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx = request_log.current()
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await self._send_in_time(send, {"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except StreamFailed:
            if ctx is not None:
                ctx.end_response_early()
        except ClientTooSlow:
            self.pace.cut_off = True
            if ctx is not None:
                ctx.reset_connection()
        finally:
            await self.body_iterator.aclose()

    async def _send_in_time(self, send: Send, message: dict) -> None:
        left = self.pace.time_left()
        if left is None:
            await send(message)
            return
        try:
            async with asyncio.timeout(max(left, 0.0)):  # cancels a send waiting on flow control
                await send(message)
        except TimeoutError:
            p = self.pace
            log.warning("client too slow: kept the stream waiting %.1f s for %.1f s of audio (limit %.1f s behind); cut off",
                        p.kept_waiting_s(), p.accepted_s, p.max_lag_s)
            raise ClientTooSlow from None


def _admit(runtime: Runtime, config: LlmServerConfig, key: ApiKey | None) -> None:
    """Take a stream slot (and one of the key's) or refuse with 429."""
    refused = runtime.admission.admit(key.name if key else None, key.max_streams if key else 0)
    if refused is None:
        return
    runtime.metrics.requests.labels("refused").inc()
    by_key = refused == KEY
    if key is not None:
        runtime.metrics.key_requests.labels(key.name, "refused_key" if by_key else "refused").inc()
    who, cap = (f"API key {key.name!r}", key.max_streams) if by_key else ("server", config.max_streams)
    raise ApiError(429, f"{who} is at its limit of {cap} concurrent streams; retry shortly",
                   code="rate_limit_exceeded", headers={"Retry-After": "1"})


def _log_request(config: LlmServerConfig, body: SpeechBody, voice: str, key: ApiKey | None) -> None:
    """One line per admitted request; the text itself only with --log-input-text."""
    who = f", key {key.name}" if key else ""
    if config.log_input_text:
        log.info("speech: voice %s, %s/%s%s, input %r", voice, body.response_format, body.stream_format, who, body.input)
    else:
        log.info("speech: voice %s, %s/%s%s, %d characters", voice, body.response_format, body.stream_format, who, len(body.input))


async def _speech(runtime: Runtime, config: LlmServerConfig, body: SpeechBody, request: Request) -> Response:
    voice = validate(body, config)
    key: ApiKey | None = getattr(request.state, "api_key", None)
    _admit(runtime, config, key)
    _log_request(config, body, voice, key)
    started = time.perf_counter()
    seed = body.seed if body.seed is not None else random.getrandbits(31)
    # The job id names engine and codec requests: unique even if clients reuse X-Request-Id.
    stream = runtime.pipeline.start(SpeechJob(f"speech-{uuid.uuid4().hex[:16]}", body.input, voice, seed))
    # Watched from the start: a client gone before the first audio frees its slot at once.
    watcher = asyncio.create_task(_cancel_on_disconnect(request, stream))
    audio = aiter(stream)
    try:
        first = await anext(audio, b"")
    except Exception as exc:
        watcher.cancel()
        await audio.aclose()
        runtime.admission.release(key.name if key else None)
        if watcher.done():  # finished before our cancel(): it saw the client go
            _count(runtime, key, "disconnected")
            return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
        _count(runtime, key, "error")
        log.error("%s failed before audio: %s", stream.job.request_id, exc)
        raise ApiError(503, f"speech generation failed: {exc}", code="generation_failed") from exc
    runtime.metrics.time_to_first_audio.observe(time.perf_counter() - started)
    pace = ClientPace(config.max_client_lag_s)
    pcm = _serve_stream(runtime, stream, first, audio, watcher, pace, key)
    # Started here (it yields `first`), not by the response: a started generator is always
    # finalized, so the slot and the engine request come back even if the client is gone before
    # the response is sent.
    await anext(pcm)
    media = "text/event-stream" if body.stream_format == "sse" else MEDIA_TYPES[body.response_format]
    return SpeechResponse(
        _encode(first, pcm, body.response_format, body.stream_format, stream),
        pace,
        media_type=media,
        headers={"Cache-Control": "no-store"},
    )


def _count(runtime: Runtime, key: ApiKey | None, outcome: str) -> None:
    runtime.metrics.requests.labels(outcome).inc()
    if key is not None:
        runtime.metrics.key_requests.labels(key.name, outcome).inc()


async def _serve_stream(
    runtime: Runtime, stream: SpeechStream, first: bytes, rest: AsyncIterator[bytes], watcher: asyncio.Task,
    pace: ClientPace, key: ApiKey | None,
) -> AsyncIterator[bytes]:
    """The audio, with the client watched for a disconnect and its pace, and the admission slot
    always returned. A failure after the first chunk is logged here, in one line, and re-raised
    as StreamFailed for the response to end the stream."""
    runtime.metrics.active_streams.inc()
    outcome = "disconnected"
    try:
        pcm: bytes | None = first
        while pcm is not None:
            seconds = len(pcm) / (SAMPLE_BYTES * SAMPLE_RATE)
            runtime.metrics.audio_seconds.inc(seconds)
            pace.handing_over()
            yield pcm  # resumes when the response wants the next chunk: this one was taken
            pace.taken(seconds)
            pcm = await anext(rest, None)
        outcome = "ok"
    except Exception as exc:
        if watcher.done():
            outcome = "disconnected"
        else:
            outcome = "error"
            log.error("%s failed after %.1f s of audio: %s: %s", stream.job.request_id, pace.accepted_s,
                      type(exc).__name__, exc)
            raise StreamFailed(str(exc)) from None
    finally:
        if pace.cut_off:
            outcome = "slow_client"
        watcher.cancel()
        stream.cancel()
        await rest.aclose()
        runtime.admission.release(key.name if key else None)
        runtime.metrics.active_streams.dec()
        _count(runtime, key, outcome)


async def _cancel_on_disconnect(request: Request, stream: SpeechStream) -> None:
    """Stop generating the moment the client goes, not at the next chunk we fail to send."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            log.info("%s: client disconnected", stream.job.request_id)
            stream.cancel()
            return


def sse_error(message: str) -> bytes:
    """A final `error` event: the stream failed after audio went out (OpenAI's error shape)."""
    error = {"message": message, "type": "server_error", "param": None, "code": "generation_failed"}
    return f"data: {json.dumps({'type': 'error', 'error': error})}\n\n".encode()


async def _encode(
    first: bytes, rest: AsyncIterator[bytes], response_format: str, stream_format: str, stream: SpeechStream
) -> AsyncIterator[bytes]:
    """Wrap PCM as the client asked: raw, a streaming WAV, or SSE events."""
    try:
        if stream_format == "sse":
            try:
                if first:
                    yield sse_delta(first)
                async for chunk in rest:
                    yield sse_delta(chunk)
            except StreamFailed as exc:
                yield sse_error(f"speech generation failed: {exc}")
                return
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
