"""Prometheus metrics of the SNAC tier, in a registry of their own (one per server)."""

from __future__ import annotations

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
        self.held_streams = Gauge("snac_held_streams", "Streams further ahead of their listeners than their bound, "
                                  "waiting while another stream needs its next row", registry=r)
        self.slots_in_use = Gauge("snac_state_slots_in_use", "Streaming decoder state slots holding a stream", registry=r)
        # Their ratio is the decoder's redundancy: ~1.0 streaming (plus flush and resume context), 4.0 reference.
        self.frames_decoded = Counter(
            "snac_decoded_frames", "Frames run through the decoder (context, flush and replay included)", registry=r
        )
        self.frames_emitted = Counter("snac_emitted_frames", "Audio sent to clients, in frames (2048 samples)", registry=r)
        self.streams_total = Counter("snac_streams", "Decode streams by outcome", ["outcome"], registry=r)
        self.encode_latency = Histogram("snac_encode_seconds", "Wall time of one encode (a clone voice's reference "
                                        "recording), on the encoder's thread", buckets=_LATENCY_BUCKETS, registry=r)
        self.encodes_total = Counter("snac_encodes", "Encode requests by outcome", ["outcome"], registry=r)
        self.compiled_step = Gauge("snac_compiled_step", "1 while the streaming step runs compiled (torch.compile), 0 "
                                   "eager (not asked, or its compile failed at warm-up: the log says why)", registry=r)
        self.decoder_snr_db = Gauge("snac_decoder_snr_db", "The decoder's SNR against fp32 on the served weights "
                                    "(+Inf in fp32; measured at start-up for fp16/bf16)", registry=r)

    def count_step(self, rows: int, frames: int) -> None:
        """Count a decode step of `rows` rows and `frames` frames before any of its results is handed
        back: a client that has its audio must find it counted."""
        self.batch_size.observe(rows)
        self.frames_decoded.inc(frames)
