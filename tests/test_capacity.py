"""The admission limit's decisions (llm_server/capacity.py) on scripted paces: a GPU-shaped step time
(a fixed part plus a part per stream), windows of offered load, the codec's trouble. No clocks: every
time is given, but in the last test, the worker's own loop (Runtime.watch_capacity) over 50 ms windows."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

import pytest

from llm_server.admission import CAPACITY, KEY, REFUSAL_GAP_S, REFUSING_S, START_RAMP_S, AdmissionController
from llm_server.capacity import (
    CODEC_FAILOVER,
    CODEC_ROOM,
    GROWTH,
    HOLD_WINDOWS,
    LISTENER_BEHIND,
    LISTENER_LAG_S,
    LISTENER_QUIET_S,
    REALTIME_TOKENS_PER_S,
    RESERVE,
    SLOW,
    TARGET_MARGIN,
    WINDOW_TOKENS,
    CapacityLimit,
    Listeners,
    ListenerWindow,
    PaceMeter,
    Window,
    measured_curve,
    settled_limit,
)
from llm_server.config import GPU_TARGET_PACE

TARGET = GPU_TARGET_PACE  # 1.03


def step_ms_curve(fixed_ms: float, per_stream_ms: float):
    return lambda batch: fixed_ms + per_stream_ms * batch


def window_at(batch: float, step_ms, seconds: float = 1.0) -> Window:
    """`batch` streams decoding for `seconds`, each getting a token a step of step_ms(batch)."""
    return Window.stepping(batch, step_ms(batch), seconds)


def at_target(step_ms, target: float = TARGET) -> float:
    """The batch whose pace is `target`: step_ms(batch) = 1000 / (82.03 x target)."""
    budget = 1000.0 / (REALTIME_TOKENS_PER_S * target)
    return (budget - step_ms(0)) / (step_ms(1) - step_ms(0))


def run(limit: CapacityLimit, step_ms, windows: int, offered: float = math.inf) -> list[float]:
    """Each window: min(offered, limit) streams decode at the curve's pace; demand above the limit is refused."""
    seen = []
    for _ in range(windows):
        batch = min(offered, limit.streams)
        limit.update(window_at(batch, step_ms), peak_admitted=math.ceil(batch), admitted=math.ceil(batch))
        seen.append(limit.limit)
    return seen


H100_LIKE = step_ms_curve(2.0, 0.051)  # 12.2 ms at 200 streams: real time for 200
SLOWER = step_ms_curve(4.0, 0.12)  # a smaller GPU: real time for 68


class Lagging:
    """A stream as its listener at the target pace hears it: lag_s audio seconds waited (SpeechSession's double)."""

    def __init__(self, lag_s: float = 0.0) -> None:
        self.lag_s = lag_s

    def listener_lag_s(self, now: float) -> float:
        return self.lag_s


def test_listeners_count_a_stream_behind_once_and_one_that_ends_in_the_window_too():
    listeners = Listeners()
    a, b, c = Lagging(), Lagging(), Lagging()
    for stream in (a, b, c):
        listeners.add(stream)
    assert listeners.take(0.0).settled
    a.lag_s, b.lag_s = LISTENER_LAG_S + 0.01, 0.05
    heard = listeners.take(1.0)
    assert (heard.behind, heard.behind_since_cut, heard.waiting_lag_s) == (1, 1, pytest.approx(LISTENER_LAG_S + 0.01))
    assert not heard.settled
    a.lag_s += 0.5  # behind already: counted once, though it waits on
    heard = listeners.take(2.0)
    assert (heard.behind, heard.waiting_lag_s) == (0, pytest.approx(LISTENER_LAG_S + 0.51)) and not heard.settled
    assert listeners.take(3.0).settled, "nobody waited in the window: a's old lag is no reason to hold growth"
    b.lag_s = LISTENER_LAG_S / 2 + 0.01
    assert not listeners.take(4.0).settled, "b is waiting, past half the lag allowed"
    listeners.cut()
    d = Lagging()
    listeners.add(d)
    b.lag_s, d.lag_s = LISTENER_LAG_S + 0.1, LISTENER_LAG_S + 0.1
    listeners.remove(b, 5.0)  # it fell behind as it ended: still this window's
    heard = listeners.take(5.0)
    assert (heard.behind, heard.behind_since_cut) == (2, 1), "b was admitted before the cut, d after"
    e = Lagging()
    listeners.add(e)
    assert listeners.take(6.0).settled
    e.lag_s = LISTENER_LAG_S + 0.1
    listeners.remove(e, 7.0, judged=False)  # its client left (a barge-in, a failed level's end)
    assert listeners.take(7.0).settled and len(listeners) == 3, "gone, and its lag not judged: a, c and d left"
    assert len(listeners) == 3 and listeners.take(6.0).settled


FAST = step_ms_curve(1.0, 0.0)  # pace ~12: far ahead of the target, as a CPU's engine beside its codec
BEHIND = ListenerWindow(behind=1, behind_since_cut=1, waiting_lag_s=LISTENER_LAG_S + 0.01)


@pytest.mark.parametrize("curve", [H100_LIKE, SLOWER], ids=["h100-like", "slower"])
def test_the_limit_rises_to_the_batch_that_keeps_the_target_pace_and_never_past_it(curve):
    limit = CapacityLimit(initial=16, floor=1, ceiling=4096, target_pace=TARGET)
    seen = run(limit, curve, windows=60)
    goal = at_target(curve)
    assert max(seen) <= goal + 1e-9, "no overshoot on the way up"
    assert seen[-1] >= goal - 1, f"settled at {seen[-1]:.1f}, the target pace's batch is {goal:.1f}"
    assert all(b >= a for a, b in zip(seen, seen[1:])), "rising only, under demand"
    # settled streams run 3% ahead of real time: over 90% of the streams these curves keep in real time
    realtime = at_target(curve, 1.0)
    assert int(seen[-1]) >= 0.9 * realtime - 1


def test_growth_at_most_doubles_a_window():
    limit = CapacityLimit(initial=16, floor=1, ceiling=4096, target_pace=TARGET)
    limit.update(window_at(16, step_ms_curve(1.0, 0.0)), peak_admitted=16, admitted=16)  # pace ~12: far ahead
    assert limit.limit == pytest.approx(32)


@pytest.mark.parametrize("curve", [H100_LIKE, SLOWER], ids=["h100-like", "slower"])
def test_a_cold_start_reaches_the_capacity_in_a_few_windows(curve):
    """Issue 43: from the initial 4 the limit grew by sqrt(limit) a window, 30-odd windows to 200 streams; as
    fast as the measured pace allows (at most doubling), it is there in under a dozen, still never past it."""
    limit = CapacityLimit(initial=4, floor=1, ceiling=4096, target_pace=TARGET)
    seen = run(limit, curve, windows=12)
    goal = at_target(curve)
    assert max(seen) <= goal + 1e-9 and seen[-1] >= goal - 1, (seen, goal)


def test_a_slower_engine_brings_the_limit_down_to_its_batch_without_undershoot_and_at_most_halving():
    limit = CapacityLimit(initial=200, floor=1, ceiling=4096, target_pace=TARGET)
    before = run(limit, H100_LIKE, windows=40)[-1]
    assert before > 150
    seen = run(limit, SLOWER, windows=40)  # the GPU got slower (another tenant, thermal limits)
    goal = at_target(SLOWER)
    assert min(seen) >= goal - 1e-9, "no undershoot on the way down"
    assert seen[-1] <= at_target(SLOWER, TARGET / TARGET_MARGIN), "down to the streams it keeps in real time at most"
    halving = [before, *seen]
    assert all(b >= a / 2 - 1e-9 for a, b in zip(halving, halving[1:]))


