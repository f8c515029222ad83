"""Admission control: a cap on concurrent streams, so the ones admitted keep real time.

Past the cap a request is refused at once (HTTP 429 with Retry-After) instead of queued:
a queued voice stream is a late one, and slowing every stream to fit one more breaks all.
An API key name may have a cap of its own, on top of the worker's.
"""

from __future__ import annotations

WORKER = "worker"
KEY = "key"


class AdmissionController:
    """Counts active streams against `max_streams` (and per key name); not thread-safe (one event loop)."""

    def __init__(self, max_streams: int) -> None:
        self.max_streams = max_streams
        self.active = 0
        self.active_per_key: dict[str, int] = {}

    def admit(self, key: str | None = None, key_limit: int = 0) -> str | None:
        """Take a slot (and one of `key`'s, if it has a limit); None when admitted, else which
        cap refused: KEY or WORKER."""
        held = self.active_per_key.get(key, 0) if key is not None else 0
        if key_limit and held >= key_limit:
            return KEY
        if self.active >= self.max_streams:
            return WORKER
        self.active += 1
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
