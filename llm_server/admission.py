"""Admission control: a limit on concurrent streams, so the ones admitted keep real time.

The limit is measured, not configured (capacity.py): it follows the pace the engine keeps for the
streams it holds, between a floor and a ceiling (`min_streams`, `max_streams`). Past it a request waits
in a short FIFO queue, at most `wait_s` (a few hundred ms on a GPU) and at most as many waiting as the
limit admits (as the ceiling admits while the limit is in its slow start: a cold worker's first burst is
no sign of overload), then is refused (HTTP 429 with Retry-After): a slot that frees goes to the longest waiting,
not to whoever knocks first (a closed-loop client ending one stream asks again at once and would keep
its slot forever, refused clients never getting one), and first to the request refused most often before
(its `retries`: the count the openai SDK, and every SDK generated as it is, sends on each retry). In FIFO order
alone each refusal starts a client's wait over: at 2x the capacity, clients had the same chance at every
slot however long they had waited, and 16 % of them got no audio in 10 s of audio time (issue 43, run 37).
A client that overstates its count gets ahead in the queue, never past the limit (nor past its key's cap).
Never more streams than the limit: slowing every stream to fit one more breaks all. Past the limit's slow start, streams also start at most at the limit's worth
per START_RAMP_S (below): a burst waits in the same queue. An API key name may have a cap of its own, on top of
the worker's (its waiting requests count against it). A request refused is told when a slot may be expected for it
(expected_wait_s, its Retry-After): a knock sooner is refused again, and takes its share of the cores from the streams.
While requests go on being refused, the limit's reserve is held back (hold_reserve, REFUSING_S; 0 unless configured),
and at once when one is refused with the queue full.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
import time
from collections import deque
from collections.abc import Callable

from .capacity import CapacityLimit, Listeners, ListenerWindow, PaceMeter, Window

CAPACITY = "capacity"
KEY = "key"
# Past the slow start, streams start at most at the limit's worth per START_RAMP_S of audio time (at the target
# pace), from a bucket holding at most START_BURST of the limit: a stream's start (its prompt's prefill, its first
# rows at the codec) costs the shared cores more than its decoding, and a burst of the limit's worth within a second
# ran dry the streams it admitted first while the rest started (issue 43's overload levels: 48 and 72 clients over
# 2 s, and the admitted streams that ran past the buffer were the level's first; a pinned limit's levels start the
# same streams over 2 s and keep them). 0.2 s of audio is within a first audio's 0.3 s (capacity.FIRST_AUDIO_S):
# a start the ramp delays is still in time. 2 s at a CPU's 0.1x target, 0.19 s at a GPU's. Not in the slow start:
# a cold worker's first burst must reach the capacity before its queue's deadline.
START_RAMP_S = 0.2
START_BURST = 0.25
# A refused request may expect a slot once the requests queued ahead of it and its own were handed one, slots freeing at
# the limit's worth per stream's life (Little's law; the mean of the last RELEASES_SEEN streams'). Told only the queue's
# wait (3 s on a CPU), the 2x overload's refused clients knocked 9.5 times a second, the codec replicas had 1.42 cores
# against 1.52 in the warm levels before, and 15 streams admitted at the limit the warm search had found (51, against
# 52 kept pinned) ran past the buffer, the slowest 3 % below real time (issue 43, run 52).
RELEASES_SEEN = 32
# Refusals that went on for REFUSING_S of audio time at the target pace (9.7 s at a CPU's 0.103x, 0.97 s at a GPU's
# 1.03x), none REFUSAL_GAP_S apart (the queue's wait: 2.9 s, 0.29 s), are an overload: the limit's reserve is held back
# (CapacityLimit.reserve, llm_server's refusal_reserve) until a gap ends them with none waiting. Where the refused requests knock on the
# streams' own cores (megapod up with no GPU), the limit found without them is too many with them: over issue 43's
# run 55 the codec replicas had 1.49-1.51 cores on the pinned levels at the capacity, 1.46 at 2x it (4 refusals a
# second) and 1.42 at 3x (9 a second: the front's and the benchmark client's work of each), and at 3x three streams
# admitted at the limit the 2x level had left (42 of 43 kept pinned) ran past the buffer. A burst's refusals are no
# overload: held back for 9.5 s after every refusal, a warm worker's reserve outlived each search level that failed
# on refusals and refused the next level's burst in turn (run 56: levels of 45-47 streams under a limit of 47). A refusal
# with the queue full (the limit's worth waiting) is an overload's at once: the 3x level's first cohort was admitted
# whole at the limit in its first second, and four of its first streams ran past the buffer (run 58).
REFUSING_S = 1.0
REFUSAL_GAP_S = 0.3


class AdmissionController:
    """Counts active streams against the capacity limit (and per key name); not thread-safe (one event loop)."""

    def __init__(self, limit: CapacityLimit, meter: PaceMeter, listeners: Listeners | None = None,
                 clock: Callable[[], float] = time.monotonic, on_reserve: Callable[[int], None] = lambda before: None) -> None:
        self.limit = limit
        self.meter = meter
        # The admitted streams, as their listeners at the target pace hear them (capacity.Listeners).
        self.listeners = Listeners() if listeners is None else listeners
        self.heard = ListenerWindow(self.listeners.allowed_s)  # what they showed over the last window
        self.active = 0
        self.active_per_key: dict[str, int] = {}  # admitted and waiting, per key name
        self._peak = 0  # the most streams admitted at once this window
        # Waiting for a slot, in the order they get one: (-retries, arrival, slot).
        self._queue: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()
        self._clock = clock
        self._starts = float("inf")  # streams that may start now past the slow start (START_RAMP_S's bucket; full)
        self._starts_at = clock()  # when the bucket was last filled
        self._paced: asyncio.TimerHandle | None = None  # the hand-out waiting for the bucket
        self._lives: deque[float] = deque(maxlen=RELEASES_SEEN)  # how long the last streams held their slots
        self._refused_at = -math.inf  # when a request was last refused for capacity
        self._refusing_since = -math.inf  # when the refusals going on since (none REFUSAL_GAP_S apart) began
        self.on_reserve = on_reserve  # told the streams admitted before the reserve was held or given back (a log line)

    @property
    def queued(self) -> int:
        """Requests waiting for a slot now."""
        return len(self._queue)

    @property
    def max_streams(self) -> int:
        """Streams admitted at once now."""
        return self.limit.streams

    @property
    def free(self) -> int:
        """Streams that would be admitted now (what the front routes by)."""
        return max(0, self.limit.streams - self.active)

    def admit(self, key: str | None = None, key_limit: int = 0, paced: bool = True) -> str | None:
        """Take a slot now (and one of `key`'s, if it has a limit); None when admitted, else which
        limit refused: KEY or CAPACITY (`paced`: also when the starts' ramp has no room now)."""
        if key_limit and self.active_per_key.get(key, 0) >= key_limit:
            return KEY
        if not self.free or self._queue:  # the waiting go first
            return CAPACITY
        if paced and not self._may_start():
            return CAPACITY
        self._count_key(key, +1)
        self._take()
        return None

    async def enter(self, key: str | None = None, key_limit: int = 0, wait_s: float = 0.0, retries: int = 0) -> str | None:
        """admit(), waiting up to `wait_s` in the queue for a slot when none is free (and the queue is
        shorter than the limit, or the ceiling in the slow start), ahead of those that were refused fewer times
        before (`retries`); None when admitted, else which limit refused."""
        refused = self.admit(key, key_limit, paced=wait_s > 0)  # no queue to pace a burst in: only the limit
        room = max(self.limit.streams, self.limit.ceiling - self.active) if self.limit.slow_start else self.limit.streams
        if refused != CAPACITY or wait_s <= 0:
            return self._counted(refused)
        if len(self._queue) >= room:  # the limit's worth waiting: an overload from this refusal on, the reserve held now
            self._counted(refused)
            self._refusing_since = -math.inf
            self.hold_reserve(self._refused_at)
            return refused
        slot = asyncio.get_running_loop().create_future()
        bisect.insort(self._queue, (-max(0, retries), next(self._arrivals), slot))
        self._count_key(key, +1)
        self._hand_out()  # a slot free but the ramp full: handed out once it has room
        try:
            await asyncio.wait({slot}, timeout=wait_s)
        except asyncio.CancelledError:  # the client went away while waiting
            self._leave(slot, key)
            raise
        if slot.done():
            return None
        self._leave(slot, key)
        return self._counted(CAPACITY)

    def _counted(self, refused: str | None) -> str | None:
        """`refused`, noted if it is a refusal for capacity (hold_reserve)."""
        if refused == CAPACITY:
            now = self._clock()
            if now - self._refused_at > REFUSAL_GAP_S / self.limit.target_pace:
                self._refusing_since = now
            self._refused_at = now
        return refused

    def hold_reserve(self, now: float) -> bool:
        """Hold the limit's reserve back while requests have been refused for capacity for REFUSING_S, none
        REFUSAL_GAP_S apart (or since one was refused with the queue full), and on while requests still wait; else give
        it back; whether that changed the streams admitted (told to on_reserve, with the streams admitted before).
        Given back after a gap in the refusals with requests waiting, it admitted them into the overload that was still
        on (the refused clients' retries come in waves): run 62's 2x level went 37 -> 41 streams 90 s in, and 17
        streams sent in the 20 s around it ran past the buffer by 0.9-7.8 s before listener cuts took it to 26."""
        pace, before = self.limit.target_pace, self.limit.streams
        overloaded = (now - self._refused_at <= REFUSAL_GAP_S / pace
                      and self._refused_at - self._refusing_since >= REFUSING_S / pace)
        if not self.limit.hold_reserve(overloaded or (self.limit.refusing and bool(self._queue))):
            return False
        self.on_reserve(before)
        self._hand_out()
        return True

    def release(self, key: str | None = None, held_s: float | None = None) -> None:
        """Give back a slot taken by admit() or enter() with the same key (`held_s`: how long its stream held it):
        to the longest waiting, if any."""
        self._count_key(key, -1)
        self.active -= 1
        if held_s is not None:
            self._lives.append(held_s)
        self._hand_out()

    def expected_wait_s(self) -> float | None:
        """How long a request refused now may expect to wait for a slot: one freed for each request queued and one
        for its own, the limit's worth freeing per stream's life (the last RELEASES_SEEN streams' mean); None before a
        stream ended."""
        if not self._lives:
            return None
        return (len(self._queue) + 1) * sum(self._lives) / len(self._lives) / self.limit.streams

    def _take(self) -> None:
        self.active += 1
        self._peak = max(self._peak, self.active)

    def _hand_out(self) -> None:
        """Slots free under the limit go to the waiting, in order, as the starts' ramp allows (else once it does)."""
        while self._queue and self.limit.streams > self.active:
            if not self._may_start():
                self._hand_out_later()
                return
            self._queue.pop(0)[-1].set_result(None)
            self._take()

    def _may_start(self) -> bool:
        """Whether a stream may start now (START_RAMP_S), taking its place in the ramp if so."""
        if self.limit.slow_start:
            return True
        now = self._clock()
        self._starts = min(self._start_burst, self._starts + (now - self._starts_at) * self._start_rate)
        self._starts_at = now
        if self._starts < 1.0:
            return False
        self._starts -= 1.0
        return True

    @property
    def _start_rate(self) -> float:
        """Starts a second: the limit's worth per START_RAMP_S of audio time."""
        return self.limit.streams * self.limit.target_pace / START_RAMP_S

    @property
    def _start_burst(self) -> float:
        return max(1.0, START_BURST * self.limit.streams)

    def _hand_out_later(self) -> None:
        """One hand-out waits for the ramp's next start at a time."""
        if self._paced is None:
            wait = (1.0 - self._starts) / self._start_rate
            self._paced = asyncio.get_running_loop().call_later(wait, self._paced_hand_out)

    def _paced_hand_out(self) -> None:
        self._paced = None
        self._hand_out()

    def _leave(self, slot: asyncio.Future[None], key: str | None) -> None:
        """A wait ended without its stream: out of the queue, or the slot it was just handed given back."""
        if slot.done():
            self.release(key)
        else:
            self._queue[:] = [waiting for waiting in self._queue if waiting[-1] is not slot]
            slot.cancel()
            self._count_key(key, -1)

    def _count_key(self, key: str | None, delta: int) -> None:
        if key is None:
            return
        held = self.active_per_key.get(key, 0) + delta
        if held > 0:
            self.active_per_key[key] = held
        else:
            self.active_per_key.pop(key, None)

    def end_window(self, now: float) -> Window | None:
        """A control window ends, once its streams decoded enough to judge the pace by (else it goes
        on): the limit moves by the pace measured in it. None while it goes on."""
        if not self.limit.enough(self.meter.decoded_s(now), self.meter.decoded_tokens):
            if not self.meter.decoding_now:
                self.limit.idle()
            if self._queue and self.limit.grow_queued():
                self._hand_out()
            return None
        window = self.meter.take(now)
        before = self.limit.limit
        self.heard = self.listeners.take(now)
        self.limit.update(window, self._peak, self.active, self.heard)
        if self.limit.limit < before:
            self.listeners.cut()
        self._peak = self.active
        self._hand_out()  # the limit may have grown
        return window