def test_a_pace_between_real_time_and_the_target_neither_cuts_nor_grows_a_limit_in_use():
    """Issue 43, run 41: judged at the target (5 % over real time), spans at 0.100-0.105 on a CPU cut a warm worker's
    limit four times while no listener was behind. Real time is the line for the engine's pace to cut; the target, for
    growth (the listeners keep the margin)."""
    limit = CapacityLimit(initial=40, floor=1, ceiling=64, target_pace=TARGET)
    assert limit.realtime_pace == pytest.approx(1.0)
    for pace in (1.029, 1.002, 1.02, 1.001):
        limit.update(Window(1.0, 40.0, round(40 * pace * REALTIME_TOKENS_PER_S), 40), peak_admitted=40, admitted=40)
        assert (limit.limit, limit.reason) == (40, None), pace
    limit.update(Window(1.0, 40.0, round(40 * 0.99 * REALTIME_TOKENS_PER_S), 40), peak_admitted=40, admitted=40)
    assert limit.reason == SLOW and limit.limit == pytest.approx(40 * 0.99 / TARGET, rel=1e-2)


def test_without_demand_at_the_limit_it_does_not_grow():
    limit = CapacityLimit(initial=16, floor=1, ceiling=4096, target_pace=TARGET)
    run(limit, H100_LIKE, windows=20, offered=4)  # 4 streams, far ahead of real time
    assert limit.streams == 16


def test_a_window_with_too_little_decoding_changes_nothing():
    limit = CapacityLimit(initial=16, floor=1, ceiling=64, target_pace=TARGET)
    assert not limit.enough(1.0, 90)
    limit.update(Window(1.0, 1.0, 90, 1), peak_admitted=16, admitted=16)  # too little to judge
    assert limit.limit == 16 and limit.pace is None


def test_a_window_far_ahead_of_the_target_ends_once_it_has_its_tokens():
    """Issue 43, a cold start: WINDOW_TOKENS tokens say enough about the pace however few stream-seconds they took
    (a CPU's slow-motion target made a window of 4 fast streams last 5 s, past a waiting request's deadline); a
    window behind the target ends after the stream-seconds those tokens take at it."""
    cpu = CapacityLimit(initial=4, floor=1, ceiling=64, target_pace=0.105)
    assert cpu.enough(stream_s=2.0, tokens=WINDOW_TOKENS) and not cpu.enough(stream_s=2.0, tokens=WINDOW_TOKENS - 1)
    assert cpu.enough(stream_s=WINDOW_TOKENS / (0.105 * REALTIME_TOKENS_PER_S), tokens=10)
    cpu.update(Window.stepping(4, 1000 / REALTIME_TOKENS_PER_S, seconds=1.0), peak_admitted=4, admitted=4)  # 1 x real time
    assert cpu.limit == 8 and cpu.reason == GROWTH, "one second of four streams at 10 x the target: doubled"


def test_a_slow_window_with_idle_streams_admitted_shrinks_to_what_decoded():
    """Sessions waiting for text do not decode: the limit follows the streams that did."""
    limit = CapacityLimit(initial=16, floor=1, ceiling=64, target_pace=TARGET)
    window = Window(1.0, 12.0, round(12 * REALTIME_TOKENS_PER_S * 0.99), 12)  # 12 of 16 decoding, under real time
    limit.update(window, peak_admitted=16, admitted=16)
    assert limit.limit == pytest.approx(12 * 0.99 / TARGET, rel=1e-3)


def test_codec_failovers_shrink_the_limit_once_a_window_and_hold_it_a_while():
    limit = CapacityLimit(initial=100, floor=1, ceiling=4096, target_pace=TARGET)
    limit.codec_failover()
    limit.codec_failover()
    limit.update(window_at(100, step_ms_curve(1.0, 0.0)), peak_admitted=50, admitted=50)  # fast, not binding
    assert limit.limit == pytest.approx(90.0)
    for _ in range(HOLD_WINDOWS):  # then at the limit and far ahead of real time: no growth yet
        limit.update(window_at(90, step_ms_curve(1.0, 0.0)), peak_admitted=90, admitted=90)
    assert limit.limit == pytest.approx(90.0), "counted once, and held"
    limit.update(window_at(90, step_ms_curve(1.0, 0.0)), peak_admitted=90, admitted=90)
    assert limit.limit > 90


def _at_pace(streams: int, pace: float) -> Window:
    """`streams` decoding for a second at `pace` x real time."""
    return Window.stepping(streams, 1000.0 / (REALTIME_TOKENS_PER_S * pace), seconds=1.0)


def test_a_window_slow_by_itself_cuts_nothing_while_the_span_before_it_kept_the_target():
    """Issue 43, run 39: a CPU engine yielding the cores to the codec replicas got them in bursts, and windows of
    1 s read 0.10 where it kept 0.12 over the level; every such dip cut the limit. Judged with the windows before it
    (PACE_SPAN_S of audio time: 9.5 s here), a dip cuts nothing; a pace that stays below the target cuts within that
    span, to the milder of the window's and the span's."""
    limit = CapacityLimit(initial=36, floor=1, ceiling=64, target_pace=0.105)
    for pace in (0.15, 0.12, 0.2, 0.13, 0.12, 0.15, 0.12, 0.14):
        limit.update(_at_pace(36, pace), peak_admitted=30, admitted=30)
    for _ in range(2):
        limit.update(_at_pace(36, 0.09), peak_admitted=30, admitted=30)
    assert limit.reason is None and limit.limit == 36, "two seconds' dip, in a span that kept 0.13"
    cuts = []
    for _ in range(8):
        limit.update(_at_pace(36, 0.09), peak_admitted=30, admitted=30)
        cuts.append(limit.limit)
    assert cuts[0] == 36 and cuts[-1] < 36 and limit.reason == SLOW, cuts
    assert 36 * 0.09 / 0.105 < cuts[-1], "by the span's pace, milder than the window's"


def test_a_pace_below_real_time_cuts_only_once_a_listener_shows_it():
    """Issue 43, run 53: over 9.5 s spans the CPU engine read 0.09-0.10 while no listener had waited past 0.125 s and
    the codec tier had twice the room it needed; six cuts held the warm search at 42 against 51 pinned. A replica runs
    its streams ahead of their listeners: the pace cuts once a listener waits past half its allowance (or falls
    behind), and alone where the listeners are not judged."""
    quiet, waiting = ListenerWindow(waiting_lag_s=LISTENER_LAG_S / 2), ListenerWindow(waiting_lag_s=LISTENER_LAG_S * 0.6)
    limit = CapacityLimit(initial=40, floor=1, ceiling=64, target_pace=0.105)
    for _ in range(12):
        limit.update(_at_pace(40, 0.09), peak_admitted=40, admitted=40, heard=quiet)
        assert (limit.limit, limit.reason) == (40, None), "below real time, every listener within half its allowance"
    limit.update(_at_pace(40, 0.09), peak_admitted=40, admitted=40, heard=waiting)
    assert limit.reason == SLOW and limit.limit == pytest.approx(40 * 0.09 / 0.105, rel=1e-2)
    unjudged = CapacityLimit(initial=40, floor=1, ceiling=64, target_pace=0.105)
    unjudged.update(_at_pace(40, 0.09), peak_admitted=40, admitted=40, heard=ListenerWindow(allowed_s=0.0))
    assert unjudged.reason == SLOW, "listener_lag_s 0: the pace alone judges"


def test_a_pace_below_real_time_cuts_once_for_the_streams_it_was_cut_for():
    """Issue 43, run 60: a warm level's 43 streams cut the limit by their pace five times in 6 s (43 -> 37), each cut
    lowering where the way back ends, and every level of 41-44 after them was refused at its start. While the streams
    past a cut still run, their pace is that of the load already cut for; once they end, a pace below real time cuts
    again."""
    waiting = ListenerWindow(waiting_lag_s=LISTENER_LAG_S * 0.6)
    limit = CapacityLimit(initial=43, floor=1, ceiling=64, target_pace=0.103)
    limit.update(_at_pace(43, 0.09), peak_admitted=43, admitted=43, heard=waiting)
    first = limit.limit
    assert limit.reason == SLOW and first == pytest.approx(43 * 0.09 / 0.103, rel=1e-2)
    for pace in (0.085, 0.08, 0.09):  # the same 43 streams, slower still
        limit.update(_at_pace(43, pace), peak_admitted=43, admitted=43, heard=waiting)
        assert (limit.limit, limit.reason) == (first, None)
    limit.update(_at_pace(37, 0.08), peak_admitted=43, admitted=limit.streams, heard=waiting)
    assert limit.reason == SLOW and limit.limit < first, "the streams admitted under the cut are slow too"


