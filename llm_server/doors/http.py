"""What the doors' HTTP routes share: a JSON body's text, checked as every door checks text; speech of a whole
text streamed as a response; the worker's silence trim; a full worker's 429.

The response starts with the first audio, so a failure before any is a proper error status, not a truncated
200. A failure after audio started ends the stream deliberately: a framed body's own error (an SSE `error`
event, an NDJSON error line), or for raw audio a body cut short (the connection closes without the final
chunk), which is how HTTP says "incomplete". How the events are framed is a `Framing`: raw audio, OpenAI's SSE,
or a door's own (ElevenLabs' NDJSON with timestamps). A client that reads far slower than real time is cut off once it is
`max_client_lag_s` of audio behind (the session's pacing); while it keeps us waiting nothing more is
read from the codec, so gRPC flow control holds the stream back and memory stays bounded.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from orpheus_common import connections
from orpheus_common.http import ADMISSION_WAIT, RETRY_COUNT, whole_number

from ..config import LlmServerConfig
from ..edge.errors import ApiError
from ..speech.encoding import SilenceTrim, sse_delta, sse_done, sse_event
from ..speech.session import Audio, ClientTooSlow, PromptTooLong, Refused, SpeechSession, SpeechSpec, Words

log = logging.getLogger(__name__)


def check_text(text: str, config: LlmServerConfig, param: str = "input") -> None:
    """Text every front door refuses the same way."""
    if not text.strip():
        raise ApiError(400, f"{param} is empty", param)
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate from a \\ud800 escape: no tokenizer takes it
            raise ApiError(400, f"{param} is not valid Unicode text (lone surrogate)", param) from None
    if len(text) > config.max_input_chars:
        raise ApiError(400, f"{param} has {len(text)} characters; the limit is {config.max_input_chars}", param,
                       "input_too_long")


def trim_of(config: LlmServerConfig) -> SilenceTrim | None:
    """The worker's leading-silence trim, if on."""
    return SilenceTrim(config.trim_silence_dbfs, config.trim_silence_max_ms) if config.trim_silence else None


