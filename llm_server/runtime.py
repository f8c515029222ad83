"""Everything one worker runs, started once in the app's lifespan and stopped with it."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

from codec_contract.audio import POLICIES

from .admission import AdmissionController
from .capacity import CapacityLimit, Listeners, PaceMeter
from .config import LlmServerConfig
from .engine import Engine
from .engine.model_source import resolve_model
from .metrics import LlmMetrics
from .reference_audio import ReferenceBounds, ReferenceDecoder
from .speech.codec_client import CodecClient, CodecClientConfig
from .speech.prompt import Tokenizer
from .speech.stream import SpeechPipeline
from .voices import VoiceRegistry, VoicesDirectory, has_adapters

log = logging.getLogger(__name__)


def codec_client_config(config: LlmServerConfig) -> CodecClientConfig:
    """The worker's settings for its codec client: replicas, policy, stall deadline, when audio is late, TLS."""
    return CodecClientConfig(
        addresses=config.snac,
        policy=POLICIES[config.codec_policy],
        stall_timeout_s=config.resolved_codec_stall_timeout_s,
        target_pace=config.resolved_target_pace,  # audio slower than this is late: the codec tier is behind
        listener_ahead_s=config.codec_listener_ahead_s,
        tls_ca=config.codec_tls_ca,
        tls_cert=config.codec_tls_cert,
        tls_key=config.codec_tls_key,
        tls_server_name=config.codec_tls_server_name,
    )


@dataclass(frozen=True)
class CodecCounts:
    """The codec client's counts since it started (differences of two: what happened between)."""

    failovers: int = 0
    late: int = 0
    owed_audio_s: float = 0.0
    owed_wait_s: float = 0.0

    @classmethod
    def of(cls, codec: CodecClient) -> CodecCounts:
        return cls(codec.failovers, codec.late, codec.owed_audio_s, codec.owed_wait_s)

    def __sub__(self, other: CodecCounts) -> CodecCounts:
        return CodecCounts(self.failovers - other.failovers, self.late - other.late,
                           self.owed_audio_s - other.owed_audio_s, self.owed_wait_s - other.owed_wait_s)


def lora_enabled(config: LlmServerConfig) -> bool:
    """LoRA as configured; unset, on when the voices directory holds an adapter (it costs every step)."""
    return config.enable_lora if config.enable_lora is not None else has_adapters(config.voices_dir)


def build_engine(config: LlmServerConfig, model_dir: str) -> Engine:
    """The configured backend over a resolved model directory (or Hub id), LoRA on or off as lora_enabled says."""
    config = config.model_copy(update={"enable_lora": lora_enabled(config)})
    if config.backend == "trtllm":
        from .engine.trtllm import TrtLlmEngine

        return TrtLlmEngine(config, model_dir)
    from .engine.vllm import VllmEngine

    return VllmEngine(config, model_dir)