def test_every_move_of_the_limit_says_why_and_the_deeper_cut_names_it():
    fast, slow = step_ms_curve(1.0, 0.0), step_ms_curve(100.0, 10.0)
    limit = CapacityLimit(initial=16, floor=1, ceiling=4096, target_pace=TARGET)
    limit.update(window_at(16, slow), peak_admitted=16, admitted=16)
    assert limit.reason == SLOW and limit.streams < 16
    limit.update(window_at(limit.streams, fast), peak_admitted=limit.streams, admitted=limit.streams)
    assert limit.reason == GROWTH, "back toward the limit the cut started from"
    grown = limit.streams
    limit.update(window_at(grown, fast), peak_admitted=1, admitted=1)  # not in use: no move, no reason
    assert limit.reason is None and limit.streams == grown
    limit.update(window_at(grown, fast), grown, grown, BEHIND)  # growth had room; a listener behind wins
    assert limit.reason == LISTENER_BEHIND and limit.streams < grown
    limit.codec_failover()
    limit.update(window_at(limit.streams, fast), peak_admitted=1, admitted=1)
    assert limit.reason == CODEC_FAILOVER
    limit.codec_failover()  # with a stream behind whose window held few streams: its cut (to half) is deeper
    limit.update(window_at(limit.streams, fast), 1, 1, BEHIND)
    assert limit.reason == LISTENER_BEHIND
    floor = CapacityLimit(initial=4, floor=4, ceiling=8, target_pace=TARGET)
    floor.update(window_at(4, slow), peak_admitted=4, admitted=4)  # at the floor already: nothing moved
    assert floor.reason is None and floor.streams == 4


def test_floor_and_ceiling_hold():
    limit = CapacityLimit(initial=8, floor=4, ceiling=10, target_pace=TARGET)
    run(limit, step_ms_curve(100.0, 10.0), windows=10)  # hopelessly slow
    assert limit.streams == 4
    run(limit, step_ms_curve(0.1, 0.0), windows=20)  # one stream every two windows past the cut
    assert limit.streams == 10
    fixed = CapacityLimit(initial=16, floor=8, ceiling=8, target_pace=TARGET)
    assert fixed.streams == 8 and run(fixed, step_ms_curve(100.0, 10.0), windows=3)[-1] == 8
    with pytest.raises(ValueError, match="floor"):
        CapacityLimit(initial=1, floor=9, ceiling=8, target_pace=TARGET)


def test_the_meter_counts_decoding_from_the_first_token_to_the_end():
    meter = PaceMeter(now=0.0)
    meter.started(0.5)  # the first delivery: prefill's tokens, not counted
    meter.tokens(41)
    meter.started(1.0)
    meter.tokens(82)
    meter.stopped(1.5)
    window = meter.take(2.0)
    assert window.elapsed_s == 2.0 and window.stream_s == pytest.approx(1.5 + 0.5) and window.peak_decoding == 2
    assert window.pace == pytest.approx(123 / 2.0 / REALTIME_TOKENS_PER_S)
    assert window.mean_decoding == pytest.approx(1.0)
    nxt = meter.take(3.0)  # one stream still decoding: the next window starts with it
    assert nxt.stream_s == pytest.approx(1.0) and nxt.peak_decoding == 1 and nxt.tokens == 0


def test_admission_refuses_at_the_limit_and_a_limit_in_use_grows():
    admission = AdmissionController(CapacityLimit(initial=2, floor=1, ceiling=64, target_pace=TARGET), PaceMeter(0.0))
    assert admission.admit() is None and admission.admit("k", key_limit=1) is None
    assert admission.admit("k", key_limit=1) == KEY, "the key's own cap first"
    assert admission.admit() == CAPACITY and admission.free == 0
    for t in (0.0, 0.0):
        admission.meter.started(t)
    admission.meter.tokens(80)
    assert admission.end_window(0.5) is None, "80 tokens in 1 stream-second: too little, the window goes on"
    admission.meter.tokens(round(2 * 1.0 * REALTIME_TOKENS_PER_S * 3) - 80)  # two streams, 1 s, 3 x real time
    admission.end_window(1.0)  # 2 stream-seconds, pace 3.0 (enough: 492 tokens): room, the limit in use
    assert admission.max_streams == 4 and admission.free == 2, "5.8 would keep the target pace: doubled, no more"
    admission.release("k")
    assert admission.active == 1 and admission.active_per_key == {}


def test_an_idle_worker_shows_no_pace():
    """The last busy window's pace must not stay on the gauge (and hold an alert up) once nothing decodes."""
    admission = AdmissionController(CapacityLimit(initial=4, floor=1, ceiling=64, target_pace=TARGET), PaceMeter(0.0))
    admission.meter.started(0.0)
    admission.meter.tokens(round(2.1 * REALTIME_TOKENS_PER_S * 0.9))
    admission.meter.stopped(2.1)  # enough: 2.01 stream-seconds at the target
    assert admission.end_window(2.1) is not None and admission.limit.pace == pytest.approx(0.9, abs=0.01)
    assert admission.end_window(3.0) is None and admission.limit.pace is None


def test_no_growth_while_the_streams_admitted_are_still_over_a_lowered_limit():
    """After a decrease the streams past the new limit are yet to end: a fast window then (noise, or a
    moment's relief) must not raise the limit again before they have."""
    limit = CapacityLimit(initial=8, floor=1, ceiling=64, target_pace=TARGET)
    limit.update(window_at(8, step_ms_curve(20.0, 0.0)), peak_admitted=8, admitted=8)  # slow: down
    lowered = limit.limit
    assert lowered < 8
    limit.update(window_at(8, step_ms_curve(1.0, 0.0)), peak_admitted=8, admitted=8)  # fast, 8 still admitted
    assert limit.limit == lowered
    limit.update(window_at(limit.streams, step_ms_curve(1.0, 0.0)), peak_admitted=8, admitted=limit.streams)
    assert limit.limit > lowered, "once the admitted streams are within it, it grows"


def test_the_doctors_prediction_is_where_the_limit_settles_on_the_step_times_it_measured():
    """megapod doctor times decode steps at a few batches and runs the controller on them (settled_limit)."""
    measured = {b: H100_LIKE(b) for b in (1, 16, 64, 128, 256, 384, 512)}
    settled = settled_limit(measured_curve(measured), CapacityLimit(initial=4, floor=1, ceiling=512, target_pace=TARGET))
    assert int(at_target(H100_LIKE)) - 1 <= settled <= at_target(H100_LIKE)
    # the largest batch measured is the ceiling: an engine fast at every batch settles there
    fast = settled_limit(measured_curve({1: 2.0, 64: 3.0}), CapacityLimit(initial=4, floor=1, ceiling=64, target_pace=TARGET))
    assert fast == 64
    # a slower GPU, the same controller: its own batch
    slower = settled_limit(measured_curve({b: SLOWER(b) for b in (1, 16, 64, 128)}),
                           CapacityLimit(initial=4, floor=1, ceiling=128, target_pace=TARGET))
    assert int(at_target(SLOWER)) - 1 <= slower <= at_target(SLOWER)


def test_a_curve_needs_a_measured_point_and_skips_the_unmeasured():
    with pytest.raises(ValueError, match="no step time"):
        measured_curve({1: float("nan")})
    assert measured_curve({1: 2.0, 16: float("nan"), 64: 8.0})(32.5) == pytest.approx(5.0)


# -- the admission queue (issue 43: a refused client gets a turn) ----------------------------------------------------

def _admission(initial: int) -> AdmissionController:
    return AdmissionController(CapacityLimit(initial=initial, floor=1, ceiling=64, target_pace=TARGET), PaceMeter(0.0))


