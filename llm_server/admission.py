"""Admission control: a cap on concurrent streams, so the ones admitted keep real time.

Past the cap a request is refused at once (HTTP 429 with Retry-After) instead of queued:
a queued voice stream is a late one, and slowing every stream to fit one more breaks all.
"""

from __future__ import annotations


class AdmissionController:
    """Counts active streams against `max_streams`; not thread-safe (one event loop)."""

    def __init__(self, max_streams: int) -> None:
        self.max_streams = max_streams
        self.active = 0

    def try_admit(self) -> bool:
        """Take a slot if one is free."""
        if self.active >= self.max_streams:
            return False
        self.active += 1
        return True

    def release(self) -> None:
        self.active -= 1
