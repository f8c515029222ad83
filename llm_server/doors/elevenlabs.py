"""ElevenLabs' TTS protocol, so Pipecat's ElevenLabsTTSService and ElevenLabsHttpTTSService and LiveKit's
elevenlabs.TTS work unchanged (read from their sources: pipecat-ai 1.14, livekit-plugins-elevenlabs 1.8.9).

WebSocket /v1/text-to-speech/{voice_id}/multi-stream-input?output_format=&sync_alignment=: contexts, each
its own SpeechSession (admitted on its own). `{text, context_id, voice_settings?, flush?}` feeds a
context (the first opens it; text is spoken at sentence ends, and at once on `flush: true`); a message
whose text is empty and has no flush is a keep-alive. `{context_id, close_context: true}` ends a context:
right after a flush without text (how both clients end a turn) the audio of what was sent finishes, then
`isFinal`; anywhere else it is a barge-in, and the context's engine request and codec stream go at once.
`{close_socket: true}` stops every context and closes. Out, each with `contextId`: `{audio}` (base64, in
output_format), `{alignment, normalizedAlignment}` after each sentence's audio, and `{isFinal: true}`
alone when a context ends; `{error, message, contextId}` for what is refused (the socket lives on).

WebSocket /v1/text-to-speech/{voice_id}/stream-input: the single-context form: the same messages without
context_id, empty text ends the input, and the socket closes after `isFinal`.

POST /v1/text-to-speech/{voice_id} and .../stream: `{text}` in, the audio streamed as it is decoded;
.../stream/with-timestamps: newline-delimited JSON, `{audio_base64}` lines and, after each sentence's
audio, `{alignment, normalized_alignment}` with `characters`, `character_start_times_seconds` and
`character_end_times_seconds` (from the start of the request's audio); the other HTTP doors' response path
(doors/http.py, its Framing): a status before the first audio, a last `{error}` line after it.

Alignment is the approximation of the other doors' timestamps: a sentence's audio is shared among its
words in proportion to their length, and a word's among its characters evenly; a space separating words
takes no time. Times count from the start of the context's audio with `sync_alignment=true` (LiveKit sends
it and reads them so), else from the start of each message (Pipecat adds each message's span to a clock).
output_format: pcm_<rate>, ulaw_8000, alaw_8000, mp3_<rate>_<kbps>, opus_48000_<kbps> (the bitrate is the
encoder's own); ElevenLabs' default is mp3_44100_128. voice_id goes through the voice registry:
another vendor's id is spoken in the default voice unless vendor_voice_fallback is off. Not supported:
voice_settings and model_id (ignored: Orpheus takes inline tags such as <laugh>).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import random
import uuid

from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import Response

from ..edge.errors import ApiError
from ..speech.encoding import AudioOutput, UnsupportedOutput
from ..speech.session import Audio, Refused, SpeechSession, SpeechSpec, Words
from ..voices import UnknownVoice
from .http import Framing, speak_whole, text_body, trim_of
from .sockets import (
    MAX_CONTEXTS,
    SocketWriter,
    accept,
    client_messages,
    context_audio,
    parse_message,
    refuse_socket,
    stop_context,
)

log = logging.getLogger(__name__)
router = APIRouter()

DEFAULT_FORMAT = "mp3_44100_128"  # ElevenLabs' own default
_FORMATS = {"pcm": "pcm", "ulaw": "mulaw", "alaw": "alaw", "mp3": "mp3", "opus": "opus"}
SINGLE_CONTEXT = "0"  # the stream-input socket's one context


class Refusal(ValueError):
    """What this door refuses: an HTTP status (HTTP routes) and the context it concerns (sockets)."""

    def __init__(self, message: str, status: int = 400, context_id: str | None = None) -> None:
        super().__init__(message)
        self.status, self.context_id = status, context_id


def output_of(output_format: str) -> AudioOutput:
    """ElevenLabs' output_format as this server's encoder's: Refusal for what it cannot serve."""
    codec, _, rest = output_format.partition("_")
    rate = rest.split("_")[0]
    if codec not in _FORMATS or not rate.isdigit():
        raise Refusal(f"output_format {output_format!r} is not pcm_<rate>, ulaw_8000, alaw_8000, mp3_<rate>_<kbps> "
                      "or opus_48000_<kbps>")
    try:
        return AudioOutput(_FORMATS[codec], int(rate))
    except UnsupportedOutput as exc:
        raise Refusal(f"output_format {output_format!r}: {exc}") from None


def spec_of(runtime, voice_id: str, query) -> SpeechSpec:
    """How to speak for a request's voice and query; Refusal for what this server cannot do."""
    try:
        voice, substituted = runtime.voices.resolve_vendor(voice_id)
    except UnknownVoice as exc:
        raise Refusal(str(exc)) from None
    if substituted:
        log.info("elevenlabs voice: %s", substituted)
    output = output_of(query.get("output_format") or DEFAULT_FORMAT)
    return SpeechSpec(voice, random.getrandbits(31), output, trim_of(runtime.config))


