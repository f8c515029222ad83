"""Cartesia's TTS protocol, so Pipecat's CartesiaTTSService and LiveKit's cartesia.TTS work unchanged.

WebSocket /tts/websocket: each context is its own SpeechSession (admitted on its own), fed the
context's transcripts as they come and ended by `continue: false`; several contexts may be open on
one socket, each with its own audio. Messages in: `{transcript, continue, context_id, model_id,
voice: {mode: "id", id}, output_format: {container: "raw", encoding, sample_rate}, add_timestamps,
max_buffer_delay_ms, generation_config, flush}` and `{context_id, cancel: true}`. Out, every one with
its context_id: `chunk` (base64 audio), `timestamps` (word_timestamps, a proportional approximation),
`flush_done` (with `flush_id`, counting from 1) after the audio of the text a `flush: true` spoke,
`done` after a context's last chunk, `error` (never with `done: true`: LiveKit would take it for the
end). POST /tts/bytes speaks one transcript and streams the bytes (raw, wav or mp3). GET /voices lists the
registry's voices as Cartesia's List Voices does ({data, has_more, next_page}; limit, starting_after, ending_before,
q, is_owner, gender, language): a voice's id is its name, the one `voice: {mode: "id", id}` takes.

Not supported: voice embeddings (refused), `generation_config` speed other than 1 (refused),
emotion, volume and language (ignored: Orpheus takes inline tags such as <laugh>).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import random
import time
import uuid

from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import Response

from codec_contract.audio import SAMPLE_RATE

from ..edge.errors import ApiError
from ..speech.encoding import AudioOutput, UnsupportedOutput
from ..speech.session import Audio, Refused, SegmentEnd, SpeechSession, SpeechSpec, Words
from ..voices import CLONE, UnknownVoice, Voice
from .http import speak_whole, text_body, trim_of
from .sockets import (
    MAX_CONTEXTS,
    SocketWriter,
    accept,
    client_messages,
    context_audio,
    parse_message,
    stop_context,
)

log = logging.getLogger(__name__)

ENCODINGS = {"pcm_s16le": "pcm", "pcm_f32le": "pcm_f32le", "pcm_mulaw": "mulaw", "pcm_alaw": "alaw"}
DEFAULT_BUFFER_DELAY_MS = 3000  # Cartesia's default wait for more text before speaking a fragment
router = APIRouter()


class Refusal(ValueError):
    """A message the protocol refuses, with the status code its error carries."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def spec_of(message: dict, runtime, containers: tuple[str, ...] = ("raw",)) -> SpeechSpec:
    """How to speak a context, from its first message; Refusal for what this server cannot do."""
    voice = message.get("voice") or {}
    if not isinstance(voice, dict) or voice.get("mode", "id") != "id":
        raise Refusal(400, "only voices by id are supported (voice: {mode: 'id', id: 'tara'}), not embeddings")
    try:
        chosen, substituted = runtime.voices.resolve_vendor(voice.get("id") if isinstance(voice.get("id"), str) else None)
    except UnknownVoice as exc:
        raise Refusal(400, str(exc)) from None
    if substituted:
        log.info("cartesia voice: %s", substituted)
    speed = (message.get("generation_config") or {}).get("speed")
    if speed not in (None, 1, 1.0):
        raise Refusal(400, "speed other than 1 is not supported: Orpheus speaks at its own pace")
    fmt = message.get("output_format") or {}
    container, encoding = fmt.get("container", "raw"), fmt.get("encoding", "pcm_s16le")
    if container not in containers:
        raise Refusal(400, f"output_format.container {container!r} is not one of {list(containers)}")
    if container == "raw" and encoding not in ENCODINGS:
        raise Refusal(400, f"output_format.encoding {encoding!r} is not one of {sorted(ENCODINGS)}")
    try:
        output = AudioOutput(ENCODINGS[encoding] if container == "raw" else container, int(fmt.get("sample_rate", SAMPLE_RATE)))
    except (UnsupportedOutput, TypeError, ValueError) as exc:
        raise Refusal(400, f"output_format: {exc}") from None
    return SpeechSpec(chosen, random.getrandbits(31), output, trim_of(runtime.config))


class _Context:
    """One context of a socket: its session, the task sending its audio, and its text timer."""

    def __init__(self, context_id: str, session: SpeechSession, timestamps: bool, delay_ms: int) -> None:
        self.id, self.session, self.timestamps, self.delay_ms = context_id, session, timestamps, delay_ms
        self.flushes: list[tuple[int, int]] = []  # (flush_id, the last segment it spoke), answered in order
        self.flush_ids = 0
        self.segments_done = 0
        self.sender: asyncio.Task | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.text_chars = 0
        self.ended = False


