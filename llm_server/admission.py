"""Admission control: a limit on concurrent streams, so the ones admitted keep real time.

The limit is measured, not configured (capacity.py): it follows the pace the engine keeps for the
streams it holds, between a floor and a ceiling (`min_streams`, `max_streams`). Past it a request is
refused at once (HTTP 429 with Retry-After) instead of queued: a queued voice stream is a late one,
and slowing every stream to fit one more breaks all. An API key name may have a cap of its own, on
top of the worker's.
"""

from __future__ import annotations

from .capacity import CapacityLimit, PaceMeter, Window

CAPACITY = "capacity"
KEY = "key"


class AdmissionController:
    """Counts active streams against the capacity limit (and per key name); not thread-safe (one event loop)."""

    def __init__(self, limit: CapacityLimit, meter: PaceMeter) -> None:
        self.limit = limit
        self.meter = meter
        self.active = 0
        self.active_per_key: dict[str, int] = {}
        self._peak = 0  # the most streams admitted at once this window

    @property
    def max_streams(self) -> int:
        """Streams admitted at once now."""
        return self.limit.streams

    @property
    def free(self) -> int:
        """Streams that would be admitted now (what the front routes by)."""
        return max(0, self.limit.streams - self.active)

    def admit(self, key: str | None = None, key_limit: int = 0) -> str | None:
        """Take a slot (and one of `key`'s, if it has a limit); None when admitted, else which
        limit refused: KEY or CAPACITY."""
        held = self.active_per_key.get(key, 0) if key is not None else 0
        if key_limit and held >= key_limit:
            return KEY
        if not self.free:
            return CAPACITY
        self.active += 1
        self._peak = max(self._peak, self.active)
        if key is not None:
            self.active_per_key[key] = held + 1
        return None

    def release(self, key: str | None = None) -> None:
        """Give back a slot taken by admit() with the same key."""
        self.active -= 1
        if key is not None:
            left = self.active_per_key.get(key, 0) - 1
            if left > 0:
                self.active_per_key[key] = left
            else:
                self.active_per_key.pop(key, None)

    def end_window(self, now: float) -> Window | None:
        """A control window ends, once its streams decoded enough to judge the pace by (else it goes
        on): the limit moves by the pace measured in it. None while it goes on."""
        if not self.limit.enough(self.meter.decoded_s(now)):
            if not self.meter.decoding_now:
                self.limit.idle()
            return None
        window = self.meter.take(now)
        self.limit.update(window, self._peak, self.active)
        self._peak = self.active
        return window
