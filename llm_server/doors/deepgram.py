"""Deepgram's TTS protocol, so Pipecat's DeepgramTTSService and LiveKit's deepgram.TTS work unchanged.

WebSocket /v1/speak?model=&encoding=&sample_rate=: `Speak {text}` adds text (LiveKit sends one word
per Speak: this server's sentence buffering is what makes that sound right; speaking starts at each
sentence end, without waiting for a Flush), `Flush` speaks the rest and answers `Flushed` after that
audio, `Clear` stops the audio at once (barge-in) and answers `Cleared`, `Close` stops and closes
(clients send it as they leave: LiveKit waits a second for the socket to close, Pipecat not at all). Audio goes out as binary frames. The text between two flushes is one
SpeechSession (admitted on its own), and sessions play in order. `Metadata` opens the socket;
`Warning` says what was accepted with a change (another vendor's voice name); `Error` refuses.
POST /v1/speak speaks `{"text"}` and streams the bytes.

Voices: `model=aura-2-<voice>-<language>` (or a bare voice name) asks for a voice of this worker
(voices.py). Not supported: `speed` other than 1 (refused), Deepgram's own voices (their names get the
default voice, with a Warning, unless vendor_voice_fallback is off: then an Error).
"""

from __future__ import annotations

import logging
import random
import re
import uuid
from dataclasses import dataclass

from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import Response

from codec_contract.audio import SAMPLE_RATE

from ..edge.errors import ApiError
from ..speech.encoding import AudioOutput, UnsupportedOutput
from ..speech.session import Audio, SpeechSession, SpeechSpec
from ..voices import UnknownVoice, Voice, VoiceRegistry
from .http import speak_whole, text_body, trim_of
from .sockets import (
    MAX_CONTEXTS,
    NotSpoken,
    SocketWriter,
    Turns,
    accept,
    client_messages,
    parse_message,
    queued_audio,
    refuse_socket,
)

log = logging.getLogger(__name__)

# encoding (and HTTP container) -> our output format
SOCKET_ENCODINGS = {"linear16": "pcm", "mulaw": "mulaw", "alaw": "alaw"}
HTTP_ENCODINGS = {**SOCKET_ENCODINGS, "mp3": "mp3", "opus": "opus", "flac": "flac", "aac": "aac"}
router = APIRouter()
AURA_MODEL = re.compile(r"aura(?:-2)?-([^-]+)-[a-z]{2}(?:-[A-Za-z]{2})?")  # aura-2-<voice>-<language>


class BadQuery(ValueError):
    """A query parameter this server cannot serve."""


@dataclass(frozen=True)
class Settings:
    """What a socket or request asked for in its query, resolved."""

    voice: Voice
    output: AudioOutput
    warning: str | None  # said in a Warning message (the socket) or logged (HTTP)


def voice_of(model: str | None) -> str | None:
    """The voice a Deepgram model name asks for: `aura-2-tara-en` and `aura-tara-en` ask for tara; any other
    name is taken as it is."""
    found = AURA_MODEL.fullmatch(model or "")
    return found.group(1) if found else model


def settings_of(query, voices: VoiceRegistry, encodings: dict[str, str]) -> Settings:
    try:
        chosen, warning = voices.resolve_vendor(voice_of(query.get("model")))
    except UnknownVoice as exc:
        raise BadQuery(str(exc)) from None
    speed = query.get("speed")
    if speed is not None and speed not in ("1", "1.0"):
        raise BadQuery("speed other than 1 is not supported: Orpheus speaks at its own pace")
    encoding = query.get("encoding", "linear16")
    if encoding not in encodings:
        raise BadQuery(f"encoding {encoding!r} is not one of {sorted(encodings)}")
    fmt = "wav" if encoding == "linear16" and query.get("container") == "wav" else encodings[encoding]
    try:
        return Settings(chosen, AudioOutput(fmt, int(query.get("sample_rate", SAMPLE_RATE))), warning)
    except (UnsupportedOutput, ValueError) as exc:
        raise BadQuery(str(exc)) from None


