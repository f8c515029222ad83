"""One speech stream's owner: admission, generation, the codec, encoding, metrics, pacing, cancellation.

Every front door (doors/: six protocols, over HTTP and WebSockets) opens a SpeechSession, gives it text (whole,
or in pieces as a voice agent's LLM writes it), reads its events and closes it. Whatever happened, close() aborts the engine request, cancels the codec streams,
returns the admission slot and counts the outcome, exactly once.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from codec_contract.audio import SAMPLE_RATE

from ..admission import KEY
from ..capacity import FIRST_AUDIO_S
from ..edge.auth import ApiKey
from ..voices import Voice
from .encoding import S16_BYTES as SAMPLE_BYTES
from .encoding import AudioOutput, SilenceTrim, StreamEncoder, first_audible
from .playback import Playback
from .prompt import PromptTooLong
from .segmenter import TextSegmenter, split_sentences
from .stream import SpeechJob, SpeechStream

log = logging.getLogger(__name__)
__all__ = ["Audio", "ClientTooSlow", "PromptTooLong", "Refused", "SegmentEnd", "SpeechSession", "SpeechSpec", "Words"]


class Refused(Exception):
    """A stream cap is reached (the worker's or the key's), and no slot freed within the wait asked for."""

    def __init__(self, message: str, by_key: bool) -> None:
        super().__init__(message)
        self.by_key = by_key


class ClientTooSlow(Exception):
    """The client fell more than max_client_lag_s of audio behind; the stream is cut off."""


@dataclass(frozen=True)
class SpeechSpec:
    """How to speak: voice, seed, the bytes the client wants, and whether to trim leading silence."""

    voice: Voice
    seed: int
    output: AudioOutput = AudioOutput()
    trim: SilenceTrim | None = None


@dataclass(frozen=True)
class Audio:
    """Encoded bytes for the client, and the seconds of speech they carry."""

    data: bytes
    seconds: float


@dataclass(frozen=True)
class Words:
    """Word timings of one segment, in seconds from the start of the session's audio.

    An approximation: the segment's audio is shared among its words in proportion to their length.
    """

    words: list[str]
    starts: list[float]
    ends: list[float]


@dataclass(frozen=True)
class SegmentEnd:
    """All the audio of segment `index` (its `text`) has been handed out."""

    index: int
    text: str


class ClientPace:
    """How far behind a client is, counted only while it keeps us waiting.

    `blocked_s` sums the time each send took; `accepted_s` is the audio taken. A client reading at
    real-time pace can keep us waiting at most about the audio it took plus what its buffer holds,
    so blocked - accepted stays near zero for it, and it is exactly zero for a server slower than
    real time (never kept waiting).
    """

    def __init__(self, max_lag_s: float) -> None:
        self.max_lag_s = max_lag_s
        self.blocked_s = 0.0
        self.accepted_s = 0.0

    def time_left(self) -> float:
        """How long the next send may take before the client is over its lag."""
        return self.max_lag_s + self.accepted_s - self.blocked_s


class SpeechSession:
    """One stream, from admission to its outcome. Use open(), then say() or push()/flush()/end_input(),
    iterate events(), and close()."""

    def __init__(self, runtime, spec: SpeechSpec, key: ApiKey | None, request_id: str) -> None:
        self._runtime = runtime
        self._metrics = runtime.metrics
        self.spec = spec
        self.key = key
        self.request_id = request_id
        self.outcome = "disconnected"  # until the stream ends otherwise
        self._stream: SpeechStream = runtime.pipeline.start(SpeechJob(request_id, spec.voice, spec.seed))
        runtime.voices.used(spec.voice)
        self._segmenter = TextSegmenter(runtime.config.max_segment_chars)
        self.segments = 0  # segments handed to the stream so far; SegmentEnd.index counts the same way
        self._pace = ClientPace(runtime.config.max_client_lag_s)
        self.playback = Playback()  # what a real-time listener would hear of the audio sent
        self.heard = Playback(runtime.config.resolved_target_pace)  # ... and one at the target pace (admission's)
        self._text_at: collections.deque[float] = collections.deque()  # when each segment not yet spoken was given
        self._speaking_text_at = time.monotonic()  # ... and the one being spoken now
        self._speaking = False  # a segment's audio is being sent
        self._first_text_at: float | None = None
        self._first_wait_s = 0.0  # the target-pace listener's wait for the first audio, past FIRST_AUDIO_S
        self._started = time.perf_counter()
        self._closed = False
        self._cancelled = False  # cancel() was called: a failure after it is only its echo
        self._metrics.active_streams.inc()
        runtime.admission.listeners.add(self)

    @classmethod
    async def open(cls, runtime, spec: SpeechSpec, key: ApiKey | None, request_id: str,
                   wait_s: float = 0.0, retries: int = 0) -> SpeechSession:
        """Admit a new stream (a worker-wide slot and one of the key's), waiting in the admission queue for a slot
        up to `wait_s` (an HTTP request; a socket's reading loop does not wait; `retries`: the client's count of its
        retries, AdmissionController.enter), or raise Refused."""
        refused = await runtime.admission.enter(key.name if key else None, key.max_streams if key else 0, wait_s,
                                                retries)
        if refused is not None:
            runtime.metrics.refused(refused)
            by_key = refused == KEY
            if key is not None:
                runtime.metrics.key_requests.labels(key.name, "refused_key" if by_key else "refused").inc()
            who, cap = (f"API key {key.name!r}", key.max_streams) if by_key else ("server", runtime.admission.max_streams)
            raise Refused(f"{who} is at its limit of {cap} concurrent streams; retry shortly", by_key)
        return cls(runtime, spec, key, request_id)

    # -- text in --------------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        """The whole input at once: spoken sentence by sentence."""
        for segment in split_sentences(text, self._runtime.config.max_segment_chars):
            self._add(segment)
        self._stream.end()

    def push(self, piece: str) -> None:
        """A piece of text; speaking starts as soon as a segment is complete (TextSegmenter)."""
        for segment in self._segmenter.push(piece):
            self._add(segment)

    def flush(self) -> None:
        """Speak whatever is buffered, complete or not."""
        for segment in self._segmenter.flush():
            self._add(segment)

    def end_input(self) -> None:
        """No more text: what is buffered is spoken, then the audio ends."""
        self.flush()
        self._stream.end()

    def _add(self, segment: str) -> None:
        self._text_at.append(time.monotonic())
        if self._first_text_at is None:
            self._first_text_at = self._text_at[-1]
        self._stream.add(segment)
        self.segments += 1

    @property
    def pending_text(self) -> str:
        """Text pushed but not yet spoken (waiting for a sentence end)."""
        return self._segmenter.pending

    @property
    def delivered_s(self) -> float:
        """Seconds of audio the client has taken."""
        return self._pace.accepted_s

    @property
    def usage(self) -> tuple[int, int]:
        """(prompt tokens, generated tokens) so far."""
        return self._stream.prompt_tokens, self._stream.generated_tokens

    # -- audio out ------------------------------------------------------------------------------------
    async def events(self) -> AsyncIterator[Audio | Words | SegmentEnd]:
        """The client's audio as it is decoded; after each segment's audio, its Words and SegmentEnd."""
        encoder = StreamEncoder(self.spec.output)
        trimming = self.spec.trim
        audible_level = (self.spec.trim or SilenceTrim()).level
        heard = sent = False
        emitted = dropped = 0  # samples sent, and trimmed, at 24 kHz
        segment_start = 0
        index = 0
        async for text, chunks in self._stream.segments():
            if self._text_at:
                self._speaking_text_at = self._text_at.popleft()
            self._speaking = True
            async for chunk in chunks:
                pcm = chunk.pcm
                if trimming is not None:
                    pcm, cut, trimming = _trim(pcm, trimming, dropped)
                    dropped += cut
                if not heard and first_audible(pcm, audible_level) is not None:
                    heard = True
                    self._metrics.time_to_first_audible_audio.observe(time.perf_counter() - self._started)
                emitted += len(pcm) // SAMPLE_BYTES
                data = await encoder.encode_chunk(pcm)
                if data:
                    if not sent:
                        sent = True
                        self._metrics.time_to_first_audio.observe(time.perf_counter() - self._started)
                    seconds = len(pcm) / (SAMPLE_BYTES * SAMPLE_RATE)
                    self._metrics.audio_seconds.inc(seconds)
                    self._heard(seconds)
                    yield Audio(data, seconds)
            self._speaking = False
            yield self._words(text, segment_start, emitted)
            segment_start = emitted
            yield SegmentEnd(index, text)
            index += 1
        tail = await encoder.finish_stream()
        if tail:
            yield Audio(tail, 0.0)
        self.outcome = "ok"

    async def send(self, deliver: Callable[[], Awaitable[None]], seconds: float) -> None:
        """Run `deliver` (one send to the client) within the client's lag allowance; raise ClientTooSlow past it."""
        started = time.monotonic()
        try:
            async with asyncio.timeout(max(self._pace.time_left(), 0.0)):
                await deliver()
        except TimeoutError:
            p = self._pace
            log.warning("%s: client too slow: kept the stream waiting %.1f s for %.1f s of audio (limit %.1f s behind); "
                        "cut off", self.request_id, p.blocked_s + time.monotonic() - started, p.accepted_s, p.max_lag_s)
            self.outcome = "slow_client"
            raise ClientTooSlow from None
        now = time.monotonic()
        self._pace.blocked_s += now - started
        self._pace.accepted_s += seconds
        self.playback.sent(now, seconds, self._speaking_text_at)

    def _heard(self, seconds: float) -> None:
        """Audio ready to send, as the listener at the target pace hears it: when the worker had it, not when a
        slow client took it (admission judges the worker's pace, not a client's network)."""
        now = time.monotonic()
        if not self.heard.started and self._first_text_at is not None:
            self._first_wait_s = max(0.0, (now - self._first_text_at) * self.heard.pace - FIRST_AUDIO_S)
        self.heard.sent(now, seconds, self._speaking_text_at)

    def listener_lag_s(self, now: float) -> float:
        """Audio seconds the listener at the target pace has waited by `now` (capacity.Listeners): for the first
        audio past FIRST_AUDIO_S after the first text, then for audio owed (text given, not yet all spoken)."""
        pace = self.heard.pace
        if not self.heard.started:
            waited = 0.0 if self._first_text_at is None else (now - self._first_text_at) * pace
            return max(0.0, waited - FIRST_AUDIO_S)
        owed_since = self._speaking_text_at if self._speaking else (self._text_at[0] if self._text_at else None)
        dry = 0.0 if owed_since is None else self.heard.dry_s(now, owed_since)
        return self._first_wait_s + self.heard.underrun_s + dry

    # -- the end --------------------------------------------------------------------------------------
    def failed(self, exc: BaseException) -> bool:
        """Generation failed: count and log it, and say whether the client should hear of it (not
        when the stream was cancelled or its client left: the failure is then only the cancel's echo)."""
        if self._cancelled:  # not `outcome`: it reads "disconnected" until the stream ends otherwise
            return False
        if isinstance(exc, PromptTooLong):  # the client's input, not a failure of ours
            self.outcome = "invalid_input"
            log.info("%s refused: %s", self.request_id, exc)
            return True
        self.outcome = "error"
        log.error("%s failed after %.1f s of audio: %s: %s", self.request_id, self.delivered_s, type(exc).__name__, exc)
        return True

    def cancel(self, outcome: str = "cancelled") -> None:
        """Stop now (barge-in, a client gone): the engine request and codec streams go at once."""
        if self.outcome != "ok":
            self.outcome = outcome
        self._cancelled = True
        self._stream.cancel()

    async def close(self, outcome: str | None = None) -> None:
        """Release everything and count the outcome; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        if outcome is not None:
            self.outcome = outcome
        await self._stream.close()
        self._runtime.admission.listeners.remove(self, time.monotonic(), judged=not self._cancelled)
        self._runtime.admission.release(self.key.name if self.key else None, time.perf_counter() - self._started)
        self._metrics.active_streams.dec()
        self._metrics.requests.labels(self.outcome).inc()
        self._metrics.played(self.playback)
        if self.key is not None:
            self._metrics.key_requests.labels(self.key.name, self.outcome).inc()

    @staticmethod
    def _words(text: str, start: int, end: int) -> Words:
        words = text.split()
        weights = [len(w) + 1 for w in words]
        total = sum(weights) or 1
        duration = (end - start) / SAMPLE_RATE
        starts, ends, t = [], [], start / SAMPLE_RATE
        for weight in weights:
            starts.append(round(t, 3))
            t += duration * weight / total
            ends.append(round(t, 3))
        return Words(words, starts, ends)


def _trim(pcm: bytes, trim: SilenceTrim, dropped: int) -> tuple[bytes, int, SilenceTrim | None]:
    """Drop leading silence: samples before the first audible one, at most trim.max_ms in all.
    Returns what is left, how many samples went, and the trim still to apply (None once done)."""
    cap = int(trim.max_ms * SAMPLE_RATE / 1000) - dropped
    loud = first_audible(pcm, trim.level)
    cut = min(len(pcm) // SAMPLE_BYTES if loud is None else loud, cap)
    done = loud is not None or cut >= cap
    return pcm[cut * SAMPLE_BYTES :], cut, (None if done else trim)
