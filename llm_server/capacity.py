"""How many streams this worker keeps in real time, measured: the admission limit follows the engine's pace and
what each admitted stream's listener hears.

A stream is real time while its engine request gets REALTIME_TOKENS_PER_S tokens a second (7 tokens a
frame, 24000/2048 frames a second: a decode step every 12.2 ms). PaceMeter integrates, over a window,
the tokens handed to the streams that were decoding and the stream-seconds they spent decoding (from a
request's first token to its last: prefill is not decoding, but a new stream's prefill slows the steps
of the others, and that shows); tokens over stream-seconds, over the real-time rate, is the pace (2.0:
twice real time).

CapacityLimit is a gradient limiter in the style of Netflix's concurrency-limits (Gradient2Limit): each
window it moves the limit by the ratio of the measured pace to the target pace,

    limit <- streams decoding x pace / target

growing only while the limit is in use (the admitted streams reached it), shrinking to at most half, and only
once the pace falls below real time (the target less its margin, TARGET_MARGIN); a window's pace below it cuts only
if the last few windows' is too (PACE_SPAN_S), a listener shows it (a stream waited past half its allowance), and the
streams past the last cut have ended.
Growth is a slow start, as TCP's: up to doubling a window (as fast as the measured pace allows, so from a
cold start the capacity is a few windows away) until the limit is first cut or a burst fits under the streams the
pace measured room for, then one stream at a time,
each once the streams the last growth admitted have shown their cost (LISTENER_QUIET_S, below).

Where a step's time is a fixed part plus a part per stream (a GPU's: the weights are read once a step,
each stream's KV cache once), that estimate lies between the current batch and the batch that runs at
the target pace: the limit approaches it from either side without overshooting (tests/test_capacity.py
holds this on such curves). The engine's pace cannot see every bottleneck (a codec tier sharing the cores,
a replica behind); each admitted stream's listener at the target pace can (Listeners): a stream whose
listener waited past its allowance (LISTENER_LAG_S unless configured) is behind, and the limit is cut by
LISTENER_BACKOFF of the streams its window admitted, once for the streams admitted past it; past the slow
start it grows only after LISTENER_QUIET_S of audio in which no listener waited and the codec tier delivered what it
owed at CODEC_ROOM x the target pace (a codec near its capacity shows before its listeners wait), except back up to
a stream below the streams admitted when it was last cut (a settled window a stream: a warm worker cut by an
overload admits a level it kept before within a queue's wait). A codec stream failing over (a replica refusing,
stalling or gone) cuts it by CODEC_BACKOFF. Either cut holds growth for HOLD_WINDOWS. The limit stays within
[floor, ceiling]. While requests are being refused, a reserve of it is held back (admission.py, REFUSING_S): where the
refusals run on the streams' cores, they take from the streams what the limit was found with.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from codec_contract.audio import CODES_PER_FRAME, FRAME_SAMPLES, SAMPLE_RATE

REALTIME_TOKENS_PER_S = CODES_PER_FRAME * SAMPLE_RATE / FRAME_SAMPLES  # 82.03: one stream at real time
# Why the limit moved (CapacityLimit.reason, orpheus_capacity_limit_changes_total{reason}, a log line each time):
SLOW = "pace_below_realtime"  # the streams decoding got less than real time (the target less its margin)
GROWTH = "growth"  # the limit was in use and the pace had room for more
CODEC_FAILOVER = "codec_failover"  # a codec stream failed over (a replica refused, stalled or went away)
LISTENER_BEHIND = "listener_behind"  # a stream's listener at the target pace waited past LISTENER_LAG_S
RESERVE = "refusal_reserve"  # requests were refused lately, or no longer: the reserve held back, or given back
REASONS = (SLOW, GROWTH, CODEC_FAILOVER, LISTENER_BEHIND, RESERVE)
CODEC_BACKOFF = 0.9
# The target pace is TARGET_MARGIN over real time (1.03 on a GPU, 0.103 in a CPU's slow motion: 3 % ahead): the room a
# stream is admitted into, what growth needs, and the pace each stream's listener plays at. The engine's pace, a
# predictor, cuts only below real time itself; between the two it neither grows nor cuts. Judged at the target, a CPU
# worker's limit was cut four times by paces within 0.100-0.105 over the span while no listener was behind (issue 43,
# run 41). What the load itself takes from the streams (a flood of refusals on shared cores: 3-5 % of the codec's
# cores at 2x, 10-11 % at 3x, in runs 43-46) is the reserve's to cover (CapacityLimit.reserve), held back only while
# requests are refused: at a 5 % margin, which covered it without one, the warm limit settled at 0.68-0.96 of the
# streams kept pinned (runs 46-58; the pinned search passes streams a little under real time on their 3 s buffer), at
# 3 % at 1.00 (run 49, where the 3x overload ran 11 streams past the buffer with no reserve).
TARGET_MARGIN = 1.03
HOLD_WINDOWS = 5  # after a cut for a failover or a stream behind, the limit does not grow for this many windows
# A window ends only once its streams got this many tokens (about 24 deliveries of 7), or decoded as long
# as that takes at the target pace: fewer say too little about the pace, and one delivery more or less would
# move the limit. An engine far ahead of the target (a cold start's few streams) gets there in a fraction
# of the time (a CPU's slow-motion target would otherwise take ten times longer in stream-seconds).
WINDOW_TOKENS = 170
# A window's pace below real time cuts only if the pace over the last windows spanning PACE_SPAN_S of audio time (at
# the target pace; this one with them) is below it too, and only to the milder of the two. A CPU engine that yields the
# shared cores to the codec replicas (megapod up's engine_nice) gets them in bursts: at 42 streams its pace over 2 s
# ran 0.10-0.20 (0.14 over the level), single windows read 0.09-0.10, every dip cut the limit and only careful growth
# brought it back, and a warm worker settled at 32 streams against 46 kept pinned (issue 43, run 39); over 1,500
# tokens (3.5 s there) the dips still cut 64 -> 40 (run 40). 9.5 s in a CPU's slow motion, 0.95 s on a GPU.
PACE_SPAN_S = 1.0
# Each admitted stream has a listener at the target pace with no playout buffer (speech/playback.py), waiting from its
# text until its first audio (less FIRST_AUDIO_S: a prompt's prefill and the codec's first chunk) and whenever it has
# played all it was sent while audio is owed; its lag is those waits summed, in audio seconds. A stream whose lag
# passes LISTENER_LAG_S (listener_lag_s's default) is behind, once: five sixths of the 0.3 s playout buffer that
# benchmarks/concurrency.py gives a real-time listener (and a first audio 0.5 s after the text, its time-to-first-audio
# target), so the limit is cut while the streams it admitted still play on. At two thirds (0.2) the cuts came from
# streams at 0.21-0.30 s, within the buffer: once the codec's frame-rate layers were GEMMs, a warm CPU worker was held
# at 24 streams against 32 kept pinned (benchmark run 25; 28 against 28 at 0.25, run 26). The limit grows only through
# windows in which no stream fell behind and none was still waiting past half that: the capacity is where streams
# start to wait.
LISTENER_LAG_S = 0.25
FIRST_AUDIO_S = 0.3
LISTENER_BACKOFF = 0.9  # a cut for streams behind takes this much off the streams admitted in its window
# Past the slow start, the limit grows by one stream only after this much audio time (at the target pace) in which no
# listener waited at all since the last growth: the streams a growth admitted must show their cost (prompts decoded,
# their audio at the codec), and a CPU replica delivers a stream ahead of its listener in rows of up to 16 frames
# (1.37 s), so windows between rows show no waiting though the streams are near the edge (the limit climbed 27 -> 41
# in windows that showed none before the first stream fell behind, benchmark run 14; 20 -> 28 in 24 s with a growth
# every 3 s, run 15).
LISTENER_QUIET_S = 1.5
# ... and only while the codec tier delivered the audio it owed, over that same span, at CODEC_ROOM x the target pace
# or faster: a replica decodes the rows due first, so with room it runs its streams ahead of their listeners and
# the pace it delivers at is well above the target, and near its capacity it falls toward the target while no
# listener waits yet (its rows still come in time). The listeners showed the codec's capacity only once it was
# passed, and a stream's life later: on a CPU, careful growth went 17 -> 29 through quiet spans, against 21 kept
# pinned, and at 29 26 streams ran dry (benchmark run 24). Not a cut: a pace judged too low cut the limit while the
# streams of the last cut still ended (runs 6-8). GPU or CPU alike: a ratio of the target. 1.7, not 1.5: over the 2x
# overload levels of runs 29-33 (demand always past the capacity) the codec delivered at 1.51-1.60x, and careful growth
# on at 1.58x ran 22 streams dry (run 33); the pinned levels that passed at the edge (32-34 streams) had 1.61-1.69x,
# those well within it 1.8-2.2x (all measured by a benchmark client then starved of CPU: benchmarks/README.md,
# runs 34-37).
CODEC_ROOM = 1.7


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
class ListenerWindow:
    """What the admitted streams' listeners at the target pace showed over one window (Listeners.take)."""

    allowed_s: float = LISTENER_LAG_S  # the lag a stream may reach before it is behind (0: never judged)
    behind: int = 0  # streams whose lag passed allowed_s in it (each stream once in its life)
    behind_since_cut: int = 0  # of them, streams admitted since the limit was last cut
    waiting_lag_s: float = 0.0  # the most lag of a stream whose lag grew in it (one still waiting, or that waited)

    @property
    def settled(self) -> bool:
        """No stream fell behind, and none that waited in it had waited past half of allowed_s."""
        return not self.allowed_s or (not self.behind and self.waiting_lag_s <= self.allowed_s / 2)


