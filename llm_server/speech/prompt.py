"""Text -> Orpheus prompt ids, sentence splitting, and the token budget of a segment.

The prompt is rebuilt from ids, never by tokenizing a string of special tokens:
[start of human, begin of text] + tokens("{voice}: {text}") + [end of turn, end of human,
start of AI, start of speech]. Generation ends at end of speech. A clone voice's prompt puts its reference
recording before that as a turn of its own (clone_prompt_ids).
"""

from __future__ import annotations

import math
import re
from typing import Protocol

import numpy as np

from ..engine.audio_tokens import (
    BEGIN_OF_TEXT,
    CODES_PER_FRAME,
    END_OF_AI,
    END_OF_HUMAN,
    END_OF_SPEECH,
    END_OF_TURN,
    START_OF_AI,
    START_OF_HUMAN,
    START_OF_SPEECH,
    code_to_token,
)

TOKENS_PER_SECOND = 82.03  # 7 tokens per 2048-sample frame at 24 kHz
# Generous bounds on speaking rate, so the budget never cuts speech short: 10 characters per
# second is slower than any Orpheus voice; pauses, tags and the opening silence get 2 s.
_CHARS_PER_SECOND = 10.0
_SLACK_SECONDS = 2.0

_SENTENCE_END = re.compile(r"(?<=[.!?…])\s+|(?<=[.!?…][\"')\]])\s+")
_CLAUSE_END = re.compile(r"(?<=[,;:—])\s+")


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def prompt_ids(tokenizer: Tokenizer, voice: str, text: str) -> list[int]:
    """The Orpheus prompt for one segment of speech."""
    return _turn(tokenizer, f"{voice}: {text}")


def clone_prompt_ids(tokenizer: Tokenizer, transcript: str, frames: np.ndarray, text: str) -> list[int]:
    """The zero-shot prompt of a clone voice: the reference recording as an earlier turn (its transcript asked
    for, its frames spoken), then the segment asked for in a turn of its own, in the slot layout generation
    uses. The layout of Canopy Labs' pretrained-model Colab (canopyai/Orpheus-TTS, colabs/
    Orpheus_0_1_Pretrain_Inference.ipynb): both texts with begin of text, the reference frames not
    de-duplicated. The reference turn is the same for every request of the voice: vLLM's prefix cache holds it."""
    audio = [code_to_token(int(code), slot) for frame in frames for slot, code in enumerate(frame)]
    return [*_turn(tokenizer, transcript), *audio, END_OF_SPEECH, END_OF_AI, *_turn(tokenizer, text)]


def _turn(tokenizer: Tokenizer, text: str) -> list[int]:
    """A human turn of `text` and the opening of the AI's spoken answer."""
    body = tokenizer.encode(text, add_special_tokens=False)
    return [START_OF_HUMAN, BEGIN_OF_TEXT, *body, END_OF_TURN, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH]


def token_budget(text: str) -> int:
    """max_tokens for a segment: enough for its speech at a slow rate, in whole frames."""
    seconds = len(text) / _CHARS_PER_SECOND + _SLACK_SECONDS
    frames = math.ceil(seconds * TOKENS_PER_SECOND / CODES_PER_FRAME)
    return frames * CODES_PER_FRAME + 1  # +1: room for end of speech after the last frame


def split_sentences(text: str, max_chars: int) -> list[str]:
    """Split at sentence ends into segments of at most max_chars, in order, nothing lost.

    Short sentences are joined; an over-long sentence is split at clause marks, then at spaces.
    The model degrades on long prompts, so each segment is generated on its own.
    """
    segments: list[str] = []
    text = " ".join(text.split())  # newlines and runs of spaces mean nothing to the model
    for sentence in _pieces(text, _SENTENCE_END, max_chars):
        if segments and len(segments[-1]) + 1 + len(sentence) <= max_chars:
            segments[-1] = f"{segments[-1]} {sentence}"
        else:
            segments.append(sentence)
    return segments


def _pieces(text: str, boundary: re.Pattern, max_chars: int) -> list[str]:
    out: list[str] = []
    for part in (p.strip() for p in boundary.split(text)):
        if not part:
            continue
        if len(part) <= max_chars:
            out.append(part)
        elif boundary is _SENTENCE_END:
            out.extend(_pieces(part, _CLAUSE_END, max_chars))
        else:
            out.extend(_split_words(part, max_chars))
    return out


def _split_words(text: str, max_chars: int) -> list[str]:
    out: list[str] = []
    line = ""
    for word in text.split():
        while len(word) > max_chars:  # a "word" longer than a segment: cut it
            if line:
                out.append(line)
                line = ""
            out.append(word[:max_chars])
            word = word[max_chars:]
        if line and len(line) + 1 + len(word) > max_chars:
            out.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    if line:
        out.append(line)
    return out


# A piece that ends a word with sentence punctuation ends a sentence, space or not: clients that
# stream whole sentences send them without one ("Hello there." then "How are you?").
_PIECE_ENDS_SENTENCE = re.compile(r"[^\W\d_][.!?…][\"')\]]*\s*$")


class TextSegmenter:
    """Text arriving in pieces (tokens, words, sentences) -> segments to speak, each as soon as it is
    worth speaking: at a sentence end; once the buffer holds `clause_chars`, at its last clause mark;
    at `max_chars`, whatever it holds. flush() speaks the rest."""

    def __init__(self, max_chars: int, clause_chars: int | None = None) -> None:
        self._max = max_chars
        self._clause = clause_chars or max_chars // 2
        self._buffer = ""

    @property
    def pending(self) -> str:
        return self._buffer

    def push(self, piece: str) -> list[str]:
        """Add a piece; the segments it completes, in order."""
        self._buffer += piece
        if _PIECE_ENDS_SENTENCE.search(piece) and not piece[-1:].isspace():
            self._buffer += " "
        ends = [m.end() for m in _SENTENCE_END.finditer(self._buffer)]
        if ends:
            done, self._buffer = self._buffer[: ends[-1]], self._buffer[ends[-1] :]
            segments = _pieces(" ".join(done.split()), _SENTENCE_END, self._max)
        else:
            segments = []
        return segments + self._cut_long()

    def flush(self) -> list[str]:
        """Everything buffered, as segments."""
        text, self._buffer = " ".join(self._buffer.split()), ""
        return _pieces(text, _SENTENCE_END, self._max) if text else []

    def _cut_long(self) -> list[str]:
        """A long sentence still arriving: speak up to its last clause mark, or up to max_chars."""
        if len(self._buffer) < self._clause:
            return []
        clauses = [m.end() for m in _CLAUSE_END.finditer(self._buffer)]
        if clauses:
            cut = clauses[-1]
        elif len(self._buffer) >= self._max:
            cut = self._buffer.rstrip().rfind(" ")  # the last word boundary
            cut = cut if cut > 0 else len(self._buffer)  # one long word: _pieces cuts it
        else:
            return []
        head, self._buffer = " ".join(self._buffer[:cut].split()), self._buffer[cut:]
        if not head:
            return []
        return [head] if len(head) <= self._max else _pieces(head, _CLAUSE_END, self._max)
