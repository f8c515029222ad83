"""Runaway generation: a segment whose model output loops is ended at a frame boundary.

Orpheus sometimes repeats itself: the same few frames over and over (a stuck syllable, a buzz, a
tail of identical silence) until the token budget runs out, holding a batch slot and a codec slot
for audio nobody wants. A loop here: the last WINDOW frames periodic with a period of 1 to
MAX_PERIOD frames, compared exactly (codes are discrete). WINDOW is 2 s of audio, longer than any
held sound or pause inside an utterance, so speech is never cut for sounding steady; the check costs
a few tuple comparisons per frame. Speech that runs past its text's token budget is the other
runaway: the budget ends it (llm_server/speech/prompt.py), and the stream counts it (speech/stream.py).
"""

from __future__ import annotations

from collections import deque

import numpy as np

MAX_PERIOD = 4  # frames in the longest repeating block looked for (341 ms of audio)
WINDOW = 24  # frames that must repeat the block: 2.05 s (a 4-frame pattern six times running)


class LoopDetector:
    """Fed a segment's frames in order; says at which frame a loop is complete."""

    def __init__(self, max_period: int = MAX_PERIOD, window: int = WINDOW) -> None:
        if not 1 <= max_period < window:
            raise ValueError("need 1 <= max_period < window: a loop repeats its block at least twice")
        self.max_period = max_period
        self._recent: deque[bytes] = deque(maxlen=window)  # each frame's codes, as bytes: compared exactly
        self.period = 0  # of the loop found; 0 while none

    def feed(self, frames: np.ndarray) -> int | None:
        """How many of `frames` to keep when a loop completes among them (up to and including the frame
        that completes it); None while there is none."""
        for i, frame in enumerate(frames):
            self._recent.append(frame.tobytes())
            if period := self._loop_period():
                self.period = period
                return i + 1
        return None

    def _loop_period(self) -> int:
        recent = self._recent
        if len(recent) < recent.maxlen:
            return 0
        for period in range(1, self.max_period + 1):
            if all(recent[k] == recent[k - period] for k in range(period, len(recent))):
                return period
        return 0
