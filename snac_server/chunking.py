"""Streaming policies: which frames to decode next, with which context.

A policy looks at one stream's state (frames received, frames already planned, end of
stream, audio lead over playback) and returns the next Chunk to decode, or None to wait.
Every policy emits every frame, the first included, and flushes the tail at end of stream.

- reference: one 4-frame window per emitted frame (1 left, 2 right): the common streaming
  decoder, kept for comparison. 4x redundant compute.
- exact: 3 frames of context each side (wider than SNAC's ~2.3-frame receptive field), so
  the stream equals a full-sequence decode; fixed chunk size.
- adaptive: exact context; chunk size grows with the audio lead, since a listener with
  audio buffered can wait for a larger, cheaper chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .frames import FRAME_SECONDS

EXACT_CONTEXT = 3
REFERENCE_LEFT, REFERENCE_RIGHT = 1, 2


class Policy(str, Enum):
    REFERENCE = "reference"
    EXACT = "exact"
    ADAPTIVE = "adaptive"


@dataclass(frozen=True)
class StreamState:
    """What a policy may look at. Frame indices are absolute within the stream."""

    planned: int  # next frame to emit
    received: int  # frames received so far
    ended: bool  # end of stream seen: `received` is the total
    lead_s: float  # audio planned minus audio played, in seconds (0 before first audio)


@dataclass(frozen=True)
class Chunk:
    """Decode frames [window_start, window_end) and keep the audio of [emit_start, emit_end)."""

    window_start: int
    window_end: int
    emit_start: int
    emit_end: int

    @property
    def emit_frames(self) -> int:
        return self.emit_end - self.emit_start


def reference_chunk(s: StreamState) -> Chunk | None:
    """One frame from a 4-frame window around it, clamped inside the stream."""
    j = s.planned
    # Frame 0 has no left neighbour, so its window is [0, 4): it waits for frame 3.
    needed = max(j + 1 + REFERENCE_RIGHT, 4)
    if j >= s.received or (not s.ended and s.received < needed):
        return None
    end_bound = s.received if s.ended else needed
    start = max(0, min(j - REFERENCE_LEFT, end_bound - 4))
    return Chunk(start, min(start + 4, end_bound), j, j + 1)


def exact_chunk(s: StreamState, frames: int) -> Chunk | None:
    """`frames` frames with 3 frames of context each side (fewer at the stream's ends)."""
    j = s.planned
    if j >= s.received:
        return None
    if s.ended:
        emit_end = min(j + frames, s.received)
        window_end = min(emit_end + EXACT_CONTEXT, s.received)
    elif j + frames + EXACT_CONTEXT <= s.received:
        emit_end = j + frames
        window_end = emit_end + EXACT_CONTEXT
    else:
        return None
    return Chunk(max(0, j - EXACT_CONTEXT), window_end, j, emit_end)


@dataclass(frozen=True)
class AdaptiveSchedule:
    """Chunk sizes for the adaptive policy.

    The chunk is the largest size in `sizes` whose audio fits in `lead_fraction` of the
    current lead. A smaller ready chunk goes out early only when the lead is below
    `low_lead_s` (the listener is about to run dry); otherwise the stream waits for frames.
    """

    sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    lead_fraction: float = 0.5
    low_lead_s: float = 0.35

    def target(self, lead_s: float, largest: int) -> int:
        fitting = [c for c in self.sizes if c <= largest and c * FRAME_SECONDS <= lead_s * self.lead_fraction]
        return max(fitting, default=min(self.sizes))


def adaptive_chunk(s: StreamState, largest: int, schedule: AdaptiveSchedule) -> Chunk | None:
    """Exact-context chunk sized by the stream's audio lead."""
    target = schedule.target(s.lead_s, largest)
    if s.ended:
        return exact_chunk(s, largest)
    chunk = exact_chunk(s, target)
    if chunk is not None or s.lead_s >= schedule.low_lead_s:
        return chunk
    for size in sorted((c for c in schedule.sizes if c < target), reverse=True):
        chunk = exact_chunk(s, size)
        if chunk is not None:
            return chunk
    return None


def next_chunk(policy: Policy, s: StreamState, chunk_frames: int, schedule: AdaptiveSchedule) -> Chunk | None:
    """The next chunk `policy` would decode for a stream in state `s`, or None to wait."""
    if policy is Policy.REFERENCE:
        return reference_chunk(s)
    if policy is Policy.EXACT:
        return exact_chunk(s, chunk_frames)
    return adaptive_chunk(s, chunk_frames, schedule)
