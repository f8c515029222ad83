"""Per-stream figures from the client's clock and the audio bytes alone, and a level's verdict.

A stream is a Timeline: when its request was sent, every chunk of audio as it arrived (arrival
time, audio bytes; headers excluded) and how it ended. Everything here is a pure function of
timelines, so tests can feed synthetic ones with known answers.

Playback model: the listener starts playing `buffer_s` after the first audio arrives and plays at
`pace` x real time (1.0 is normal speed; below 1 is the slow-motion target used on CPUs, where
every time target is divided by the same factor). The stream runs dry when playback reaches
audio that has not arrived yet. Chunk k (arriving at t_k, with A_k seconds of audio before it)
starts playing at t_first + B + A_k / pace if nothing ran dry before, so the stream never runs
dry iff t_k <= t_first + B + A_k / pace for every k: the buffer it needs is the largest
t_k - t_first - A_k / pace.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from llm_server.speech.encoding import S16_BYTES as SAMPLE_BYTES, SAMPLE_RATE  # s16le mono

BYTES_PER_AUDIO_S = SAMPLE_RATE * SAMPLE_BYTES
EPS = 1e-9  # float slack in comparisons against targets
# The continuity SLOs (issue 46): a stream passes at T when its longest gap, played from its first audio with no
# buffer, is within T of real time (SGLang-Omni's TTS benchmark: 100 or 200 ms; the workers' own
# orpheus_stream_continuity_total counts the same on their side).
GAP_SLOS_S = (0.1, 0.2)

Chunk = tuple[float, int]  # (arrival seconds on the client's clock, audio bytes)


@dataclass(frozen=True)
class Timeline:
    """One stream as the client saw it. Times are seconds on one monotonic clock."""

    sent_s: float
    chunks: tuple[Chunk, ...] = ()
    ended_s: float | None = None  # last byte or failure; None while the stream is open
    completed: bool = False  # HTTP 200 and the body ran to its end without an error
    error: str | None = None

    @property
    def open(self) -> bool:
        return self.ended_s is None

    @property
    def audio_bytes(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def audio_s(self) -> float:
        return self.audio_bytes / BYTES_PER_AUDIO_S

    @property
    def first_audio_s(self) -> float | None:
        """Arrival of the first chunk that carries audio."""
        return next((t for t, n in self.chunks if n > 0), None)


@dataclass(frozen=True)
class Targets:
    """What a level must meet. Time targets are wall-clock seconds (already divided by pace)."""

    ttfa_s: float = 0.5  # time to first audio, at the quantile below
    buffer_s: float = 0.3  # playout buffer a stream may use and still count as real time
    pace: float = 1.0  # playback speed the stream must keep up with, x real time
    success_share: float = 0.99
    realtime_share: float = 0.99
    ttfa_quantile: float = 0.95

    def __post_init__(self) -> None:
        if self.ttfa_s <= 0 or self.buffer_s < 0 or self.pace <= 0:
            raise ValueError("need ttfa_s > 0, buffer_s >= 0 and pace > 0")
        for name in ("success_share", "realtime_share", "ttfa_quantile"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], not {getattr(self, name)}")


# -- one stream -------------------------------------------------------------------------------


def time_to_first_audio(tl: Timeline) -> float | None:
    """Request sent to the first audio byte; None when no audio came."""
    first = tl.first_audio_s
    return None if first is None else first - tl.sent_s


def time_to_offset(tl: Timeline, offset_bytes: int | None) -> float | None:
    """Request sent to the arrival of the chunk holding audio byte `offset_bytes` (e.g. the first audible)."""
    if offset_bytes is None:
        return None
    seen = 0
    for t, n in tl.chunks:
        seen += n
        if n > 0 and seen > offset_bytes:
            return t - tl.sent_s
    return None


def required_buffer_s(chunks: Sequence[Chunk], pace: float = 1.0) -> float:
    """The playout delay after the first audio that would have kept playback from ever running dry."""
    first = next((t for t, n in chunks if n > 0), None)
    if first is None:
        return 0.0
    before, need = 0.0, 0.0
    for t, n in chunks:
        if n <= 0:
            continue
        need = max(need, t - first - before / pace)
        before += n / BYTES_PER_AUDIO_S
    return need


def waits(chunks: Sequence[Chunk], buffer_s: float, pace: float = 1.0) -> list[float]:
    """Each wait of a listener that starts `buffer_s` after the first audio and plays at `pace`; it resumes on the
    next chunk."""
    first = next((t for t, n in chunks if n > 0), None)
    if first is None:
        return []
    playhead, out = first + buffer_s, []  # when playback reaches the next chunk's audio
    for t, n in chunks:
        if n <= 0:
            continue
        if t > playhead + EPS:
            out.append(t - playhead)
            playhead = t
        playhead += n / BYTES_PER_AUDIO_S / pace
    return out


def stalls(chunks: Sequence[Chunk], buffer_s: float, pace: float = 1.0) -> tuple[int, float]:
    """(times playback ran dry, seconds it waited) with `buffer_s` of buffering."""
    waited = waits(chunks, buffer_s, pace)
    return len(waited), sum(waited)


def worst_gap_s(chunks: Sequence[Chunk], pace: float = 1.0) -> float:
    """The longest wait of a listener that plays from the first audio with no buffer, in seconds of real time (at
    `pace` everything is heard 1/pace slower, its waits too: a wait of w on the clock is w x pace)."""
    return max(waits(chunks, 0.0, pace), default=0.0) * pace


def ran_dry(tl: Timeline, buffer_s: float, pace: float = 1.0, now: float | None = None) -> bool:
    """Playback with `buffer_s` of buffering has already run dry (for an open stream: by `now`)."""
    if required_buffer_s(tl.chunks, pace) > buffer_s + EPS:
        return True
    first = tl.first_audio_s
    if not tl.open or first is None or now is None:
        return False
    return now > first + buffer_s + tl.audio_s / pace + EPS


def gaps_s(chunks: Sequence[Chunk]) -> list[float]:
    """Time between consecutive chunks that carry audio."""
    times = [t for t, n in chunks if n > 0]
    return [b - a for a, b in zip(times, times[1:])]


def real_time_factor(tl: Timeline) -> float | None:
    """Wall seconds from request to last byte per second of audio (below 1/pace keeps up on average)."""
    if tl.ended_s is None or tl.audio_bytes == 0:
        return None
    return (tl.ended_s - tl.sent_s) / tl.audio_s


def truncated(tl: Timeline) -> bool:
    """Audio started but the stream was cut: an error after audio, or a partial sample."""
    return not tl.open and tl.audio_bytes > 0 and (not tl.completed or tl.audio_bytes % SAMPLE_BYTES != 0)


def succeeded(tl: Timeline) -> bool:
    """Ended cleanly with audio, and not truncated."""
    return not tl.open and tl.completed and tl.audio_bytes > 0 and not truncated(tl)


def real_time(tl: Timeline, buffer_s: float, pace: float = 1.0) -> bool:
    """Succeeded and never ran dry with `buffer_s` of buffering."""
    return succeeded(tl) and required_buffer_s(tl.chunks, pace) <= buffer_s + EPS


def first_audible_sample(pcm: bytes, threshold: int) -> int | None:
    """Index of the first s16le sample whose magnitude reaches `threshold`; None if none does."""
    samples = np.frombuffer(pcm, dtype="<i2", count=len(pcm) // SAMPLE_BYTES)  # a view: no copy
    loud = np.flatnonzero(np.abs(samples.astype(np.int32)) >= threshold)
    return int(loud[0]) if loud.size else None


def stream_figures(tl: Timeline, targets: Targets, audible_offset: int | None = None) -> dict[str, Any]:
    """Everything about one stream that a level aggregates."""
    stall_count, stall_s = stalls(tl.chunks, targets.buffer_s, targets.pace)
    return {
        "ok": succeeded(tl),
        "truncated": truncated(tl),
        "real_time": real_time(tl, targets.buffer_s, targets.pace),
        "ttfa_s": time_to_first_audio(tl),
        "ttfa_audible_s": time_to_offset(tl, audible_offset),
        "required_buffer_s": required_buffer_s(tl.chunks, targets.pace) if tl.audio_bytes else None,
        "stall_count": stall_count,
        "stall_s": stall_s,
        "worst_gap_s": worst_gap_s(tl.chunks, targets.pace) if tl.audio_bytes else None,
        "rtf": real_time_factor(tl),
        "audio_s": tl.audio_s,
        "error": tl.error,
    }


# -- a level ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Counts:
    """A level's streams, and those that certainly miss each target."""

    streams: int
    failed: int  # ended without success (error, refusal, truncation, no audio)
    not_real_time: int  # failed, or ran dry at the buffer
    slow_first_audio: int  # first audio later than the target, or never

    def over(self, targets: Targets) -> list[str]:
        """The targets these counts already miss (empty: none missed so far)."""
        reasons = []
        if self.failed > allowed(self.streams, targets.success_share):
            reasons.append(f"{self.failed}/{self.streams} streams failed (success < {targets.success_share:.0%})")
        if self.not_real_time > allowed(self.streams, targets.realtime_share):
            reasons.append(f"{self.not_real_time}/{self.streams} streams not real time at "
                           f"{targets.buffer_s:g} s buffer (< {targets.realtime_share:.0%})")
        if self.slow_first_audio > allowed(self.streams, targets.ttfa_quantile):
            reasons.append(f"{self.slow_first_audio}/{self.streams} streams over {targets.ttfa_s:g} s to first audio "
                           f"(p{targets.ttfa_quantile * 100:g} over target)")
        return reasons


