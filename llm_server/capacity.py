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

growing only while the limit is in use (the admitted streams reached it), shrinking to at most half.
Growth is a slow start, as TCP's: up to doubling a window (as fast as the measured pace allows, so from a
cold start the capacity is a few windows away) until the limit is first cut, then at most sqrt(limit) at a
time above where it was cut, each once the streams the last growth admitted have shown their cost
(SETTLE_S_AT_REALTIME): the pace cannot see every bottleneck (a codec tier sharing the cores).

Where a step's time is a fixed part plus a part per stream (a GPU's: the weights are read once a step,
each stream's KV cache once), that estimate lies between the current batch and the batch that runs at
the target pace: the limit approaches it from either side without overshooting (tests/test_capacity.py
holds this on such curves). The codec tier's headroom counts too: a codec stream failing over (a
replica refusing, stalling or gone) shrinks the limit by CODEC_BACKOFF; CodecWindow's judgment that the codec
delivered its owed audio slower than the target pace over enough of it (a replica that cannot keep up, its
streams' waits counted as they run; not a few late chunks in a burst) shrinks it by the same gradient as the
engine's: to the streams sharing the codec x its pace / (target x CODEC_HEADROOM) (a codec shared by the streams
it owes gives each its throughput over their number; at most halving, at least CODEC_BACKOFF of those streams);
either at most once a window, then no growth for CODEC_HOLD_WINDOWS. That judged figure also bounds growth: no more than
the streams the codec keeps at the target (an engine with headroom beside a codec without used to grow the
limit to 2-3x what the codec kept). The limit stays within [floor, ceiling].
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
CODEC_LATE = "codec_late"  # the codec delivered owed audio slower than the target pace, over enough chunks
CODEC_FAILOVER = "codec_failover"  # a codec stream failed over (a replica refused, stalled or went away)
REASONS = (SLOW, GROWTH, CODEC_LATE, CODEC_FAILOVER)
CODEC_BACKOFF = 0.9
# The codec's owed audio is judged against the target pace x this: it comes in rounds (a chunk of every stream per
# batch), so a codec just at the target pace on average leaves streams waiting a round for their next chunk, past a
# listener's buffer. Measured beside CPU replicas (benchmarks/README.md, concurrency.py --admission run 7): the limit
# held at the streams the codec kept at 1.0x the target (12-18), where the listener's pinned search kept 9.
CODEC_HEADROOM = 1.5
CODEC_HOLD_WINDOWS = 5  # after a codec backoff the limit does not grow for this many windows
# Past the slow start, a growth is not followed by another until the streams it admitted have shown what they cost
# (prompts decoded, their audio at the codec): about a new stream's time to first audio, 0.3 s at real time,
# divided by the target pace (3 s in a CPU's slow motion, where a window of fast streams closes each second).
SETTLE_S_AT_REALTIME = 0.3
# A window ends only once its streams got this many tokens (about 24 deliveries of 7), or decoded as long
# as that takes at the target pace: fewer say too little about the pace, and one delivery more or less would
# move the limit. An engine far ahead of the target (a cold start's few streams) gets there in a fraction
# of the time (a CPU's slow-motion target would otherwise take ten times longer in stream-seconds).
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

    @property
    def decoded_tokens(self) -> int:
        """Tokens handed to decoding streams in the window so far."""
        return self._tokens

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