class CartesiaSocket:
    """One client socket: its contexts, and the loop reading its messages."""

    def __init__(self, ws: WebSocket, runtime, key) -> None:
        self.ws, self.runtime, self.key = ws, runtime, key
        self.out = SocketWriter(ws)
        self.contexts: dict[str, _Context] = {}

    async def run(self) -> None:
        try:
            async for text in client_messages(self.ws, self.out, self.runtime, lambda why: self._error(None, 429, why)):
                if text is None:
                    await self._error(None, 400, "binary frames are not part of this protocol: send JSON text")
                    continue
                try:
                    await self._handle(parse_message(text))
                except Refusal as exc:
                    await self._error(exc.context_id, exc.status, str(exc))  # type: ignore[attr-defined]
                except ValueError as exc:  # not JSON, not an object, too long
                    await self._error(None, 400, f"malformed message: {exc}")
        finally:
            for context in list(self.contexts.values()):
                await self._finish(context, "disconnected")

    async def _handle(self, message: dict) -> None:
        context_id = message.get("context_id")
        if context_id is not None and not isinstance(context_id, str):
            raise _refusal(None, 400, "context_id must be a string")
        if message.get("cancel"):
            context = self.contexts.get(context_id)
            if context is not None:  # barge-in: audio stops now, engine and codec go at once
                await self._finish(context, "cancelled")
            return
        transcript = message.get("transcript")
        if not isinstance(transcript, str):
            raise _refusal(context_id, 400, "a message needs a transcript (a string), or cancel: true")
        context_id = context_id or f"ctx-{uuid.uuid4().hex[:12]}"
        context = self.contexts.get(context_id) or await self._open(context_id, message)
        if context is None:
            return
        if context.ended:
            raise _refusal(context_id, 400, f"context {context_id} has ended (continue: false was sent)")
        context.text_chars += len(transcript)
        if context.text_chars > self.runtime.config.max_input_chars:
            raise _refusal(context_id, 400, f"context {context_id} is over {self.runtime.config.max_input_chars} characters")
        self._feed(context, transcript, more=bool(message.get("continue", False)))
        if message.get("flush") is True:
            await self._flush(context)

    async def _open(self, context_id: str, message: dict) -> _Context | None:
        if len(self.contexts) >= MAX_CONTEXTS:
            raise _refusal(context_id, 429, f"this socket already has {MAX_CONTEXTS} open contexts")
        try:
            spec = spec_of(message, self.runtime)
            session = await SpeechSession.open(self.runtime, spec, self.key, f"cartesia-{context_id[:48]}-{uuid.uuid4().hex[:8]}")
        except Refusal as exc:
            raise _refusal(context_id, exc.status, str(exc)) from None
        except Refused as exc:
            raise _refusal(context_id, 429, str(exc)) from None
        delay = message.get("max_buffer_delay_ms")
        delay = DEFAULT_BUFFER_DELAY_MS if not isinstance(delay, int) or delay < 0 else delay
        context = _Context(context_id, session, bool(message.get("add_timestamps")), delay)
        self.contexts[context_id] = context
        context.sender = asyncio.create_task(self._pump(context))
        return context

    def _feed(self, context: _Context, text: str, more: bool) -> None:
        """Text for a context: spoken at sentence ends, at once when the client asked for no buffering,
        or after max_buffer_delay_ms without more; everything when the context ends."""
        session = context.session
        session.push(text)
        if context.timer is not None:
            context.timer.cancel()
            context.timer = None
        if not more:
            context.ended = True
            session.end_input()
        elif context.delay_ms == 0:
            session.flush()
        elif session.pending_text.strip():
            context.timer = asyncio.get_running_loop().call_later(context.delay_ms / 1000, session.flush)

    async def _flush(self, context: _Context) -> None:
        """Speak what is buffered now; `flush_done` follows the audio of everything sent before it."""
        context.session.flush()
        context.flush_ids += 1
        context.flushes.append((context.flush_ids, context.session.segments - 1))
        await self._answer_flushes(context)

    async def _answer_flushes(self, context: _Context) -> None:
        while context.flushes and context.flushes[0][1] < context.segments_done:
            flush_id, _ = context.flushes.pop(0)
            await self.out.json({"type": "flush_done", "context_id": context.id, "flush_id": flush_id,
                                 "flush_done": True, "done": False, "status_code": 206})

    async def _pump(self, context: _Context) -> None:
        """A context's audio, timestamps and done, in order; its end, however it comes."""
        cid, session = context.id, context.session

        async def report(text: str, bad_input: bool) -> None:
            await self._error(cid, 400 if bad_input else 500, text)

        try:
            async with context_audio(session, self.out, report):
                async for item in session.events():
                    if isinstance(item, Audio):
                        started = time.perf_counter()
                        message = {"type": "chunk", "data": base64.b64encode(item.data).decode(), "done": False,
                                   "status_code": 206, "context_id": cid}
                        await session.send(lambda: self.out.json({**message, "step_time": round(1000 * (time.perf_counter() - started), 3)}),
                                           item.seconds)
                    elif isinstance(item, Words) and context.timestamps and item.words:
                        await self.out.json({"type": "timestamps", "context_id": cid, "status_code": 206, "done": False,
                                             "word_timestamps": {"words": item.words, "start": item.starts, "end": item.ends}})
                    elif isinstance(item, SegmentEnd):
                        context.segments_done = item.index + 1
                        await self._answer_flushes(context)
                await self.out.json({"type": "done", "done": True, "status_code": 206, "context_id": cid})
        finally:
            if self.contexts.get(cid) is context:
                del self.contexts[cid]
            await session.close()

    async def _finish(self, context: _Context, outcome: str) -> None:
        """Stop a context now and release everything it holds."""
        self.contexts.pop(context.id, None)
        if context.timer is not None:
            context.timer.cancel()
        await stop_context(context.session, context.sender, outcome)

    async def _error(self, context_id: str | None, status: int, text: str) -> None:
        await self.out.tell({"type": "error", "context_id": context_id, "status_code": status, "done": False,
                             "error": text})


