"""Orpheus audio-code tokens <-> SNAC frames.

Audio token for slot s (0..6) of a frame with code c (0..4095) is 128266 + 4096*s + c.
Code 0 is valid (a known bug elsewhere drops it and shifts every later frame).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

AUDIO_TOKEN_BASE = 128266
CODES_PER_FRAME = 7
# Tokens per output the engine hands the worker (vLLM's SamplingParams.stream_interval; the first and
# the last come at once): a frame's worth, so the worker wakes once a frame instead of once a token.
# Outputs then end one token past each frame, so a frame reaches the codec one step (12 ms on a GPU) later.
STREAM_INTERVAL = CODES_PER_FRAME
CODEBOOK_SIZE = 4096
START_OF_HUMAN = 128259
BEGIN_OF_TEXT = 128000
END_OF_TURN = 128009
END_OF_HUMAN = 128260
START_OF_AI = 128261
START_OF_SPEECH = 128257
END_OF_SPEECH = 128258
END_OF_AI = 128262
STOP_TOKEN_IDS = (END_OF_SPEECH, END_OF_AI, END_OF_TURN)


class InvalidAudioToken(ValueError):
    """A generated token that is not the audio token its frame slot needs."""


def slot_range(slot: int) -> tuple[int, int]:
    """[first, last + 1) of the token ids allowed in frame slot `slot`."""
    first = AUDIO_TOKEN_BASE + CODEBOOK_SIZE * slot
    return first, first + CODEBOOK_SIZE


def code_to_token(code: int, slot: int) -> int:
    return AUDIO_TOKEN_BASE + CODEBOOK_SIZE * slot + code


def token_to_code(token: int, slot: int) -> int:
    """The SNAC code a token carries in `slot`; raises InvalidAudioToken if it belongs elsewhere."""
    code = token - AUDIO_TOKEN_BASE - CODEBOOK_SIZE * slot
    if not 0 <= code < CODEBOOK_SIZE:
        raise InvalidAudioToken(f"token {token} is not an audio token of slot {slot}")
    return code


def frame_violations(tokens: list[int]) -> list[tuple[int, int]]:
    """(position, token) of every generated token outside its frame slot's ids; a stop token is
    allowed only as end of speech at a frame boundary. Empty for a well-formed stream."""
    bad = []
    for k, token in enumerate(tokens):
        first, last = slot_range(k % CODES_PER_FRAME)
        if token in STOP_TOKEN_IDS:
            if token != END_OF_SPEECH or k % CODES_PER_FRAME:
                bad.append((k, token))
        elif not first <= token < last:
            bad.append((k, token))
    return bad


class FrameAssembler:
    """Turns a stream of generated token ids into complete frames of 7 codes.

    Stop tokens end the stream; a frame cut short by a stop is dropped and counted in
    `dropped_tokens` (frame-constrained decoding only allows a stop at a frame boundary).
    """

    def __init__(self) -> None:
        self._partial: list[int] = []
        self.frames = 0
        self.dropped_tokens = 0
        self.stopped = False

    def feed(self, tokens: Iterable[int]) -> np.ndarray:
        """Frames completed by these tokens, as an (n, 7) int64 array of codes."""
        done: list[list[int]] = []
        for token in tokens:
            if self.stopped:
                break
            if token in STOP_TOKEN_IDS:
                self.finish()
                break
            self._partial.append(token_to_code(token, len(self._partial)))
            if len(self._partial) == CODES_PER_FRAME:
                done.append(self._partial)
                self._partial = []
        self.frames += len(done)
        return np.asarray(done, dtype=np.int64).reshape(-1, CODES_PER_FRAME)

    def finish(self) -> None:
        """End of generation: a partial frame cannot be decoded and is dropped."""
        self.dropped_tokens += len(self._partial)
        self._partial = []
        self.stopped = True
