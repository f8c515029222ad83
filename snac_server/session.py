"""One stream's decode session: the frames it received, the decoder rows they make, the audio they free.

Pure bookkeeping, no I/O and no model: the gRPC service feeds a session frames, asks it for the next
row to decode (one at a time: a streaming row needs the state its predecessor left), and hands each
row's PCM back to learn which samples to send. Frame and sample indices are absolute in the stream.

- StreamingSession: every frame goes through the streaming decoder once. A row carries the frames
  that arrived since the last one (the largest frame bucket that fits), at most as many as the caller
  allows (the service: what the stream's listener still has to play), and every sample whose right
  context has arrived goes out at once. After the end, flush frames push the tail out.
- ReferenceSession: the common streaming decoder, kept for comparison: one 4-frame window per
  emitted frame (1 frame before it, 2 after), decoded from scratch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from codec_contract.audio import FRAME_SAMPLES, REFERENCE_WINDOW

from .frames import CODES_PER_FRAME, InvalidFrames, validate_codes
from .streaming import OPEN_END, flush_frames

# Largest resume index a header may name (2**48 frames: ~760,000 years of audio). The wire type is
# uint64, but a row's absolute position reaches the model as int64: past that, a shared step fails.
MAX_FRAME_INDEX = 2**48


@dataclass(frozen=True)
class SessionSettings:
    """What a client chose in its session header, after defaults and validation."""

    seed: int
    policy: str  # "streaming" | "reference"
    first_frame: int = 0
    emit_from_sample: int = 0
    listener_pace: float = 1.0  # x real time: when the listener needs each row's audio (the decode order)
    listener_ahead_s: float = 0.0  # the most audio decoded ahead of the listener (0: no bound)


@dataclass(frozen=True)
class StreamStep:
    """A streaming-decoder row: frames [frame0, frame0 + len(codes)) of the stream held in `slot`."""

    slot: int
    codes: np.ndarray  # (F, 7) int32; zeros for flush frames past the end
    frame0: int
    end: int  # the stream's length in frames, OPEN_END while it is unknown
    seed: int
    fresh: bool  # the stream's first step: its slot starts from zero


@dataclass(frozen=True)
class Window:
    """A reference row: frames [frame0, frame0 + len(frames)) decoded from scratch."""

    frames: np.ndarray  # (W, 7) int32
    frame0: int
    seed: int


Row = StreamStep | Window


@dataclass(frozen=True)
class Emission:
    """Samples [first_sample, first_sample + len(pcm)) for the client; `final` on the stream's last."""

    first_sample: int
    pcm: np.ndarray  # float32
    final: bool


class _Session:
    """Frames in (validated), end of stream, and the samples already sent."""

    def __init__(self, settings: SessionSettings) -> None:
        if settings.first_frame > MAX_FRAME_INDEX or settings.emit_from_sample > MAX_FRAME_INDEX * FRAME_SAMPLES:
            raise InvalidFrames(f"first_frame and emit_from_sample are limited to frame {MAX_FRAME_INDEX}")
        if settings.emit_from_sample < settings.first_frame * FRAME_SAMPLES:
            raise InvalidFrames(
                f"emit_from_sample {settings.emit_from_sample} is before first_frame {settings.first_frame}"
            )
        self.settings = settings
        self._frames = np.zeros((0, CODES_PER_FRAME), dtype=np.int32)  # frames [_frames_start, received)
        self._frames_start = settings.first_frame
        self.received = settings.first_frame
        self.emitted = settings.emit_from_sample  # the next sample the client needs
        self.ended = False
        self.in_flight = False
        self.final_sent = False

    def add_frames(self, packed: bytes) -> None:
        """Append Frames.codes, validated; raises InvalidFrames for bad codes or frames after the end."""
        if self.ended:
            raise InvalidFrames("frames after end of stream")
        codes = validate_codes(packed)
        self._frames = np.concatenate([self._frames, codes])
        self.received += len(codes)

    def end(self) -> None:
        """Mark end of stream: the tail gets flushed."""
        if self.ended:
            raise InvalidFrames("end of stream sent twice")
        self.ended = True

    @property
    def backlog(self) -> int:
        """Frames received and not yet decoded (flow control stops reading above a limit)."""
        raise NotImplementedError

    @property
    def started(self) -> bool:
        """Whether any of its audio went out."""
        return self.emitted > self.settings.emit_from_sample

    @property
    def drained(self) -> bool:
        """Ended, nothing in flight, and every sample of the stream already sent (or never owed)."""
        return self.ended and not self.in_flight and self.emitted >= self.received * FRAME_SAMPLES

    def _emit(self, start: int, pcm: np.ndarray) -> Emission | None:
        """The part of samples [start, start + len(pcm)) the client still needs, and whether it is the last."""
        limit = self.received * FRAME_SAMPLES if self.ended else start + len(pcm)
        lo, hi = max(self.emitted, start), min(start + len(pcm), limit)
        self.emitted = max(self.emitted, hi)
        final = self.ended and self.emitted >= limit
        if hi <= lo and not final:
            return None
        self.final_sent = final
        return Emission(lo, pcm[max(0, lo - start) : max(0, hi - start)], final)