def char_alignment(words: Words, origin: float) -> dict[str, list]:
    """A sentence's words as characters with start times and durations in ms from `origin` (seconds), each
    word followed by a space of no duration (the clients split words on it)."""
    chars, starts, durations = [], [], []
    for word, start, end in zip(words.words, words.starts, words.ends):
        step = (end - start) / len(word)
        for i, char in enumerate(word + " "):
            chars.append(char)
            starts.append(round(1000 * (start - origin + min(i, len(word)) * step)))
            durations.append(round(1000 * step) if i < len(word) else 0)
    return {"chars": chars, "charStartTimesMs": starts, "charDurationsMs": durations}


class _Context:
    """One context of a socket: its session and the task sending its audio."""

    def __init__(self, context_id: str, session: SpeechSession) -> None:
        self.id, self.session = context_id, session
        self.sender: asyncio.Task | None = None
        self.text_chars = 0
        self.flushed_empty = False  # the last message that did anything was a flush without text
        self.ending = False  # the input ended: the audio finishes, then isFinal


class ElevenLabsSocket:
    """One client socket (multi-context, or single-context with `single`)."""

    def __init__(self, ws: WebSocket, runtime, key, spec: SpeechSpec, cumulative: bool, single: bool) -> None:
        self.ws, self.runtime, self.key, self.spec = ws, runtime, key, spec
        self.cumulative, self.single = cumulative, single
        self.out = SocketWriter(ws)
        self.contexts: dict[str, _Context] = {}

    async def run(self) -> None:
        try:
            async for text in client_messages(self.ws, self.out, self.runtime, lambda why: self._error(None, why)):
                if text is None:
                    await self._error(None, "binary frames are not part of this protocol: send JSON text")
                    continue
                try:
                    await self._handle(parse_message(text))
                except Refusal as exc:
                    await self._error(exc.context_id, str(exc))
                except ValueError as exc:  # not JSON, not an object, too long
                    await self._error(None, f"malformed message: {exc}")
        finally:
            for context in list(self.contexts.values()):
                await self._finish(context, "disconnected")

    async def _handle(self, message: dict) -> None:
        if message.get("close_socket") is True:
            for context in list(self.contexts.values()):
                await self._finish(context, "cancelled")
            await self.out.close(1000, "close_socket")
            return
        context_id = SINGLE_CONTEXT if self.single else message.get("context_id")
        if context_id is not None and not isinstance(context_id, str):
            raise Refusal("context_id must be a string")
        if message.get("close_context") is True:
            await self._close_context(self.contexts.get(context_id) if context_id else None)
            return
        text, flush = message.get("text"), message.get("flush") is True
        if text is not None and not isinstance(text, str):
            raise Refusal("text must be a string", context_id=context_id)
        if text is None and not flush:
            raise Refusal("a message needs text, flush, close_context or close_socket", context_id=context_id)
        context = self.contexts.get(context_id) if context_id else None
        if self.single and text == "" and not flush:  # the single-context form's end of input
            if context is not None:
                self._end_input(context)
            else:
                await self.out.close(1000, "no text")
            return
        if context is None and not (text or "").strip() and not flush and "voice_settings" not in message:
            return  # a keep-alive, before or without a context
        context_id = context_id or f"ctx-{uuid.uuid4().hex[:12]}"
        limit = self.runtime.config.max_input_chars
        if text and (context.text_chars if context else 0) + len(text) > limit:
            raise Refusal(f"context {context_id} is over {limit} characters", context_id=context_id)
        context = context or await self._open(context_id)
        if context.ending:
            raise Refusal(f"context {context.id} was closed", context_id=context.id)
        if text:
            context.text_chars += len(text)
            context.session.push(text)
        if flush:
            context.session.flush()
        if text or flush:
            context.flushed_empty = flush and not (text or "").strip()

    async def _open(self, context_id: str) -> _Context:
        if len(self.contexts) >= MAX_CONTEXTS:
            raise Refusal(f"this socket already has {MAX_CONTEXTS} open contexts", 429, context_id)
        try:
            session = await SpeechSession.open(self.runtime, self.spec, self.key, f"elevenlabs-{context_id[:48]}-{uuid.uuid4().hex[:8]}")
        except Refused as exc:
            raise Refusal(str(exc), 429, context_id) from None
        context = _Context(context_id, session)
        self.contexts[context_id] = context
        context.sender = asyncio.create_task(self._pump(context))
        return context

    def _end_input(self, context: _Context) -> None:
        context.ending = True
        context.session.end_input()

    async def _close_context(self, context: _Context | None) -> None:
        """The end of a turn right after a flush without text; otherwise (or once ending) a barge-in."""
        if context is None:
            return
        if context.flushed_empty and not context.ending:
            self._end_input(context)
            return
        await self._finish(context, "cancelled")
        await self.out.tell({"contextId": context.id, "isFinal": True})  # a client that left has no need of it

    async def _pump(self, context: _Context) -> None:
        """A context's audio and alignment, in order, then isFinal; its end, however it comes."""
        cid, session = context.id, context.session
        said = {} if self.single else {"contextId": cid}
        try:
            async with context_audio(session, self.out, lambda text, bad_input: self._error(cid, text)):
                async for item in session.events():
                    if isinstance(item, Audio):
                        message = {**said, "audio": base64.b64encode(item.data).decode()}
                        await session.send(lambda: self.out.json(message), item.seconds)
                    elif isinstance(item, Words) and item.words:
                        alignment = char_alignment(item, 0.0 if self.cumulative else item.starts[0])
                        await self.out.json({**said, "alignment": alignment, "normalizedAlignment": alignment})
                await self.out.json({**said, "isFinal": True})
                if self.single:
                    await self.out.close(1000, "done")
        finally:
            if self.contexts.get(cid) is context:
                del self.contexts[cid]
            await session.close()

    async def _finish(self, context: _Context, outcome: str) -> None:
        """Stop a context now and release everything it holds."""
        self.contexts.pop(context.id, None)
        await stop_context(context.session, context.sender, outcome)

    async def _error(self, context_id: str | None, text: str) -> None:
        said = {} if self.single or context_id is None else {"contextId": context_id}
        await self.out.tell({**said, "error": text, "message": text})


