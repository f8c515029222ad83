"""How late the event loop runs what is ready: the lag every stream of a server shares.

A task sleeps `every_s` and records how much later than asked it woke up. Anything synchronous on the loop
(a decode, a directory scan, a flood of messages parsed in one go) shows here as lag, on every stream of the
process at once; a voice agent hears one 85 ms frame of it as a gap.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Gauge, Histogram

FRAME_S = 2048 / 24000  # one SNAC frame of audio: 85 ms
# Around the frame: a few ms is a healthy loop, a frame is a gap a listener can hear, seconds are an outage.
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, FRAME_S, 0.12, 0.17, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
EVERY_S = 0.05


class LoopLag:
    """orpheus_event_loop_lag_seconds (a histogram) and its largest value since start (a gauge), in `registry`."""

    def __init__(self, registry: CollectorRegistry, every_s: float = EVERY_S) -> None:
        self.every_s = every_s
        self.histogram = Histogram("orpheus_event_loop_lag_seconds", "How much later than due the event loop woke a "
                                   f"task that slept {every_s:g} s (synchronous work on the loop delays every stream)",
                                   buckets=LAG_BUCKETS, registry=registry)
        self.max_seen = 0.0
        Gauge("orpheus_event_loop_lag_max_seconds", "The largest event-loop lag seen since the process started",
              registry=registry).set_function(lambda: self.max_seen)

    def record(self, lag_s: float) -> None:
        lag_s = max(lag_s, 0.0)
        self.histogram.observe(lag_s)
        self.max_seen = max(self.max_seen, lag_s)

    async def watch(self) -> None:
        """Measure until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.every_s
            await asyncio.sleep(self.every_s)
            self.record(loop.time() - due)