async def open_session(request: Request, spec: SpeechSpec, name: str) -> SpeechSession:
    """An HTTP request's stream, admitted after waiting for a slot as long as admission_wait() allows, or a 429;
    a client that leaves while it waits leaves the queue then (its place is the next one's, not a slot handed to
    nobody). The session id names engine and codec requests: unique even if clients reuse X-Request-Id."""
    request_id, wait_s = f"{name}-{uuid.uuid4().hex[:16]}", admission_wait(request)
    opening = SpeechSession.open(request.app.state.runtime, spec, getattr(request.state, "api_key", None), request_id,
                                 wait_s, retries_of(request))
    if wait_s > 0:  # a task of its own only where it may wait: raced against the client leaving
        opening = asyncio.ensure_future(opening)
        gone = asyncio.ensure_future(_disconnected(request))  # the body is read: what comes next is the disconnect
        try:
            await asyncio.wait({opening, gone}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this handler was cancelled: nothing may stay queued or held for it
            await _abandon(opening)
            raise
        finally:
            gone.cancel()
        if not opening.done():
            await _abandon(opening)
            log.info("%s: client disconnected while waiting for a slot", request_id)
            raise ApiError(499, "the client closed the request while it waited for a slot")
    try:
        return await opening
    except Refused as exc:
        runtime = request.app.state.runtime
        expected_s = None if exc.by_key else runtime.admission.expected_wait_s()
        raise refused_error(exc, runtime.config.resolved_admission_queue_s, expected_s) from None


async def _abandon(opening: asyncio.Future[SpeechSession]) -> None:
    """Stop waiting for a slot: out of the queue (AdmissionController.enter gives back a slot it was just handed),
    or the session it was given closed."""
    opening.cancel()
    await asyncio.wait({opening})
    if not opening.cancelled() and opening.exception() is None:
        await opening.result().close()


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (its body already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def admission_wait(request: Request) -> float:
    """How long this request may wait for a slot: the worker's queue wait, or less if the caller (the front, trying
    another worker next) says so in ADMISSION_WAIT."""
    wait_s = request.app.state.runtime.config.resolved_admission_queue_s
    try:
        return min(wait_s, max(0.0, float(request.headers.get(ADMISSION_WAIT, wait_s))))
    except ValueError:  # not a number: the worker's own
        return wait_s


def retries_of(request: Request) -> int:
    """How many times the client says it retried this request (RETRY_COUNT; 0 if it says nothing, or nothing that
    is a count): a hint that orders the admission queue, so a malformed one is ignored, not refused."""
    return whole_number(request.headers.get(RETRY_COUNT)) or 0


# The openai SDK (3.63) waits as long as a 429's Retry-After says up to 120 s, and past that does not retry at all.
RETRY_AFTER_MAX_S = 60.0


def refused_error(exc: Refused, queue_s: float, expected_s: float | None = None,
                  draw: Callable[[float, float], float] = random.uniform) -> ApiError:
    """A 429 whose Retry-After (whole seconds, 1 at least) is drawn between the worker's queue wait `queue_s` (a retry
    sooner meets the same queue) and `expected_s`, when it expects a slot for the request
    (AdmissionController.expected_wait_s; None: not known; at most RETRY_AFTER_MAX_S).

    Told only the queue's wait (3 s on a CPU), the refused clients of a 2x overload knocked 9.5 times a second and took 6 %
    of the codec replicas' cores from the streams admitted (issue 43, run 52); at 1 s, 29 a second at 3x (run 34). Told
    the expected wait itself, clients refused together came back together: a slot that freed while they slept went to a
    client asking again at once as its stream ended, and 18 % of the 2x level's clients had no audio in time (run 53; 37 %
    in run 27 at a fixed 10 s). Drawn between the two, refused clients come back spread out, one of them waits in the
    queue at most moments a slot frees, and they knock a third less at 2x and half as often at 3x
    (benchmarks/retry_after_model.py)."""
    wait_s = draw(queue_s, max(queue_s, min(expected_s or 0.0, RETRY_AFTER_MAX_S)))
    return ApiError(429, str(exc), code="rate_limit_exceeded", headers={"Retry-After": str(max(1, math.ceil(wait_s)))})


async def text_body(request: Request, field: str) -> dict:
    """A JSON object with a text `field`, checked as every front door checks text (the WebSocket
    protocols' HTTP twins)."""
    try:
        body = await request.json()
    except ValueError:
        raise ApiError(400, "request body is not valid JSON") from None
    if not isinstance(body, dict) or not isinstance(body.get(field), str):
        raise ApiError(400, f"the body needs {field} (a string)", field)
    check_text(body[field], request.app.state.runtime.config, field)
    return body


class Framing:
    """How a whole-text response carries a session's events: raw audio (this class), or a subclass's framing of
    its audio, its segments' word timings (when `words`), its end and a failure after audio went out."""

    media_type: str | None = None  # None: the audio's own
    words = False  # whether Words events are framed (else skipped)

    def audio(self, audio: Audio) -> bytes:
        return audio.data

    def timings(self, words: Words) -> bytes:
        return b""

    def end(self, session: SpeechSession) -> bytes:
        return b""

    def failure(self, message: str) -> bytes | None:
        """The body's last bytes after a failure; None: cut the body short (the connection closes unfinished)."""
        return None


class Sse(Framing):
    """OpenAI's `stream_format: sse`: speech.audio.delta events, then speech.audio.done with usage, or error."""

    media_type = "text/event-stream"

    def audio(self, audio: Audio) -> bytes:
        return sse_delta(audio.data)

    def end(self, session: SpeechSession) -> bytes:
        return sse_done(*session.usage)

    def failure(self, message: str) -> bytes | None:
        return sse_error(message)


RAW, SSE = Framing(), Sse()


async def speak_whole(request: Request, spec: SpeechSpec, text: str, name: str, framing: Framing = RAW,
                      on_admit: Callable[[object], None] = lambda key: None) -> Response:
    """Speak all of `text`: a full worker refuses with 429; the first audio is awaited, so a failure before
    it is an error status (a prompt the context cannot hold: 400); then the rest as it is decoded."""
    session = await open_session(request, spec, name)
    on_admit(session.key)
    session.say(text)
    # Watched from the start: a client gone before the first audio frees everything at once.
    watcher = asyncio.create_task(_close_on_disconnect(request, session))
    events = session.events()
    try:
        first = await _next_item(events, framing)
    except Exception as exc:
        told = session.failed(exc)  # counted (invalid_input or error) and logged as every door's failures are
        await _release(watcher, events, session)
        if not told:
            return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
        if isinstance(exc, PromptTooLong):
            raise ApiError(400, str(exc), "input", "context_length_exceeded") from None
        raise ApiError(503, f"speech generation failed: {exc}", code="generation_failed") from exc
    return SpeechResponse(session, first, events, framing, watcher, framing.media_type or spec.output.media_type)


async def _release(watcher: asyncio.Task, events: AsyncIterator, session: SpeechSession) -> None:
    """Stop watching the client, close the events and the session (slot, engine, codec); safe to repeat."""
    watcher.cancel()
    await events.aclose()
    await session.close()


async def _next_item(events: AsyncIterator, framing: Framing) -> Audio | Words | None:
    """The next encoded bytes, or word timings where the framing carries them (segment ends are the sockets')."""
    async for item in events:
        if isinstance(item, Audio) or (framing.words and isinstance(item, Words) and item.words):
            return item
    return None


class SpeechResponse(StreamingResponse):
    """The audio as it is decoded, framed, sent within the client's lag allowance; ends deliberately on failure.
    (A StreamingResponse for its headers: chunked, no Content-Length.)"""

    def __init__(self, session: SpeechSession, first: Audio | Words | None, events: AsyncIterator, framing: Framing,
                 watcher: asyncio.Task, media_type: str) -> None:
        super().__init__(iter(()), media_type=media_type, headers={"Cache-Control": "no-store"})
        self.session, self.first, self.events, self.framing, self.watcher = session, first, events, framing, watcher

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        session, ctx, framing = self.session, connections.current(), self.framing
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            item = self.first
            while item is not None:
                audio = isinstance(item, Audio)
                body = framing.audio(item) if audio else framing.timings(item)
                await session.send(lambda: send({"type": "http.response.body", "body": body, "more_body": True}),
                                   item.seconds if audio else 0.0)
                item = await self._next()
            # Free the slot before the client can see the end: one that asks again at once (a stream at a
            # time, at its cap) must not be refused for the stream it just finished.
            await _release(self.watcher, self.events, session)
            await send({"type": "http.response.body", "body": framing.end(session), "more_body": False})
        except ClientTooSlow:
            if ctx is not None:
                ctx.reset_connection()
        except _Failed as failure:
            last = framing.failure(str(failure))
            if last is not None:
                await send({"type": "http.response.body", "body": last, "more_body": False})
            elif ctx is not None:
                ctx.end_response_early()
        finally:
            await _release(self.watcher, self.events, session)

    async def _next(self) -> Audio | Words | None:
        try:
            return await _next_item(self.events, self.framing)
        except Exception as exc:
            if not self.session.failed(exc):
                return None  # the client left (the watcher cancelled the session): nothing more to send
            raise _Failed(str(exc)) from None


class _Failed(Exception):
    """Generation failed after audio went out (already logged); the response ends early."""


def sse_error(message: str) -> bytes:
    """A final `error` event: the stream failed after audio went out (OpenAI's error shape)."""
    error = {"message": f"speech generation failed: {message}", "type": "server_error", "param": None,
             "code": "generation_failed"}
    return sse_event({"type": "error", "error": error})


async def _close_on_disconnect(request: Request, session: SpeechSession) -> None:
    """Stop generating the moment the client goes, not at the next chunk we fail to send."""
    await _disconnected(request)
    log.info("%s: client disconnected", session.request_id)
    session.cancel("disconnected")
