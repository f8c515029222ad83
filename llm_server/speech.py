"""One speech stream end to end: text -> segments -> engine tokens -> frames -> codec -> PCM.

Long text is split at sentence boundaries; each segment is its own engine request, and
all their frames feed one codec stream, so the listener hears one continuous stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from .audio_tokens import FrameAssembler
from .codec_client import CodecClient, CodecError, CodecStream
from .config import LlmServerConfig
from .engine import Engine, Sampling
from .metrics import LlmMetrics
from .prompt import Tokenizer, prompt_ids, split_sentences, token_budget

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpeechJob:
    """A validated request: text, the Orpheus voice to speak it, and its seed."""

    request_id: str
    text: str
    voice: str
    seed: int


class SpeechStream:
    """PCM chunks of one job, in order; cancel() stops the engine requests and the codec stream."""

    def __init__(self, pipeline: SpeechPipeline, job: SpeechJob) -> None:
        self.job = job
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self._codec = pipeline.codec.stream(job.seed, job.request_id)
        self._producer = asyncio.create_task(pipeline.produce(self, self._codec))
        self._producer.add_done_callback(self._wake_on_failure)

    def cancel(self) -> None:
        """The client went away: abort generation (frees KV cache) and the codec session."""
        self._producer.cancel()
        self._codec.cancel()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._codec.chunks():
                if chunk.pcm:
                    yield chunk.pcm
            await self._producer
        except CodecError:
            if self._producer.done() and not self._producer.cancelled() and self._producer.exception():
                raise self._producer.exception() from None
            raise
        finally:
            self.cancel()
            await asyncio.gather(self._producer, return_exceptions=True)

    def _wake_on_failure(self, producer: asyncio.Task) -> None:
        """A failed producer cancels the codec stream: its reader would otherwise wait forever."""
        if not producer.cancelled() and producer.exception() is not None:
            self._codec.cancel()


class SpeechPipeline:
    """Turns SpeechJobs into 16-bit PCM at 24 kHz, chunk by chunk, as soon as it is decoded."""

    def __init__(
        self, engine: Engine, codec: CodecClient, tokenizer: Tokenizer, config: LlmServerConfig, metrics: LlmMetrics
    ) -> None:
        self.engine = engine
        self.codec = codec
        self._tokenizer = tokenizer
        self._config = config
        self._metrics = metrics

    def start(self, job: SpeechJob) -> SpeechStream:
        """Begin generating; iterate the result for audio."""
        return SpeechStream(self, job)

    async def produce(self, out: SpeechStream, codec: CodecStream) -> None:
        """Generate every segment in order and send its frames to the codec as they complete."""
        job = out.job
        for index, segment in enumerate(split_sentences(job.text, self._config.max_segment_chars)):
            ids = prompt_ids(self._tokenizer, job.voice, segment)
            out.prompt_tokens += len(ids)
            assembler = FrameAssembler()
            generation = self.engine.generate(ids, self._sampling(segment, len(ids), job.seed + index), f"{job.request_id}-{index}")
            # Closed here even when cancelled mid-send: the engine aborts the request at once,
            # not whenever the garbage collector finalizes a dropped generator.
            async with aclosing(generation):
                async for tokens in generation:
                    out.generated_tokens += len(tokens)
                    self._metrics.tokens.inc(len(tokens))
                    frames = assembler.feed(tokens)
                    if len(frames):
                        self._metrics.frames.inc(len(frames))
                        await codec.send(frames)
            assembler.finish()
            if assembler.dropped_tokens:
                log.warning("%s segment %d: dropped %d tokens of a partial frame", job.request_id, index, assembler.dropped_tokens)
        await codec.end()

    def _sampling(self, segment: str, prompt_len: int, seed: int) -> Sampling:
        return Sampling(
            max_tokens=max(8, min(token_budget(segment), self._config.max_model_len - prompt_len)),
            temperature=self._config.temperature,
            top_p=self._config.top_p,
            repetition_penalty=self._config.repetition_penalty,
            seed=seed & 0x7FFFFFFF,
        )