class Heard(Protocol):
    """An admitted stream as its listener at the target pace hears it (SpeechSession)."""

    def listener_lag_s(self, now: float) -> float:
        """Audio seconds its listener has waited by `now`, past what a stream is allowed (FIRST_AUDIO_S)."""
        ...


@dataclass
class _Listening:
    order: int  # when it was admitted, counted
    lag_s: float = 0.0  # at the last look
    behind: bool = False


class Listeners:
    """The admitted streams' listeners, each looked at once a window, and once more as its stream ends."""

    def __init__(self, allowed_s: float = LISTENER_LAG_S) -> None:
        self.allowed_s = allowed_s  # the lag a stream may reach before it is behind (0: listeners not judged)
        self._streams: dict[Heard, _Listening] = {}
        self._admitted = 0
        self._cut_at = 0  # streams admitted when the limit was last cut
        self._ended = ListenerWindow(allowed_s)  # what streams that ended in this window showed

    def __len__(self) -> int:
        return len(self._streams)

    def add(self, stream: Heard) -> None:
        self._admitted += 1
        self._streams[stream] = _Listening(self._admitted)

    def remove(self, stream: Heard, now: float, judged: bool = True) -> None:
        """A stream ended: looked at once more, unless not `judged` (its client left or cancelled it: a barge-in,
        a benchmark's failed level ending its streams together; what it showed up to the last window stands). Looked at
        as they went, a failed level's streams, each still waiting when its client left, cut the limit 32 -> 16 with
        one stream left admitted, and the way back started from that one (issue 43, run 35)."""
        listening = self._streams.pop(stream, None)
        if listening is not None and judged:
            self._look(self._ended, listening, stream.listener_lag_s(now))

    def cut(self) -> None:
        """The limit was cut: streams admitted before now that fall behind were admitted past it."""
        self._cut_at = self._admitted

    def take(self, now: float) -> ListenerWindow:
        """The window since the last take(): every stream looked at now; a new one starts."""
        window, self._ended = self._ended, ListenerWindow(self.allowed_s)
        for stream, listening in self._streams.items():
            self._look(window, listening, stream.listener_lag_s(now))
        return window

    def _look(self, window: ListenerWindow, listening: _Listening, lag_s: float) -> None:
        if lag_s > listening.lag_s:
            window.waiting_lag_s = max(window.waiting_lag_s, lag_s)
        listening.lag_s = lag_s
        if self.allowed_s and lag_s > self.allowed_s and not listening.behind:
            listening.behind = True
            window.behind += 1
            window.behind_since_cut += listening.order > self._cut_at


