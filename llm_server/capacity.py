"""How many streams this worker keeps in real time, measured: the admission limit follows the engine's pace.

A stream is real time while its engine request gets REALTIME_TOKENS_PER_S tokens a second (7 tokens a
frame, 24000/2048 frames a second: a decode step every 12.2 ms). PaceMeter integrates, over a window,
the tokens handed to the streams that were decoding and the stream-seconds they spent decoding (from a
request's first token to its last: prefill is not decoding, but a new stream's prefill slows the steps
of the others, and that shows); tokens over stream-seconds, over the real-time rate, is the pace (2.0:
twice real time).

CapacityLimit is a gradient limiter in the style of Netflix's concurrency-limits (Gradient2Limit): each
window it moves the limit by the ratio of the measured pace to the target pace,

    limit <- streams decoding x pace / target

growing by at most sqrt(limit) a window and only while the limit is in use (the admitted streams
reached it), shrinking to at most half. Where a step's time is a fixed part plus a
part per stream (a GPU's: the weights are read once a step, each stream's KV cache once), that estimate
lies between the current batch and the batch that runs at the target pace: the limit approaches it
from either side without overshooting (tests/test_capacity.py holds this on such curves). The codec
tier's headroom counts too: a codec stream failing over (a replica refusing, stalling or gone), or a
window in which the codec's audio came late (a replica falling behind: runtime.py) shrinks the limit by
CODEC_BACKOFF, at most once a window, and holds it from growing for CODEC_HOLD_WINDOWS.
The limit stays within [floor, ceiling].
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

import numpy as np

from codec_contract.audio import CODES_PER_FRAME, FRAME_SAMPLES, SAMPLE_RATE

REALTIME_TOKENS_PER_S = CODES_PER_FRAME * SAMPLE_RATE / FRAME_SAMPLES  # 82.03: one stream at real time
# Why the limit moved (CapacityLimit.reason, orpheus_capacity_limit_changes_total{reason}, a log line each time):
SLOW = "pace_below_target"  # the streams decoding got less than the target pace
GROWTH = "growth"  # the limit was in use and the pace had room for more
CODEC_LATE = "codec_late"  # more than codec_late_share of the window's codec chunks came late
CODEC_FAILOVER = "codec_failover"  # a codec stream failed over (a replica refused, stalled or went away)
REASONS = (SLOW, GROWTH, CODEC_LATE, CODEC_FAILOVER)
CODEC_BACKOFF = 0.9
CODEC_HOLD_WINDOWS = 5  # after a codec backoff the limit does not grow for this many windows
# A window ends only once its streams have decoded this many tokens' worth at the target pace (about
# 24 deliveries of 7): fewer say too little about the pace, and one delivery more or less would move
# the limit (a CPU's slow-motion target gets windows ten times longer in stream-seconds).
WINDOW_TOKENS = 170


@dataclass(frozen=True)
class Window:
    """What PaceMeter saw over one window."""

    elapsed_s: float
    stream_s: float  # stream-seconds of decoding
    tokens: int  # tokens handed to decoding streams
    peak_decoding: int

    @property
    def pace(self) -> float | None:
        """Tokens per decoding stream-second over real time; None without decoding."""
        if self.stream_s <= 0:
            return None
        return self.tokens / self.stream_s / REALTIME_TOKENS_PER_S

    @property
    def mean_decoding(self) -> float:
        return self.stream_s / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @classmethod
    def stepping(cls, batch: float, step_ms: float, seconds: float) -> Window:
        """`batch` streams decoding together for `seconds`, each getting a token every step of `step_ms`."""
        return cls(seconds, batch * seconds, round(batch * seconds * 1000.0 / step_ms), math.ceil(batch))


class PaceMeter:
    """Streams decoding and the tokens they got, integrated over time; take() ends a window."""

    def __init__(self, now: float) -> None:
        self.decoding_now = 0
        self._since = self._window_start = now
        self._stream_s = 0.0
        self._tokens = 0
        self._peak = 0

    def started(self, now: float) -> None:
        """A request's first token arrived: it decodes from now (its first tokens are its prefill's)."""
        self._advance(now)
        self.decoding_now += 1
        self._peak = max(self._peak, self.decoding_now)

    def tokens(self, n: int) -> None:
        """A decoding request got n more tokens."""
        self._tokens += n

    def stopped(self, now: float) -> None:
        """A decoding request ended (finished, aborted or cut)."""
        self._advance(now)
        self.decoding_now -= 1

    @contextlib.asynccontextmanager
    async def decoding(self) -> AsyncIterator[Callable[[int], None]]:
        """Around one engine request's outputs (async, as they are): the function given takes each
        delivery's token count; the request decodes from its first delivery (its prefill's tokens) until
        the block ends, however it ends."""
        started = False

        def delivered(n: int) -> None:
            nonlocal started
            if started:
                self.tokens(n)
            else:
                started = True
                self.started(time.monotonic())

        try:
            yield delivered
        finally:
            if started:
                self.stopped(time.monotonic())

    def decoded_s(self, now: float) -> float:
        """Stream-seconds of decoding in the window so far."""
        return self._stream_s + self.decoding_now * (now - self._since)

    def take(self, now: float) -> Window:
        """The window since the last take(); a new one starts."""
        self._advance(now)
        window = Window(now - self._window_start, self._stream_s, self._tokens, self._peak)
        self._window_start, self._stream_s, self._tokens, self._peak = now, 0.0, 0, self.decoding_now
        return window

    def _advance(self, now: float) -> None:
        self._stream_s += self.decoding_now * (now - self._since)
        self._since = now


class CapacityLimit:
    """The number of streams admitted at once, moved each window by the pace the engine kept."""

    def __init__(self, initial: float, floor: int, ceiling: int, target_pace: float) -> None:
        if not 1 <= floor <= ceiling:
            raise ValueError(f"need 1 <= floor ({floor}) <= ceiling ({ceiling})")
        self.floor, self.ceiling, self.target_pace = floor, ceiling, target_pace
        self._window_stream_s = WINDOW_TOKENS / (target_pace * REALTIME_TOKENS_PER_S)  # a window's least decoding
        self.limit = float(min(max(initial, floor), ceiling))
        self.pace: float | None = None  # the last window's
        self._codec_trouble: str | None = None  # CODEC_LATE or CODEC_FAILOVER, until the next window
        self.reason: str | None = None  # why the last update moved the limit (None: it did not)
        self._hold = 0  # windows left without growth after a codec backoff

    @property
    def streams(self) -> int:
        """The whole streams the limit admits."""
        return int(self.limit)

    def enough(self, stream_s: float) -> bool:
        """Whether a window with this much decoding says enough about the pace (WINDOW_TOKENS' worth)."""
        return stream_s >= self._window_stream_s

    def idle(self) -> None:
        """Nothing decodes: no pace to show (an old one would hold an alert up)."""
        self.pace = None

    def codec_trouble(self, reason: str = CODEC_LATE) -> None:
        """The codec tier was in trouble since the last window: a stream failed over (CODEC_FAILOVER: a replica
        refused, stalled or went away) or its audio came late (CODEC_LATE: a replica behind). A failover wins."""
        if self._codec_trouble != CODEC_FAILOVER:
            self._codec_trouble = reason

    def update(self, window: Window, peak_admitted: int, admitted: int) -> float:
        """End of a window: move the limit. `peak_admitted`: the most streams admitted at once in it (at
        the limit: demand met it, and every stream past it was refused); `admitted`: now. Returns the
        new limit. A window without enough decoding changes nothing."""
        pace = window.pace if self.enough(window.stream_s) else None
        limit, reason = self.limit, None
        self.pace = pace
        if pace is not None and pace < self.target_pace:
            # Too slow for the streams decoding: the limit those streams would keep at the target.
            limit, reason = min(limit, max(limit / 2, window.mean_decoding * pace / self.target_pace)), SLOW
        elif pace is not None and peak_admitted >= self.streams >= admitted and not self._hold:
            # In use, and not still over it after a decrease (the streams past it are yet to end).
            limit = max(limit, min(window.mean_decoding * pace / self.target_pace, limit + math.sqrt(limit)))
            reason = GROWTH
        self._hold = max(0, self._hold - 1)
        if self._codec_trouble:
            if self.limit * CODEC_BACKOFF < limit:  # the codec's cut binds: the move is the codec's
                limit, reason = self.limit * CODEC_BACKOFF, self._codec_trouble
            self._codec_trouble, self._hold = None, CODEC_HOLD_WINDOWS
        before, self.limit = self.limit, min(max(limit, float(self.floor)), float(self.ceiling))
        self.reason = reason if self.limit != before else None
        return self.limit


def measured_curve(step_ms: Mapping[int, float]) -> Callable[[float], float]:
    """Step time by batch, linear between the batches measured and flat past the largest (the engine
    batches no more than it was given: the ceiling is that batch); NaN points (not measured) left out."""
    points = sorted((b, ms) for b, ms in step_ms.items() if ms == ms)
    if not points:
        raise ValueError("no step time was measured")
    batches, times = zip(*points)
    return lambda batch: float(np.interp(batch, batches, times))


def settled_limit(step_ms: Callable[[float], float], limit: CapacityLimit, windows: int = 200) -> int:
    """Where `limit` settles on an engine whose decode step takes step_ms(batch) when demand always meets it
    (every stream past it refused): the controller itself run on a step-time curve, as the doctor predicts
    admission from the step times it measured. Windows of 10 s: each says enough about the pace."""
    for _ in range(windows):
        batch = limit.streams
        limit.update(Window.stepping(batch, step_ms(batch), seconds=10.0), peak_admitted=batch, admitted=batch)
    return limit.streams
