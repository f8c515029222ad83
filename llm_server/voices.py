"""The voices a worker speaks, by name: the one registry every front door resolves its voice field through.

A voice has a name, a kind and, where known, a language. Two kinds:

- `checkpoint`: a speaker the fine-tune learned, spoken by putting its name before the text (speech/prompt.py).
  They come from a `voices.json` beside the checkpoint when it has one (a fine-tune in another language
  names its own speakers), else from --voices (the English fine-tune's eight, in --voices-language).
  `voices.json` is a JSON list whose items are a name or {"name": ..., "language": ...}:

      ["pierre", {"name": "amelie", "language": "fr"}]

- `lora`: a PEFT LoRA adapter directory in the voices directory (--voices-dir), named by its directory,
  applied by the engine to that voice's requests only (vLLM's multi-LoRA: streams of different adapters
  and of the base share a batch). The prompt names the speaker the adapter was trained on: the directory's
  name, or `speaker` in an optional `voice.json` beside the adapter (`{"speaker": "tara", "language": "en"}`).
  The directory is re-read while serving (VoicesDirectory): an adapter added becomes a voice once the
  engine has loaded it (one it cannot load is logged and not offered), one removed stops being offered;
  requests already speaking with it finish from the engine's adapter cache.
- `clone`: a zero-shot clone (POST /v1/voices, clones.py): a reference recording's frames and its transcript,
  in `clone.json` in the voice's directory; its requests are prompted with them (prompt.clone_prompt_ids).

Aliases let clients ask by another vendor's names (OpenAI's thirteen); those that point at a voice the
checkpoint lacks are left out, with a log line. An OpenAI `voice` must be a voice or an alias: anything
else is a 400 naming the voices. The Cartesia and Deepgram doors' clients send their own vendor's stock
ids (a Cartesia voice UUID, Deepgram's `aura-2-thalia-en`): those are spoken in the default voice, said in
the protocol's warning or logged, unless vendor_voice_fallback is off, when they too are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import re
import uuid
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from codec_contract.audio import CODEBOOK_SIZE, CODES_PER_FRAME, pack_frames

from .config import LlmServerConfig, parse_aliases
from .engine import Adapter

log = logging.getLogger(__name__)

VOICES_FILE = "voices.json"
CHECKPOINT = "checkpoint"  # a speaker the checkpoint was fine-tuned on
LORA = "lora"  # a LoRA adapter over the checkpoint
CLONE = "clone"  # a zero-shot clone of a reference recording
CLONE_FILE = "clone.json"  # what makes a directory a clone voice
ADAPTER_CONFIG = "adapter_config.json"  # what makes a directory a PEFT adapter
VOICE_FILE = "voice.json"  # optional, in a voice's directory: its speaker and language


@dataclass(frozen=True)
class Reference:
    """A clone voice's reference: its transcript and the recording's frames (packed, 14 bytes a frame)."""

    transcript: str
    frames: bytes


@dataclass(frozen=True)
class Voice:
    name: str
    kind: str
    language: str | None = None
    speaker: str | None = None  # the name the prompt gives, when not the voice's own
    adapter: Adapter | None = None
    reference: Reference | None = None

    @property
    def prompt_name(self) -> str:
        return self.speaker or self.name

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

    def __init__(self, voices: Sequence[Voice], aliases: Mapping[str, str], vendor_fallback: bool = True,
                 held_adapters: int = 4) -> None:
        if not voices:
            raise ValueError("a worker needs at least one voice")
        self._voices = {v.name.lower(): v for v in voices}
        if len(self._voices) != len(voices):
            raise ValueError(f"voice names repeat (case-insensitive): {[v.name for v in voices]}")
        self._checkpoint = dict(self._voices)
        self.aliases = {a.lower(): t.lower() for a, t in aliases.items() if t.lower() in self._voices}
        if dropped := sorted(set(aliases) - set(self.aliases)):
            log.info("voice aliases left out (their voice is not this checkpoint's): %s", ", ".join(dropped))
        self.default = voices[0]
        self.vendor_fallback = vendor_fallback
        self.held_adapters = held_adapters  # how many adapters the engine keeps loaded (max_cpu_loras)
        self._loaded: OrderedDict[str, None] = OrderedDict()  # LoRA voices the engine has loaded, most recent last
        self.unavailable: dict[str, str] = {}  # the voices directory's voices not offered -> why

    @classmethod
    def of(cls, config: LlmServerConfig, model_dir: str | None = None) -> VoiceRegistry:
        """The checkpoint's voices: its voices.json if `model_dir` (a directory or a Hub id) has one, else --voices."""
        listed = voices_file(model_dir) if model_dir else None
        if listed is not None:
            voices = read_voices_file(listed)
            log.info("voices from %s: %s", listed, ", ".join(v.name for v in voices))
        else:
            voices = [Voice(name, CHECKPOINT, config.voices_language or None) for name in config.voices]
        return cls(voices, parse_aliases(config.voice_aliases), config.vendor_voice_fallback,
                   config.max_cpu_loras or config.max_loras)

    def is_checkpoints(self, name: str) -> bool:
        return name.lower() in self._checkpoint

    def update_own(self, found: Sequence[Voice], unavailable: Mapping[str, str] | None = None) -> None:
        """Replace the voices directory's voices with `found` (named unlike the checkpoint's), and those it holds
        that are not offered with `unavailable` (name -> why)."""
        self._voices = {**self._checkpoint, **{v.name.lower(): v for v in found}}
        self.unavailable = dict(unavailable or {})
        for gone in [name for name in self._loaded if name not in self._voices]:
            del self._loaded[gone]

    def used(self, voice: Voice) -> None:
        """`voice` was loaded or spoken: its adapter is the engine's most recently used (vLLM keeps the
        held_adapters most recent ones loaded; the rest are read from disk again when asked for)."""
        if voice.adapter is not None:
            self._loaded[voice.name.lower()] = None
            self._loaded.move_to_end(voice.name.lower())
            while len(self._loaded) > self.held_adapters:
                self._loaded.popitem(last=False)

    def loaded_lora_voices(self) -> list[str]:
        return [self._voices[name].name for name in self._loaded]

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

    def named(self, name: object) -> Voice:
        """The voice a protocol's field names, whatever JSON it holds: absent (None), the default voice; anything
        but a voice or an alias, UnknownVoice saying so (the doors that speak only this server's voices)."""
        if name is None:
            return self.default
        if not isinstance(name, str):
            raise UnknownVoice(f"voice must be a string (a voice name), not {type(name).__name__}")
        return self.resolve(name)

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
        list_voices reads voice_id, name and category); `unavailable` the voices directory's voices that are not
        offered, each with why (an adapter the engine refuses, a file that does not parse)."""
        return {"object": "list",
                "data": [{"id": v.name, "object": "voice", "name": v.name, "kind": v.kind, "language": v.language}
                         for v in self._voices.values()],
                "aliases": dict(self.aliases),
                "unavailable": [{"id": name, "reason": why} for name, why in sorted(self.unavailable.items())],
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


class CloneFile(BaseModel):
    """clone.json: what POST /v1/voices stores for a clone voice."""

    model_config = ConfigDict(extra="forbid")
    transcript: str = Field(min_length=1)
    language: str | None = Field(None, min_length=2, max_length=16)
    frames: list[list[Annotated[int, Field(ge=0, lt=CODEBOOK_SIZE)]]] = Field(min_length=1)

    @model_validator(mode="after")
    def _whole_frames(self) -> CloneFile:
        if any(len(frame) != CODES_PER_FRAME for frame in self.frames):
            raise ValueError(f"every frame holds {CODES_PER_FRAME} codes")
        return self

    def voice(self, name: str) -> Voice:
        return Voice(name, CLONE, self.language, reference=Reference(self.transcript, pack_frames(self.frames)))


class _VoiceFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    speaker: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[^\s:]+$")
    language: str | None = Field(None, min_length=2, max_length=16)


VOICE_NAME = re.compile(r"^[^\s:/\\.][^\s:/\\]{0,63}$")  # a voice name, and no hidden directory


SWEEP_EVERY = 30  # scans: every voice's directory looked at again (a minute at --voices-poll-s 2, 30 s at 1)

# The engine knows an adapter by its id alone (one it has loaded under an id is never read again): ids are unique
# in the process, whichever directory an adapter comes from.
_ADAPTER_IDS = itertools.count(1)


def has_adapters(root: str) -> bool:
    """Whether the voices directory `root` holds a LoRA adapter (LoRA is on in the engine at start then)."""
    return bool(root) and Path(root).is_dir() and any((d / ADAPTER_CONFIG).is_file() for d in Path(root).iterdir())


class VoicesDirectory:
    """The voices directory (--voices-dir): one sub-directory a voice, read again whenever it changes.

    refresh() scans the directory in a thread (it is often a network volume, where each stat can take
    milliseconds, and it may hold thousands of clones): the directory's own modification time, a listing when it
    changed, and for the voices that are not clones (LoRA adapters, whose files may be rewritten in place) each
    file's size and modification time; a clone's files are only ever replaced whole, by a rename that changes the
    directory, so a clone already known costs nothing but at a sweep (one stat of its directory, every
    SWEEP_EVERY scans). Only the voices whose reading changed are read again. Back on the event loop, the
    engine loads adapters it has not seen (`load`: the engine's load_adapter, which raises saying why it
    cannot), and the registry gets the usable voices in one step. `stat` is os.stat, or a stand-in for a slow filesystem in a test."""

    def __init__(self, root: str, stat: Callable[[str], os.stat_result] = os.stat) -> None:
        self.root = Path(root)
        self.stat = stat  # every stat of the scan goes through it
        self._known: dict[str, tuple[tuple, Voice | None]] | None = None  # name -> (its reading, its voice)
        self._versions: dict[tuple[str, tuple], int] = {}  # (voice, its files' reading) -> adapter id
        self._loaded: set[int] = set()
        self._scans = 0
        self._seen_root_mtime: int | None = None
        self._lock = asyncio.Lock()  # one refresh at a time (the poll, and a clone made or deleted)
        self._making: set[str] = set()  # names an upload of this worker is making now
        self._problems: dict[str, str] = {}  # voice directory -> why it is not offered, kept while it is unchanged

    @contextlib.contextmanager
    def making(self, name: str) -> Iterator[bool]:
        """Hold `name` while an upload makes it: yields False when another upload of this worker holds it."""
        key = name.lower()
        if key in self._making:
            yield False
            return
        self._making.add(key)
        try:
            yield True
        finally:
            self._making.discard(key)

    async def refresh(self, registry: VoiceRegistry, load: Callable[[Adapter], Awaitable[None]]) -> bool:
        """Read the directory again if it changed; True if it did (and at the first reading)."""
        async with self._lock:
            known = await asyncio.to_thread(self._scan, registry)
            if known is None:
                return False
            added = sorted(set(known) - set(self._known or ()))
            removed = sorted(set(self._known or ()) - set(known))
            self._known = known
            usable, loaded_now = [], []
            for name, (_, voice) in known.items():
                if voice is None:
                    continue
                if voice.adapter is not None and voice.adapter.id not in self._loaded:
                    try:
                        await load(voice.adapter)
                    except Exception as exc:
                        log.warning("voice %r (%s) is not offered: %s", name, self.root / name, exc)
                        self._problems[name] = str(exc)
                        continue
                    self._problems.pop(name, None)
                    self._loaded.add(voice.adapter.id)
                    loaded_now.append(voice)
                usable.append(voice)
            self._problems = {name: why for name, why in self._problems.items() if name in known}
            registry.update_own(usable, self._problems)
            for voice in loaded_now:  # the engine holds what it just loaded
                registry.used(voice)
            log.info("voices directory %s: %d voices (%s)%s%s", self.root, len(usable), _kinds(usable),
                     _names(" added", added), _names(" removed", removed))
            return True

    def _scan(self, registry: VoiceRegistry) -> dict[str, tuple[tuple, Voice | None]] | None:
        """In a thread: each voice directory's reading and voice, those unchanged taken from the last scan; None if
        nothing changed since it. Between sweeps (every SWEEP_EVERY scans) a clone already known is not looked at:
        one made or deleted changes the directory's own modification time, which is all a scan then reads when
        only clones are there (a clone replaced under its name by another worker shows at the next sweep)."""
        before = self._known or {}
        sweep = self._known is None or self._scans % SWEEP_EVERY == 0
        self._scans += 1
        root_mtime = self._root_mtime()
        names = self._voice_dirs() if sweep or root_mtime != self._seen_root_mtime else list(before)
        self._seen_root_mtime = root_mtime
        known, changed = {}, self._known is None
        for name in names:
            old = before.get(name)
            if old is not None and not sweep and old[1] is not None and old[1].kind == CLONE:
                known[name] = old
                continue
            reading = self._reading(name, old[1] if old else None)
            if old is not None and old[0] == reading:
                known[name] = old
                continue
            voice = self._voice(name, reading, registry)
            # Read as it will be next time: a clone by its directory alone, anything else with its files.
            if voice is not None and voice.kind == CLONE:
                reading = reading[:1]
            elif len(reading) == 1:
                reading = self._reading(name, voice)
            known[name] = (reading, voice)
            changed = True
        return known if changed or known.keys() != before.keys() else None

    def _root_mtime(self) -> int | None:
        try:
            return self.stat(str(self.root)).st_mtime_ns
        except OSError:
            return None

    def _voice_dirs(self) -> list[str]:
        try:
            with os.scandir(self.root) as entries:
                # A leading dot: a voice being written (clones.py), or no voice at all.
                return sorted(e.name for e in entries if e.name[0] != "." and e.is_dir())
        except (FileNotFoundError, NotADirectoryError):
            return []

    def _reading(self, name: str, voice: Voice | None) -> tuple:
        """What changes when a voice does: its directory's modification time, and, unless it is a clone, each
        file's name, size and modification time."""
        path = os.path.join(self.root, name)
        try:
            mtime = self.stat(path).st_mtime_ns
            if voice is not None and voice.kind == CLONE:
                return (mtime,)
            with os.scandir(path) as entries:
                files = [e.name for e in entries if e.is_file()]
            return (mtime, *sorted((f, *_size_and_time(self.stat(os.path.join(path, f)))) for f in files))
        except OSError:  # removed while read
            return ()

    def _voice(self, name: str, reading: tuple, registry: VoiceRegistry) -> Voice | None:
        """The voice in sub-directory `name`, or None (logged, and kept as why it is not offered) if it is none."""
        path = self.root / name
        self._problems.pop(name, None)  # read again: what was wrong may be mended
        try:
            if not VOICE_NAME.match(name):
                raise ValueError("not a voice name (no spaces, colons or leading dot; at most 64 characters)")
            if registry.is_checkpoints(name):
                raise ValueError("the checkpoint has a voice of that name")
            if (path / CLONE_FILE).is_file():
                return CloneFile.model_validate_json((path / CLONE_FILE).read_text()).voice(name)
            about = _VoiceFile.model_validate_json((path / VOICE_FILE).read_text()) if (path / VOICE_FILE).is_file() \
                else _VoiceFile()
            if (path / ADAPTER_CONFIG).is_file():
                peft = json.loads((path / ADAPTER_CONFIG).read_text())
                if peft.get("peft_type") != "LORA":
                    raise ValueError(f"{ADAPTER_CONFIG} says peft_type {peft.get('peft_type')!r}, not LORA")
                # The adapter's version: its files, not its directory's time.
                files = reading[1:] if len(reading) > 1 else self._reading(name, None)[1:]
                if (name, files) not in self._versions:
                    self._versions[name, files] = next(_ADAPTER_IDS)
                version = self._versions[name, files]
                return Voice(name, LORA, about.language, about.speaker, Adapter(f"{name}@{version}", version, str(path)))
        except (OSError, ValueError) as exc:  # pydantic's ValidationError and JSONDecodeError are ValueErrors
            log.warning("voice %r (%s) is not offered: %s", name, path, exc)
            self._problems[name] = str(exc)
            return None
        log.debug("%s holds no voice (no %s or %s)", path, ADAPTER_CONFIG, CLONE_FILE)
        return None


def _size_and_time(stat: os.stat_result) -> tuple[int, int]:
    return stat.st_size, stat.st_mtime_ns


def _kinds(voices: Sequence[Voice]) -> str:
    counts = Counter(v.kind for v in voices)
    return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items())) or "none"


def _names(said: str, names: list[str], at_most: int = 10) -> str:
    if not names:
        return ""
    more = f" and {len(names) - at_most} more" if len(names) > at_most else ""
    return f";{said}: {', '.join(names[:at_most])}{more}"
