"""Prometheus metrics of the SNAC tier, in a registry of their own (one per server)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Buckets around the frame budget (85 ms of audio per frame) and the 50 ms chunk target.
_LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.085, 0.12, 0.17, 0.25, 0.5, 1.0, 2.0, 5.0)


class SnacMetrics:
    """The codec tier's metrics; `registry` is what the /metrics endpoint serves."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.batch_size = Histogram(
            "snac_batch_size", "Rows per decode step", buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r
        )
        self.queue_wait = Histogram(
            "snac_queue_wait_seconds", "Time a row waits before its step starts", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.step_latency = Histogram(
            "snac_decode_step_seconds", "Wall time of one decode step", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.chunk_latency = Histogram(
            "snac_chunk_latency_seconds",
            "From a chunk becoming decodable to its PCM being sent",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.active_streams = Gauge("snac_active_streams", "Open decode streams", registry=r)
        self.frames_decoded = Counter("snac_frames_decoded", "Frames whose audio was produced", registry=r)
        self.streams_total = Counter("snac_streams", "Decode streams by outcome", ["outcome"], registry=r)

    def observe_step(self, rows: int, frames: int, started: float) -> None:
        """Record one decode step of `rows` rows emitting `frames` frames."""
        self.batch_size.observe(rows)
        self.step_latency.observe(time.perf_counter() - started)
        self.frames_decoded.inc(frames)
