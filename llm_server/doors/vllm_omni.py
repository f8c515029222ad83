"""vLLM-Omni's streaming speech WebSocket, so LiveKit's baseten.TTS(model="qwen3-tts") works unchanged (read from
livekit-plugins-baseten 1.8.9, livekit/plugins/baseten/qwen3_tts.py; the server's side from vLLM-Omni's
vllm_omni/entrypoints/openai/serving_speech_stream.py). The plugin takes the socket's full URL (model_endpoint).

WebSocket /v1/audio/speech/stream: `session.config` first ({voice, response_format: "pcm", stream_audio, speed,
timestamp_type: "word", ...}; sticky, and sent again between utterances to change it), then `input.text` ({text})
pieces and `input.done`: the text since the last input.done is one utterance, its own SpeechSession (admitted on
its own), spoken sentence by sentence as each ends, and utterances play in order. For each sentence: `audio.start`
({utterance_index, sentence_index, format: "pcm", sample_rate: 24000, channels: 1}) with its first audio, binary
frames of PCM (s16le, 24 kHz, mono), then `audio.done` ({utterance_index, sentence_index, sentence_text,
total_bytes, error: false}; with timestamp_type "word" or word_timestamps, also `timestamp_info: {word_alignment:
{words, word_start_times_seconds, word_end_times_seconds}}` in seconds from the sentence's start, the other doors'
proportional approximation); after an utterance's audio, `session.done` ({utterance_index, total_sentences}). An
input.done with nothing before it answers session.done in its turn (the plugin's keep-alive). `session.close` lets
what was sent play out, then closes (1000). A client that closes the socket is a barge-in (how the plugin abandons
a turn): every utterance's engine request and codec stream go at once.

Refused in the protocol's shape, `{"type": "error", "message"}`: a first message that is not a session.config this
server can serve closes the socket after it (1008), as vLLM-Omni ends a malformed handshake; later, malformed JSON,
an unknown type, a binary frame, text over --max-input-chars in one utterance, too many utterances waiting, and a
session.config mid-utterance or refused (the one before stays) are refused and the socket lives on.

`voice.add` and `voice.list` are taken at any time, before a session.config too (the plugin's register_voice and
list_voices send them first, on a socket of their own; below): voice.add ({name, audio_data: base64,
ref_text}) makes a clone as POST /v1/voices does, answered `voice.add.result` ({success: true, voice}), and the
voice is named in the next session.config's voice; refused, the error, nothing written, and the socket lives on.
Only a voice.add may be over 64 KiB: up to max_reference_bytes' worth of base64 (a larger message gets the error,
unparsed). Orpheus clones from a recording and its transcript, so ref_text is required; consent and audio_format
are not needed (the container says its format); speaker_embedding is refused. The voice messages are Baseten's
(basetenlabs/vllm-omni, serving_speech_stream.py), as LiveKit's Baseten plugin (1.8.9) sends them. `voice.list`
answers {voices, uploaded_voices} (clones). Not supported: response formats other than
pcm, speed other than 1 and inline cloning (ref_audio) are refused; task_type, language, instructions,
max_new_tokens, initial_codec_chunk_frames, x_vector_only_mode and split_granularity are ignored (every sentence is
spoken as it ends). Keys: `Authorization: Api-Key` (as the plugin sends it) or Bearer.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import logging
import random
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import APIRouter, WebSocket

from codec_contract.audio import SAMPLE_RATE

from ..clones import make_clone
from ..edge.auth import ApiKey
from ..edge.errors import ApiError
from ..speech.encoding import AudioOutput
from ..speech.session import Audio, SegmentEnd, SpeechSession, SpeechSpec, Words
from ..voices import CLONE, UnknownVoice
from .http import trim_of
from .sockets import (
    MAX_CONTEXTS,
    MAX_MESSAGE_CHARS,
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

PCM = AudioOutput("pcm")  # what the plugin plays: s16le at 24 kHz
BYTES_PER_SECOND = 2 * SAMPLE_RATE


class BadConfig(ValueError):
    """A session.config this server cannot serve."""


@dataclass(frozen=True)
class Config:
    """What a session.config asked for, resolved."""

    spec: SpeechSpec
    timestamps: bool


def config_of(message: dict, runtime) -> Config:
    """A session.config's settings; BadConfig for what this server cannot do."""
    try:
        voice = runtime.voices.named(message.get("voice"))
    except UnknownVoice as exc:
        raise BadConfig(str(exc)) from None
    if message.get("response_format", "pcm") != "pcm":
        raise BadConfig(f"response_format {message.get('response_format')!r} is not supported: this server streams pcm")
    if message.get("speed") not in (None, 1, 1.0):
        raise BadConfig("speed other than 1 is not supported: Orpheus speaks at its own pace")
    if message.get("ref_audio"):
        raise BadConfig("inline cloning (ref_audio) is not supported: make a clone with voice.add (or POST "
                        "/v1/voices), then name it in voice")
    timestamps = message.get("timestamp_type") == "word" or message.get("word_timestamps") is True
    return Config(SpeechSpec(voice, 0, PCM, trim_of(runtime.config)), timestamps)  # each utterance its own seed