class CapacityLimit:
    """The number of streams admitted at once, moved each window by the pace the engine kept."""

    def __init__(self, initial: float, floor: int, ceiling: int, target_pace: float, reserve: float = 0.0) -> None:
        if not 1 <= floor <= ceiling:
            raise ValueError(f"need 1 <= floor ({floor}) <= ceiling ({ceiling})")
        if not 0.0 <= reserve < 1.0:
            raise ValueError(f"need 0 <= reserve ({reserve}) < 1")
        self.floor, self.ceiling, self.target_pace = floor, ceiling, target_pace
        # The share of the limit held back while requests are refused (`refusing`, set by admission), where the refusals
        # take their cores from the streams' (llm_server's refusal_reserve; 0: never). Not in the slow start: a cold
        # worker's first burst is no overload.
        self.reserve = reserve
        self.refusing = False
        self.realtime_pace = target_pace / TARGET_MARGIN  # the engine's pace below it cuts the limit
        self._window_stream_s = WINDOW_TOKENS / (target_pace * REALTIME_TOKENS_PER_S)  # a window's least decoding
        self.limit = float(min(max(initial, floor), ceiling))
        self.pace: float | None = None  # the last window's
        self._failed_over = False  # a codec stream failed over since the last window
        self.reason: str | None = None  # why the last update moved the limit (None: it did not)
        self._hold = 0  # windows left without growth after a cut for a failover or a stream behind
        # Slow start, as TCP's: the limit may double a window until it is first cut (a cut says where the capacity
        # is) or a burst fits under the capacity the pace measured, and from then on grows one stream at a time, each
        # growth once the last one's streams settled.
        self._cut_from: float | None = None  # where the way back after a cut ends (_recovering; None: in the slow start)
        self._reached = False  # the last slow-start growth stopped at what the pace keeps, short of doubling
        self._kept: float | None = None  # the streams the last window's pace keeps at the target, if it had room
        self._quiet_s = 0.0  # seconds of windows since a listener last waited, or the limit last grew past a cut
        self._codec: deque[tuple[float, float, float]] = deque()  # (when, owed audio s, wait s): the last quiet span's
        self._grown_queued = False  # grown past the slow start for requests waiting since the last window
        self._paced: deque[Window] = deque()  # the last windows with a pace, spanning PACE_SPAN_S with the newest

    @property
    def streams(self) -> int:
        """The whole streams the limit admits (its reserve held back while requests are refused)."""
        return max(self.floor, int(self.limit * self._admitted_share))

    @property
    def _admitted_share(self) -> float:
        """The share of the limit admitted: all of it, but its reserve while requests are refused."""
        return 1.0 - self.reserve if self.refusing and not self.slow_start else 1.0

    def hold_reserve(self, refusing: bool) -> bool:
        """Hold the reserve back while requests go on being refused (admission's judgment), else give it back; whether
        that changed the streams admitted (the reason: RESERVE)."""
        before, self.refusing = self.streams, refusing
        if self.streams == before:
            return False
        self.reason = RESERVE
        return True

    @property
    def slow_start(self) -> bool:
        """Whether the limit may still double a window (never cut, and no burst fit under what the pace measured)."""
        return self._cut_from is None

    def enough(self, stream_s: float, tokens: int) -> bool:
        """Whether a window with this much decoding says enough about the pace: WINDOW_TOKENS tokens, or the
        stream-seconds they take at the target pace (an engine behind it is judged in that time)."""
        return tokens >= WINDOW_TOKENS or stream_s >= self._window_stream_s

    def idle(self) -> None:
        """Nothing decodes: no pace to show (an old one would hold an alert up)."""
        self.pace = None

    def grow_queued(self) -> bool:
        """Requests wait at the limit: grow it now, by what the last window showed, rather than after the next window.
        In the slow start, double it, up to what the last window's pace keeps at the target (if it had room and no
        listener waited): on a CPU a cold worker's first burst spends the tokens a window needs on its prompts, and
        its queue's deadline passed first. Past it, one stream once a window, on careful growth's own terms (room for
        one more at the target, no hold, quiet): a warm worker's limit is in use only when a burst meets it, and a
        burst of one stream more was refused after the queue's wait before a window could show the room (issue 43's
        warm search, run 33: the limit at 30 after a cut, every level of 31-48 failed on a refusal within 3 s, and
        levels below 30 never used it). Whether it grew."""
        if self._kept is None or self._kept <= self.limit:
            return False
        before = self.limit
        if self.slow_start:
            self.limit = self._slow_start_growth(self._kept)
        elif not self._hold and not self._grown_queued and self._quiet():
            self.limit = min(self._kept, self.limit + 1.0, float(self.ceiling))
            self._grown_queued, self._quiet_s = True, 0.0  # as a window's careful growth: the next waits for its cost
        self.reason = GROWTH if self.limit > before else None
        return self.limit > before

    def _slow_start_growth(self, kept: float) -> float:
        """The limit a slow-start growth to `kept` streams (more than the limit) takes: at most double, within the
        ceiling; noting whether the pace, not the doubling, bounded it (_reached)."""
        bound = min(2 * self.limit, float(self.ceiling))
        self._reached = kept < bound
        return min(kept, bound)

    def _recovering(self) -> bool:
        """Past the slow start and up to a stream below the streams admitted when the limit was last cut: careful
        growth is one stream a settled window, as TCP CUBIC returns to where it lost packets (not the limit: a slow
        start's last doubling, 16 -> 32 for a burst of 24, was never in use)."""
        return not self.slow_start and self.limit + 1.0 <= self._cut_from - 1.0

    def _quiet(self) -> bool:
        """Whether careful growth may take a stream now: in the slow start or recovering, or after LISTENER_QUIET_S
        with no listener waiting and a codec tier with room (CODEC_ROOM)."""
        codec_room = self.codec_pace is None or self.codec_pace >= CODEC_ROOM
        return (self.slow_start or self._recovering()
                or (self._quiet_s * self.target_pace >= LISTENER_QUIET_S and codec_room))

    def codec_delivered(self, audio_s: float, wait_s: float, now: float) -> None:
        """The codec tier delivered `audio_s` of owed audio for `wait_s` of streams waiting on it since the last call
        (codec_client's owed counts); kept for a quiet span (LISTENER_QUIET_S of audio at the target pace)."""
        self._codec.append((now, audio_s, wait_s))
        while self._codec[0][0] < now - LISTENER_QUIET_S / self.target_pace:
            self._codec.popleft()

    @property
    def codec_pace(self) -> float | None:
        """The pace the codec tier delivered owed audio at over the last quiet span, over the target; None when no
        stream waited on it."""
        wait = sum(w for _, _, w in self._codec)
        return sum(a for _, a, _ in self._codec) / wait / self.target_pace if wait > 0 else None

    def codec_failover(self) -> None:
        """A codec stream failed over since the last window (a replica refused, stalled or went away): the next
        update cuts the limit by CODEC_BACKOFF, once however many did."""
        self._failed_over = True

    def _span_pace(self) -> float:
        """The pace over the last windows that span PACE_SPAN_S of audio time (the newest last)."""
        span_s = PACE_SPAN_S / self.target_pace
        while len(self._paced) > 1 and sum(w.elapsed_s for w in self._paced) - self._paced[0].elapsed_s >= span_s:
            self._paced.popleft()
        return Window(0.0, sum(w.stream_s for w in self._paced), sum(w.tokens for w in self._paced), 0).pace

    def update(self, window: Window, peak_admitted: int, admitted: int, heard: ListenerWindow | None = None) -> float:
        """End of a window: move the limit. `peak_admitted`: the most streams admitted at once in it (at
        the limit: demand met it, and every stream past it waited or was refused); `admitted`: now; `heard`: what
        their listeners at the target pace showed (None: not looked at). Returns the new limit. A window without
        enough decoding changes nothing."""
        pace = window.pace if self.enough(window.stream_s, window.tokens) else None
        limit, reason = self.limit, None
        self.pace = pace
        # A pace below real time cuts only once a listener shows it (not settled), where the listeners are judged at all
        # (not the doctor's settled_limit, nor listener_lag_s 0): a replica runs its streams up to listener_ahead_s ahead
        # of their listeners, so an engine behind for a while is no stream behind yet. Over 9.5 s spans the CPU engine
        # read 0.09-0.10 at 40-46 streams while the codec tier delivered owed audio at 2.0-2.2x the target and no listener
        # had waited past 0.125 s: six cuts (49 -> 40, 44 -> 37), the warm search held at 42 against 51 pinned (run 53).
        shown = heard is None or not heard.allowed_s or not heard.settled
        # ... and only once the streams past the last decrease ended: their pace is that of the load the limit was already
        # cut for, and says nothing of the streams it admits now. Over run 60's warm search a level's 52 streams cut it by
        # their pace three times in 5 s (54 -> 42), the next level's 43 five times (43 -> 37), each cut lowering where the
        # way back ends: every level of 41-44 after them was refused at its start (warm 37 of 45 kept pinned).
        over = admitted > self.streams
        heard = heard or ListenerWindow()
        self._quiet_s = 0.0 if heard.waiting_lag_s > 0 else self._quiet_s + window.elapsed_s
        self._grown_queued = False
        quiet = self._quiet()  # careful growth waits for quiet only near the last trouble (_recovering)
        room = pace is not None and pace >= self.target_pace and heard.settled
        kept = None if pace is None else window.mean_decoding * pace / self.target_pace  # streams this pace keeps
        self._kept = kept if room else None
        slow = None
        if pace is not None:
            self._paced.append(window)
            slow = max(pace, self._span_pace())
        if slow is not None and slow < self.realtime_pace and shown and not over:
            # Behind real time: the limit whose streams admitted are those this pace keeps at the target (a pace with
            # the refusals' work in it: the reserve held back on top would take it twice).
            kept_slow = window.mean_decoding * slow / self.target_pace / self._admitted_share
            limit, reason = min(limit, max(limit / 2, kept_slow)), SLOW
        elif heard.behind_since_cut:
            # Streams behind: LISTENER_BACKOFF of the streams the window admitted (the limit, when it was in use).
            # Only streams admitted since the last cut count: those admitted before it that fall behind later were
            # admitted past it (a cut each ran a level's limit from 28 to 18 while its streams ended, benchmark run
            # 13); if the limit is still too high, the streams it admits next fall behind.
            cut = max(limit / 2, min(limit, peak_admitted / self._admitted_share) * LISTENER_BACKOFF)
            if cut < limit:
                limit, reason = cut, LISTENER_BEHIND
        elif (pace is not None and peak_admitted >= self.streams >= admitted and not self._hold
              and heard.settled and quiet):
            # In use, and not still over it after a decrease (the streams past it are yet to end).
            if kept > limit:
                limit = self._slow_start_growth(kept) if self.slow_start else min(kept, limit + 1.0)
            reason = GROWTH
        self._hold = HOLD_WINDOWS if reason == LISTENER_BEHIND else max(0, self._hold - 1)
        if self._failed_over:
            if self.limit * CODEC_BACKOFF < limit:  # the failover's cut binds: the move is the codec's
                limit, reason = self.limit * CODEC_BACKOFF, CODEC_FAILOVER
            self._failed_over, self._hold = False, HOLD_WINDOWS
        before, self.limit = self.limit, min(max(limit, float(self.floor)), float(self.ceiling))
        self.reason = reason if self.limit != before else None
        if self.limit < before:  # trouble found the capacity: from here on, growth is careful
            self._quiet_s, self._cut_from = 0.0, min(before, peak_admitted / self._admitted_share)
        elif (self.slow_start and self._reached and pace is not None and self.limit == before
              and peak_admitted < int(before)):
            # The slow start grew to what the pace keeps and a burst fit under it: the capacity is found (a slow start
            # ends at ssthresh), and later bursts meet careful growth. On a CPU the pace measured while a burst's
            # streams open overstates what they will cost (their prompts and first rows are yet to come): a warm
            # worker never cut still doubled 46 -> 64 for a burst of 56, on paces of 0.12-0.14 at 44-51 streams, and
            # admitted 53 where 48 kept real time pinned (run 43). A last growth past the demand is not covered: a
            # burst of 39 grew the limit 32 -> 60 and a later one of 56 was admitted whole (run 46).
            self._quiet_s, self._cut_from = 0.0, self.limit
        elif self.limit > before and not self.slow_start:  # a careful growth: the next waits for its streams' cost
            self._quiet_s = 0.0
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
