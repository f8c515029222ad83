"""Decode sessions: every sample once, in order, as soon as it is final; one row in flight; the
streaming session's rows take what arrived; the reference session's windows are the reference's."""

from __future__ import annotations

import numpy as np
import pytest

from codec_contract.audio import FRAME_SAMPLES, STREAMING_DELAY_SAMPLES, pack_frames
from conftest import random_frames
from snac_server.frames import InvalidFrames
from snac_server.session import MAX_FRAME_INDEX, ReferenceSession, SessionSettings, StreamingSession
from snac_server.streaming import OPEN_END

BUCKETS = (1, 2, 4, 8, 16)


def streaming(**kw) -> StreamingSession:
    return StreamingSession(SessionSettings(seed=3, policy="streaming", **kw), slot=5, frame_buckets=BUCKETS,
                            delay=STREAMING_DELAY_SAMPLES)


def reference(**kw) -> ReferenceSession:
    return ReferenceSession(SessionSettings(seed=3, policy="reference", **kw))


def run(session, arrivals: list[int]) -> list:
    """Feed frames in the given batch sizes, decoding (a stand-in PCM of sample indices) whenever a row
    is ready; then end and drain. Returns the emissions."""
    emissions, sent = [], 0

    def drain():
        while (row := session.next_row()) is not None:
            n = len(row.codes) if hasattr(row, "codes") else len(row.frames)
            start = row.frame0 * FRAME_SAMPLES - (STREAMING_DELAY_SAMPLES if hasattr(row, "codes") else 0)
            if (e := session.take(row, np.arange(start, start + n * FRAME_SAMPLES, dtype=np.float32))) is not None:
                emissions.append(e)

    for n in arrivals:
        session.add_frames(pack_frames(random_frames(n, seed=sent)))
        sent += n
        drain()
    session.end()
    drain()
    return emissions


def contiguous(emissions, first: int, total_frames: int) -> None:
    """Samples [first, total) exactly once, in order; the last emission final and only it."""
    at = first
    for e in emissions:
        assert e.first_sample == at
        assert np.array_equal(e.pcm, np.arange(at, at + len(e.pcm)))  # the right samples, by position
        at += len(e.pcm)
    assert at == total_frames * FRAME_SAMPLES
    assert emissions[-1].final and not any(e.final for e in emissions[:-1])


@pytest.mark.parametrize("arrivals", [[1] * 9, [3, 1, 5], [20], [1], [2], [4, 4, 4, 4, 1]])
@pytest.mark.parametrize("make", [streaming, reference], ids=["streaming", "reference"])
def test_every_sample_once_in_order(make, arrivals):
    contiguous(run(make(), arrivals), 0, sum(arrivals))


def test_streaming_sends_samples_as_soon_as_their_right_context_arrived():
    session = streaming()
    emitted = []
    for k in range(1, 7):
        session.add_frames(pack_frames(random_frames(1, seed=k)))
        row = session.next_row()
        start = row.frame0 * FRAME_SAMPLES - STREAMING_DELAY_SAMPLES
        e = session.take(row, np.arange(start, start + FRAME_SAMPLES, dtype=np.float32))
        emitted.append(0 if e is None else e.first_sample + len(e.pcm))
    # After k frames, samples up to k * 2048 - 4757 are out: the first 1,387 after the third frame.
    assert emitted == [max(0, k * FRAME_SAMPLES - STREAMING_DELAY_SAMPLES) for k in range(1, 7)]


def test_streaming_rows_take_every_waiting_frame_in_the_largest_bucket():
    session = streaming()
    session.add_frames(pack_frames(random_frames(11, seed=0)))
    first = session.next_row()
    assert (len(first.codes), first.frame0, first.end, first.fresh, first.slot) == (8, 0, OPEN_END, True, 5)
    assert session.next_row() is None, "one row in flight per stream"
    session.take(first, np.zeros(8 * FRAME_SAMPLES, np.float32))
    second = session.next_row()
    assert (len(second.codes), second.frame0, second.fresh) == (2, 8, False)


def test_a_row_takes_the_largest_bucket_within_the_bound_it_is_given():
    """The service bounds a row by what its listener still has to play: 11 frames waiting and a bound of 3 make a
    2-frame row, a bound of 0 none (the 8-frame bucket), and a bound of 1 one frame."""
    session = streaming()
    session.add_frames(pack_frames(random_frames(11, seed=0)))
    for bound, frames in ((3, 2), (0, 8), (1, 1)):
        row = session.next_row(bound)
        assert len(row.codes) == frames, bound
        session.take(row, np.zeros(frames * FRAME_SAMPLES, np.float32))
    assert session.backlog == 0


def test_after_the_end_flush_frames_carry_the_length():
    session = streaming()
    session.add_frames(pack_frames(random_frames(2, seed=0)))
    session.end()
    row = session.next_row()
    assert len(row.codes) == 4 and row.end == 2, "2 frames and 2 of the 3 flush frames, which are past the end"
    assert not row.codes[2:].any()


def test_resume_emits_from_the_requested_sample():
    contiguous(run(streaming(first_frame=7, emit_from_sample=10 * FRAME_SAMPLES + 5), [3, 8, 2]),
               10 * FRAME_SAMPLES + 5, 20)
    contiguous(run(reference(first_frame=7, emit_from_sample=10 * FRAME_SAMPLES), [3, 8, 2]), 10 * FRAME_SAMPLES, 20)


def test_reference_windows_are_one_before_and_two_after_clamped_inside():
    session = reference()
    session.add_frames(pack_frames(random_frames(6, seed=0)))
    starts = []
    while (row := session.next_row()) is not None:
        starts.append((row.frame0, len(row.frames)))
        session.take(row, np.zeros(len(row.frames) * FRAME_SAMPLES, np.float32))
    session.end()
    while (row := session.next_row()) is not None:
        starts.append((row.frame0, len(row.frames)))
        session.take(row, np.zeros(len(row.frames) * FRAME_SAMPLES, np.float32))
    assert starts == [(0, 4), (0, 4), (1, 4), (2, 4), (2, 4), (2, 4)]


def test_an_ended_stream_with_nothing_owed_is_drained_without_decoding():
    session = streaming()
    session.end()
    assert session.next_row() is None and session.drained


@pytest.mark.parametrize("make, settings, message", [
    (streaming, dict(first_frame=9, emit_from_sample=2), "before first_frame"),
    (streaming, dict(first_frame=MAX_FRAME_INDEX + 1, emit_from_sample=(MAX_FRAME_INDEX + 1) * FRAME_SAMPLES), "limited to frame"),
    (reference, dict(emit_from_sample=100), "whole frames"),
])
def test_bad_resume_points_are_refused(make, settings, message):
    with pytest.raises(InvalidFrames, match=message):
        make(**settings)


def test_misuse_is_refused():
    session = streaming()
    session.end()
    with pytest.raises(InvalidFrames, match="after end"):
        session.add_frames(pack_frames([[0] * 7]))
    with pytest.raises(InvalidFrames, match="sent twice"):
        session.end()


def test_reference_history_is_trimmed_on_long_streams():
    session = reference()
    run(session, [50] * 20)
    assert len(session._frames) < 300
