"""A Together-compatible front door: Together AI's realtime TTS WebSocket, read from Pipecat's TogetherTTSService
(pipecat-ai 1.14, pipecat/services/together/tts.py), whose own example is Orpheus with voice "tara".

WebSocket /v1/audio/speech/websocket?model=&voice=&language=: the server opens with `session.created`
({session: {id, voice}}). Client events: `tts_session.updated` ({session: {voice}}: answered with
`session.updated`), `input_text_buffer.append` ({text}), `input_text_buffer.commit` (what was appended becomes an
item: spoken, its audio after the items committed before it), `input_text_buffer.clear` (the cancel: the text
not yet committed and every item still speaking are dropped, their engine requests and codec streams freed at
once; answered with `input_text_buffer.cleared`). Server events per item: `conversation.item.input_text.received`
({item_id, text}), `conversation.item.audio_output.delta` ({item_id, delta}: base64 PCM s16le, 24 kHz, mono) as it
is decoded, `conversation.item.audio_output.done` ({item_id}); `conversation.item.tts.failed` ({item_id, error})
when an item cannot be spoken. Refused input (malformed JSON, an unknown event type, a binary frame, text over
--max-input-chars, too many items waiting, an unknown voice) gets `error` ({error: {type, code, message}}) and
the socket lives on; an unknown voice in the URL closes it (1008) after the error. Keys: `Authorization: Bearer`.
Not supported: other rates or encodings (Together streams 24 kHz PCM only), `extra_params` (ignored), `language`
(the voice's own), `max_partial_length` (items are spoken sentence by sentence as they come).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import random
import uuid

from fastapi import APIRouter, WebSocket

from ..speech.encoding import AudioOutput
from ..speech.session import Audio, Refused, SpeechSession, SpeechSpec
from ..voices import UnknownVoice, Voice
from .http import trim_of
from .sockets import (
    MAX_CONTEXTS,
    SocketGone,
    SocketWriter,
    accept,
    client_messages,
    context_audio,
    parse_message,
    refuse_socket,
    stop_sessions,
)

log = logging.getLogger(__name__)
router = APIRouter()

PCM = AudioOutput("pcm")  # Together's only format: s16le at 24 kHz


class TogetherSocket:
    """One client socket: the buffer being appended to, and the committed items, spoken in order by one task."""

    def __init__(self, ws: WebSocket, runtime, key, voice: Voice) -> None:
        self.ws, self.runtime, self.key, self.voice = ws, runtime, key, voice
        self.out = SocketWriter(ws)
        self.buffer: list[str] = []
        self.buffered = 0  # characters in buffer
        self.items: asyncio.Queue[tuple[str, SpeechSession, str]] = asyncio.Queue()
        self.live: list[SpeechSession] = []  # every item committed and not yet spoken out
        self.sender = asyncio.create_task(self._speak_items())

    async def run(self) -> None:
        await self.out.tell({"type": "session.created", "session": {"id": uuid.uuid4().hex, "voice": self.voice.name}})
        try:
            async for text in client_messages(self.ws, self.out, self.runtime,
                                             lambda why: self._error("rate_limit_exceeded", why)):
                if text is None:
                    await self._error("invalid_event", "binary frames are not part of this protocol: send JSON events")
                    continue
                try:
                    event = parse_message(text)
                except ValueError as exc:
                    await self._error("invalid_event", f"malformed event: {exc}")
                    continue
                await self._handle(event)
        finally:
            await self._clear("disconnected")
            self.sender.cancel()
            await asyncio.gather(self.sender, return_exceptions=True)

    async def _handle(self, event: dict) -> None:
        kind = event.get("type")
        if kind == "input_text_buffer.append":
            text = event.get("text")
            if not isinstance(text, str):
                await self._error("invalid_event", "input_text_buffer.append needs text (a string)")
            elif self.buffered + len(text) > self.runtime.config.max_input_chars:
                await self._error("input_too_long", f"over {self.runtime.config.max_input_chars} characters before a commit")
            else:
                self.buffer.append(text)
                self.buffered += len(text)
        elif kind == "input_text_buffer.commit":
            await self._commit()
        elif kind == "input_text_buffer.clear":
            await self._clear("cancelled")
            self.sender = asyncio.create_task(self._speak_items())
            await self.out.tell({"type": "input_text_buffer.cleared"})
        elif kind == "tts_session.updated":
            session = event.get("session")
            try:
                if isinstance(session, dict) and session.get("voice") is not None:
                    self.voice = self.runtime.voices.named(session["voice"])
            except UnknownVoice as exc:
                await self._error("invalid_voice", str(exc))
                return
            await self.out.tell({"type": "session.updated", "session": {"voice": self.voice.name}})
        else:
            await self._error("invalid_event", f"unknown event type {kind!r}: input_text_buffer.append, .commit, "
                                               ".clear or tts_session.updated")

    async def _commit(self) -> None:
        text, self.buffer, self.buffered = "".join(self.buffer).strip(), [], 0
        if not text:
            return
        if len(self.live) >= MAX_CONTEXTS:
            await self._error("too_many_items", f"{MAX_CONTEXTS} items are already waiting to be spoken")
            return
        spec = SpeechSpec(self.voice, random.getrandbits(31), PCM, trim_of(self.runtime.config))
        try:
            session = await SpeechSession.open(self.runtime, spec, self.key, f"together-{uuid.uuid4().hex[:16]}")
        except Refused as exc:
            await self._error("rate_limit_exceeded", str(exc))
            return
        session.say(text)
        item_id = f"item_{uuid.uuid4().hex[:12]}"
        self.live.append(session)
        self.items.put_nowait((item_id, session, text))

    async def _speak_items(self) -> None:
        """Each committed item in order: its text received, its audio as deltas, its done."""
        try:
            while True:
                item_id, session, text = await self.items.get()
                try:
                    await self.out.json({"type": "conversation.item.input_text.received", "item_id": item_id, "text": text})
                    await self._speak(item_id, session)
                finally:
                    if session in self.live:
                        self.live.remove(session)
                    await session.close()
        except SocketGone:
            for session in list(self.live):
                session.cancel("disconnected")

    async def _speak(self, item_id: str, session: SpeechSession) -> None:
        async def failed(text: str, bad_input: bool) -> None:
            await self.out.tell({"type": "conversation.item.tts.failed", "item_id": item_id,
                                 "error": {"type": "invalid_request_error" if bad_input else "server_error", "message": text}})

        async with context_audio(session, self.out, failed):
            async for piece in session.events():
                if isinstance(piece, Audio):
                    delta = {"type": "conversation.item.audio_output.delta", "item_id": item_id,
                             "delta": base64.b64encode(piece.data).decode()}
                    await session.send(lambda: self.out.json(delta), piece.seconds)
            await self.out.json({"type": "conversation.item.audio_output.done", "item_id": item_id})

    async def _clear(self, outcome: str) -> None:
        """The cancel (or a vanished client): uncommitted text and every item stop now and release what they hold."""
        self.buffer, self.buffered = [], 0
        await stop_sessions(self.live, self.sender, outcome)
        self.items = asyncio.Queue()

    async def _error(self, code: str, message: str) -> None:
        await self.out.tell({"type": "error", "error": {"type": "invalid_request_error", "code": code, "message": message}})


@router.websocket("/v1/audio/speech/websocket")
async def together_websocket(ws: WebSocket) -> None:
    if (accepted := await accept(ws)) is None:
        return
    runtime, key = accepted
    try:
        voice = runtime.voices.named(ws.query_params.get("voice"))
    except UnknownVoice as exc:
        await refuse_socket(SocketWriter(ws), {"type": "error", "error": {
            "type": "invalid_request_error", "code": "invalid_voice", "message": str(exc)}}, "invalid voice")
        return
    await TogetherSocket(ws, runtime, key, voice).run()
