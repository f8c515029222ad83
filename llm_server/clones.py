"""Clone voices (zero-shot): POST /v1/voices makes one from a reference recording and its transcript,
DELETE /v1/voices/{name} removes it.

The recording (any format PyAV reads) is decoded, mixed to mono, resampled to 24 kHz with soxr and encoded to
frames by the codec tier (its Encode RPC: SNAC's encoder on a replica's device). The frames and the transcript
go into `clone.json` in a directory of the voices directory named as the voice (written whole, then renamed
into place), which every worker sharing that directory reads (voices.py); this worker reads it at once. Every
request of the voice is prompted with them (prompt.clone_prompt_ids).

Refused with a 4xx saying why, nothing written: a worker without a voices directory (501), a key without the
`voices` permission when keys are on (403), a name taken or malformed, an empty or over-long transcript, audio
that does not decode, holds no sound or runs past max_reference_s, and a reference whose prompt leaves the
model's context no room for speech (400 or 409), a voices directory mounted read-only (501).
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import av
import numpy as np
import soxr
from fastapi import APIRouter, File, Form, Request, UploadFile

from codec_contract.audio import SAMPLE_RATE

from .codec_client import CodecError
from .errors import ApiError
from .prompt import clone_prompt_ids
from .speech import MIN_SPEECH_TOKENS
from .voices import CLONE, CLONE_FILE, VOICE_NAME, CloneFile

log = logging.getLogger(__name__)

router = APIRouter()

VOICES_PERMISSION = "voices"  # what a key needs, in the keys file, to create and delete voices
# Room a clone's prompt must leave besides its reference: a short sentence's text and its speech.
ROOM_FOR_A_SENTENCE = 64 + MIN_SPEECH_TOKENS


def decode_reference(data: bytes, max_s: float) -> np.ndarray:
    """A recording in any format PyAV reads -> 24 kHz mono float32; ApiError (400) for what is not usable."""
    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.audio:
                raise ApiError(400, "the file holds no audio stream", "audio")
            stream = container.streams.audio[0]
            to_mono = av.AudioResampler(format="flt", layout="mono")  # packed float32, the rate as it is
            pieces, rate = [], None
            for frame in container.decode(stream):
                rate = rate or frame.sample_rate
                pieces += [f.to_ndarray().reshape(-1) for f in to_mono.resample(frame)]
                if sum(map(len, pieces)) > max_s * rate:
                    raise ApiError(400, f"the recording is longer than {max_s:g} s; a reference of 5 to 15 s is best",
                                   "audio")
            pieces += [f.to_ndarray().reshape(-1) for f in to_mono.resample(None)]
    except av.FFmpegError as exc:
        raise ApiError(400, f"the audio could not be decoded: {exc}", "audio") from None
    pcm = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
    if not pcm.size or not np.isfinite(pcm).all() or np.abs(pcm).max() < 1e-4:
        raise ApiError(400, "the recording holds no sound", "audio")
    if rate != SAMPLE_RATE:
        pcm = soxr.resample(pcm, rate, SAMPLE_RATE)
    return np.clip(pcm, -1.0, 1.0).astype(np.float32)


def _may_change_voices(request: Request) -> None:
    key = getattr(request.state, "api_key", None)  # set when API keys are on
    if key is not None and VOICES_PERMISSION not in key.permissions:
        raise ApiError(403, f"the key {key.name!r} may not create or delete voices (keys file: "
                            f"name:key:max_streams:{VOICES_PERMISSION})", code="permission_denied")


def _voices_dir(runtime) -> Path:
    if runtime.voices_dir is None:
        raise ApiError(501, "this worker has no voices directory to keep voices in: start it with --voices-dir",
                       code="not_implemented")
    root = runtime.voices_dir.root
    if root.exists() and not os.access(root, os.W_OK):  # a read-only volume (the chart's llm.voices.readOnly)
        raise ApiError(501, f"this worker's voices directory is read-only: voices are made and deleted where it is "
                            "written", code="not_implemented")
    return root


@router.post("/v1/voices", status_code=201)
async def create_voice(request: Request, audio: UploadFile = File(...), transcript: str = Form(...),
                       name: str = Form(...), language: str | None = Form(None)) -> dict:
    runtime = request.app.state.runtime
    _may_change_voices(request)
    root = _voices_dir(runtime)
    await runtime.refresh_voices()  # another worker may have made one of that name since this one last looked
    config = runtime.config
    if not VOICE_NAME.match(name):
        raise ApiError(400, "name: letters, digits and marks, no spaces, colons or slashes, at most 64", "name")
    if runtime.voices.get(name) is not None or (root / name).exists():
        raise ApiError(409, f"a voice named {name!r} exists; DELETE /v1/voices/{name} first", "name", "voice_exists")
    transcript = " ".join(transcript.split())
    if not transcript or len(transcript) > config.max_transcript_chars:
        raise ApiError(400, f"transcript: what the recording says, 1 to {config.max_transcript_chars} characters",
                       "transcript")
    pcm = decode_reference(await audio.read(), config.max_reference_s)
    try:
        frames = await runtime.codec.encode(pcm)
    except CodecError as exc:
        raise ApiError(502, f"the codec tier could not encode the recording: {exc}", "audio", "codec_error") from None
    prompt = len(clone_prompt_ids(runtime.tokenizer, transcript, frames, ""))
    if prompt + ROOM_FOR_A_SENTENCE > config.max_model_len:
        raise ApiError(400, f"the reference is a {prompt}-token prompt, which leaves no room for speech in this worker's "
                            f"{config.max_model_len}-token context (max_model_len): use a shorter recording", "audio")
    clone = CloneFile(transcript=transcript, language=language or None, frames=frames.tolist())
    _write_voice(root, name, clone)
    await runtime.refresh_voices()
    log.info("clone voice %r made from %.1f s of audio (%d frames)", name, pcm.size / SAMPLE_RATE, len(frames))
    return {"id": name, "object": "voice", "name": name, "kind": CLONE, "language": clone.language,
            "frames": len(frames), "prompt_tokens": prompt}


@router.delete("/v1/voices/{name}")
async def delete_voice(request: Request, name: str) -> dict:
    runtime = request.app.state.runtime
    _may_change_voices(request)
    root = _voices_dir(runtime)
    await runtime.refresh_voices()  # another worker may have deleted it since this one last looked
    voice = runtime.voices.get(name)
    if voice is None:
        raise ApiError(404, f"no voice named {name!r}", "name", "voice_not_found")
    if voice.kind != CLONE:
        raise ApiError(409, f"{name!r} is a {voice.kind} voice; only clones are deleted through the API", "name")
    shutil.rmtree(root / voice.name, ignore_errors=True)
    await runtime.refresh_voices()
    log.info("clone voice %r deleted", voice.name)
    return {"id": voice.name, "object": "voice.deleted", "deleted": True}


def _write_voice(root: Path, name: str, clone: CloneFile) -> None:
    """The voice's directory, written whole beside its place and renamed into it: a worker reading the voices
    directory meanwhile sees no voice or the whole one."""
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))  # a leading dot: not a voice (voices.py)
    try:
        (staging / CLONE_FILE).write_text(json.dumps(clone.model_dump(), separators=(",", ":")))
        os.chmod(staging, 0o755)
        staging.rename(root / name)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