async def _socket(ws: WebSocket, voice_id: str, single: bool) -> None:
    if (accepted := await accept(ws)) is None:
        return
    runtime, key = accepted
    try:
        spec = spec_of(runtime, voice_id, ws.query_params)
    except Refusal as exc:  # the socket's own settings: nothing can be spoken on it
        await refuse_socket(SocketWriter(ws), {"error": str(exc), "message": str(exc)}, str(exc)[:120])
        return
    cumulative = ws.query_params.get("sync_alignment", "false").lower() == "true"
    await ElevenLabsSocket(ws, runtime, key, spec, cumulative, single).run()


@router.websocket("/v1/text-to-speech/{voice_id}/multi-stream-input")
async def multi_stream_input(ws: WebSocket, voice_id: str) -> None:
    await _socket(ws, voice_id, single=False)


@router.websocket("/v1/text-to-speech/{voice_id}/stream-input")
async def stream_input(ws: WebSocket, voice_id: str) -> None:
    await _socket(ws, voice_id, single=True)


async def _http_spec(request: Request, voice_id: str) -> tuple[SpeechSpec, str]:
    body = await text_body(request, "text")
    try:
        return spec_of(request.app.state.runtime, voice_id, request.query_params), body["text"]
    except Refusal as exc:
        raise ApiError(exc.status, str(exc)) from None


@router.post("/v1/text-to-speech/{voice_id}")
@router.post("/v1/text-to-speech/{voice_id}/stream")
async def speech(request: Request, voice_id: str) -> Response:
    """`{text}` in, its audio streamed as it is decoded."""
    spec, text = await _http_spec(request, voice_id)
    return await speak_whole(request, spec, text, "elevenlabs")


class Timestamped(Framing):
    """.../stream/with-timestamps: newline-delimited JSON, `{audio_base64}` lines and each sentence's character
    alignment after its audio; a failure after audio went out is a last `{error}` line."""

    media_type = "application/x-ndjson"
    words = True

    def audio(self, audio: Audio) -> bytes:
        return _line({"audio_base64": base64.b64encode(audio.data).decode()})

    def timings(self, words: Words) -> bytes:
        aligned = char_alignment(words, 0.0)
        seconds = {"characters": aligned["chars"],
                   "character_start_times_seconds": [ms / 1000 for ms in aligned["charStartTimesMs"]],
                   "character_end_times_seconds": [(s + d) / 1000 for s, d in
                                                   zip(aligned["charStartTimesMs"], aligned["charDurationsMs"])]}
        return _line({"alignment": seconds, "normalized_alignment": seconds})

    def failure(self, message: str) -> bytes:
        return _line({"error": f"speech generation failed: {message}"})


def _line(obj: dict) -> bytes:
    return json.dumps(obj).encode() + b"\n"


TIMESTAMPED = Timestamped()


@router.post("/v1/text-to-speech/{voice_id}/stream/with-timestamps")
async def speech_with_timestamps(request: Request, voice_id: str) -> Response:
    """The audio and its alignment, through the other HTTP doors' path: a 4xx/503 before the first audio, a client
    too slow to read cut off."""
    spec, text = await _http_spec(request, voice_id)
    return await speak_whole(request, spec, text, "elevenlabs", TIMESTAMPED)