def _refusal(context_id: str | None, status: int, text: str) -> Refusal:
    refusal = Refusal(status, text)
    refusal.context_id = context_id  # type: ignore[attr-defined]
    return refusal


@router.websocket("/tts/websocket")
async def cartesia_websocket(ws: WebSocket) -> None:
    if (accepted := await accept(ws)) is None:
        return
    runtime, key = accepted
    await CartesiaSocket(ws, runtime, key).run()


@router.get("/voices")
async def cartesia_voices(request: Request, limit: int = 10, starting_after: str | None = None,
                          ending_before: str | None = None, q: str | None = None, is_owner: bool | None = None,
                          gender: str | None = None, language: str | None = None) -> dict:
    """Cartesia's List Voices: the registry's voices as Cartesia's Voice objects, a page at a time."""
    if not 1 <= limit <= 100:
        raise ApiError(400, "limit must be between 1 and 100", "limit")
    voices = listed_voices(request.app.state.runtime.voices.voices, q, is_owner, gender, language)
    ids = [v["id"] for v in voices]
    for cursor, name in ((starting_after, "starting_after"), (ending_before, "ending_before")):
        if cursor is not None and cursor not in ids:
            raise ApiError(400, f"{name}: no voice {cursor!r} in this list", name)
    if ending_before is not None:
        end = ids.index(ending_before)
        page, more = voices[max(0, end - limit):end], end > limit
    else:
        start = ids.index(starting_after) + 1 if starting_after is not None else 0
        page, more = voices[start:start + limit], start + limit < len(voices)
    return {"data": page, "has_more": more, "next_page": page[-1]["id"] if more and page else None}


def listed_voices(voices: list[Voice], q: str | None, is_owner: bool | None, gender: str | None,
                  language: str | None) -> list[dict]:
    """The voices a List Voices query matches, as Cartesia's Voice objects. The server's voices are public; clones
    are its owner's (made through POST /v1/voices). No voice's gender is recorded: a gender filter matches none."""
    found = []
    wanted = language.replace("_", "-").split("-")[0].lower() if language else None  # en_GB and en-GB: en
    for v in voices:
        owned = v.kind == CLONE
        if (q and q.lower() not in v.name.lower()) or (is_owner and not owned) or gender \
                or (wanted and (v.language or "").split("-")[0].lower() != wanted):
            continue
        found.append({"id": v.name, "name": v.name, "description": f"Orpheus {v.kind} voice {v.name}",
                      "is_owner": owned, "is_public": not owned, "language": v.language, "gender": None,
                      "created_at": None})
    return found


@router.post("/tts/bytes")
async def cartesia_bytes(request: Request) -> Response:
    """One transcript, its audio streamed as the bytes come (raw, wav or mp3)."""
    message = await text_body(request, "transcript")
    try:
        spec = spec_of(message, request.app.state.runtime, containers=("raw", "wav", "mp3"))
    except Refusal as exc:
        raise ApiError(exc.status, str(exc), "output_format") from None
    return await speak_whole(request, spec, message["transcript"], "cartesia-bytes")