class DeepgramSocket:
    """One client socket: the flush groups it sent, played in order (sockets.Turns)."""

    def __init__(self, ws: WebSocket, runtime, key, settings: Settings) -> None:
        self.ws, self.runtime, self.settings = ws, runtime, settings
        self.out = SocketWriter(ws)
        self.flushes = self.played = 0
        self.groups = Turns(self.out, runtime, key, self._play_group)

    async def run(self) -> None:
        request_id = uuid.uuid4().hex
        await self.out.tell({"type": "Metadata", "request_id": request_id, "model_name": self.settings.voice.name,
                             "model_version": "orpheus", "model_uuid": request_id})
        if self.settings.warning:
            await self._warning("VOICE_SUBSTITUTED", self.settings.warning)
        try:
            async for text in client_messages(self.ws, self.out, self.runtime,
                                             lambda why: self._error("TOO_MANY_REQUESTS", why)):
                if text is None:
                    await self._error("INVALID_MESSAGE", "binary frames are not part of this protocol: send JSON text")
                    continue
                try:
                    closing = await self._handle(parse_message(text))
                except ValueError as exc:
                    await self._error("INVALID_MESSAGE", f"malformed message: {exc}")
                    continue
                if closing:
                    return
        finally:
            await self.groups.stop("disconnected")

    async def _handle(self, message: dict) -> bool:
        """One message; True once the socket should close."""
        kind = message.get("type")
        if kind == "Speak":
            text = message.get("text")
            if not isinstance(text, str):
                await self._error("INVALID_MESSAGE", "Speak needs text (a string)")
            else:
                await self._speak(text)
        elif kind == "Flush":
            self.flushes += 1
            self.groups.end()  # with nothing to speak, an empty group: Flushed in order after what plays
        elif kind == "Clear":
            await self.groups.clear()
            await self.out.tell({"type": "Cleared", "sequence_id": self.flushes})
        elif kind == "Close":
            await self.groups.stop("cancelled")
            await self.out.close(1000)
            return True
        else:
            await self._warning("UNKNOWN_MESSAGE", f"unknown message type {kind!r}: Speak, Flush, Clear or Close")
        return False

    async def _speak(self, text: str) -> None:
        def spec() -> SpeechSpec:
            return SpeechSpec(self.settings.voice, random.getrandbits(31), self.settings.output,
                              trim_of(self.runtime.config))

        try:
            await self.groups.text(text, spec, f"deepgram-{uuid.uuid4().hex[:16]}")
        except NotSpoken as exc:
            if exc.kind == NotSpoken.BUSY:
                await self._error("TOO_MANY_REQUESTS", f"{MAX_CONTEXTS} flushes are already waiting to play")
            elif exc.kind == NotSpoken.REFUSED:
                await self._error("TOO_MANY_REQUESTS", str(exc))
            else:
                await self._error("INPUT_TOO_LONG", f"over {self.runtime.config.max_input_chars} characters before a "
                                                    "Flush")

    async def _play_group(self, _tag, session: SpeechSession | None) -> None:
        """One group's audio, ended as every socket door's context is (sockets.queued_audio), then its Flushed (a
        Flush with nothing to speak: just Flushed); a client gone or cut off is seen by the next send."""
        if session is not None:
            async with queued_audio(session, self.out, self._report, self.groups.live):
                async for item in session.events():
                    if isinstance(item, Audio):
                        await session.send(lambda: self.out.bytes(item.data), item.seconds)
        self.played += 1
        await self.out.json({"type": "Flushed", "sequence_id": self.played})

    async def _report(self, text: str, bad_input: bool) -> None:
        await self._error("INPUT_TOO_LONG" if bad_input else "SYNTHESIS_FAILED", text)

    async def _warning(self, code: str, text: str) -> None:
        await self.out.tell(_message("Warning", code, text))

    async def _error(self, code: str, text: str) -> None:
        await self.out.tell(_message("Error", code, text))


def _message(kind: str, code: str, text: str) -> dict:
    """Deepgram's Warning or Error: {type, warn_code|err_code, warn_msg|err_msg, description}."""
    prefix = "warn" if kind == "Warning" else "err"
    return {"type": kind, f"{prefix}_code": code, f"{prefix}_msg": text, "description": text}


@router.websocket("/v1/speak")
async def deepgram_websocket(ws: WebSocket) -> None:
    if (accepted := await accept(ws)) is None:
        return
    runtime, key = accepted
    try:
        settings = settings_of(ws.query_params, runtime.voices, SOCKET_ENCODINGS)
    except BadQuery as exc:
        await refuse_socket(SocketWriter(ws), _message("Error", "INVALID_QUERY_PARAMETER", str(exc)), "invalid query parameter")
        return
    await DeepgramSocket(ws, runtime, key, settings).run()


@router.post("/v1/speak")
async def deepgram_http(request: Request) -> Response:
    """`{"text"}` in, its audio streamed as the bytes come."""
    runtime = request.app.state.runtime
    config = runtime.config
    try:
        settings = settings_of(request.query_params, runtime.voices, HTTP_ENCODINGS)
    except BadQuery as exc:
        raise ApiError(400, str(exc)) from None
    body = await text_body(request, "text")
    if settings.warning:
        log.info("deepgram speak: %s", settings.warning)
    spec = SpeechSpec(settings.voice, random.getrandbits(31), settings.output, trim_of(config))
    return await speak_whole(request, spec, body["text"], "deepgram")
