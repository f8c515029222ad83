"""One stream's audio: text segments in, in order; PCM out, in order.

Each segment is its own engine request (the model degrades on long prompts) and its own codec
stream, ended as soon as its generation ends: the decoder flushes the segment's tail at once, so a
voice agent that pauses between sentences hears every sample of the last one. Segments are
generated one after another while earlier ones are still being decoded and played; a segment's
codec stream opens when its audio is next in line, so a long answer holds one decoder slot and the
codec decodes what is about to be heard first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from codec_contract.audio import unpack_frames

from ..capacity import PaceMeter
from ..config import LlmServerConfig
from ..engine import Engine, Sampling
from ..engine.audio_tokens import FrameAssembler
from ..metrics import LlmMetrics
from ..voices import Voice
from .codec_client import AudioChunk, CodecClient, CodecError, CodecStream
from .prompt import MIN_SPEECH_TOKENS, Tokenizer, check_room, clone_prompt_ids, prompt_ids, token_budget
from .runaway import WINDOW, LoopDetector

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpeechJob:
    """What is spoken, by whom: the request id (names engine and codec requests), voice and seed."""

    request_id: str
    voice: Voice
    seed: int


class SpeechPipeline:
    """What every stream of a worker shares: the engine, the codec client, the tokenizer, the settings, the
    metrics, and admission's pace meter (how fast the engine really generates for the streams it holds)."""

    def __init__(self, engine: Engine, codec: CodecClient, tokenizer: Tokenizer, config: LlmServerConfig,
                 metrics: LlmMetrics, pace: PaceMeter) -> None:
        self.engine = engine
        self.codec = codec
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics
        self.pace = pace

    def start(self, job: SpeechJob) -> SpeechStream:
        """Begin a stream; add() its segments, iterate segments() for PCM."""
        return SpeechStream(self, job)


