"""A real-time listener's playback of one stream, as the worker sends it: where it would have run dry.

The listener starts playing the first audio the moment it is sent and plays at the audio's own rate (no playout
buffer). Each later send that comes after the listener has played everything before it is a gap; a gap counts
from when the listener ran dry, or from when the text it speaks was given if that was later (a socket's next
sentence arriving after the last one was heard is the client's pause, not ours). vLLM-Omni exports the same as
audio underrun seconds; SGLang-Omni's TTS benchmark passes a stream whose worst gap is within 100 or 200 ms.
"""

from __future__ import annotations


class Playback:
    def __init__(self) -> None:
        self._playhead: float | None = None  # when the listener reaches the end of what it was sent
        self.underrun_s = 0.0  # gaps, summed
        self.worst_gap_s = 0.0
        self.gaps = 0

    @property
    def started(self) -> bool:
        return self._playhead is not None

    def sent(self, now: float, seconds: float, text_at: float) -> None:
        """`seconds` of audio sent at `now` (monotonic), speaking text given at `text_at`."""
        if seconds <= 0:
            return
        if self._playhead is None:  # the first audio: playing starts now
            self._playhead = now
        elif now > self._playhead:  # the listener had run dry: it waited from then, or from when the text came
            gap = now - max(self._playhead, text_at)
            if gap > 0:
                self.gaps += 1
                self.underrun_s += gap
                self.worst_gap_s = max(self.worst_gap_s, gap)
            self._playhead = now
        self._playhead += seconds

    def continuous(self, threshold_s: float) -> bool:
        """No gap longer than `threshold_s`."""
        return self.worst_gap_s <= threshold_s