class OmniSocket:
    """One client socket: its config, and its utterances, played in order (sockets.Turns, each tagged its index)."""

    def __init__(self, ws: WebSocket, runtime, key) -> None:
        self.ws, self.runtime, self.key = ws, runtime, key
        self.out = SocketWriter(ws)
        self.config: Config | None = None
        self.utterances = 0  # input.done so far: the next utterance's index
        self.max_chars = max_message_chars(runtime.config)  # a voice.add's, with its recording
        self.turns = Turns(self.out, runtime, key, self._play_utterance, lambda: self.out.close(1000))

    async def run(self) -> None:
        try:
            async for text in client_messages(self.ws, self.out, self.runtime, self._error, self.max_chars):
                closing = await self._receive(text)
                del text  # a voice.add's recording is not held while the socket waits for the next message
                if closing:
                    await asyncio.shield(self.turns.sender)  # what was sent plays out, then the close
                    return
        finally:
            await self.turns.stop("disconnected")

    async def _receive(self, text: str | None) -> bool:
        """One message as received; True once session.close has been queued."""
        if text is None:
            await self._refuse_or_tell("binary frames are not part of this protocol: send JSON text")
            return False
        if len(text) > MAX_MESSAGE_CHARS:
            message = await self._large(text)
            return message is not None and await self._handle(message)
        try:
            message = parse_message(text)
        except ValueError as exc:
            await self._refuse_or_tell(f"malformed message: {exc}")
            return False
        return await self._handle(message)

    async def _large(self, text: str) -> dict | None:
        """A message over MAX_MESSAGE_CHARS: a voice.add (its recording) up to max_chars, parsed off the loop; None
        once refused, with no close (the plugin sends voice.add first, on a socket of its own)."""
        if len(text) > self.max_chars:
            await self._error(f"message of {len(text)} characters is over the limit of {self.max_chars} (a voice.add "
                              f"with a recording of max_reference_bytes, {self.runtime.config.max_reference_bytes})")
            return None
        try:
            message = await asyncio.to_thread(parse_message, text, self.max_chars)
        except ValueError as exc:
            await self._error(f"malformed message: {exc}")
            return None
        if message.get("type") != "voice.add":
            await self._error(f"message of {len(text)} characters is over the limit of {MAX_MESSAGE_CHARS}: only a "
                              "voice.add may be longer")
            return None
        return message

    async def _handle(self, message: dict) -> bool:
        """One message; True once session.close has been queued."""
        kind = message.get("type")
        if kind == "session.config":
            await self._configure(message)
        elif kind == "voice.add":  # voice.* are taken before a config too: the plugin sends them first
            await self._voice_add(message)
        elif kind == "voice.list":
            await self.out.tell(voice_list(self.runtime))
        elif self.config is None:
            await self._refuse_or_tell(f"Expected session.config, got: {kind}")
        elif kind == "input.text":
            text = message.get("text")
            if not isinstance(text, str):
                await self._error("input.text requires a string value")
            elif text:
                await self._text(text)
        elif kind == "input.done":
            self._done()
        elif kind == "session.close":
            if self.turns.current is not None:  # text sent without its input.done is spoken too
                self._done()
            self.turns.close()
            return True
        else:
            await self._error(f"Unknown message type: {kind}")
        return False

    async def _voice_add(self, message: dict) -> None:
        """A clone made as POST /v1/voices makes it (clones.make_clone), answered voice.add.result; refused with the
        protocol's error, nothing written, and the socket lives on."""
        try:
            answer = await voice_add(message, self.runtime, self.key)
        except ApiError as exc:
            await self._error(f"voice.add refused: {exc.message}")
            return
        await self.out.tell(answer)

    async def _configure(self, message: dict) -> None:
        if self.turns.current is not None:
            await self._error("session.config cannot be applied while an utterance is in progress; send input.done "
                              "first")
            return
        try:
            self.config = config_of(message, self.runtime)
        except BadConfig as exc:
            await self._refuse_or_tell(f"Invalid session config: {exc}")

    async def _text(self, text: str) -> None:
        def spec() -> SpeechSpec:
            return dataclasses.replace(self.config.spec, seed=random.getrandbits(31))

        try:
            await self.turns.text(text, spec, f"vllm-omni-{uuid.uuid4().hex[:16]}", self.utterances)
        except NotSpoken as exc:
            if exc.kind == NotSpoken.BUSY:
                await self._error(f"{MAX_CONTEXTS} utterances are already waiting to be spoken")
            elif exc.kind == NotSpoken.REFUSED:
                await self._error(str(exc))
            else:
                await self._error(f"over {self.runtime.config.max_input_chars} characters in one utterance")

    def _done(self) -> None:
        """input.done: the utterance's text is all there (nothing sent: session.done in its turn)."""
        self.turns.end(self.utterances)
        self.utterances += 1

    async def _play_utterance(self, index: int, session: SpeechSession | None) -> None:
        """One utterance's audio, each sentence framed by audio.start and audio.done, then its session.done."""
        sentences = await self._sentences(index, session) if session is not None else 0
        await self.out.json({"type": "session.done", "utterance_index": index, "total_sentences": sentences})

    async def _sentences(self, index: int, session: SpeechSession) -> int:
        """The utterance's sentences sent; how many."""
        sentence = {"utterance_index": index, "sentence_index": 0}
        started, sent, before, words = False, 0, 0, None
        async with queued_audio(session, self.out, self._report, self.turns.live):
            async for item in session.events():
                if isinstance(item, Audio):
                    if not started:
                        started = True
                        await self.out.json({"type": "audio.start", **sentence, "format": "pcm",
                                             "sample_rate": SAMPLE_RATE, "channels": 1})
                    await session.send(lambda: self.out.bytes(item.data), item.seconds)
                    sent += len(item.data)
                elif isinstance(item, Words):
                    words = item
                elif isinstance(item, SegmentEnd):
                    if not started:  # a sentence with no audio: the pair still goes out, as vLLM-Omni's does
                        await self.out.json({"type": "audio.start", **sentence, "format": "pcm"})
                    await self.out.json(self._audio_done(sentence, item.text, sent - before, words,
                                                         before / BYTES_PER_SECOND))
                    sentence = {"utterance_index": index, "sentence_index": item.index + 1}
                    started, before, words = False, sent, None
        return sentence["sentence_index"]

    def _audio_done(self, sentence: dict, text: str, total_bytes: int, words: Words | None, origin: float) -> dict:
        done = {"type": "audio.done", **sentence, "sentence_text": text, "total_bytes": total_bytes, "error": False}
        if self.config is not None and self.config.timestamps and words is not None:
            done["timestamp_info"] = {"word_alignment": {
                "words": words.words,
                "word_start_times_seconds": [max(0.0, round(s - origin, 3)) for s in words.starts],
                "word_end_times_seconds": [max(0.0, round(e - origin, 3)) for e in words.ends]}}
        return done

    async def _report(self, text: str, bad_input: bool) -> None:
        await self._error(text)

    async def _refuse_or_tell(self, text: str) -> None:
        """Before a config is in force the socket cannot be used: the error, then 1008; after, the error alone."""
        if self.config is None:
            await refuse_socket(self.out, {"type": "error", "message": text}, text[:120])
        else:
            await self._error(text)

    async def _error(self, text: str) -> None:
        await self.out.tell({"type": "error", "message": text})


