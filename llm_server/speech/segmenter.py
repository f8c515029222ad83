"""Text -> the segments a stream speaks: a whole input split at sentence ends (split_sentences), or text
arriving in pieces cut as soon as a segment is worth speaking (TextSegmenter). The model degrades on long
prompts, so each segment is its own engine request."""

from __future__ import annotations

import re

_SENTENCE_END = re.compile(r"(?<=[.!?…])\s+|(?<=[.!?…][\"')\]])\s+")
_CLAUSE_END = re.compile(r"(?<=[,;:—])\s+")


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
