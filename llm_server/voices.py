"""The voices a worker speaks, by name: the one registry every front door resolves its voice field through.

A voice has a name, a kind and, where known, a language. Today every voice is the checkpoint's own (kind
`checkpoint`): a speaker the fine-tune learned, spoken by putting its name before the text (prompt.py).
They come from a `voices.json` beside the checkpoint when it has one (a fine-tune in another language
names its own speakers), else from --voices (the English fine-tune's eight, in --voices-language).
`voices.json` is a JSON list whose items are a name or {"name": ..., "language": ...}:

    ["pierre", {"name": "amelie", "language": "fr"}]

Aliases let clients ask by another vendor's names (OpenAI's thirteen); those that point at a voice the
checkpoint lacks are left out, with a log line. An OpenAI `voice` must be a voice or an alias: anything
else is a 400 naming the voices. The Cartesia and Deepgram doors' clients send their own vendor's stock
ids (a Cartesia voice UUID, Deepgram's `aura-2-thalia-en`): those are spoken in the default voice, said in
the protocol's warning or logged, unless vendor_voice_fallback is off, when they too are refused.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from .config import LlmServerConfig, parse_aliases

log = logging.getLogger(__name__)

VOICES_FILE = "voices.json"
CHECKPOINT = "checkpoint"  # a speaker the checkpoint was fine-tuned on


@dataclass(frozen=True)
class Voice:
    name: str
    kind: str
    language: str | None = None

    @property
    def uuid(self) -> str:
        """A stable UUID, for listings whose entries carry one (Deepgram's models)."""
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"orpheus-megapod:voice:{self.name}"))


class UnknownVoice(LookupError):
    """A voice name this worker does not speak; the message names those it does."""


class _Listed(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Any script (Orpheus's Korean and Chinese fine-tunes name their speakers in theirs); no space or colon:
    # the prompt is "<voice>: <text>".
    name: str = Field(min_length=1, max_length=64, pattern=r"^[^\s:/\\]+$")
    language: str | None = Field(None, min_length=2, max_length=16)


_VOICES_FILE_FORMAT = TypeAdapter(list[_Listed])


class VoiceRegistry:
    """Voices by name (case-insensitive), the aliases that point at them and the default voice."""

    def __init__(self, voices: Sequence[Voice], aliases: Mapping[str, str], vendor_fallback: bool = True) -> None:
        if not voices:
            raise ValueError("a worker needs at least one voice")
        self._voices = {v.name.lower(): v for v in voices}
        if len(self._voices) != len(voices):
            raise ValueError(f"voice names repeat (case-insensitive): {[v.name for v in voices]}")
        self.aliases = {a.lower(): t.lower() for a, t in aliases.items() if t.lower() in self._voices}
        if dropped := sorted(set(aliases) - set(self.aliases)):
            log.info("voice aliases left out (their voice is not this checkpoint's): %s", ", ".join(dropped))
        self.default = voices[0]
        self.vendor_fallback = vendor_fallback

    @classmethod
    def of(cls, config: LlmServerConfig, model_dir: str | None = None) -> VoiceRegistry:
        """The checkpoint's voices: its voices.json if `model_dir` (a directory or a Hub id) has one, else --voices."""
        listed = voices_file(model_dir) if model_dir else None
        if listed is not None:
            voices = read_voices_file(listed)
            log.info("voices from %s: %s", listed, ", ".join(v.name for v in voices))
        else:
            voices = [Voice(name, CHECKPOINT, config.voices_language or None) for name in config.voices]
        return cls(voices, parse_aliases(config.voice_aliases), config.vendor_voice_fallback)

    @property
    def voices(self) -> list[Voice]:
        return list(self._voices.values())

    def names(self) -> list[str]:
        return [v.name for v in self._voices.values()]

    def get(self, name: str) -> Voice | None:
        """The voice called `name` or aliased by it, else None."""
        key = name.strip().lower()
        return self._voices.get(self.aliases.get(key, key))

    def resolve(self, name: str) -> Voice:
        """The voice a client named; UnknownVoice naming the voices there are."""
        voice = self.get(name)
        if voice is None:
            raise self._unknown(name)
        return voice

    def resolve_vendor(self, name: str | None) -> tuple[Voice, str | None]:
        """For the doors whose clients send their own vendor's voice ids: the voice named, or the default
        voice with a note saying so (None: no substitution); UnknownVoice when the fallback is off."""
        if not name:
            return self.default, None
        voice = self.get(name)
        if voice is not None:
            return voice, None
        if not self.vendor_fallback:
            raise self._unknown(name)
        return self.default, f"{name!r} is not a voice of this server: speaking as {self.default.name}"

    def _unknown(self, name: str) -> UnknownVoice:
        return UnknownVoice(f"unknown voice {name!r}; this server speaks {self.names()} "
                            f"(and the aliases {sorted(self.aliases)})")

    def listing(self) -> dict[str, object]:
        """GET /v1/voices: an OpenAI-style list and the aliases; `voices` is ElevenLabs' list (its clients'
        list_voices reads voice_id, name and category)."""
        return {"object": "list",
                "data": [{"id": v.name, "object": "voice", "name": v.name, "kind": v.kind, "language": v.language}
                         for v in self._voices.values()],
                "aliases": dict(self.aliases),
                "voices": [{"voice_id": v.name, "name": v.name, "category": v.kind} for v in self._voices.values()]}


def voices_file(model: str) -> Path | None:
    """The checkpoint's voices.json: in its directory, or fetched from the Hub for a Hub id; None if it has none
    (or the Hub cannot be asked: said in the log, and --voices holds)."""
    if Path(model).is_dir():
        path = Path(model) / VOICES_FILE
        return path if path.is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(model, VOICES_FILE))
    except EntryNotFoundError:
        return None
    except Exception as exc:  # offline, no access: the checkpoint's voices are --voices then
        log.warning("could not look for %s in %s (%s): the voices are --voices", VOICES_FILE, model, exc)
        return None


def read_voices_file(path: Path) -> list[Voice]:
    """A checkpoint's voices.json; ValueError saying what is wrong with it."""
    try:
        raw = json.loads(path.read_text())
        items = _VOICES_FILE_FORMAT.validate_python(
            [{"name": item} if isinstance(item, str) else item for item in raw] if isinstance(raw, list) else raw)
    except (json.JSONDecodeError, ValidationError) as exc:
        raise ValueError(f"{path}: not a list of voice names or {{\"name\", \"language\"}} objects: {exc}") from None
    voices = [Voice(item.name, CHECKPOINT, item.language) for item in items]
    if not voices:
        raise ValueError(f"{path} lists no voice")
    return voices