# -- voice.add and voice.list, as LiveKit's Baseten plugin sends them (livekit-plugins-baseten 1.8.9,
# qwen3_tts.register_voice and list_voices) and Baseten's vLLM-Omni answers them (basetenlabs/vllm-omni,
# serving_speech_stream.py): see the module's docstring.


def max_message_chars(config) -> int:
    """The largest message the socket takes: a voice.add with the largest recording POST /v1/voices takes."""
    return _base64_chars(config.max_reference_bytes) + MAX_MESSAGE_CHARS


async def voice_add(message: dict, runtime, key: ApiKey | None) -> dict:
    """The clone made, and the answer to send; ApiError saying why not, nothing written."""
    name, transcript, language, audio = _fields(message)
    made = await make_clone(runtime, key, name, transcript, language,
                            _recording(audio, runtime.config.max_reference_bytes))
    return {"type": "voice.add.result", "success": True, "voice": made}


def voice_list(runtime) -> dict:
    """The registry's voices: the checkpoint's (and LoRA voices) in voices, clones in uploaded_voices."""
    voices = runtime.voices.voices
    return {"type": "voice.list", "voices": [v.name for v in voices if v.kind != CLONE],
            "uploaded_voices": [v.name for v in voices if v.kind == CLONE]}


def _fields(message: dict) -> tuple[str, str, str | None, str]:
    """A voice.add's name, ref_text, language and audio_data; ApiError for one missing or not a string."""
    name, transcript, language, audio = (message.get(k) for k in ("name", "ref_text", "language", "audio_data"))
    if message.get("speaker_embedding") is not None:
        raise ApiError(400, "speaker_embedding is not supported: Orpheus clones from a recording (audio_data) and its "
                            "transcript (ref_text)")
    if not isinstance(name, str):
        raise ApiError(400, "voice.add requires a 'name' string")
    if not isinstance(transcript, str):
        raise ApiError(400, "voice.add requires 'ref_text', what the recording says: Orpheus clones from a recording "
                            "and its transcript")
    if not isinstance(audio, str):
        raise ApiError(400, "voice.add requires 'audio_data', the recording in base64")
    if language is not None and not isinstance(language, str):
        raise ApiError(400, "language must be a string")
    return name, transcript, language, audio


def _recording(data: str, limit: int) -> Callable[[], Awaitable[bytes]]:
    """audio_data, decoded off the loop when make_clone asks for it (once the name is free); ApiError past `limit`
    bytes, before any decoding, or for what is not base64."""
    too_large = f"audio_data: the recording is over this worker's limit of {limit} bytes (max_reference_bytes)"

    async def read() -> bytes:
        if len(data) > _base64_chars(limit):
            raise ApiError(413, too_large)
        try:
            audio = await asyncio.to_thread(base64.b64decode, data, validate=True)
        except binascii.Error as exc:
            raise ApiError(400, f"audio_data is not base64: {exc}") from None
        if len(audio) > limit:  # the base64 bound lets up to 2 bytes more through
            raise ApiError(413, too_large)
        return audio
    return read


def _base64_chars(size: int) -> int:
    return 4 * -(-size // 3)


@router.websocket("/v1/audio/speech/stream")
async def vllm_omni_websocket(ws: WebSocket) -> None:
    if (accepted := await accept(ws)) is None:
        return
    runtime, key = accepted
    await OmniSocket(ws, runtime, key).run()