def allowed(streams: int, share: float) -> int:
    """How many of `streams` may miss a target that `share` of them must meet."""
    return streams - math.ceil(share * streams - EPS)


def count(timelines: Iterable[Timeline], targets: Targets, now: float | None = None) -> Counts:
    """Misses that are certain: ended streams are judged whole, open ones on what `now` already shows."""
    n = failed = dry = slow = 0
    for tl in timelines:
        n += 1
        bad = not tl.open and not succeeded(tl)
        failed += bad
        dry += bad or ran_dry(tl, targets.buffer_s, targets.pace, now)
        ttfa = time_to_first_audio(tl)
        if ttfa is not None:
            slow += ttfa > targets.ttfa_s + EPS
        else:
            slow += not tl.open or (now is not None and now - tl.sent_s > targets.ttfa_s + EPS)
    return Counts(n, failed, dry, slow)


def verdict(timelines: Sequence[Timeline], targets: Targets) -> list[str]:
    """Why a level of ended streams fails (empty: it passes)."""
    if not timelines:
        return ["no stream was measured"]
    if any(tl.open for tl in timelines):
        return [f"{sum(tl.open for tl in timelines)} streams did not end"]
    return count(timelines, targets).over(targets)


def percentiles(values: Iterable[float | None], ps: Sequence[float] = (50, 95, 99),
                digits: int | None = None) -> dict[str, float | None]:
    """Linear-interpolated percentiles of the values that exist (rounded to `digits`); None when there are none."""
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    out = {f"p{p:g}": (float(np.percentile(arr, p)) if arr.size else None) for p in ps}
    return out if digits is None else {k: None if v is None else round(v, digits) for k, v in out.items()}
