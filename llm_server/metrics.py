"""Prometheus metrics of one llm-server worker, in a registry of its own."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from orpheus_common.loop_lag import LoopLag

from .capacity import REASONS

# Around what a voice agent feels: 100-300 ms to first audio is good, a second is bad.
_TTFA_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0)
# A stream's playback gaps, summed (0: none at all); a listener notices 100 ms.
_UNDERRUN_BUCKETS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
# A stream is continuous at T when no gap of its playback was longer (SGLang-Omni's TTS benchmark passes at 100 or
# 200 ms; vLLM-Omni's audio_continuity_ok_total counts by the same thresholds).
CONTINUITY_THRESHOLDS_MS = (100, 200)


class VllmMetrics:
    """vLLM's own metrics (vllm:*), which its Prometheus stat logger keeps in prometheus_client's
    default registry, served beside the worker's: engine queue, KV-cache use, token latencies."""

    def collect(self):
        return (family for family in REGISTRY.collect() if family.name.startswith("vllm:"))


class LlmMetrics:
    """The worker's metrics; `registry` is what GET /metrics serves."""

    def __init__(self, engine_unfinished: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.time_to_first_audio = Histogram(
            "orpheus_time_to_first_audio_seconds", "Request start to first audio byte", buckets=_TTFA_BUCKETS, registry=r
        )
        self.time_to_first_audible_audio = Histogram(
            "orpheus_time_to_first_audible_audio_seconds", "Request start to the first audio above the silence threshold",
            buckets=_TTFA_BUCKETS, registry=r,
        )
        self.active_streams = Gauge("orpheus_active_streams", "Speech streams being served", registry=r)
        self.tokens = Counter("orpheus_generated_tokens", "Audio-code tokens generated", registry=r)
        self.frames = Counter("orpheus_frames", "Audio frames generated (7 tokens each)", registry=r)
        self.audio_seconds = Counter("orpheus_audio_seconds", "Seconds of audio delivered", registry=r)
        # A real-time listener of each stream that sent audio, from its first audio on (speech/playback.py).
        self.underrun = Histogram("orpheus_stream_underrun_seconds", "Seconds a real-time listener of a stream "
                                  "waited with nothing to play after its first audio, per stream",
                                  buckets=_UNDERRUN_BUCKETS, registry=r)
        self.continuity = Counter("orpheus_stream_continuity", "Streams that sent audio, by whether their longest "
                                  "playback gap at real time was within threshold_ms", ["threshold_ms", "continuous"],
                                  registry=r)
        for threshold in CONTINUITY_THRESHOLDS_MS:
            for continuous in ("true", "false"):
                self.continuity.labels(str(threshold), continuous)  # at 0 from the start: a ratio needs both
        # kind: loop (the model repeated a few frames for 2 s: ended there), budget (no end of speech
        # within the text's token budget: ended by it)
        self.runaway = Counter("orpheus_runaway_segments", "Segments ended for runaway generation", ["kind"], registry=r)
        # outcome: ok, disconnected, error, slow_client (cut off), cancelled (barge-in), refused (a stream cap),
        # invalid_input (a segment's prompt too long for the context)
        self.requests = Counter("orpheus_requests", "Speech requests by outcome", ["outcome"], registry=r)
        # By key name (never the key), when API keys are on: outcomes as above, plus refused_key.
        self.key_requests = Counter("orpheus_key_requests", "Speech requests by API key name and outcome",
                                    ["key", "outcome"], registry=r)
        # cause: capacity (the worker's measured limit), key (an API key's own cap)
        self.refusals = Counter("megapod_worker_refusals", "Streams refused at admission, by cause", ["cause"], registry=r)
        self.codec_late_chunks = Counter("orpheus_codec_late_chunks", "Codec audio chunks owed that came slower than "
                                         "the target pace on their own", registry=r)
        # Their ratio of rates is the pace the codec tier delivers owed audio at (a stalled replica's silence counted
        # as it happens): the codec's own view beside what each stream's listener heard (admission's signal).
        self.codec_owed_audio = Counter("orpheus_codec_owed_audio_seconds", "Audio seconds the codec tier delivered "
                                        "while streams waited on it (a frame's allowance more a chunk)", registry=r)
        self.codec_owed_wait = Counter("orpheus_codec_owed_wait_seconds", "Seconds streams waited on the codec tier "
                                       "for owed audio, those still waiting counted as they wait", registry=r)
        self.codec_failovers = Counter("orpheus_codec_failovers", "Codec streams that failed over to another replica "
                                       "(one refused, stalled past the stall timeout, or went away)", registry=r)
        self.capacity = Gauge("megapod_worker_capacity_streams", "Streams this worker admits at once now (the "
                              "measured limit, llm_server/capacity.py)", registry=r)
        self.decoding = Gauge("megapod_worker_decoding_streams", "Streams whose engine request is decoding now (the "
                              "batch the pace is measured on)", registry=r)
        self.queued = Gauge("megapod_worker_queued_streams", "Requests waiting in the admission queue for a slot",
                            registry=r)
        # The autoscaler's metric: a fixed active-stream target was wrong wherever the measured limit is not it.
        self.capacity_used = Gauge("megapod_worker_capacity_used_ratio", "Streams held over the streams admitted at "
                                   "once now (above 1 while the limit falls below what was admitted)", registry=r)
        # reason: pace_below_realtime, growth, codec_failover, listener_behind (capacity.py); every move of the limit
        self.limit_changes = Counter("orpheus_capacity_limit_changes", "Moves of the admission limit, by why it moved",
                                     ["reason"], registry=r)
        for reason in REASONS:
            self.limit_changes.labels(reason)  # exported at 0 from the start: a rate() needs the series
        self.pace = Gauge("megapod_worker_pace_ratio", "Tokens per decoding stream over real time, last window "
                          "(1: exactly real time; NaN: too little decoding to say)", registry=r)
        self.codec_pace = Gauge("megapod_worker_codec_pace_ratio", "The pace the codec tier delivered owed audio at "
                                "over the last quiet span (capacity.LISTENER_QUIET_S), over the target pace; past the "
                                "slow start the limit grows only at capacity.CODEC_ROOM or more (NaN: no stream waited "
                                "on the codec)", registry=r)
        self.streams_behind = Counter("megapod_worker_streams_behind", "Admitted streams whose listener at the "
                                      "target pace waited past the lag admission allows (capacity.LISTENER_LAG_S)",
                                      registry=r)
        # action: refused (a message over a socket's budget, dropped unread), closed (a flood that went on)
        self.socket_refused = Counter("orpheus_socket_budget_refusals", "Client socket messages refused over the "
                                      "socket's budget, and sockets closed for it", ["action"], registry=r)
        self.loop_lag = LoopLag(r)
        self.unauthorized = Counter("orpheus_unauthorized_requests", "Requests refused for a missing or unknown API key",
                                    registry=r)
        self.engine_queue = Gauge("orpheus_engine_unfinished_requests", "Requests held by the engine", registry=r)
        self.engine_queue.set_function(engine_unfinished)
        self.engine_info = Gauge("orpheus_engine_info", "What runs the model, as the engine reports it (value 1)",
                                 ["engine", "runner", "attention_backend", "trtllm_decode", "head"], registry=r)
        r.register(VllmMetrics())

    def refused(self, cause: str) -> None:
        """A stream refused at admission: its outcome and its cause."""
        self.requests.labels("refused").inc()
        self.refusals.labels(cause).inc()

    def counted_codec(self, counts) -> None:
        """What the codec client counted since the last call (runtime.CodecCounts)."""
        self.codec_failovers.inc(counts.failovers)
        self.codec_late_chunks.inc(counts.late)
        self.codec_owed_audio.inc(max(0.0, counts.owed_audio_s))
        self.codec_owed_wait.inc(max(0.0, counts.owed_wait_s))

    def played(self, playback) -> None:
        """A stream's playback as a real-time listener heard it (speech/playback.Playback), once it has ended."""
        if not playback.started:
            return
        self.underrun.observe(playback.underrun_s)
        for threshold in CONTINUITY_THRESHOLDS_MS:
            self.continuity.labels(str(threshold), str(playback.continuous(threshold / 1000)).lower()).inc()

    def describe_engine(self, description: dict[str, object]) -> None:
        """Publish the engine's own description as the labels of orpheus_engine_info."""
        backends = description.get("backends", [])
        self.engine_info.labels(
            str(description.get("engine", "")), str(description.get("runner", "")),
            ",".join(backends) if isinstance(backends, list) else str(backends), str(description.get("trtllm_decode", "")),
            str(description.get("head", "")),
        ).set(1)
