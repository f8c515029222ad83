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
from ..speech.session import Audio, Refused, SpeechSession, SpeechSpec
from ..voices import UnknownVoice
from .http import trim_of
from .sockets import (
    MAX_CONTEXTS,
    SocketGone,
    SocketWriter,
    accept,
    client_messages,
    parse_message,
    queued_audio,
    refuse_socket,
    stop_sessions,
)

log = logging.getLogger(__name__)
router = APIRouter()

ENCODINGS = {"linear16": "pcm", "pcm_s16le": "pcm", "mulaw": "mulaw", "alaw": "alaw"}
CLOSE = object()  # close's place in the queue of flush groups


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
    """One client socket after its init: the flush groups it sent, played in order by one sender task."""

    def __init__(self, out: SocketWriter, runtime, key, spec: SpeechSpec) -> None:
        self.out, self.runtime, self.key, self.spec = out, runtime, key, spec
        self.current: SpeechSession | None = None  # the group receiving text
        self.current_chars = 0
        self.groups: asyncio.Queue = asyncio.Queue()  # a group's session, None (a flush of nothing), or CLOSE
        self.live: list[SpeechSession] = []  # every group not yet played out
        self.sequence = 0  # audio_chunk messages sent
        self.seconds = 0.0  # audio sent, for done's duration
        self.sender = asyncio.create_task(self._play())

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
            await self._stop_all("disconnected")

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
            self._flush()
        elif kind == "clear":
            await self._stop_all("cancelled")
            self.sender = asyncio.create_task(self._play())
            await self.out.tell({"type": "cleared"})
        elif kind == "cancel":
            await self._stop_all("cancelled")
            await self.out.close(1000)
            return True
        elif kind == "close":
            self._flush()
            self.groups.put_nowait(CLOSE)
            await asyncio.shield(self.sender)  # what was sent plays out, then done and the close
            return True
        elif kind != "keepalive":
            await self._error("invalid_request", f"unknown message type {kind!r}: text, flush, clear, cancel, close "
                                                 "or keepalive")
        return False

    async def _text(self, text: str) -> None:
        if self.current is None:
            if len(self.live) >= MAX_CONTEXTS:
                await self._error("rate_limit", f"{MAX_CONTEXTS} flushes are already waiting to play")
                return
            spec = SpeechSpec(self.spec.voice, random.getrandbits(31), self.spec.output, self.spec.trim)
            try:
                self.current = await SpeechSession.open(self.runtime, spec, self.key, f"slng-{uuid.uuid4().hex[:16]}")
            except Refused as exc:
                await self._error("rate_limit", str(exc))
                return
            self.current_chars = 0
            self.live.append(self.current)
            self.groups.put_nowait(self.current)
        self.current_chars += len(text)
        if self.current_chars > self.runtime.config.max_input_chars:
            limit = self.runtime.config.max_input_chars
            await self._error("invalid_request", f"over {limit} characters before a flush")
            return
        self.current.push(text)

    def _flush(self) -> None:
        if self.current is not None:
            self.current.end_input()
            self.current = None
        else:  # nothing to speak: flushed in its turn
            self.groups.put_nowait(None)

    async def _play(self) -> None:
        """Each group's audio in order, then its flushed; close's place: done, then the close."""
        try:
            while (group := await self.groups.get()) is not CLOSE:
                if group is not None:
                    await self._play_group(group)
                await self.out.json({"type": "flushed"})
            await self.out.json({"type": "done", "duration": round(self.seconds, 3)})
            await self.out.close(1000)
        except SocketGone:  # the client left: what is still queued stops (run() releases it)
            for session in list(self.live):
                session.cancel("disconnected")

    async def _play_group(self, session: SpeechSession) -> None:
        async with queued_audio(session, self.out, self._report, self.live):
            async for item in session.events():
                if isinstance(item, Audio):
                    self.sequence += 1
                    chunk = {"type": "audio_chunk", "data": base64.b64encode(item.data).decode(),
                             "sequence": self.sequence}
                    await session.send(lambda: self.out.json(chunk), item.seconds)
                    self.seconds += item.seconds

    async def _report(self, text: str, bad_input: bool) -> None:
        await self._error("invalid_request" if bad_input else "backend_error", text)

    async def _stop_all(self, outcome: str) -> None:
        """Barge-in or a vanished client: every group stops now and releases what it holds."""
        self.current = None
        await stop_sessions(self.live, self.sender, outcome)
        self.groups = asyncio.Queue()

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
