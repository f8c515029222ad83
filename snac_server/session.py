"""One stream's decode session: the frames it has, the chunks it has planned, its audio lead.

Pure bookkeeping, no I/O and no model: the gRPC service feeds it frames and deliveries,
and it answers with DecodeRows for the batcher. Frame indices are absolute in the stream.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from .chunking import AdaptiveSchedule, Chunk, Policy, StreamState, next_chunk
from .frames import CODES_PER_FRAME, FRAME_SECONDS, InvalidFrames, validate_frames

# Largest resume index a header may name (2**48 frames: ~760,000 years of audio). The wire type
# is uint64, but a row's absolute frame index reaches the model as int64: past 2**63 the whole
# decode batch, other streams' rows included, would fail.
MAX_FRAME_INDEX = 2**48


@dataclass(frozen=True)
class SessionSettings:
    """What a client chose in its session header, after defaults and validation."""

    seed: int
    policy: Policy
    chunk_frames: int
    first_frame: int = 0
    emit_from_frame: int = 0


@dataclass
class DecodeRow:
    """One row of a decode batch: real frames, where they sit in the stream, what to keep.

    `pad_ok` is False when the window ends at the stream's true end: padding there would
    change the last frames, so such a row is decoded at its exact length.
    """

    frames: np.ndarray  # (n, 7) int32
    frame0: int
    seed: int
    keep_start: int  # relative frame range of the window whose audio is returned
    keep_end: int
    pad_ok: bool
    first_frame: int  # absolute index of the first emitted frame
    final: bool  # last chunk of the stream


class DecodeSession:
    """Frames in, DecodeRows out, for one stream; at most `max_inflight` rows outstanding."""

    def __init__(
        self,
        settings: SessionSettings,
        window_buckets: tuple[int, ...],
        max_inflight: int,
        schedule: AdaptiveSchedule,
    ) -> None:
        for name in ("first_frame", "emit_from_frame"):
            if getattr(settings, name) > MAX_FRAME_INDEX:
                raise InvalidFrames(f"{name} {getattr(settings, name)} exceeds {MAX_FRAME_INDEX}")
        if settings.emit_from_frame < settings.first_frame:
            raise InvalidFrames(
                f"emit_from_frame {settings.emit_from_frame} is before first_frame {settings.first_frame}"
            )
        self.settings = settings
        self._buckets = tuple(sorted(window_buckets))
        self._max_inflight = max_inflight
        self._schedule = schedule
        self._history = np.zeros((0, CODES_PER_FRAME), dtype=np.int32)
        self._history_start = settings.first_frame
        self.received = settings.first_frame
        self.planned = settings.emit_from_frame
        self.delivered = settings.emit_from_frame
        self.ended = False
        self.inflight = 0
        self._play_start: float | None = None  # when audio would start playing

    # -- input -------------------------------------------------------------------------
    def add_frames(self, frames: list[list[int]]) -> None:
        """Append validated frames; raises InvalidFrames for bad codes or frames after the end."""
        if self.ended:
            raise InvalidFrames("frames after end of stream")
        codes = validate_frames(frames)
        self._history = np.concatenate([self._history, codes])
        self.received += len(codes)

    def end(self) -> None:
        """Mark end of stream: the tail gets flushed."""
        if self.ended:
            raise InvalidFrames("end of stream sent twice")
        self.ended = True

    # -- planning ----------------------------------------------------------------------
    def lead_s(self, now: float) -> float:
        """Audio planned ahead of a listener who started playing at the first chunk."""
        if self._play_start is None:
            return 0.0
        lead = (self.planned - self.settings.emit_from_frame) * FRAME_SECONDS - (now - self._play_start)
        if lead < 0:  # the listener ran dry and waited: playback resumes from here
            self._play_start -= lead
            lead = 0.0
        return lead

    def plan(self, now: float) -> list[DecodeRow]:
        """Rows ready to decode now, in stream order, up to the in-flight limit."""
        rows: list[DecodeRow] = []
        while self.inflight < self._max_inflight:
            state = StreamState(self.planned, self.received, self.ended, self.lead_s(now))
            chunk = next_chunk(self.settings.policy, state, self.settings.chunk_frames, self._schedule)
            if chunk is None:
                break
            if self._play_start is None:
                self._play_start = now
            rows.append(self._row(chunk))
            self.planned = chunk.emit_end
            self.inflight += 1
        self._trim_history()
        return rows

    def on_delivered(self, row: DecodeRow) -> None:
        """A row's audio went out to the client."""
        self.inflight -= 1
        self.delivered = row.first_frame + row.keep_end - row.keep_start

    @property
    def finished(self) -> bool:
        """Every frame delivered after end of stream."""
        return self.ended and self.delivered >= self.received and self.inflight == 0

    def _row(self, chunk: Chunk) -> DecodeRow:
        start, end = self._fit_window(chunk)
        at_true_end = self.ended and end == self.received
        frames = self._history[start - self._history_start : end - self._history_start]
        final = self.ended and chunk.emit_end == self.received
        return DecodeRow(
            frames=frames,
            frame0=start,
            seed=self.settings.seed,
            keep_start=chunk.emit_start - start,
            keep_end=chunk.emit_end - start,
            pad_ok=not at_true_end,
            first_frame=chunk.emit_start,
            final=final,
        )

    def _fit_window(self, chunk: Chunk) -> tuple[int, int]:
        """Grow the window to a bucket length with more real frames, left first.

        More real context never changes the kept audio, while padding may; growing the
        window lets rows share a fixed bucket shape (and its CUDA Graph).
        """
        start = max(chunk.window_start, self._history_start)
        end = chunk.window_end
        i = bisect.bisect_left(self._buckets, end - start)
        if i == len(self._buckets):
            return start, end
        width = self._buckets[i]
        start = max(self._history_start, end - width)
        end = min(self.received, start + width)
        return start, end

    def _trim_history(self) -> None:
        """Drop frames no future window can reach, so long streams use bounded memory.

        Never past `received`: a resume whose emit_from_frame lies far beyond the frames sent
        so far would otherwise drop frames not yet in the history and misalign later ones.
        """
        keep_from = min(self.planned, self.received) - max(self._buckets, default=0) - 1
        drop = keep_from - self._history_start
        if drop > 256:
            self._history = self._history[drop:]
            self._history_start = keep_from
