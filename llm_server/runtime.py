"""Everything one worker runs, started once in the app's lifespan and stopped with it."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

from codec_contract.audio import POLICIES

from .admission import AdmissionController
from .capacity import CODEC_FAILOVER, CODEC_LATE, CapacityLimit, PaceMeter
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
        stall_timeout_s=config.codec_stall_timeout_s,
        target_pace=config.resolved_target_pace,  # audio slower than this is late: the codec tier is behind
        tls_ca=config.codec_tls_ca,
        tls_cert=config.codec_tls_cert,
        tls_key=config.codec_tls_key,
        tls_server_name=config.codec_tls_server_name,
    )


def codec_in_trouble(failovers: int, deliveries: int, late: int, late_share: float) -> bool:
    """Whether a window's codec streams say the codec tier has no headroom: a failover, or more than
    `late_share` of its chunks late (one late chunk among many is a hiccup, not a replica behind)."""
    return failovers > 0 or late > late_share * deliveries


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
        limit = CapacityLimit(config.initial_streams, config.stream_floor, config.stream_ceiling, config.resolved_target_pace)
        admission = AdmissionController(limit, PaceMeter(time.monotonic()))
        metrics.capacity.set_function(lambda: admission.max_streams)
        metrics.capacity_used.set_function(lambda: admission.active / admission.max_streams)
        metrics.pace.set_function(lambda: math.nan if limit.pace is None else limit.pace)
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
        """Move the admission limit every capacity_window_s, by the pace measured and the codec tier's trouble:
        a failover, or more than codec_late_share of the window's codec chunks late (a replica behind)."""
        failovers, deliveries, late = self.codec.failovers, self.codec.deliveries, self.codec.late
        codec = (0, 0, 0)  # failovers, deliveries and late chunks of the codec trouble not yet acted on
        while True:
            await asyncio.sleep(self.config.capacity_window_s)
            try:  # a failure here must not freeze the limit for the worker's life
                seen = (self.codec.failovers - failovers, self.codec.deliveries - deliveries, self.codec.late - late)
                self.metrics.codec_late_chunks.inc(seen[2])
                if codec_in_trouble(*seen, self.config.codec_late_share):
                    self.admission.limit.codec_trouble(CODEC_FAILOVER if seen[0] else CODEC_LATE)
                    codec = tuple(a + b for a, b in zip(codec, seen))  # what the next window's move answers
                failovers, deliveries, late = self.codec.failovers, self.codec.deliveries, self.codec.late
                before = self.admission.max_streams
                window = self.admission.end_window(time.monotonic())
                if window is not None:
                    if self.admission.limit.reason is not None:
                        self._limit_moved(before, window, codec)
                    codec = (0, 0, 0)
            except Exception:
                log.exception("moving the admission limit failed; it stays at %d", self.admission.max_streams)

    def _limit_moved(self, before: int, window, codec: tuple[int, int, int]) -> None:
        """Count and log why the limit moved, with the figures it moved by."""
        limit = self.admission.limit
        self.metrics.limit_changes.labels(limit.reason).inc()
        pace = "-" if window.pace is None else f"{window.pace:.2f}"
        log.info("admission limit %d -> %d streams: %s (pace %s against a target of %.2f, %.1f streams decoding; codec: "
                 "%d failovers, %d of %d chunks late)", before, limit.streams, limit.reason, pace, limit.target_pace,
                 window.mean_decoding, codec[0], codec[2], codec[1])

    async def readiness_problems(self) -> list[str]:
        """Why this worker should not get traffic now; empty when ready."""
        problems = []
        if not await self.codec.ready(timeout_s=1.0):
            problems.append(f"no SNAC replica reachable at {self.config.snac}")
        return problems

    async def stop(self) -> None:
        await self.engine.shutdown()
        await self.codec.close()
