"""A Baseten-compatible front door: the protocol of Baseten's Orpheus deployments, read from LiveKit's
`baseten.TTS` (livekit-plugins-baseten 1.8.9, livekit/plugins/baseten/tts.py), the plugin LiveKit points Orpheus
users to. Paths as on Baseten's own endpoints, so a client is pointed here by replacing the host:

WebSocket /environments/{environment}/websocket: a JSON metadata message first, `{"voice", "max_tokens",
"buffer_size"}`, then the text as text frames (any pieces: spoken at sentence ends), then `__END__`; the audio
comes back as binary frames of raw PCM (s16le, 24 kHz, mono), and the server closes the socket once it has
all gone. A client that closes the socket is a barge-in: the engine request and codec stream go at once.

POST /environments/{environment}/predict: `{"prompt", "voice"?, "temperature"?, "language"?}` in, the raw
PCM streamed as it is decoded.

Refused in the protocol's shape: on the socket a text frame `{"type": "error", "message"}`, then close (1008
for a bad message or voice, 1003 for a binary frame, 1013 when the worker is full); over HTTP the usual error
body. The voice goes through the voice registry (Baseten's are Orpheus's own names): unknown is refused. A first
message that is a `session.config` (the plugin's qwen3-tts protocol, whose Baseten URL has this same path) is
refused with the path of that protocol's own door (doors/vllm_omni.py), not read as metadata.
Not supported: buffer_size (this server speaks each sentence as it ends, whatever the word count), max_tokens
(each sentence gets the budget its length needs), temperature and language (ignored: the worker's sampling,
the voice's language). Keys: `Authorization: Api-Key <key>`, as the plugin sends it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid

from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import Response

from ..edge.errors import ApiError
from ..speech.encoding import AudioOutput
from ..speech.session import Audio, Refused, SpeechSession, SpeechSpec
from ..voices import UnknownVoice
from .http import speak_whole, text_body, trim_of
from .sockets import SocketGone, SocketWriter, accept, client_messages, context_audio, parse_message

log = logging.getLogger(__name__)
router = APIRouter()

END = "__END__"  # the client's last text frame
PCM = AudioOutput("pcm")  # what the plugin plays: s16le at 24 kHz
BAD_MESSAGE, UNSUPPORTED_DATA, TRY_AGAIN_LATER = 1008, 1003, 1013


class BasetenSocket:
    """One client socket: its metadata, then one stream of text until __END__."""

    def __init__(self, ws: WebSocket, runtime, key) -> None:
        self.ws, self.runtime, self.key = ws, runtime, key
        self.out = SocketWriter(ws)
        self.chars = 0

    async def run(self) -> None:
        messages = client_messages(self.ws, self.out, self.runtime,
                                   lambda why: self._refuse(BAD_MESSAGE, why))
        session = await self._open(await anext(messages, None))
        if session is None:
            return
        sender = asyncio.create_task(self._send_audio(session))
        try:
            async for text in messages:
                if text is None:
                    await self._refuse(UNSUPPORTED_DATA, "binary frames are not part of this protocol: send text")
                    return
                if text == END:
                    session.end_input()
                    await asyncio.shield(sender)  # the rest of the audio, then the close
                    return
                self.chars += len(text)
                if self.chars > self.runtime.config.max_input_chars:
                    await self._refuse(BAD_MESSAGE, f"over {self.runtime.config.max_input_chars} characters of text")
                    return
                session.push(text)
        finally:
            session.cancel("disconnected")  # a no-op once the stream has ended
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
            await session.close()

    async def _open(self, first: str | None) -> SpeechSession | None:
        """The session the metadata message asks for, or None (refused, said and closed; or the client left)."""
        if first is None:
            await self._refuse(UNSUPPORTED_DATA, "the first message is the JSON metadata, not a binary frame")
            return None
        try:
            metadata = parse_message(first)
            if metadata.get("type") == "session.config":  # LiveKit's qwen3-tts protocol, pointed at the wrong door
                raise ValueError("a session.config is vLLM-Omni's protocol (baseten.TTS(model='qwen3-tts')): its "
                                 "socket is /v1/audio/speech/stream")
            voice = self.runtime.voices.named(metadata.get("voice"))
        except (ValueError, UnknownVoice) as exc:
            await self._refuse(BAD_MESSAGE, f"the first message must be the JSON metadata {{voice, max_tokens, "
                                            f"buffer_size}}: {exc}")
            return None
        spec = SpeechSpec(voice, random.getrandbits(31), PCM, trim_of(self.runtime.config))
        try:
            return await SpeechSession.open(self.runtime, spec, self.key, f"baseten-{uuid.uuid4().hex[:16]}")
        except Refused as exc:
            await self._refuse(TRY_AGAIN_LATER, str(exc))
            return None

    async def _send_audio(self, session: SpeechSession) -> None:
        async with context_audio(session, self.out, self._report):
            async for item in session.events():
                if isinstance(item, Audio):
                    await session.send(lambda: self.out.bytes(item.data), item.seconds)
            await self.out.close(1000)

    async def _report(self, text: str, bad_input: bool) -> None:
        await self._refuse(BAD_MESSAGE if bad_input else 1011, text)

    async def _refuse(self, code: int, text: str) -> None:
        await self.out.tell({"type": "error", "message": text})
        await self.out.close(code, text[:120])


@router.websocket("/environments/{environment}/websocket")
async def baseten_websocket(ws: WebSocket, environment: str) -> None:
    if (accepted := await accept(ws)) is None:
        return
    runtime, key = accepted
    try:
        await BasetenSocket(ws, runtime, key).run()
    except SocketGone:
        pass


@router.post("/environments/{environment}/predict")
async def baseten_predict(request: Request, environment: str) -> Response:
    runtime = request.app.state.runtime
    body = await text_body(request, "prompt")
    try:
        voice = runtime.voices.named(body.get("voice"))
    except UnknownVoice as exc:
        raise ApiError(400, str(exc), "voice") from None
    spec = SpeechSpec(voice, random.getrandbits(31), PCM, trim_of(runtime.config))
    return await speak_whole(request, spec, body["prompt"], "baseten")