async def test_a_slot_that_frees_goes_to_the_longest_waiting_not_to_whoever_asks_next():
    """Without the queue a closed-loop client ending its stream asked again at once and kept the slot forever."""
    admission = _admission(2)
    assert admission.admit() is None and admission.admit() is None
    first = asyncio.create_task(admission.enter(wait_s=30))
    second = asyncio.create_task(admission.enter(wait_s=30))
    await asyncio.sleep(0)
    assert admission.queued == 2 and admission.free == 0
    admission.release()  # the holder's stream ends...
    assert admission.admit() == CAPACITY, "...and its next request does not jump the queue"
    assert await first is None and not second.done() and admission.active == 2
    admission.release()
    assert await second is None and admission.queued == 0 and admission.active == 2


async def test_a_slot_goes_first_to_the_request_refused_most_often_then_in_order_of_arrival():
    """Issue 43's 2x level (run 37): in arrival order alone each refusal started a client's wait over, and 16 % of
    the clients got no audio in time. The client's retry count (the openai SDK's header) orders the queue."""
    admission = _admission(1)
    assert admission.admit() is None
    fresh = asyncio.create_task(admission.enter(wait_s=30))
    twice = asyncio.create_task(admission.enter(wait_s=30, retries=2))
    leaving = asyncio.create_task(admission.enter(wait_s=30, retries=5))
    once_early = asyncio.create_task(admission.enter(wait_s=30, retries=1))
    once_late = asyncio.create_task(admission.enter(wait_s=30, retries=1))
    await asyncio.sleep(0)
    leaving.cancel()  # the most refused client goes away while it waits: it takes no slot and blocks no one
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert admission.queued == 4
    order = []
    for _ in range(4):
        admission.release()
        done, _ = await asyncio.wait({fresh, twice, once_early, once_late} - set(order),
                                     return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1 and admission.active == 1
        order.append(done.pop())
    assert order == [twice, once_early, once_late, fresh]
    assert all(task.result() is None for task in order) and admission.queued == 0


async def test_a_wait_past_its_deadline_is_refused_holding_nothing():
    admission = _admission(1)
    assert admission.admit("k", key_limit=2) is None
    assert await admission.enter("k", key_limit=2, wait_s=0.05) == CAPACITY
    assert admission.queued == 0 and admission.active == 1 and admission.active_per_key == {"k": 1}
    assert await admission.enter(wait_s=0) == CAPACITY, "no wait asked: refused at once"


async def test_a_refused_request_is_told_when_a_slot_is_expected_for_it():
    """Told only the queue's wait, the 2x overload's refused clients knocked 9.5 times a second and took 6 % of the
    codec replicas' cores from the streams admitted (issue 43, run 52): a slot is expected once one freed for each
    request queued and one for its own, the limit's worth freeing per stream's life."""
    admission = _admission(4)
    assert admission.expected_wait_s() is None, "no stream has ended: nothing to expect by"
    for _ in range(4):
        assert admission.admit() is None
    admission.release(held_s=30.0)
    admission.release(held_s=50.0)
    admission.release()  # handed a slot, its client gone before a stream: no life to count
    assert admission.admit() is None and admission.admit() is None and admission.admit() is None
    assert admission.expected_wait_s() == pytest.approx(40.0 / 4), "alone: a slot every 10 s, the first is its own"
    waiting = [asyncio.create_task(admission.enter(wait_s=30)) for _ in range(3)]
    await asyncio.sleep(0)
    assert admission.queued == 3
    assert admission.expected_wait_s() == pytest.approx(4 * 40.0 / 4), "three ahead of it, then its own"
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_the_queue_is_no_longer_than_the_limit_and_waiting_counts_against_a_key():
    admission = _admission(2)
    admission.limit.codec_failover()  # a cut (2 -> 1): past the slow start, where a burst queues up to the ceiling
    admission.limit.update(window_at(1, FAST), 1, 1)
    assert admission.max_streams == 1 and not admission.limit.slow_start
    assert admission.admit() is None
    waiting = asyncio.create_task(admission.enter("k", key_limit=1, wait_s=30))
    await asyncio.sleep(0)
    assert await admission.enter(wait_s=30) == CAPACITY, "one waiting for the one slot: the next is refused at once"
    assert await admission.enter("k", key_limit=1, wait_s=30) == KEY, "the key's waiting request holds its cap"
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert admission.queued == 0 and admission.active_per_key == {}


async def test_a_cold_limit_queues_a_burst_up_to_the_ceiling():
    """Issue 43's fresh level: 20 requests at once at a cold worker's 4 streams had only 4 places in the queue, and
    12 were refused on arrival. Until the limit is first cut, the queue holds up to the ceiling (64 here)."""
    admission = _admission(4)
    assert all(admission.admit() is None for _ in range(4))
    waiting = [asyncio.create_task(admission.enter(wait_s=30)) for _ in range(60)]
    await asyncio.sleep(0)
    assert admission.queued == 60 and await admission.enter(wait_s=30) == CAPACITY, "the 65th: past the ceiling"
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert admission.queued == 0


async def test_a_client_gone_after_it_was_handed_a_slot_gives_the_slot_to_the_next():
    admission = _admission(1)
    assert admission.admit() is None
    gone = asyncio.create_task(admission.enter(wait_s=30))
    await asyncio.sleep(0)
    admission.release()  # handed to `gone`, which has not run since
    assert admission.active == 1 and admission.queued == 0
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert admission.active == 0 and admission.free == 1


async def test_a_limit_that_grows_admits_the_waiting():
    admission = _admission(1)
    assert admission.admit() is None
    waiting = asyncio.create_task(admission.enter(wait_s=30))
    await asyncio.sleep(0)
    admission.meter.started(0.0)
    admission.meter.tokens(round(2.0 * REALTIME_TOKENS_PER_S * 3))  # one stream, 2 s at 3 x real time
    admission.end_window(2.0)
    assert admission.max_streams == 2 and await waiting is None and admission.active == 2


def test_after_a_cut_growth_past_it_is_careful():
    """Slow start: doubling until the first cut (a codec failover here: a bottleneck the engine's pace does not
    show), then one stream at a time above the limit the cut left."""
    fast = step_ms_curve(1.0, 0.0)
    limit = CapacityLimit(initial=4, floor=1, ceiling=4096, target_pace=TARGET)
    run(limit, fast, windows=3)
    assert limit.limit == 32, "doubling from a cold start"
    limit.codec_failover()
    run(limit, fast, windows=1 + HOLD_WINDOWS)  # the cut, then held
    cut = limit.limit
    assert cut == pytest.approx(32 * 0.9)
    run(limit, fast, windows=1)
    assert limit.limit == pytest.approx(cut + 1)


def test_past_a_cut_a_growth_waits_for_the_streams_it_admitted_to_show_their_cost():
    """On a CPU's slow-motion target a window of fast streams closes every second, but a new stream takes seconds to
    reach the codec, and its audio then comes in rows: growth every window ran the limit from 6 to 41 in 8 s before
    the codec's lateness showed, and one every 3 s from 20 to 28 in 24 s before a listener waited (benchmark runs of
    issue 43). Past the slow start, back up to a stream below the streams admitted at the last cut is a stream a
    settled window (a level the worker kept before); past that, one stream per LISTENER_QUIET_S of audio at the target
    pace (14.3 s here) since the last cut or growth with no listener waiting; a listener waiting starts the count
    again."""
    limit = CapacityLimit(initial=20, floor=1, ceiling=4096, target_pace=0.105)
    limit.update(Window.stepping(20, 20 * 1000 / REALTIME_TOKENS_PER_S, seconds=1.0), 20, 20)  # 0.05 x: cut
    assert limit.reason == SLOW and limit.limit == 10
    grew = growths_in_use(limit, seconds=40, waited_at=20)  # one listener waited a little at 20 s
    assert grew == [*range(1, 10), 35] and limit.limit == 20, grew


def test_the_way_back_after_a_cut_ends_below_the_streams_it_found_in_use_not_below_the_limit():
    """A slow start's last doubling (16 -> 32 for a burst of 24) was never in use: cut there, the limit comes back a
    stream a window only up to 23 (a stream below the 24 admitted when trouble showed), and past that carefully."""
    limit = CapacityLimit(initial=32, floor=1, ceiling=4096, target_pace=0.105)
    limit.update(Window.stepping(24, 24 * 1000 / REALTIME_TOKENS_PER_S, seconds=1.0), 24, 24)  # 0.04 x: cut
    assert limit.reason == SLOW and limit.limit == 16
    grew = growths_in_use(limit, seconds=20)
    assert grew == list(range(1, 8)) and limit.limit == 23, grew


def test_the_slow_start_ends_once_a_burst_fits_under_what_the_pace_measured():
    """Issue 43, run 43: never cut, a warm worker's limit stayed in its slow start and doubled 46 -> 64 for a burst of
    56 on the paces its opening streams showed, then admitted 53 where 48 kept real time. A slow start whose growth
    stopped at what the pace keeps (short of doubling), with a burst then fitting under it, has found the capacity:
    growth from there is careful. A limit that only doubled (never reached the pace's figure) stays in it."""
    limit = CapacityLimit(initial=4, floor=1, ceiling=4096, target_pace=TARGET)
    limit.update(window_at(4, FAST), 4, 4)  # far ahead: doubled
    assert limit.limit == 8 and limit.slow_start
    limit.update(Window.stepping(8, 1000 / (REALTIME_TOKENS_PER_S * TARGET * 1.5), 1.0), 8, 8)  # room for 12: to 12
    assert limit.limit == pytest.approx(12, abs=0.01) and limit.slow_start
    limit.update(window_at(10, FAST), 10, 10)  # the burst fit under it
    assert not limit.slow_start
    limit.update(window_at(12, FAST), 12, 12)
    assert limit.limit == pytest.approx(12, abs=0.01), "careful: no growth before a quiet span"
    doubling = CapacityLimit(initial=4, floor=1, ceiling=4096, target_pace=TARGET)
    run(doubling, FAST, windows=2)
    doubling.update(window_at(10, FAST), 10, 10)  # fits under 16, which no pace figure stopped at
    assert doubling.slow_start and doubling.limit == 16


def test_the_slow_start_ends_only_under_a_limit_its_last_growth_took_from_the_pace():
    """Between windows (requests waiting) as at a window's end: a growth the pace bounded, then a doubling on a larger
    figure, leaves a limit no pace measured, and a burst fitting under it does not end the slow start."""
    limit = CapacityLimit(initial=8, floor=1, ceiling=4096, target_pace=TARGET)
    limit.update(Window.stepping(4, 1000 / (REALTIME_TOKENS_PER_S * TARGET * 3), 1.0), 4, 4)  # not in use: room for 12
    assert limit.grow_queued() and limit.limit == pytest.approx(12, abs=0.01)  # the pace's figure, short of 16
    limit.update(window_at(12, FAST), 12, 12)  # far ahead: doubled
    assert limit.limit == pytest.approx(24, abs=0.02) and limit.slow_start
    limit.update(window_at(20, FAST), 20, 20)  # fits under 24, which the doubling set
    assert limit.slow_start


def test_past_the_way_back_growth_waits_for_a_codec_with_room_too():
    """Quiet listeners are not enough: a replica decodes the rows due first, so near its capacity its streams' rows
    still come in time while the pace it delivers at falls toward the target (benchmark run 24: careful growth 17 -> 29
    through quiet spans against 21 kept pinned, then 26 streams ran dry). Past the way back, careful growth waits for
    a quiet span in which the codec delivered what it owed at CODEC_ROOM x the target or faster: at 1.2 x it does not
    grow; once it delivers at 2 x, it grows when the span's pace reaches CODEC_ROOM. The way back does not wait."""
    limit = CapacityLimit(initial=20, floor=1, ceiling=4096, target_pace=0.105)
    limit.update(Window.stepping(20, 20 * 1000 / REALTIME_TOKENS_PER_S, seconds=1.0), 20, 20)  # 0.05 x: cut to 10
    assert limit.limit == 10
    grew = growths_in_use(limit, seconds=60, codec_pace=lambda second: 1.2 if second <= 30 else 2.0)
    held = math.floor(LISTENER_QUIET_S / 0.105) + 1  # the seconds' deliveries a quiet span (14.3 s) holds: 15
    first_with_room = 30 + math.ceil(held * (CODEC_ROOM - 1.2) / (2.0 - 1.2))  # 10 of them at 2 x make 1.7 x: second 40
    assert grew[:9] == list(range(1, 10)), "back to a stream below the 20 admitted at the cut, the codec not asked"
    assert grew[9] == first_with_room and limit.codec_pace == pytest.approx(2.0), grew


def growths_in_use(limit: CapacityLimit, seconds: int, waited_at: int | None = None,
                   codec_pace: Callable[[int], float] | None = None) -> list[int]:
    """Windows of a second of 10 streams at 1 x real time (10 x a CPU's target), the limit always in use: the seconds at
    which it grew; at `waited_at` a listener waited a little; each second the codec tier delivered what it owed the 10
    streams at codec_pace(second) x the target pace (None: nobody waited on it)."""
    fast = Window.stepping(10, 1000 / REALTIME_TOKENS_PER_S, seconds=1.0)
    grew = []
    for second in range(1, seconds + 1):
        heard = ListenerWindow(waiting_lag_s=0.01) if second == waited_at else None
        if codec_pace is not None:
            limit.codec_delivered(10 * codec_pace(second) * limit.target_pace, 10.0, now=float(second))
        limit.update(fast, limit.streams, limit.streams, heard)
        if limit.reason == GROWTH:
            grew.append(second)
    return grew


# -- the codec as the bottleneck (issue 43: the limit hovered at 2-3x what the codec kept) ---------------------------

CPU_TARGET = 0.105


async def test_the_worker_cuts_for_a_stream_behind_and_a_failover_and_exports_the_codecs_counts(caplog):
    """Runtime.watch_capacity end to end (windows of 50 ms, 16 streams admitted under a limit of 20): a stream whose
    listener waited past its allowance cuts the limit once, by a tenth of the 16, with the figures in the log line
    and on /metrics; a codec failover then cuts by a tenth; the codec client's counts are exported as they grow."""
    from served import CharTokenizerDouble, ScriptedEngineDouble

    from llm_server.config import LlmServerConfig
    from llm_server.runtime import Runtime, codec_client_config
    from llm_server.speech.codec_client import CodecClient

    config = LlmServerConfig(snac="127.0.0.1:9", initial_streams=20, max_streams=64, target_pace=CPU_TARGET,
                             capacity_window_s=0.05)
    runtime = Runtime.assemble(config, ScriptedEngineDouble(), CodecClient(codec_client_config(config)),
                               CharTokenizerDouble())
    limit, meter, registry = runtime.admission.limit, runtime.admission.meter, runtime.metrics.registry
    streams = [Lagging() for _ in range(16)]

    async def windows(n: int) -> None:  # n windows end, each with decoding enough to judge
        for _ in range(n):
            meter.tokens(WINDOW_TOKENS)
            await asyncio.sleep(0.08)

    for stream in streams:
        assert runtime.admission.admit() is None
        runtime.admission.listeners.add(stream)
    meter.started(time.monotonic())  # the clock end_window reads
    watching = asyncio.create_task(runtime.watch_capacity())
    try:
        with caplog.at_level(logging.INFO, logger="llm_server.runtime"):
            await windows(2)
            assert limit.streams == 20, "16 of 20 admitted, every listener content: nothing moves"
            streams[3].lag_s = config.listener_lag_s + 0.05
            runtime.codec._delivered(0.17, 0.17 / 0.09)  # a chunk of owed audio at 0.09 x real time
            await windows(3)
            assert limit.streams == int(16 * 0.9)
            moves = registry.get_sample_value("orpheus_capacity_limit_changes_total", {"reason": LISTENER_BEHIND})
            assert moves == 1
            assert registry.get_sample_value("megapod_worker_streams_behind_total") == 1
            assert registry.get_sample_value("orpheus_codec_owed_audio_seconds_total") == pytest.approx(0.17)
            assert registry.get_sample_value("orpheus_codec_owed_wait_seconds_total") == pytest.approx(0.17 / 0.09)
            assert registry.get_sample_value("orpheus_codec_late_chunks_total") == 1
            assert registry.get_sample_value("megapod_worker_codec_pace_ratio") == pytest.approx(0.09 / CPU_TARGET)
            runtime.codec._failed_over()
            await windows(2)
            assert limit.streams == int(16 * 0.9 * 0.9)
            assert registry.get_sample_value("orpheus_capacity_limit_changes_total", {"reason": CODEC_FAILOVER}) == 1
            assert registry.get_sample_value("orpheus_codec_failovers_total") == 1
        lines = [r.getMessage() for r in caplog.records if "admission limit" in r.getMessage()]
        assert "20 -> 14 streams: listener_behind" in lines[0]
        assert "1 fell behind, 1 of them admitted since" in lines[0]
        assert "16 admitted" in lines[0] and "0 codec failovers" in lines[0]
        assert "codec owed audio at 0.86x the target" in lines[0]
        assert "14 -> 12 streams: codec_failover" in lines[1] and "1 codec failovers" in lines[1]
    finally:
        watching.cancel()
        await runtime.codec.close()


def test_beside_a_codec_that_keeps_k_streams_the_limit_hovers_at_k():
    """A fast engine beside a codec that keeps K streams at the target pace: a stream admitted while more than K
    share it falls behind. From a cold start the limit doubles past K, is cut back, and then hovers at K, a stream
    over at most, one growth a settle, one cut a stream behind."""
    k, seen = 10, []
    limit, listeners = CapacityLimit(initial=4, floor=1, ceiling=4096, target_pace=CPU_TARGET), Listeners()
    for second in range(120):
        n = limit.streams
        newest = Lagging(2 * LISTENER_LAG_S if n > k else 0.0)
        listeners.add(newest)
        before = limit.limit
        limit.update(window_at(n, FAST), n, n, listeners.take(float(second)))
        if limit.limit < before:
            listeners.cut()
        listeners.remove(newest, float(second))
        seen.append(limit.streams)
    assert max(seen) > k, "the slow start runs past K before anything is behind"
    assert k * 0.85 <= min(seen[-60:]) and max(seen[-60:]) <= k + 1, seen


async def test_a_cold_worker_looks_at_its_limit_ten_times_a_queue_wait_while_requests_wait_for_it():
    """Issue 43, cold start: a fresh stack's first burst waited in the queue a whole capacity window per doubling
    (the benchmark's fresh level, 3 s of queue on a CPU: its streams' first audio over 5 s). While requests wait and
    the limit is in its slow start, the worker looks again every tenth of the queue's wait; otherwise each window."""
    from served import CharTokenizerDouble, ScriptedEngineDouble

    from llm_server.config import LlmServerConfig
    from llm_server.runtime import Runtime, codec_client_config
    from llm_server.speech.codec_client import CodecClient

    config = LlmServerConfig(snac="127.0.0.1:9", initial_streams=2, max_streams=8, target_pace=CPU_TARGET,
                             admission_queue_s=3.0)
    runtime = Runtime.assemble(config, ScriptedEngineDouble(), CodecClient(codec_client_config(config)),
                               CharTokenizerDouble())
    admission = runtime.admission
    try:
        assert runtime.capacity_tick_s() == config.capacity_window_s
        assert admission.admit() is None and admission.admit() is None
        waiting = asyncio.create_task(admission.enter(wait_s=3.0))
        await asyncio.sleep(0)
        assert admission.queued == 1 and runtime.capacity_tick_s() == pytest.approx(0.3)
        admission.limit.codec_failover()  # cut: past the slow start, growth is careful anyway
        admission.limit.update(window_at(2, step_ms_curve(1.0, 0.0)), peak_admitted=2, admitted=2)
        assert not admission.limit.slow_start and runtime.capacity_tick_s() == config.capacity_window_s
        waiting.cancel()
    finally:
        await runtime.codec.close()



def test_streams_behind_cut_the_limit_by_a_tenth_of_those_admitted_once_a_cut_and_hold_growth():
    limit = CapacityLimit(initial=20, floor=1, ceiling=64, target_pace=TARGET)
    limit.update(window_at(20, FAST), 20, 20, BEHIND)
    assert limit.reason == LISTENER_BEHIND and limit.limit == pytest.approx(18)
    before_cut = ListenerWindow(behind=1, behind_since_cut=0, waiting_lag_s=0.3)
    for admitted in (20, 18):  # admitted before the cut, while the 20 were over it and once within: no second cut
        limit.update(window_at(18, FAST), admitted, admitted, before_cut)
        assert limit.limit == pytest.approx(18) and limit.reason is None
    limit.update(window_at(18, FAST), 18, 18, BEHIND)  # one admitted since the cut: the limit is still too high
    assert limit.reason == LISTENER_BEHIND and limit.limit == pytest.approx(18 * 0.9)
    held = limit.limit
    for _ in range(HOLD_WINDOWS):
        limit.update(window_at(16, FAST), 16, 16, ListenerWindow())
    assert limit.limit == held, "no growth for a while after a cut"
    limit.update(window_at(16, FAST), 16, 16, ListenerWindow(waiting_lag_s=LISTENER_LAG_S * 0.6))
    assert limit.limit == held, "no growth while a listener waits past half the lag allowed"
    limit.update(window_at(16, FAST), 16, 16, ListenerWindow(waiting_lag_s=LISTENER_LAG_S * 0.1))
    assert limit.limit == held, "a listener waited: 1.5 s of audio with none waiting first"
    limit.update(window_at(16, FAST), 16, 16, ListenerWindow())
    assert limit.limit == held, "1.05 s of audio so far"
    limit.update(window_at(16, FAST), 16, 16, ListenerWindow())
    assert limit.reason == GROWTH and limit.limit == pytest.approx(held + 1)


def test_a_cut_for_streams_behind_counts_the_streams_admitted_in_its_window_and_at_most_halves():
    limit = CapacityLimit(initial=40, floor=1, ceiling=64, target_pace=TARGET)
    limit.update(window_at(30, FAST), 30, 4, BEHIND)  # the window's 30 streams, 4 left when one was found behind
    assert limit.limit == pytest.approx(27)
    few = CapacityLimit(initial=40, floor=1, ceiling=64, target_pace=TARGET)
    few.update(window_at(10, FAST), 10, 10, BEHIND)
    assert few.limit == pytest.approx(20), "10 admitted of 40, one behind: no lower than half the limit"


def test_a_cold_limit_with_requests_waiting_doubles_between_windows_up_to_what_the_pace_keeps():
    """Issue 43's fresh level: 26 requests at once on a CPU, the limit 4 -> 8 -> 16 in two windows, then no window
    closed before the queue's 3 s (the new streams' prompts held up the tokens a window needs): 10 refused."""
    room_for_10 = step_ms_curve(1000 / (REALTIME_TOKENS_PER_S * CPU_TARGET * 2.5), 0.0)  # 4 streams at 2.5 x target
    limit = CapacityLimit(initial=4, floor=1, ceiling=64, target_pace=CPU_TARGET)
    assert not limit.grow_queued(), "no pace measured yet"
    limit.update(window_at(4, room_for_10, seconds=10.0), 4, 4)
    assert limit.limit == 8
    assert limit.grow_queued() and limit.limit == pytest.approx(10, abs=0.01) and limit.reason == GROWTH
    assert not limit.grow_queued(), "no further than the 10 the pace kept"
    n = limit.streams
    limit.update(window_at(n, FAST), n, n)  # the engine far ahead: a window doubles, waiting requests double again
    assert limit.streams == 19 and limit.grow_queued() and limit.grow_queued() and limit.streams == 64
    limit.update(window_at(40, FAST), 40, 40, BEHIND)
    assert not limit.slow_start and not limit.grow_queued(), "a cut holds growth"
    waiting = CapacityLimit(initial=4, floor=1, ceiling=64, target_pace=CPU_TARGET)
    waiting.update(window_at(4, FAST), 4, 4, ListenerWindow(waiting_lag_s=LISTENER_LAG_S))
    assert waiting.limit == 4 and not waiting.grow_queued(), "a listener waiting: no room shown"


def test_past_the_slow_start_requests_waiting_take_one_stream_a_window_on_careful_growths_terms():
    """Issue 43's warm search (run 33): a cut left the limit at 30, levels of 31-48 each failed on a refusal after the
    queue's 3 s (no window showed room before it), and levels below 30 never used the limit: it could not grow. Past
    the slow start, requests waiting take one stream at once when careful growth would take it at the window's end:
    on the way back, or after a quiet span with a codec with room; once a window; not while a cut holds growth, nor
    past what the last window's pace keeps."""
    limit = CapacityLimit(initial=20, floor=1, ceiling=64, target_pace=CPU_TARGET)
    fast = Window.stepping(10, 1000 / REALTIME_TOKENS_PER_S, seconds=1.0)  # 10 streams at 10 x the target: room
    limit.update(Window.stepping(20, 20 * 1000 / REALTIME_TOKENS_PER_S, seconds=1.0), 20, 20)  # 0.05 x: cut to 10
    assert limit.limit == 10 and not limit.slow_start
    assert not limit.grow_queued(), "the last window had no room"
    limit.update(fast, 9, 9)  # the limit not in use: the window does not grow it
    assert limit.limit == 10 and limit.grow_queued(), "on the way back: at once"
    assert limit.limit == 11 and limit.reason == GROWTH
    assert not limit.grow_queued(), "once a window"
    for _ in range(8):  # the way back, a window each, up to 19 (a stream below the 20 admitted at the cut)
        limit.update(fast, limit.streams, limit.streams)
    assert limit.limit == 19
    limit.update(fast, 9, 9)
    assert not limit.grow_queued(), "past the way back: no quiet span yet"
    for _ in range(math.ceil(LISTENER_QUIET_S / CPU_TARGET)):  # a quiet span below the limit (not in use: no growth)
        limit.update(fast, 9, 9)
    assert limit.limit == 19 and limit.grow_queued() and limit.limit == 20, "a burst meets it after a quiet span"
    limit.update(fast, 9, 9)
    assert not limit.grow_queued(), "the next growth waits for a quiet span again"
    slow_codec = CapacityLimit(initial=20, floor=1, ceiling=64, target_pace=CPU_TARGET)
    slow_codec.update(Window.stepping(20, 20 * 1000 / REALTIME_TOKENS_PER_S, seconds=1.0), 20, 20)  # cut to 10
    for second in range(1, 40):  # the way back, then a quiet span, the codec delivering at 1.2 x the target
        slow_codec.codec_delivered(10 * 1.2 * CPU_TARGET, 10.0, now=float(second))
        slow_codec.update(fast, slow_codec.streams, slow_codec.streams)
    assert slow_codec.limit == 10 + 9 and not slow_codec.grow_queued(), "a codec without room: no growth"
    held = CapacityLimit(initial=20, floor=1, ceiling=64, target_pace=CPU_TARGET)
    held.update(window_at(20, FAST), 20, 20, BEHIND)  # a stream behind: cut to 18, growth held for HOLD_WINDOWS
    held.update(fast, 10, 10)
    assert not held.grow_queued(), "a cut's hold"


async def test_past_the_slow_start_a_burst_starts_at_the_limits_worth_per_ramp_in_order():
    """Issue 43's overload levels: the limit's worth of streams admitted within a second ran dry the first of them
    while the rest started. Past the slow start a quarter of the limit starts at once, the rest wait in the queue and
    start at the limit's worth per START_RAMP_S of audio time (0.19 s at this target), in the order they came."""
    admission = _admission(20)
    admission.limit.update(window_at(20, FAST), 20, 20, BEHIND)
    assert admission.max_streams == 18 and not admission.limit.slow_start
    started = time.monotonic()
    order: list[int] = []

    async def stream(i: int) -> None:
        assert await admission.enter(wait_s=30) is None
        order.append(i)

    tasks = [asyncio.create_task(stream(i)) for i in range(18)]
    await asyncio.sleep(0)
    assert admission.active == 4 and admission.queued == 14, "a quarter of the limit at once, the rest wait"
    await asyncio.gather(*tasks)
    rate = 18 * TARGET / START_RAMP_S
    assert time.monotonic() - started >= 13 / rate, "no faster than the ramp"
    assert order == list(range(18)) and admission.active == 18
    cold = _admission(18)
    tasks = [asyncio.create_task(cold.enter(wait_s=30)) for _ in range(18)]
    await asyncio.sleep(0)
    assert cold.active == 18 and cold.queued == 0, "in the slow start a burst starts at once"
    await asyncio.gather(*tasks)
    unqueued = _admission(20)
    unqueued.limit.update(window_at(20, FAST), 20, 20, BEHIND)
    assert all([await unqueued.enter(wait_s=0) is None for _ in range(18)]), "no queue to pace in: only the limit"


# -- the reserve while requests are refused (issue 43, run 55: refusals took the codec's cores) ----------------------

class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _reserving(initial: int, clock: Clock, reserve: float = 0.05) -> AdmissionController:
    limit = CapacityLimit(initial=initial, floor=1, ceiling=64, target_pace=TARGET, reserve=reserve)
    return AdmissionController(limit, PaceMeter(0.0), clock=clock)


async def test_while_requests_go_on_being_refused_the_limit_holds_its_reserve_back_and_then_gives_it_back():
    """Over issue 43's run 55 the 3x level's refusals (9 a second, on the cores the codec replicas share) left the codec
    5 % fewer cores than the pinned levels at the capacity had, and streams admitted at the limit ran past the buffer.
    Refusals that went on for REFUSING_S of audio time hold 5 % of the limit back until a gap of REFUSAL_GAP_S; the
    streams over it end on their own."""
    clock = Clock()
    admission = _reserving(44, clock)
    admission.limit.update(window_at(44, FAST), 44, 44, BEHIND)  # a cut, 44 -> 39.6: past the slow start
    assert admission.max_streams == 39
    for _ in range(39):
        assert admission.admit(paced=False) is None
    assert not admission.hold_reserve(clock()), "nothing refused yet"
    step = 0.9 * REFUSAL_GAP_S / TARGET
    for _ in range(math.ceil(REFUSING_S / REFUSAL_GAP_S / 0.9)):
        assert await admission.enter(wait_s=0) == CAPACITY
        assert not admission.hold_reserve(clock()), "refusals not yet REFUSING_S long"
        clock.now += step
    assert await admission.enter(wait_s=0) == CAPACITY
    assert admission.hold_reserve(clock()) and admission.limit.reason == RESERVE
    assert admission.max_streams == int(39.6 * 0.95) == 37 and admission.active == 39 and admission.free == 0
    admission.release()
    assert admission.admit(paced=False) == CAPACITY, "38 admitted: over the 37 the reserve leaves"
    waiting = asyncio.create_task(admission.enter(wait_s=60))
    await asyncio.sleep(0)
    clock.now += step
    assert not admission.hold_reserve(clock()) and not waiting.done(), "refused within REFUSAL_GAP_S: still held back"
    clock.now += step
    assert not admission.hold_reserve(clock()) and not waiting.done(), "none refused lately, but one waits: still on"
    admission.release()
    admission.release()
    assert await waiting is None and admission.active == 37, "under the reserve's limit: to the waiting first"
    assert admission.hold_reserve(clock()) and admission.max_streams == 39, "none waiting, none refused lately"


async def test_the_reserve_is_not_given_back_while_requests_wait():
    """Issue 43, run 62: given back after a gap in the refusals (the refused clients' retries come in waves) with
    requests still waiting, the reserve admitted them into the overload that was still on (37 -> 41 streams 90 s into
    the 2x level), and 17 streams sent in the 20 s around it ran past the buffer."""
    clock = Clock()
    admission = _reserving(44, clock, reserve=0.1)
    admission.limit.update(window_at(44, FAST), 44, 44, BEHIND)  # 39.6
    for _ in range(39):
        assert admission.admit(paced=False) is None
    waiting = [asyncio.create_task(admission.enter(wait_s=60)) for _ in range(39)]
    await asyncio.sleep(0)
    assert await admission.enter(wait_s=60) == CAPACITY and admission.max_streams == 35, "the queue full: held back"
    for _ in range(10):  # no refusal for ten gaps: the queue's requests still wait
        clock.now += REFUSAL_GAP_S / TARGET
        assert not admission.hold_reserve(clock()) and admission.max_streams == 35
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert admission.hold_reserve(clock()) and admission.max_streams == 39, "none waiting: given back"


async def test_a_bursts_refusals_are_no_overload():
    """Held back for a while after any refusal, a warm worker's reserve outlived each search level that failed on
    refusals at its start and refused the next level's burst in turn (issue 43, run 56). Refusals a gap apart start
    over."""
    clock = Clock()
    admission = _reserving(44, clock)
    admission.limit.update(window_at(44, FAST), 44, 44, BEHIND)
    for _ in range(39):
        assert admission.admit(paced=False) is None
    for _ in range(3):  # three bursts of refusals, each shorter than REFUSING_S, a gap apart
        for _ in range(3):
            assert await admission.enter(wait_s=0) == CAPACITY
            assert not admission.hold_reserve(clock())
            clock.now += 0.25 * REFUSING_S / TARGET
        clock.now += 1.1 * REFUSAL_GAP_S / TARGET
    assert admission.max_streams == 39


async def test_a_refusal_with_the_queue_full_holds_the_reserve_back_at_once():
    """Issue 43, run 58: the 3x level's first cohort was admitted whole at the limit (40) in its first second, before
    its refusals had gone on for REFUSING_S, and four of its first streams ran past the buffer. With the limit's worth
    waiting, a refusal is an overload's: the reserve is held back at that refusal (not at the next capacity tick), so
    the requests still waiting get the limit less its reserve; told to on_reserve with the streams admitted before."""
    clock = Clock()
    admission = _reserving(44, clock, reserve=0.1)
    moved = []
    admission.on_reserve = moved.append
    admission.limit.update(window_at(44, FAST), 44, 44, BEHIND)  # past the slow start: 39.6
    for _ in range(30):
        assert admission.admit(paced=False) is None
    waiting = [asyncio.create_task(admission.enter(wait_s=60)) for _ in range(39)]  # a slot free, the ramp full
    await asyncio.sleep(0)
    assert (admission.active, admission.queued) == (39, 30) and not moved, "a queue short of the limit's worth: a burst"
    while admission.queued < admission.max_streams:
        waiting.append(asyncio.create_task(admission.enter(wait_s=60)))
        await asyncio.sleep(0)
    assert await admission.enter(wait_s=60) == CAPACITY, "the queue full: refused at once"
    assert moved == [39] and admission.max_streams == int(39.6 * 0.9) == 35
    assert admission.limit.reason == RESERVE and admission.limit.refusing
    clock.now += 0.5 * REFUSAL_GAP_S / TARGET
    assert not admission.hold_reserve(clock()), "held on while refusals go on"
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    clock.now += 0.6 * REFUSAL_GAP_S / TARGET
    assert admission.hold_reserve(clock()) and moved == [39, 35] and admission.max_streams == 39


async def test_no_reserve_unless_configured_nor_in_the_slow_start():
    clock = Clock()
    unreserved = _reserving(44, clock, reserve=0.0)
    unreserved.limit.update(window_at(44, FAST), 44, 44, BEHIND)
    cold = _reserving(44, clock)
    for admission in (unreserved, cold):
        before = admission.max_streams
        for _ in range(before):
            assert admission.admit(paced=False) is None
        refused_at = clock()
        while clock() - refused_at < 1.5 * REFUSING_S / TARGET:  # an overload's refusals
            assert await admission.enter(wait_s=0) == CAPACITY
            clock.now += 0.5 * REFUSAL_GAP_S / TARGET
        assert not admission.hold_reserve(clock()) and admission.max_streams == before
    assert cold.limit.slow_start, "a cold worker's first burst is no overload"
    with pytest.raises(ValueError, match="reserve"):
        CapacityLimit(initial=4, floor=1, ceiling=64, target_pace=TARGET, reserve=1.0)


def test_a_cut_while_the_reserve_is_held_back_is_a_cut_of_the_limit_not_of_the_streams_admitted():
    """With 37 of a limit of 39.6 admitted (the reserve held back), a stream behind cuts a tenth of the 39 the 37 were
    of, as without the reserve: a tenth of the 37, and the reserve again, would take 15 % off."""
    limit = CapacityLimit(initial=44, floor=1, ceiling=64, target_pace=TARGET, reserve=0.05)
    limit.update(window_at(44, FAST), 44, 44, BEHIND)
    assert limit.hold_reserve(True)
    assert limit.streams == 37
    for _ in range(HOLD_WINDOWS):  # a cut's hold: no growth
        limit.update(window_at(37, FAST), 37, 37)
    assert limit.limit == pytest.approx(39.6)
    limit.update(window_at(37, FAST), 37, 37, BEHIND)
    assert limit.limit == pytest.approx(37 / 0.95 * 0.9) and limit.streams == 33


def test_a_pace_cut_while_the_reserve_is_held_back_admits_the_streams_that_pace_keeps():
    """A pace measured while requests are refused has the refusals' work in it: the limit it sets is the one whose
    streams admitted (the reserve held back) are the streams it keeps at the target, not a tenth fewer (issue 43, run
    59: a 3x level's pace cut, 39 -> 29 streams where the pace kept 32)."""
    limit = CapacityLimit(initial=44, floor=1, ceiling=64, target_pace=TARGET, reserve=0.1)
    limit.update(window_at(44, FAST), 44, 44, BEHIND)  # past the slow start: 39.6
    assert limit.hold_reserve(True) and limit.streams == 35
    slow = Window(1.0, 35.0, round(35 * 0.95 * REALTIME_TOKENS_PER_S), 35)  # 35 decoding at 0.95
    limit.update(slow, 35, 35, BEHIND)
    kept = 35 * 0.95 / TARGET
    assert limit.reason == SLOW and limit.streams == int(kept) == 32
    assert limit.limit == pytest.approx(kept / 0.9, rel=1e-3)


async def test_the_worker_logs_and_counts_its_reserve_held_back_and_given_back(caplog, monkeypatch):
    """Runtime.watch_capacity: a refusal holds the reserve back at the next look, with a log line and a count under
    orpheus_capacity_limit_changes_total{reason="refusal_reserve"}; REFUSAL_GAP_S later it is given back the same way."""
    from served import CharTokenizerDouble, ScriptedEngineDouble

    import llm_server.admission
    from llm_server.config import LlmServerConfig
    from llm_server.runtime import Runtime, codec_client_config
    from llm_server.speech.codec_client import CodecClient

    monkeypatch.setattr(llm_server.admission, "REFUSING_S", 0.0)  # one refusal is an overload here...
    monkeypatch.setattr(llm_server.admission, "REFUSAL_GAP_S", 1.0 * CPU_TARGET)  # ...held back for 1 s
    config = LlmServerConfig(snac="127.0.0.1:9", initial_streams=20, max_streams=64, target_pace=CPU_TARGET,
                             capacity_window_s=0.05, refusal_reserve=0.05)
    runtime = Runtime.assemble(config, ScriptedEngineDouble(), CodecClient(codec_client_config(config)),
                               CharTokenizerDouble())
    admission, registry = runtime.admission, runtime.metrics.registry
    admission.limit.update(window_at(20, FAST), 20, 20, BEHIND)  # 20 -> 18: past the slow start
    for _ in range(18):
        assert admission.admit(paced=False) is None

    async def until(streams: int) -> None:
        for _ in range(100):
            if admission.max_streams == streams:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"the limit stayed at {admission.max_streams}, not {streams}")

    watching = asyncio.create_task(runtime.watch_capacity())
    try:
        with caplog.at_level(logging.INFO, logger="llm_server.runtime"):
            assert await admission.enter(wait_s=0) == CAPACITY
            await until(17)
            await until(18)
        moves = registry.get_sample_value("orpheus_capacity_limit_changes_total", {"reason": RESERVE})
        assert moves == 2
        lines = [r.getMessage() for r in caplog.records if "refusal_reserve" in r.getMessage()]
        assert "18 -> 17 streams: refusal_reserve (requests refused: 5 % of the limit held back, 18 admitted" in lines[0]
        assert "17 -> 18 streams: refusal_reserve (none refused lately: 5 % of the limit given back" in lines[1]
    finally:
        watching.cancel()
        await runtime.codec.close()
