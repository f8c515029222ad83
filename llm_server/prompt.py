"""Text -> Orpheus prompt ids, sentence splitting, and the token budget of a segment.

The prompt is rebuilt from ids, never by tokenizing a string of special tokens:
[start of human, begin of text] + tokens("{voice}: {text}") + [end of turn, end of human,
start of AI, start of speech]. Generation ends at end of speech.
"""

from __future__ import annotations

import math
import re
from typing import Protocol

from .audio_tokens import BEGIN_OF_TEXT, CODES_PER_FRAME, END_OF_HUMAN, END_OF_TURN, START_OF_AI, START_OF_HUMAN, START_OF_SPEECH

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
    body = tokenizer.encode(f"{voice}: {text}", add_special_tokens=False)
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
