"""SLNG's Unmute Bridge TTS protocol, so LiveKit's slng.TTS works unchanged (read from livekit-plugins-slng 1.8.9:
livekit/plugins/slng/tts.py, connection.py and gateway_adapter.py; the message names from SLNG's API reference,
docs.slng.ai, "Unmute TTS Bridge"). The plugin builds the URL from a host and a model id, ws:// for localhost.

WebSocket /v1/bridges/unmute/tts/{model} (a provider/model:variant id such as canopylabs/orpheus:en, the name SLNG's
hosted service gives Orpheus; any id is taken, this worker serves its one model): `init` first ({model, voice,
language, config: {encoding, sample_rate, speed, language}}), answered with `ready` ({session_id}). `text`
({text}) adds text, spoken at sentence ends; `flush` speaks the rest and answers `flushed` after that audio (the
plugin ends a segment on it, and on `Flushed`, `done` or `audio_end` alike). The text between two flushes is one
SpeechSession (admitted on its own), and they play in order. Audio comes as `audio_chunk` ({data: base64,
sequence}). `clear` stops every flush's audio at once (a barge-in: engine requests and codec streams freed) and
answers `cleared`; `cancel` does the same and closes the socket; `close` lets what was sent play out, then
answers `done` ({duration}) and closes (1000); `keepalive` is taken and ignored. A client that closes the socket
(the plugin does after each segment's end, and at a barge-in) frees everything at once.

Refused in the protocol's shape, `{"type": "error", "code", "message"}`, with the Bridge's codes (the plugin maps
them to statuses: invalid_request and config_error 400, rate_limit 429, backend_error 502): a first message that
is not an init this server can serve closes the socket after it (1008); later, malformed JSON, an unknown type, a
binary frame, text over --max-input-chars before a flush and too many flushes waiting are refused and the socket
lives on. config.encoding linear16 (raw s16le; the plugin's), mulaw or alaw, at any sample_rate the resampler
takes; speed other than 1 is refused; language is the voice's own. Keys: `Authorization: Bearer` (the plugin also
sends X-API-Key).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import random
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, WebSocket

from codec_contract.audio import SAMPLE_RATE

from ..speech.encoding import AudioOutput, UnsupportedOutput
from ..speech.session import Audio, SpeechSession, SpeechSpec
from ..voices import UnknownVoice
from .http import trim_of
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
router = APIRouter()

ENCODINGS = {"linear16": "pcm", "pcm_s16le": "pcm", "mulaw": "mulaw", "alaw": "alaw"}


class BadInit(ValueError):
    """An init this server cannot serve."""


def spec_of(init: dict, runtime) -> SpeechSpec:
    """How to speak for an init message; BadInit for what this server cannot do."""
    if init.get("type") != "init":
        raise BadInit(f"the first message must be init ({{type: 'init', voice, config}}), not {init.get('type')!r}")
    config = init.get("config") or {}
    if not isinstance(config, dict):
        raise BadInit("config must be an object")
    try:
        voice = runtime.voices.named(init.get("voice"))
    except UnknownVoice as exc:
        raise BadInit(str(exc)) from None
    if config.get("speed", init.get("speed")) not in (None, 1, 1.0):
        raise BadInit("speed other than 1 is not supported: Orpheus speaks at its own pace")
    encoding = config.get("encoding", "linear16")
    if encoding not in ENCODINGS:
        raise BadInit(f"encoding {encoding!r} is not one of {sorted(ENCODINGS)}")
    try:
        output = AudioOutput(ENCODINGS[encoding], int(config.get("sample_rate", SAMPLE_RATE)))
    except (UnsupportedOutput, TypeError, ValueError) as exc:
        raise BadInit(f"config: {exc}") from None
    return SpeechSpec(voice, 0, output, trim_of(runtime.config))


class SlngSocket:
    """One client socket after its init: the flush groups it sent, played in order (sockets.Turns)."""

    def __init__(self, out: SocketWriter, runtime, key, spec: SpeechSpec) -> None:
        self.out, self.runtime, self.spec = out, runtime, spec
        self.sequence = 0  # audio_chunk messages sent
        self.seconds = 0.0  # audio sent, for done's duration
        self.groups = Turns(out, runtime, key, self._play_group, self._done)

    async def run(self, messages: AsyncIterator[str | None]) -> None:
        """Read the socket's messages after its init (sockets.client_messages: within its budget) until it goes."""
        await self.out.tell({"type": "ready", "session_id": f"sess_tts_{uuid.uuid4().hex[:16]}"})
        try:
            async for text in messages:
                if text is None:
                    await self._error("invalid_request", "binary frames are not part of this protocol: send JSON text")
                    continue
                try:
                    message = parse_message(text)
                except ValueError as exc:
                    await self._error("invalid_request", f"malformed message: {exc}")
                    continue
                if await self._handle(message):
                    return
        finally:
            await self.groups.stop("disconnected")

    async def _handle(self, message: dict) -> bool:
        """One message; True once the socket is done with (close played out, or cancel)."""
        kind = message.get("type")
        if kind == "text":
            text = message.get("text")
            if not isinstance(text, str):
                await self._error("invalid_request", "text needs text (a string)")
            elif text:
                await self._text(text)
        elif kind == "flush":
            self.groups.end()
        elif kind == "clear":
            await self.groups.clear()
            await self.out.tell({"type": "cleared"})
        elif kind == "cancel":
            await self.groups.stop("cancelled")
            await self.out.close(1000)
            return True
        elif kind == "close":
            self.groups.end()
            self.groups.close()
            await asyncio.shield(self.groups.sender)  # what was sent plays out, then done and the close
            return True
        elif kind != "keepalive":
            await self._error("invalid_request", f"unknown message type {kind!r}: text, flush, clear, cancel, close "
                                                 "or keepalive")
        return False

    async def _text(self, text: str) -> None:
        def spec() -> SpeechSpec:
            return SpeechSpec(self.spec.voice, random.getrandbits(31), self.spec.output, self.spec.trim)

        try:
            await self.groups.text(text, spec, f"slng-{uuid.uuid4().hex[:16]}")
        except NotSpoken as exc:
            if exc.kind == NotSpoken.BUSY:
                await self._error("rate_limit", f"{MAX_CONTEXTS} flushes are already waiting to play")
            elif exc.kind == NotSpoken.REFUSED:
                await self._error("rate_limit", str(exc))
            else:
                await self._error("invalid_request", f"over {self.runtime.config.max_input_chars} characters before a "
                                                     "flush")

    async def _play_group(self, _tag, session: SpeechSession | None) -> None:
        """A group's audio, then its flushed (a flush of nothing: flushed in its turn)."""
        if session is not None:
            async with queued_audio(session, self.out, self._report, self.groups.live):
                async for item in session.events():
                    if isinstance(item, Audio):
                        self.sequence += 1
                        chunk = {"type": "audio_chunk", "data": base64.b64encode(item.data).decode(),
                                 "sequence": self.sequence}
                        await session.send(lambda: self.out.json(chunk), item.seconds)
                        self.seconds += item.seconds
        await self.out.json({"type": "flushed"})

    async def _done(self) -> None:
        """close's place: done, then the close."""
        await self.out.json({"type": "done", "duration": round(self.seconds, 3)})
        await self.out.close(1000)

    async def _report(self, text: str, bad_input: bool) -> None:
        await self._error("invalid_request" if bad_input else "backend_error", text)

    async def _error(self, code: str, text: str) -> None:
        await self.out.tell(_error(code, text))


def _error(code: str, text: str) -> dict:
    return {"type": "error", "code": code, "message": text}


@router.websocket("/v1/bridges/unmute/tts/{model:path}")
async def slng_websocket(ws: WebSocket, model: str) -> None:
    if (accepted := await accept(ws)) is None:
        return
    runtime, key = accepted
    out = SocketWriter(ws)
    messages = client_messages(ws, out, runtime, lambda why: out.tell(_error("rate_limit", why)))
    first = await anext(messages, None)
    try:
        if first is None:
            raise BadInit("binary frames are not part of this protocol: the first message is init, as JSON text")
        spec = spec_of(parse_message(first), runtime)
    except ValueError as exc:  # BadInit, or not JSON
        await refuse_socket(out, _error("config_error", str(exc)), str(exc)[:120])
        return
    log.debug("slng socket for model %s", model)
    await SlngSocket(out, runtime, key, spec).run(messages)
