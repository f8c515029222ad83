"""The utterance corpus: a versioned JSONL file of voice-agent turns, its hash, and who says what when.

Each line is {"id", "kind" (short | medium | long), "text"}. Every result records the file's
sha256, so figures measured on different texts are never compared by mistake. Which utterance a
request speaks depends only on (stream, request number) and the seed, so two configurations
measured at the same level get exactly the same requests.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

KINDS = ("short", "medium", "long")
DEFAULT_CORPUS = Path(__file__).resolve().parent.parent / "corpus" / "voice_agent_v1.jsonl"


@dataclass(frozen=True)
class Utterance:
    id: str
    kind: str
    text: str


@dataclass(frozen=True)
class Corpus:
    """The utterances a run draws from, in a fixed seeded order."""

    path: Path
    sha256: str
    utterances: tuple[Utterance, ...]
    seed: int

    def pick(self, stream: int, request: int) -> Utterance:
        """Stream i's j-th request: streams start at spread-out points of the order and walk it."""
        n = len(self.utterances)
        return self.utterances[(stream * 7919 + request) % n]  # 7919 is prime: start points spread

    def describe(self) -> dict:
        counts = Counter(u.kind for u in self.utterances)
        chars = [len(u.text) for u in self.utterances]
        return {"path": str(self.path.name), "sha256": self.sha256, "utterances": len(self.utterances),
                "by_kind": dict(sorted(counts.items())), "seed": self.seed,
                "chars_mean": round(sum(chars) / len(chars), 1), "chars_min": min(chars), "chars_max": max(chars)}


def load_corpus(path: Path = DEFAULT_CORPUS, kinds: tuple[str, ...] = KINDS, seed: int = 1234) -> Corpus:
    """Read, hash and validate the file; keep `kinds`; shuffle once with `seed`."""
    raw = path.read_bytes()
    utterances = []
    for number, line in enumerate(raw.decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if row.get("kind") not in KINDS or not str(row.get("text", "")).strip() or not row.get("id"):
            raise ValueError(f"{path}:{number}: need id, kind in {KINDS} and non-empty text")
        utterances.append(Utterance(row["id"], row["kind"], row["text"]))
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown utterance kinds {sorted(unknown)}; choose from {KINDS}")
    chosen = [u for u in utterances if u.kind in kinds]
    if not chosen:
        raise ValueError(f"{path} has no utterances of kinds {kinds}")
    random.Random(seed).shuffle(chosen)
    return Corpus(path, hashlib.sha256(raw).hexdigest(), tuple(chosen), seed)