@dataclass
class Runtime:
    """The engine, codec client, tokenizer and pipeline of one worker."""

    config: LlmServerConfig
    engine: Engine
    codec: CodecClient
    tokenizer: Tokenizer
    pipeline: SpeechPipeline
    admission: AdmissionController
    metrics: LlmMetrics
    voices: VoiceRegistry
    voices_dir: VoicesDirectory | None = None  # the operator's own voices (--voices-dir), re-read while serving
    reference_decoder: ReferenceDecoder | None = None  # clone uploads' recordings (clones.py)

    def __post_init__(self) -> None:
        self.admission.on_reserve = self._reserve_moved  # held back at a refusal too, not only at the capacity tick

    @classmethod
    async def start(cls, config: LlmServerConfig) -> Runtime:
        """Resolve the model, start the engine, connect to the codec tier."""
        from transformers import AutoTokenizer

        model_dir = resolve_model(config.model, config.cache_dir)
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or model_dir)
        engine = build_engine(config, model_dir)
        await engine.start()
        runtime = cls.assemble(config, engine, CodecClient(codec_client_config(config)), tokenizer, model_dir)
        await runtime.refresh_voices()
        log.info(
            "worker ready: model %s (%s backend), codec at %s%s; admitting %d streams at first (%d to %d, by the "
            "pace the engine keeps)", config.model, config.backend, config.snac, " over TLS" if config.codec_tls_ca else "",
            runtime.admission.max_streams, config.stream_floor, config.stream_ceiling,
        )
        return runtime

    @classmethod
    def assemble(cls, config: LlmServerConfig, engine: Engine, codec: CodecClient, tokenizer: Tokenizer,
                 model_dir: str | None = None) -> Runtime:
        """A worker's runtime around a started engine and a codec client: metrics, pipeline, admission, and
        the voices of the checkpoint in `model_dir` and of the voices directory (voices.py; refresh_voices reads it)."""
        voices = VoiceRegistry.of(config, model_dir)
        voices_dir = VoicesDirectory(config.voices_dir) if config.voices_dir else None
        metrics = LlmMetrics(engine.num_unfinished)
        metrics.describe_engine(engine.describe())
        limit = CapacityLimit(config.initial_streams, config.stream_floor, config.stream_ceiling, config.resolved_target_pace,
                              config.refusal_reserve)
        admission = AdmissionController(limit, PaceMeter(time.monotonic()), Listeners(config.listener_lag_s))
        metrics.capacity.set_function(lambda: admission.max_streams)
        metrics.capacity_used.set_function(lambda: admission.active / admission.max_streams)
        metrics.decoding.set_function(lambda: admission.meter.decoding_now)
        metrics.queued.set_function(lambda: admission.queued)
        metrics.pace.set_function(lambda: math.nan if limit.pace is None else limit.pace)
        metrics.codec_pace.set_function(lambda: math.nan if limit.codec_pace is None else limit.codec_pace)
        pipeline = SpeechPipeline(engine, codec, tokenizer, config, metrics, admission.meter)
        decoder = ReferenceDecoder(ReferenceBounds(max_s=config.max_reference_s), config.reference_decode_timeout_s,
                                   config.max_reference_uploads)
        return cls(config, engine, codec, tokenizer, pipeline, admission, metrics, voices, voices_dir, decoder)

    async def refresh_voices(self) -> None:
        """Read the voices directory again if it changed: new adapters loaded into the engine, removed ones
        no longer offered."""
        if self.voices_dir is not None:
            await self.voices_dir.refresh(self.voices, self.engine.load_adapter)

    async def watch_voices(self) -> None:
        """refresh_voices every voices_poll_s, while serving."""
        while self.voices_dir is not None:
            await asyncio.sleep(self.config.voices_poll_s)
            try:  # a failure here must not stop the worker from seeing later changes
                await self.refresh_voices()
            except Exception:
                log.exception("reading the voices directory %s failed; its voices stay as they were", self.config.voices_dir)

    async def watch_capacity(self) -> None:
        """Move the admission limit every capacity_tick_s(), by the pace measured, what the admitted streams' listeners
        heard (capacity.Listeners) and the codec tier's failovers; export the codec client's counts as they grow."""
        counted = CodecCounts.of(self.codec)
        failovers = 0  # since the limit last moved (its log line's)
        while True:
            await asyncio.sleep(self.capacity_tick_s())
            try:  # a failure here must not freeze the limit for the worker's life
                now = CodecCounts.of(self.codec)
                self.metrics.counted_codec(now - counted)
                self.admission.limit.codec_delivered(now.owed_audio_s - counted.owed_audio_s,
                                                     now.owed_wait_s - counted.owed_wait_s, time.monotonic())
                if now.failovers > counted.failovers:
                    self.admission.limit.codec_failover()
                    failovers += now.failovers - counted.failovers
                counted = now
                self.admission.hold_reserve(time.monotonic())
                before = self.admission.max_streams
                window = self.admission.end_window(time.monotonic())
                if window is not None:
                    self.metrics.streams_behind.inc(self.admission.heard.behind)
                    if self.admission.limit.reason is not None:
                        self._limit_moved(before, window, failovers)
                    failovers = 0
                elif self.admission.max_streams != before:  # grown while requests wait, between windows
                    self.metrics.limit_changes.labels(self.admission.limit.reason).inc()
                    log.info("admission limit %d -> %d streams: %s (%s, %d requests waiting)", before,
                             self.admission.max_streams, self.admission.limit.reason,
                             "slow start" if self.admission.limit.slow_start else "careful", self.admission.queued)
            except Exception:
                log.exception("moving the admission limit failed; it stays at %d", self.admission.max_streams)

    def capacity_tick_s(self) -> float:
        """How long until watch_capacity looks again: capacity_window_s, or a tenth of the queue's wait while requests
        wait for a limit in its slow start (a cold worker's first burst, which waited a whole tick per doubling:
        most of its 3 s on a CPU). A window still ends only once it says enough about the pace."""
        if self.admission.queued and self.admission.limit.slow_start:
            return max(0.01, min(self.config.capacity_window_s, self.config.resolved_admission_queue_s / 10))
        return self.config.capacity_window_s

    def _reserve_moved(self, before: int) -> None:
        """Count and log the limit's reserve held back (requests refused) or given back."""
        limit = self.admission.limit
        self.metrics.limit_changes.labels(limit.reason).inc()
        log.info("admission limit %d -> %d streams: %s (%s: %.0f %% of the limit %s, %d admitted, %d requests waiting)",
                 before, limit.streams, limit.reason, "requests refused" if limit.refusing else "none refused lately",
                 100 * limit.reserve, "held back" if limit.refusing else "given back", self.admission.active,
                 self.admission.queued)

    def _limit_moved(self, before: int, window, failovers: int) -> None:
        """Count and log why the limit moved, with the figures it moved by."""
        limit, heard = self.admission.limit, self.admission.heard
        self.metrics.limit_changes.labels(limit.reason).inc()
        pace = "-" if window.pace is None else f"{window.pace:.2f}"
        codec = "-" if limit.codec_pace is None else f"{limit.codec_pace:.2f}x"
        log.info("admission limit %d -> %d streams: %s (pace %s against real time %.3f and a target of %.3f, %.1f "
                 "streams decoding, %d admitted; listeners at the target pace: %d fell behind, %d of them admitted since "
                 "the last cut, the most lag of one waiting %.3f s; codec owed audio at %s the target; %d codec "
                 "failovers)", before, limit.streams, limit.reason, pace, limit.realtime_pace, limit.target_pace,
                 window.mean_decoding, self.admission.active, heard.behind, heard.behind_since_cut, heard.waiting_lag_s,
                 codec, failovers)

    async def readiness_problems(self) -> list[str]:
        """Why this worker should not get traffic now; empty when ready."""
        problems = []
        if not await self.codec.ready(timeout_s=1.0):
            problems.append(f"no SNAC replica reachable at {self.config.snac}")
        return problems

    async def stop(self) -> None:
        await self.engine.shutdown()
        await self.codec.close()