@dataclass
class CodecWindow:
    """What the codec tier did since its last judgment (CodecClient's counts, differenced): failovers, and the
    chunks of owed audio with their audio (a frame's allowance each) and the waits for owed audio (those still
    waiting counted up to now, those that ended in a failover too: a stalled replica shows as it stalls)."""

    failovers: int = 0
    chunks: int = 0
    late: int = 0  # chunks slower than the target pace on their own (a metric; the judgment is the pace)
    audio_s: float = 0.0
    wait_s: float = 0.0

    @property
    def pace(self) -> float | None:
        """Owed audio over the waits for it: the pace the codec kept while streams waited on it."""
        return self.audio_s / self.wait_s if self.wait_s > 0 else None

    def enough(self, target_pace: float, judge_chunks: int) -> bool:
        """Whether the pace can be judged: `judge_chunks` chunks came (0: never judged), or streams waited as long
        as that many frames' audio takes at the target pace (a codec too slow to deliver many chunks)."""
        return judge_chunks > 0 and (self.chunks >= judge_chunks or
                                     self.wait_s * target_pace >= judge_chunks * FRAME_SAMPLES / SAMPLE_RATE)

    def trouble(self, target_pace: float, judge_chunks: int) -> str | None:
        """CODEC_FAILOVER after a failover; CODEC_LATE once enough() says so and the owed audio came, together,
        slower than `target_pace`: a replica that cannot keep up, where one burst's late chunks are made up
        by the rest; None otherwise (and while too little came to say: the counts go on adding up)."""
        if self.failovers:
            return CODEC_FAILOVER
        if self.enough(target_pace, judge_chunks) and self.pace is not None and self.pace < target_pace:
            return CODEC_LATE
        return None

    def judged(self, target_pace: float, judge_chunks: int) -> bool:
        """Whether this window's counts were judged (a failover, or enough): the next one starts anew."""
        return bool(self.failovers) or self.enough(target_pace, judge_chunks) or not judge_chunks

    def __sub__(self, other: CodecWindow) -> CodecWindow:
        return CodecWindow(self.failovers - other.failovers, self.chunks - other.chunks, self.late - other.late,
                           self.audio_s - other.audio_s, self.wait_s - other.wait_s)


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
        self._codec_cut_to = math.inf  # the limit that trouble cuts to
        self.codec_room: float | None = None  # the last judged codec pace over the target (None: never judged)
        self.codec_streams: float | None = None  # the streams the codec keeps at the target, by that judgment
        self.reason: str | None = None  # why the last update moved the limit (None: it did not)
        self._hold = 0  # windows left without growth after a codec backoff
        # Slow start, as TCP's: the limit may double a window until it is first cut (a cut says where the capacity
        # is), and from then on grows by at most its square root, each growth once the last one's streams settled.
        self._cut = False
        self._settling_s = 0.0  # seconds of windows left before the next careful growth

    @property
    def streams(self) -> int:
        """The whole streams the limit admits."""
        return int(self.limit)

    @property
    def codec_target(self) -> float:
        """The pace the codec's owed audio is judged against."""
        return self.target_pace * CODEC_HEADROOM

    @property
    def slow_start(self) -> bool:
        """Whether the limit may still double a window (it was never cut)."""
        return not self._cut

    def enough(self, stream_s: float, tokens: int) -> bool:
        """Whether a window with this much decoding says enough about the pace: WINDOW_TOKENS tokens, or the
        stream-seconds they take at the target pace (an engine behind it is judged in that time)."""
        return tokens >= WINDOW_TOKENS or stream_s >= self._window_stream_s

    def idle(self) -> None:
        """Nothing decodes: no pace to show (an old one would hold an alert up)."""
        self.pace = None

    def codec_trouble(self, reason: str = CODEC_LATE, kept: float | None = None) -> None:
        """The codec tier was in trouble since the last window: a stream failed over (CODEC_FAILOVER: a replica
        refused, stalled or went away; the limit cut by CODEC_BACKOFF) or its audio came late (CODEC_LATE: a replica
        behind, keeping `kept` streams at the target: the limit cut to that, at most halving; None: not known, cut as
        after a failover). A failover wins the reason; the deepest cut is kept."""
        if self._codec_trouble != CODEC_FAILOVER:
            self._codec_trouble = reason
        cut_to = self.limit * CODEC_BACKOFF if kept is None else max(self.limit / 2, kept)
        self._codec_cut_to = min(self._codec_cut_to, cut_to)

    def judge_codec(self, window: CodecWindow, judge_chunks: int, streams: int) -> str | None:
        """The codec tier's counts since its last judgment, `streams` sharing it now (the admitted), against the target
        pace x CODEC_HEADROOM: once enough came, the streams it keeps at that target, streams x pace / target (a codec
        shared by the streams it owes gives each its throughput over their number), the most growth may reach; behind
        that target, its trouble noted for the next update (and returned): the limit cut to those streams, by at least
        CODEC_BACKOFF of them. Streams still
        over a limit just cut are counted, not the limit: the next judgment cuts no further than what they showed."""
        target = self.codec_target
        trouble = window.trouble(target, judge_chunks)
        pace = window.pace if window.enough(target, judge_chunks) else None
        room, sharing = None if pace is None else pace / target, max(1, streams)
        if room is not None:
            self.codec_room, self.codec_streams = room, sharing * room
        if trouble is not None:
            late = trouble == CODEC_LATE and room is not None
            self.codec_trouble(trouble, sharing * min(room, CODEC_BACKOFF) if late else None)
        return trouble

    def update(self, window: Window, peak_admitted: int, admitted: int) -> float:
        """End of a window: move the limit. `peak_admitted`: the most streams admitted at once in it (at
        the limit: demand met it, and every stream past it waited or was refused); `admitted`: now. Returns the
        new limit. A window without enough decoding changes nothing."""
        pace = window.pace if self.enough(window.stream_s, window.tokens) else None
        limit, reason = self.limit, None
        self.pace = pace
        self._settling_s -= window.elapsed_s
        if pace is not None and pace < self.target_pace:
            # Too slow for the streams decoding: the limit those streams would keep at the target.
            limit, reason = min(limit, max(limit / 2, window.mean_decoding * pace / self.target_pace)), SLOW
        elif pace is not None and peak_admitted >= self.streams >= admitted and not self._hold:
            # In use, and not still over it after a decrease (the streams past it are yet to end).
            if self._settling_s <= 0:
                step = math.sqrt(limit) if self._cut else limit
                grown = min(window.mean_decoding * pace / self.target_pace, limit + step)
                if self.codec_streams is not None:  # and no more than the codec keeps at the target
                    grown = min(grown, self.codec_streams)
                limit = max(limit, grown)
                reason = GROWTH
        self._hold = max(0, self._hold - 1)
        if self._codec_trouble:
            if self._codec_cut_to < limit:  # the codec's cut binds: the move is the codec's
                limit, reason = self._codec_cut_to, self._codec_trouble
            self._codec_trouble, self._codec_cut_to, self._hold = None, math.inf, CODEC_HOLD_WINDOWS
        before, self.limit = self.limit, min(max(limit, float(self.floor)), float(self.ceiling))
        self.reason = reason if self.limit != before else None
        if self.limit < before:  # trouble found the capacity: from here on, growth is careful
            self._cut = True
        elif self.limit > before and self._cut:  # a careful growth: the next waits for its streams' cost
            self._settling_s = SETTLE_S_AT_REALTIME / self.target_pace
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
