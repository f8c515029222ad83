"""A listener's playback of one stream, as the worker sends it: where it would have run dry.

The listener starts playing the first audio the moment it is sent and plays at `pace` x the audio's own rate (no
playout buffer; 1.0: real time). Each later send that comes after the listener has played everything before it is a
gap; a gap counts from when the listener ran dry, or from when the text it speaks was given if that was later (a
socket's next sentence arriving after the last one was heard is the client's pause, not ours). Gaps are in seconds
of audio time (a wait on the clock x pace). vLLM-Omni exports the same as audio underrun seconds; SGLang-Omni's TTS
benchmark passes a stream whose worst gap is within 100 or 200 ms. The worker keeps one listener at real time (its
continuity metrics) and one at its target pace (what admission judges: capacity.Listeners).
"""

from __future__ import annotations


class Playback:
    def __init__(self, pace: float = 1.0) -> None:
        self.pace = pace
        self._playhead: float | None = None  # when the listener reaches the end of what it was sent
        self.underrun_s = 0.0  # gaps, summed
        self.worst_gap_s = 0.0
        self.gaps = 0

    @property
    def started(self) -> bool:
        return self._playhead is not None

    @property
    def runs_out_at(self) -> float | None:
        """When the listener will have played all it was sent (monotonic; None before the first audio)."""
        return self._playhead

    def sent(self, now: float, seconds: float, text_at: float) -> None:
        """`seconds` of audio sent at `now` (monotonic), speaking text given at `text_at`."""
        if seconds <= 0:
            return
        if self._playhead is None:  # the first audio: playing starts now
            self._playhead = now
        elif now > self._playhead:  # the listener had run dry: it waited from then, or from when the text came
            gap = self.dry_s(now, text_at)
            if gap > 0:
                self.gaps += 1
                self.underrun_s += gap
                self.worst_gap_s = max(self.worst_gap_s, gap)
            self._playhead = now
        self._playhead += seconds / self.pace

    def dry_s(self, now: float, text_at: float) -> float:
        """How long the listener has waited by `now` for the audio of text given at `text_at` (in audio time; 0
        while it plays, and before its first audio)."""
        if self._playhead is None:
            return 0.0
        return max(0.0, now - max(self._playhead, text_at)) * self.pace

    def continuous(self, threshold_s: float) -> bool:
        """No gap longer than `threshold_s`."""
        return self.worst_gap_s <= threshold_s