class SpeechStream:
    """One stream's generation, owned whole: segments in with add()/end(); segments() yields each one's
    text and its AudioChunks, in order, while later segments are generated.

    cancel() stops at once: the engine request is aborted (its KV cache freed) and the codec streams
    are cancelled.
    """

    def __init__(self, pipeline: SpeechPipeline, job: SpeechJob) -> None:
        self.job = job
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self._pipeline = pipeline
        self._texts: asyncio.Queue[str | None] = asyncio.Queue()
        self._codecs: asyncio.Queue[tuple[str, CodecStream] | None] = asyncio.Queue()
        self._live: set[CodecStream] = set()
        self._producer = asyncio.create_task(self._produce())
        self._producer.add_done_callback(self._wake_on_failure)

    def add(self, text: str) -> None:
        """Speak `text` after everything added before it."""
        self._texts.put_nowait(text)

    def end(self) -> None:
        """No more segments: segments() ends after the last one's audio."""
        self._texts.put_nowait(None)

    async def segments(self) -> AsyncIterator[tuple[str, AsyncIterator[AudioChunk]]]:
        """Each segment's text and its audio, in order; read a segment's audio whole before asking for the next."""
        while True:
            item = await self._codecs.get()
            if item is None:
                if not self._producer.cancelled():
                    await self._producer  # re-raises a failure before any codec stream opened
                return
            text, codec = item
            yield text, self._audio(codec)

    def cancel(self) -> None:
        """Abort generation (frees the KV cache) and every codec stream."""
        self._producer.cancel()
        for codec in list(self._live):
            codec.cancel()

    async def close(self) -> None:
        """Cancel, and wait until generation has really stopped."""
        self.cancel()
        await asyncio.gather(self._producer, return_exceptions=True)

    async def _audio(self, codec: CodecStream) -> AsyncIterator[AudioChunk]:
        try:
            async for chunk in codec.chunks():
                yield chunk
        except CodecError:
            self._raise_producer_failure()
            raise
        finally:
            self._live.discard(codec)

    async def _produce(self) -> None:
        """Generate every segment in order, each into a codec stream queued for segments() as it starts."""
        index = 0
        while (text := await self._texts.get()) is not None:
            seed = (self.job.seed + index) & 0x7FFFFFFF
            request_id = f"{self.job.request_id}-{index}"
            codec = self._pipeline.codec.stream(seed, request_id)
            self._live.add(codec)
            self._codecs.put_nowait((text, codec))
            await self._generate(codec, text, seed, request_id)
            index += 1
        self._codecs.put_nowait(None)

    async def _generate(self, codec: CodecStream, text: str, seed: int, request_id: str) -> None:
        """One segment: its engine request, its frames sent to `codec` as they complete, then the end."""
        p = self._pipeline
        ids = self._prompt(text)
        check_room(ids, text, p.config.max_model_len)
        self.prompt_tokens += len(ids)
        assembler, loops = FrameAssembler(), LoopDetector()
        sampling = self._sampling(text, len(ids), seed)
        generation = p.engine.generate(ids, sampling, request_id, self.job.voice.adapter)
        generated = sent = 0
        keep: int | None = None
        # Closed here even when cancelled mid-send (or ended for a loop): the engine aborts the request
        # at once, not whenever the garbage collector finalizes a dropped generator.
        async with aclosing(generation), p.pace.decoding() as decoded:
            async for tokens in generation:
                decoded(len(tokens))
                generated += len(tokens)
                self.generated_tokens += len(tokens)
                p.metrics.tokens.inc(len(tokens))
                frames = assembler.feed(tokens)
                if (keep := loops.feed(frames)) is not None:
                    frames = frames[:keep]  # up to the frame that completed the loop: a frame boundary
                if len(frames):
                    p.metrics.frames.inc(len(frames))
                    sent += len(frames)
                    await codec.send(frames)
                if keep is not None:
                    p.metrics.runaway.labels("loop").inc()
                    log.warning("%s: the model looped (a %d-frame block over %d frames); segment ended after "
                                "%d frames", request_id, loops.period, WINDOW, sent)
                    break
        if keep is None and not assembler.stopped and generated >= sampling.max_tokens:
            p.metrics.runaway.labels("budget").inc()  # it would have gone on: the text's budget ended it
            # INFO, not WARNING: with random weights (make serve, the tests) every segment ends so
            log.info("%s: no end of speech within the segment's budget of %d tokens", request_id, sampling.max_tokens)
        assembler.finish()
        if assembler.dropped_tokens and keep is None:  # after a loop, the tokens past it were cut on purpose
            log.warning("%s: dropped %d tokens of a partial frame", request_id, assembler.dropped_tokens)
        await codec.end()

    def _prompt(self, text: str) -> list[int]:
        voice, tokenizer = self.job.voice, self._pipeline.tokenizer
        if voice.reference is not None:
            return clone_prompt_ids(tokenizer, voice.reference.transcript, unpack_frames(voice.reference.frames), text)
        return prompt_ids(tokenizer, voice.prompt_name, text)

    def _sampling(self, segment: str, prompt_len: int, seed: int) -> Sampling:
        config = self._pipeline.config
        return Sampling(
            max_tokens=max(MIN_SPEECH_TOKENS, min(token_budget(segment), config.max_model_len - prompt_len)),
            temperature=config.temperature,
            top_p=config.top_p,
            repetition_penalty=config.repetition_penalty,
            seed=seed,
        )

    def _wake_on_failure(self, producer: asyncio.Task) -> None:
        """A failed producer cancels the codec streams, and an idle reader gets the end: nobody waits forever."""
        if producer.cancelled() or producer.exception() is not None:
            for codec in list(self._live):
                codec.cancel()
            self._codecs.put_nowait(None)

    def _raise_producer_failure(self) -> None:
        if self._producer.done() and not self._producer.cancelled() and self._producer.exception():
            raise self._producer.exception() from None