class StreamingSession(_Session):
    """A stream through the streaming decoder, its state in `slot`."""

    def __init__(self, settings: SessionSettings, slot: int, frame_buckets: tuple[int, ...], delay: int) -> None:
        super().__init__(settings)
        self.slot = slot
        self._buckets = tuple(sorted(frame_buckets))
        self._delay = delay
        self._fed = settings.first_frame
        self._flush_left = flush_frames(delay)

    @property
    def backlog(self) -> int:
        return len(self._frames)  # received, not yet fed

    def next_row(self, max_frames: int = 0) -> StreamStep | None:
        """The frames that arrived since the last row, in the largest bucket that fits them and `max_frames`
        (0: no bound), or None."""
        if self.in_flight or self.final_sent or self.drained:
            return None
        waiting = len(self._frames)
        available = waiting + (self._flush_left if self.ended else 0)
        if available == 0:
            return None
        fits = min(available, max_frames) if max_frames > 0 else available
        n = max(b for b in self._buckets if b <= fits)
        real = min(n, waiting)
        codes = np.zeros((n, CODES_PER_FRAME), dtype=np.int32)
        codes[:real] = self._frames[:real]
        row = StreamStep(self.slot, codes, self._fed, self.received if self.ended else OPEN_END,
                         self.settings.seed, fresh=self._fed == self.settings.first_frame)
        self._frames = self._frames[real:]
        self._frames_start += real
        self._flush_left -= n - real
        self._fed += n
        self.in_flight = True
        return row

    def take(self, row: StreamStep, pcm: np.ndarray) -> Emission | None:
        """The row's samples the client still needs (the decoder returns them `delay` samples late)."""
        self.in_flight = False
        return self._emit(row.frame0 * FRAME_SAMPLES - self._delay, pcm)


class ReferenceSession(_Session):
    """A stream through the reference decoder: frame j from the window [j - 1, j + 3), clamped inside."""

    def __init__(self, settings: SessionSettings) -> None:
        if settings.emit_from_sample % FRAME_SAMPLES:
            raise InvalidFrames("the reference policy sends whole frames: emit_from_sample must be a multiple of 2048")
        super().__init__(settings)
        self._next = settings.emit_from_sample // FRAME_SAMPLES  # the next frame to emit

    @property
    def backlog(self) -> int:
        return self.received - self._next

    def next_row(self, max_frames: int = 0) -> Window | None:
        """The window of the next frame, once its right context (or the end) arrived (a window emits one frame:
        `max_frames` has nothing to bound)."""
        j = self._next
        needed = max(j + 3, REFERENCE_WINDOW)  # frame 0 has no left neighbour: its window is [0, 4)
        if self.in_flight or j >= self.received or (not self.ended and self.received < needed):
            return None
        bound = self.received if self.ended else needed
        start = max(self._frames_start, min(j - 1, bound - REFERENCE_WINDOW))
        stop = min(start + REFERENCE_WINDOW, bound)
        frames = self._frames[start - self._frames_start : stop - self._frames_start]
        self._next += 1
        self.in_flight = True
        self._trim(start)
        return Window(frames, start, self.settings.seed)

    def take(self, row: Window, pcm: np.ndarray) -> Emission | None:
        """The window's frame being emitted (the one after the last emitted)."""
        self.in_flight = False
        j = self._next - 1
        keep = (j - row.frame0) * FRAME_SAMPLES
        return self._emit(j * FRAME_SAMPLES, pcm[keep : keep + FRAME_SAMPLES])

    def _trim(self, start: int) -> None:
        """Drop frames no later window can reach, so long streams use bounded memory."""
        drop = start - self._frames_start
        if drop > 256:
            self._frames = self._frames[drop:]
            self._frames_start = start
