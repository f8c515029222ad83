"""GET /v1/models: the one model list two protocols read. OpenAI's `data` (the model names a request may give);
Deepgram's `tts` (its GET /v1/models: each voice as the model name that asks for it); and `megapod`, what the
playground says about this worker (random weights: noise, not speech)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..engine.model_source import TINY
from ..voices import Voice

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request) -> dict:
    runtime = request.app.state.runtime
    config = runtime.config
    return {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "orpheus-megapod"} for m in config.model_names],
            "tts": [model_entry(v) for v in runtime.voices.voices],
            "megapod": {"random_weights": config.model == TINY or config.load_format == "dummy"}}


def model_entry(voice: Voice) -> dict[str, object]:
    """A voice as Deepgram's model list (GET /v1/models, `tts`) describes a voice model."""
    language = voice.language or "en"
    return {"name": voice.name, "canonical_name": f"aura-2-{voice.name}-{language}", "architecture": "orpheus",
            "languages": [language], "version": voice.kind, "uuid": voice.uuid}
