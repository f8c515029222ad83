"""Streaming policies and sessions: every frame emitted once, in order, with the context promised."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from snac_server.chunking import AdaptiveSchedule, Policy
from snac_server.frames import FRAME_SECONDS, InvalidFrames
from snac_server.session import DecodeRow, DecodeSession, SessionSettings

BUCKETS = (4, 8, 12, 16, 24)


def _session(policy: Policy, chunk: int = 4, **kw) -> DecodeSession:
    return DecodeSession(SessionSettings(seed=1, policy=policy, chunk_frames=chunk, **kw), BUCKETS, 2, AdaptiveSchedule())


def _drive(session: DecodeSession, arrivals: list[int], now_step: float = 0.0) -> list[DecodeRow]:
    """Feed frames in the given batch sizes, delivering every planned row at once; then end."""
    rows: list[DecodeRow] = []
    now = 0.0

    def pump() -> None:
        nonlocal now
        while True:
            planned = session.plan(now)
            if not planned:
                return
            for row in planned:
                session.on_delivered(row)
                rows.append(row)
            now += now_step

    for n in arrivals:
        session.add_frames([[5] * 7] * n)
        pump()
    session.end()
    pump()
    return rows


def _check_rows(rows: list[DecodeRow], total: int, first: int = 0) -> None:
    emitted = first
    for row in rows:
        assert row.first_frame == emitted, "frames emitted out of order or twice"
        assert 0 <= row.keep_start < row.keep_end <= len(row.frames)
        assert row.frame0 + row.keep_start == row.first_frame
        emitted += row.keep_end - row.keep_start
    assert emitted == total, "not every frame was emitted"
    assert [r.final for r in rows] == [False] * (len(rows) - 1) + [True]


@settings(max_examples=150, deadline=None)
@given(
    arrivals=st.lists(st.integers(0, 9), min_size=0, max_size=12),
    policy=st.sampled_from(list(Policy)),
    chunk=st.sampled_from([1, 2, 4, 8, 16]),
    step=st.sampled_from([0.0, 0.05, 0.5]),
)
def test_every_frame_once_in_order_with_enough_context(arrivals, policy, chunk, step):
    total = sum(arrivals)
    rows = _drive(_session(policy, chunk), arrivals, step)
    if total == 0:
        assert rows == []
        return
    _check_rows(rows, total)
    for row in rows:
        window_end = row.frame0 + len(row.frames)
        emit_end = row.first_frame + row.keep_end - row.keep_start
        if policy is Policy.REFERENCE:
            assert len(row.frames) == min(4, total)
            assert row.keep_end - row.keep_start == 1
        else:
            # SNAC's receptive field is ~2.3 frames: 3 frames each side make a chunk exact.
            assert row.keep_start >= min(3, row.first_frame)
            assert window_end - emit_end >= min(3, total - emit_end)
        if row.pad_ok or len(row.frames) in BUCKETS:
            continue
        assert row.frame0 == 0 and window_end == total, "only a whole short stream may skip its bucket"


def test_first_frame_emitted_before_the_stream_ends():
    session = _session(Policy.ADAPTIVE, 16)
    session.add_frames([[1] * 7] * 4)
    rows = session.plan(0.0)
    assert [(r.first_frame, r.keep_end - r.keep_start) for r in rows] == [(0, 1)]


def test_adaptive_chunks_grow_with_the_lead():
    session = _session(Policy.ADAPTIVE, 16)
    rows = _drive(session, [200], now_step=0.0)
    sizes = [r.keep_end - r.keep_start for r in rows]
    assert sizes[0] == 1
    assert max(sizes) == 16
    assert sizes == sorted(sizes[:-1]) + sizes[-1:], "chunk sizes only grow until the final flush"


def _pump(session: DecodeSession, now: float) -> list[DecodeRow]:
    """Plan and deliver at time `now` until the session has nothing ready."""
    rows = []
    while planned := session.plan(now):
        for row in planned:
            session.on_delivered(row)
        rows += planned
    return rows


def test_adaptive_waits_for_a_bigger_chunk_while_audio_is_buffered():
    session = _session(Policy.ADAPTIVE, 16)
    session.add_frames([[1] * 7] * 40)
    _pump(session, 0.0)
    planned = session.planned
    assert planned < 37, "with audio buffered, it waits for a 16-frame chunk"
    assert session.lead_s(0.0) > 2.0
    session.add_frames([[1] * 7])
    assert session.plan(0.0) == []
    # Once the buffer runs low (0.2 s left), small chunks go out again at once.
    rows = session.plan(planned * FRAME_SECONDS - 0.2)
    assert [(r.first_frame, r.keep_end - r.keep_start) for r in rows][:1] == [(planned, 1)]


def test_exact_chunks_have_the_requested_size():
    rows = _drive(_session(Policy.EXACT, 4), [40])
    assert [r.keep_end - r.keep_start for r in rows] == [4] * 10


def test_resume_emits_from_the_requested_frame_with_context():
    session = _session(Policy.EXACT, 4, first_frame=17, emit_from_frame=20)
    rows = _drive(session, [15])
    _check_rows(rows, 32, first=20)
    assert rows[0].frame0 == 17 and rows[0].keep_start == 3


def test_session_rejects_misuse():
    session = _session(Policy.EXACT)
    session.end()
    with pytest.raises(InvalidFrames, match="after end of stream"):
        session.add_frames([[0] * 7])
    with pytest.raises(InvalidFrames, match="sent twice"):
        session.end()
    with pytest.raises(InvalidFrames, match="before first_frame"):
        _session(Policy.EXACT, first_frame=5, emit_from_frame=2)


def test_history_is_trimmed_on_long_streams():
    session = _session(Policy.EXACT, 4)
    for _ in range(200):
        session.add_frames([[3] * 7] * 10)
        _pump(session, 0.0)
    assert session.received == 2000
    assert len(session._history) < 300, "frames no window can reach are dropped"
