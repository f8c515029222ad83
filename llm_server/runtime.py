"""Everything one worker runs, started once in the app's lifespan and stopped with it."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from codec_contract.audio import POLICIES

from .admission import AdmissionController
from .codec_client import CodecClient, CodecClientConfig
from .config import LlmServerConfig
from .engine import Engine
from .metrics import LlmMetrics
from .model_source import resolve_model
from .prompt import Tokenizer
from .speech import SpeechPipeline

log = logging.getLogger(__name__)

def codec_client_config(config: LlmServerConfig) -> CodecClientConfig:
    """The worker's settings for its codec client: replicas, policy, stall deadline, TLS."""
    return CodecClientConfig(
        addresses=config.snac,
        policy=POLICIES[config.codec_policy],
        stall_timeout_s=config.codec_stall_timeout_s,
        tls_ca=config.codec_tls_ca,
        tls_cert=config.codec_tls_cert,
        tls_key=config.codec_tls_key,
        tls_server_name=config.codec_tls_server_name,
    )


def build_engine(config: LlmServerConfig, model_dir: str) -> Engine:
    """The configured backend over a resolved model directory (or Hub id)."""
    if config.backend == "trtllm":
        from .trtllm_engine import TrtLlmEngine

        return TrtLlmEngine(config, model_dir)
    from .vllm_engine import VllmEngine

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

    @classmethod
    async def start(cls, config: LlmServerConfig) -> Runtime:
        """Resolve the model, start the engine, connect to the codec tier."""
        from transformers import AutoTokenizer

        model_dir = resolve_model(config.model, config.cache_dir)
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or model_dir)
        engine = build_engine(config, model_dir)
        await engine.start()
        codec = CodecClient(codec_client_config(config))
        metrics = LlmMetrics(engine.num_unfinished)
        metrics.describe_engine(engine.describe())
        pipeline = SpeechPipeline(engine, codec, tokenizer, config, metrics)
        log.info(
            "worker ready: model %s (%s backend), codec at %s%s",
            config.model, config.backend, config.snac, " over TLS" if config.codec_tls_ca else "",
        )
        return cls(config, engine, codec, tokenizer, pipeline, AdmissionController(config.max_streams), metrics)

    async def readiness_problems(self) -> list[str]:
        """Why this worker should not get traffic now; empty when ready."""
        problems = []
        if not await self.codec.ready(timeout_s=1.0):
            problems.append(f"no SNAC replica reachable at {self.config.snac}")
        return problems

    async def stop(self) -> None:
        await self.engine.shutdown()
        await self.codec.close()
