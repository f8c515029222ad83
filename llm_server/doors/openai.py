"""OpenAI's speech API (POST /v1/audio/speech) over a SpeechSession: streamed in any of its formats, raw or
as server-sent events (http.py streams it, as it does every door's whole-text speech)."""

from __future__ import annotations

import logging
import random

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from codec_contract.audio import SAMPLE_RATE

from ..config import LlmServerConfig
from ..edge.errors import ApiError
from ..speech.encoding import AudioOutput
from ..speech.session import SpeechSpec
from ..voices import UnknownVoice, VoiceRegistry
from .http import RAW, SSE, check_text, speak_whole, trim_of

log = logging.getLogger(__name__)

FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
STREAM_FORMATS = ("audio", "sse")
router = APIRouter()


class SpeechBody(BaseModel):
    """POST /v1/audio/speech, as OpenAI defines it, plus `seed` and `sample_rate`."""

    model_config = ConfigDict(extra="forbid")
    model: str
    input: str
    voice: str = "tara"
    response_format: str = "mp3"  # OpenAI's default
    speed: float = 1.0
    stream_format: str = "audio"
    instructions: str | None = None
    seed: int | None = Field(None, ge=0, le=2**64 - 1)  # the codec's noise seed is a uint64
    sample_rate: int = SAMPLE_RATE  # an extension: 8000 to 48000


def validate(body: SpeechBody, config: LlmServerConfig, voices: VoiceRegistry) -> SpeechSpec:
    """Check a request against this worker's limits and voices; returns how to speak it."""
    if body.model not in config.model_names:
        raise ApiError(404, f"model {body.model!r} not found; this server speaks {list(config.model_names)}", "model", "model_not_found")
    check_text(body.input, config)
    try:
        voice = voices.resolve(body.voice)
    except UnknownVoice as exc:
        raise ApiError(400, str(exc), "voice") from None
    if body.response_format not in FORMATS:
        raise ApiError(400, f"response_format {body.response_format!r} is not supported; use one of {list(FORMATS)}", "response_format")
    if body.stream_format not in STREAM_FORMATS:
        raise ApiError(400, f"stream_format {body.stream_format!r} is not supported; use one of {list(STREAM_FORMATS)}", "stream_format")
    if body.speed != 1.0:
        raise ApiError(400, "speed other than 1.0 is not supported: Orpheus speaks at its own pace", "speed")
    if body.instructions:
        raise ApiError(400, "instructions are not supported; use inline tags such as <laugh> in the input", "instructions")
    try:
        output = AudioOutput(body.response_format, body.sample_rate)
    except ValueError as exc:
        raise ApiError(400, str(exc), "sample_rate") from None
    seed = body.seed if body.seed is not None else random.getrandbits(31)
    return SpeechSpec(voice, seed, output, trim_of(config))


@router.post("/v1/audio/speech")
async def speech(body: SpeechBody, request: Request) -> Response:
    runtime = request.app.state.runtime
    spec = validate(body, runtime.config, runtime.voices)
    return await speak_whole(request, spec, body.input, "speech", SSE if body.stream_format == "sse" else RAW,
                             on_admit=lambda key: _log_request(runtime.config, body, spec.voice.name, key))


def _log_request(config: LlmServerConfig, body: SpeechBody, voice: str, key) -> None:
    """One line per admitted request; the text itself only with --log-input-text."""
    who = f", key {key.name}" if key else ""
    what = f"input {body.input!r}" if config.log_input_text else f"{len(body.input)} characters"
    log.info("speech: voice %s, %s/%s at %d Hz%s, %s", voice, body.response_format, body.stream_format,
             body.sample_rate, who, what)

