"""Clone voices (zero-shot): POST /v1/voices makes one from a reference recording and its transcript (as does
vLLM-Omni's socket, its `voice.add`: doors/vllm_omni.py, through the same `make_clone`), DELETE /v1/voices/{name}
removes it.

The recording (any format PyAV reads) is decoded, mixed to mono and resampled to 24 kHz with soxr in a process
of its own, within bounds and a deadline (reference_audio.py: the event loop serves streams meanwhile), and encoded
to frames by the codec tier (its Encode RPC: SNAC's encoder on a replica's device). The frames and the transcript
go into `clone.json` in a directory of the voices directory named as the voice (written whole, then renamed
into place), which every worker sharing that directory reads (voices.py); this worker reads it at once. Every
request of the voice is prompted with them (prompt.clone_prompt_ids).

Refused with a 4xx saying why, nothing written: a worker without a voices directory (501), a key without the
`voices` permission when keys are on (403), a name taken or malformed, an empty or over-long transcript, audio
that does not decode, holds no sound, runs past max_reference_s or past the decoder's bounds or deadline, and a
reference whose prompt leaves the model's context no room for speech (400 or 409), a name another upload is making
(409), every decode slot busy (429), a voices directory mounted read-only (501). The filesystem is touched off the
event loop (the voices directory is often a network volume).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import APIRouter, File, Form, Request, UploadFile

from codec_contract.audio import SAMPLE_RATE

from .edge.auth import ApiKey
from .edge.errors import ApiError
from .reference_audio import ReferenceRefused, UploadsBusy
from .speech.codec_client import CodecError
from .speech.prompt import MIN_SPEECH_TOKENS, clone_prompt_ids
from .voices import CLONE, CLONE_FILE, VOICE_NAME, CloneFile

log = logging.getLogger(__name__)

router = APIRouter()

VOICES_PERMISSION = "voices"  # what a key needs, in the keys file, to create and delete voices
# Room a clone's prompt must leave besides its reference: a short sentence's text and its speech.
ROOM_FOR_A_SENTENCE = 64 + MIN_SPEECH_TOKENS


def _may_change_voices(key: ApiKey | None) -> None:
    """403 for a key without the voices permission; `key` is None when API keys are off."""
    if key is not None and VOICES_PERMISSION not in key.permissions:
        raise ApiError(403, f"the key {key.name!r} may not create or delete voices (keys file: "
                            f"name:key:max_streams:{VOICES_PERMISSION})", code="permission_denied")


def _voices_dir(runtime) -> Path:
    if runtime.voices_dir is None:
        raise ApiError(501, "this worker has no voices directory to keep voices in: start it with --voices-dir",
                       code="not_implemented")
    return runtime.voices_dir.root


def _writable(root: Path) -> None:
    """501 for a read-only volume (the chart's llm.voices.readOnly); a filesystem call, so off the loop."""
    if root.exists() and not os.access(root, os.W_OK):
        raise ApiError(501, "this worker's voices directory is read-only: voices are made and deleted where it is "
                            "written", code="not_implemented")


@router.post("/v1/voices", status_code=201)
async def create_voice(request: Request, audio: UploadFile = File(...), transcript: str = Form(...),
                       name: str = Form(...), language: str | None = Form(None)) -> dict:
    key = getattr(request.state, "api_key", None)  # set when API keys are on
    return await make_clone(request.app.state.runtime, key, name, transcript, language, audio.read)


async def make_clone(runtime, key: ApiKey | None, name: str, transcript: str, language: str | None,
                     audio: Callable[[], Awaitable[bytes]]) -> dict:
    """The one way a clone voice is made (POST /v1/voices; vLLM-Omni's voice.add): checked, decoded, encoded,
    written whole and read by this worker; the voice's description, or ApiError saying why, nothing written.
    `audio()` gives the recording's bytes, asked for only once the name is known to be free."""
    _may_change_voices(key)
    root = _voices_dir(runtime)
    await asyncio.to_thread(_writable, root)
    config = runtime.config
    if not VOICE_NAME.match(name):
        raise ApiError(400, "name: letters, digits and marks, no spaces, colons or slashes, at most 64", "name")
    transcript = " ".join(transcript.split())
    if not transcript or len(transcript) > config.max_transcript_chars:
        raise ApiError(400, f"transcript: what the recording says, 1 to {config.max_transcript_chars} characters",
                       "transcript")
    with runtime.voices_dir.making(name) as free:
        await runtime.refresh_voices()  # another worker may have made one of that name since this one last looked
        if not free or runtime.voices.get(name) is not None or await asyncio.to_thread((root / name).exists):
            raise ApiError(409, f"a voice named {name!r} exists; DELETE /v1/voices/{name} first", "name", "voice_exists")
        try:
            pcm = await runtime.reference_decoder.decode(await audio())
        except ReferenceRefused as exc:
            raise ApiError(400, str(exc), "audio") from None
        except UploadsBusy as exc:
            raise ApiError(429, str(exc), "audio", "rate_limit_exceeded", headers={"Retry-After": "1"}) from None
        try:
            frames = await runtime.codec.encode(pcm)
        except CodecError as exc:
            raise ApiError(502, f"the codec tier could not encode the recording: {exc}", "audio", "codec_error") from None
        prompt = len(clone_prompt_ids(runtime.tokenizer, transcript, frames, ""))
        if prompt + ROOM_FOR_A_SENTENCE > config.max_model_len:
            raise ApiError(400, f"the reference is a {prompt}-token prompt, which leaves no room for speech in this "
                                f"worker's {config.max_model_len}-token context (max_model_len): use a shorter recording",
                           "audio")
        clone = CloneFile(transcript=transcript, language=language or None, frames=frames.tolist())
        await asyncio.to_thread(_write_voice, root, name, clone)
    await runtime.refresh_voices()
    log.info("clone voice %r made from %.1f s of audio (%d frames)", name, pcm.size / SAMPLE_RATE, len(frames))
    return {"id": name, "object": "voice", "name": name, "kind": CLONE, "language": clone.language,
            "frames": len(frames), "prompt_tokens": prompt}


@router.delete("/v1/voices/{name}")
async def delete_voice(request: Request, name: str) -> dict:
    runtime = request.app.state.runtime
    _may_change_voices(getattr(request.state, "api_key", None))
    root = _voices_dir(runtime)
    await asyncio.to_thread(_writable, root)
    await runtime.refresh_voices()  # another worker may have deleted it since this one last looked
    voice = runtime.voices.get(name)
    if voice is None:
        raise ApiError(404, f"no voice named {name!r}", "name", "voice_not_found")
    if voice.kind != CLONE:
        raise ApiError(409, f"{name!r} is a {voice.kind} voice; only clones are deleted through the API", "name")
    await asyncio.to_thread(shutil.rmtree, root / voice.name, ignore_errors=True)
    await runtime.refresh_voices()
    log.info("clone voice %r deleted", voice.name)
    return {"id": voice.name, "object": "voice.deleted", "deleted": True}


def _write_voice(root: Path, name: str, clone: CloneFile) -> None:
    """The voice's directory, written whole beside its place and renamed into it: a worker reading the voices
    directory meanwhile sees no voice or the whole one; 409 when another worker's rename came first."""
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))  # a leading dot: not a voice (voices.py)
    try:
        (staging / CLONE_FILE).write_text(json.dumps(clone.model_dump(), separators=(",", ":")))
        os.chmod(staging, 0o755)
        staging.rename(root / name)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise ApiError(409, f"a voice named {name!r} exists; DELETE /v1/voices/{name} first", "name",
                           "voice_exists") from None
        raise
