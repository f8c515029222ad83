"""Admission control: a limit on concurrent streams, so the ones admitted keep real time.

The limit is measured, not configured (capacity.py): it follows the pace the engine keeps for the
streams it holds, between a floor and a ceiling (`min_streams`, `max_streams`). Past it a request waits
in a short FIFO queue, at most `wait_s` (a few hundred ms on a GPU) and at most as many waiting as the
limit admits (as the ceiling admits while the limit is in its slow start: a cold worker's first burst is
no sign of overload), then is refused (HTTP 429 with Retry-After): a slot that frees goes to the longest waiting,
not to whoever knocks first (a closed-loop client ending one stream asks again at once and would keep
its slot forever, refused clients never getting one). Never more streams than the limit: slowing every
stream to fit one more breaks all. An API key name may have a cap of its own, on top of the worker's
(its waiting requests count against it).
"""

from __future__ import annotations

import asyncio
from collections import deque

from .capacity import CapacityLimit, Listeners, ListenerWindow, PaceMeter, Window

CAPACITY = "capacity"
KEY = "key"


class AdmissionController:
    """Counts active streams against the capacity limit (and per key name); not thread-safe (one event loop)."""

    def __init__(self, limit: CapacityLimit, meter: PaceMeter, listeners: Listeners | None = None) -> None:
        self.limit = limit
        self.meter = meter
        # The admitted streams, as their listeners at the target pace hear them (capacity.Listeners).
        self.listeners = Listeners() if listeners is None else listeners
        self.heard = ListenerWindow(self.listeners.allowed_s)  # what they showed over the last window
        self.active = 0
        self.active_per_key: dict[str, int] = {}  # admitted and waiting, per key name
        self._peak = 0  # the most streams admitted at once this window
        self._queue: deque[asyncio.Future[None]] = deque()  # waiting for a slot, longest first

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

    def admit(self, key: str | None = None, key_limit: int = 0) -> str | None:
        """Take a slot now (and one of `key`'s, if it has a limit); None when admitted, else which
        limit refused: KEY or CAPACITY."""
        if key_limit and self.active_per_key.get(key, 0) >= key_limit:
            return KEY
        if not self.free or self._queue:  # the waiting go first
            return CAPACITY
        self._count_key(key, +1)
        self._take()
        return None

    async def enter(self, key: str | None = None, key_limit: int = 0, wait_s: float = 0.0) -> str | None:
        """admit(), waiting up to `wait_s` in the queue for a slot when none is free (and the queue is
        shorter than the limit, or the ceiling in the slow start); None when admitted, else which limit refused."""
        refused = self.admit(key, key_limit)
        room = max(self.limit.streams, self.limit.ceiling - self.active) if self.limit.slow_start else self.limit.streams
        if refused != CAPACITY or wait_s <= 0 or len(self._queue) >= room:
            return refused
        slot = asyncio.get_running_loop().create_future()
        self._queue.append(slot)
        self._count_key(key, +1)
        try:
            await asyncio.wait({slot}, timeout=wait_s)
        except asyncio.CancelledError:  # the client went away while waiting
            self._leave(slot, key)
            raise
        if slot.done():
            return None
        self._leave(slot, key)
        return CAPACITY

    def release(self, key: str | None = None) -> None:
        """Give back a slot taken by admit() or enter() with the same key: to the longest waiting, if any."""
        self._count_key(key, -1)
        self.active -= 1
        self._hand_out()

    def _take(self) -> None:
        self.active += 1
        self._peak = max(self._peak, self.active)

    def _hand_out(self) -> None:
        """Slots free under the limit go to the waiting, in order."""
        while self._queue and self.limit.streams > self.active:
            self._queue.popleft().set_result(None)
            self._take()

    def _leave(self, slot: asyncio.Future[None], key: str | None) -> None:
        """A wait ended without its stream: out of the queue, or the slot it was just handed given back."""
        if slot.done():
            self.release(key)
        else:
            self._queue.remove(slot)
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
