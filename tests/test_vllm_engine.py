"""The vLLM engine adapter in-process: frame-constrained tokens, seeds, abort, and both logits
processor paths (the slot sampler and the plain mask)."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest
import pytest_asyncio
from processes import TINY_CACHE

from llm_server.config import LlmServerConfig
from llm_server.engine import EngineError, Sampling
from llm_server.engine.audio_tokens import CODES_PER_FRAME, frame_violations
from llm_server.engine.model_source import resolve_model
from llm_server.engine.vllm import VllmEngine

PROMPT = [128259, 128000, 83, 64, 81, 64, 25, 128009, 128260, 128261, 128257]


@pytest_asyncio.fixture(scope="module")
async def engine():
    config = LlmServerConfig(cache_dir=TINY_CACHE, device="cpu", enforce_eager=True, max_model_len=1024, max_num_seqs=16)
    eng = VllmEngine(config, resolve_model("tiny", TINY_CACHE))
    await eng.start()
    yield eng
    await eng.shutdown()


async def _generate(engine, sampling: Sampling, request_id: str) -> list[int]:
    tokens: list[int] = []
    async for delta in engine.generate(PROMPT, sampling, request_id):
        tokens += delta
    return tokens


@pytest.mark.parametrize("slot_sampler", [True, False], ids=["slot-sampler", "mask-only"])
async def test_every_generated_id_lies_in_its_slot(engine, slot_sampler):
    engine._slot_sampler = slot_sampler
    try:  # 10 frames and a token a stream: each of the 7 slots sampled 80 times, the next frame begun
        outs = await asyncio.gather(*(_generate(engine, Sampling(max_tokens=71, seed=i), f"slots-{slot_sampler}-{i}") for i in range(8)))
    finally:
        engine._slot_sampler = True
    assert sum(len(o) for o in outs) > 8 * 7
    for tokens in outs:
        assert frame_violations(tokens) == []


def test_the_engine_reports_the_attention_its_workers_chose(engine):
    """Asked of vLLM's own workers (the front end's config keeps `auto`): on CPU, vLLM's CPU attention; the head
    the model computes (the audio rows: engine/audio_head.py, on by default)."""
    assert engine.describe() == {"engine": "vllm", "runner": "V1", "backends": ["CPU_ATTN"], "trtllm_decode": "none",
                                 "head": "audio"}


async def test_speculation_on_the_v1_runner_is_refused_before_loading():
    """vLLM's V1 runner (CPU here) refuses custom logits processors with any speculative config, but
    only at worker start; the frame constraint is one, so start() refuses first, naming what works."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    config = LlmServerConfig(cache_dir=TINY_CACHE, device="cpu", enforce_eager=True, max_model_len=1024, speculative_config=spec)
    refused = VllmEngine(config, resolve_model("tiny", TINY_CACHE))
    with pytest.raises(EngineError, match="needs vLLM's Model Runner V2.*eagle, eagle3, ngram, mtp or draft_model"):
        await refused.start()
    assert refused.num_unfinished() == 0


async def test_unconstrained_requests_are_left_alone(engine):
    tokens = await _generate(engine, Sampling(max_tokens=40, temperature=0, frame_constrained=False), "free-1")
    assert frame_violations(tokens), "a random model without the mask should stray outside the slots"


async def test_a_seed_makes_the_tokens_reproducible_whatever_runs_beside(engine):
    alone = await _generate(engine, Sampling(max_tokens=70, seed=42), "seed-alone")
    crowd = [_generate(engine, Sampling(max_tokens=70, seed=100 + i), f"seed-crowd-{i}") for i in range(5)]
    together, *_ = await asyncio.gather(_generate(engine, Sampling(max_tokens=70, seed=42), "seed-together"), *crowd)
    assert alone == together
    assert alone != await _generate(engine, Sampling(max_tokens=70, seed=43), "seed-other")


async def test_tokens_come_a_frame_at_a_time(engine):
    """After the first token vLLM hands them over a frame at a time (stream_interval), so the worker
    wakes once a frame, not once a token (a consumer that falls behind gets several frames at once)."""
    sizes = [len(d) async for d in engine.generate(PROMPT, Sampling(max_tokens=7 * 12 + 1, seed=7), "by-frame")]
    assert sizes[0] == 1 and len(sizes) >= 3
    assert all(s % CODES_PER_FRAME == 0 for s in sizes[1:-1]), sizes


async def test_a_frame_at_a_time_hands_over_the_same_tokens_as_one_at_a_time(engine):
    """Handing tokens over a frame at a time changes when they arrive, never which: the same seeded
    request gives the same tokens as with vLLM's default of one per output, so the same frames and PCM."""
    from vllm.inputs import TokensPrompt

    sampling = Sampling(max_tokens=7 * 10 + 1, seed=11)
    by_frame = await _generate(engine, sampling, "same-by-frame")
    params = engine._params(sampling)
    params.stream_interval = 1
    one_by_one: list[int] = []
    sizes = []
    async for output in engine._engine.generate(TokensPrompt(prompt_token_ids=PROMPT), params, "same-one-by-one"):
        sizes.append(len(output.outputs[0].token_ids))
        one_by_one += output.outputs[0].token_ids
    assert len(sizes) > 20, "the reference run really got its 71 tokens in many small outputs (a frame at a time: 11)"
    assert by_frame == one_by_one and len(by_frame) > 7


async def test_closing_the_stream_aborts_the_request(engine):
    stream = engine.generate(PROMPT, Sampling(max_tokens=700, seed=1), "abort-me")
    await stream.__anext__()
    assert engine.num_unfinished() >= 1
    await stream.aclose()
    for _ in range(20):
        if engine.num_unfinished() == 0:
            break
        await asyncio.sleep(0.05)
    assert engine.num_unfinished() == 0


def test_trtllm_backend_refuses_clearly_without_tensorrt_llm():
    """The second backend is importable everywhere and names what it needs where it cannot run."""
    from llm_server.engine import EngineError
    from llm_server.engine.trtllm import TrtLlmEngine

    engine = TrtLlmEngine(LlmServerConfig(backend="trtllm"), "unused")
    with pytest.raises(EngineError, match="tensorrt_llm"):
        asyncio.run(engine.start())
    assert engine.num_unfinished() == 0
    assert engine.describe()["engine"] == "trtllm"


async def test_an_engine_with_lora_off_refuses_an_adapter_saying_how_to_turn_it_on(engine, tmp_path):
    from llm_server.engine import Adapter

    with pytest.raises(EngineError, match="LoRA is off in this engine.*--enable-lora true"):
        await engine.load_adapter(Adapter("ava@1", 1, str(tmp_path)))


async def test_a_clone_voices_reference_turn_is_served_from_the_prefix_cache_on_its_second_request(engine):
    """The zero-shot prompt's reference turn is the same for every request of a clone voice: vLLM's prefix cache
    holds it, so the second request (other text) prefills only what follows it."""
    from transformers import AutoTokenizer
    from vllm.inputs import TokensPrompt

    from llm_server.speech.prompt import clone_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("tiny", TINY_CACHE))
    reference = np.random.default_rng(11).integers(0, 4096, size=(40, 7))  # 280 audio tokens
    cached, prompts = [], []
    for i, text in enumerate(("First request.", "A second, other one.")):
        prompts.append(clone_prompt_ids(tokenizer, "What the reference recording says.", reference, text))
        params = engine._params(Sampling(max_tokens=15, seed=i))
        async for output in engine._engine.generate(TokensPrompt(prompt_token_ids=prompts[-1]), params, f"clone-{i}"):
            cached.append(output.num_cached_tokens)  # the first output carries the request's prefix cache hits
            break
        await engine.abort(f"clone-{i}")
    shared = len(os.path.commonprefix(prompts))  # the reference turn and the next turn's opening
    block = engine._engine.vllm_config.cache_config.block_size
    assert shared > 280 and cached[0] == 0
    assert shared - block < cached[1] <= shared  # every whole block of it came from the cache


class RecordingEngine:
    """Test double around the real engine: records each request's prompt, delegates the rest."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.prompts: list[list[int]] = []

    def generate(self, prompt_ids, sampling, request_id, adapter=None):
        self.prompts.append(prompt_ids)
        return self.engine.generate(prompt_ids, sampling, request_id, adapter)


async def test_long_input_is_spoken_sentence_by_sentence_as_one_stream(engine, snac_server):
    from transformers import AutoTokenizer

    from llm_server.capacity import PaceMeter
    from llm_server.metrics import LlmMetrics
    from llm_server.speech.codec_client import CodecClient, CodecClientConfig
    from llm_server.speech.segmenter import split_sentences
    from llm_server.speech.stream import SpeechJob, SpeechPipeline
    from llm_server.voices import CHECKPOINT, Voice

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("tiny", TINY_CACHE))
    config = LlmServerConfig(cache_dir=TINY_CACHE, max_segment_chars=24, max_model_len=1024)
    recorder = RecordingEngine(engine)
    codec = CodecClient(CodecClientConfig(addresses=snac_server.address))
    meter = PaceMeter(time.monotonic())
    pipeline = SpeechPipeline(recorder, codec, tokenizer, config, LlmMetrics(engine.num_unfinished), meter)
    text = "First one here. Then the second. And a third at last."
    stream = pipeline.start(SpeechJob("long-1", Voice("tara", CHECKPOINT), seed=3))
    for segment in split_sentences(text, config.max_segment_chars):
        stream.add(segment)
    stream.end()
    texts, per_segment = [], []  # each segment's text and the bytes of its audio, in the order heard
    async for text, chunks in stream.segments():
        texts.append(text)
        per_segment.append(sum([len(chunk.pcm) async for chunk in chunks]))
    await codec.close()
    assert texts == ["First one here.", "Then the second.", "And a third at last."]
    pcm_bytes = sum(per_segment)
    assert all(n > 0 and n % (2048 * 2) == 0 for n in per_segment), per_segment
    spoken = [tokenizer.decode(p[2:-4]) for p in recorder.prompts]
    assert spoken == ["tara: First one here.", "tara: Then the second.", "tara: And a third at last."]
    assert pcm_bytes > 0 and pcm_bytes % (2048 * 2) == 0
    assert pcm_bytes // (2048 * 2) * 7 <= stream.generated_tokens, "every frame of every segment is audio"
    # admission's meter saw vLLM's deliveries: every token but each request's first delivery, three
    # requests decoding one after another, none left decoding
    window = meter.take(time.monotonic())
    assert 0 < window.tokens < stream.generated_tokens and window.stream_s > 0 and meter.decoding_now == 0
    assert window.peak_decoding == 1


class _RefusingEngineDouble:
    """A test double of vLLM's AsyncLLM that refuses each request on arrival, as 0.33's paused engine does (a
    RequestError handed back as GenerationError, or RetryableRequestError), and records the aborts asked of it."""

    def __init__(self, error: type[Exception]) -> None:
        self.error, self.aborted = error, []

    async def generate(self, *args, **kwargs):
        raise self.error("refused on arrival")
        yield  # an async generator, as AsyncLLM.generate is

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


@pytest.mark.parametrize("error", ["GenerationError", "RetryableRequestError"])
async def test_a_request_the_engine_refuses_on_arrival_is_an_engine_error_and_aborted(error):
    """vLLM 0.33's GenerationError is the engine's failure, not the client's: it reaches the doors as EngineError
    (a 5xx, the stream's resources freed) like EngineDeadError, not as an unhandled exception (issue 44, item 6)."""
    import vllm.exceptions

    engine = VllmEngine(LlmServerConfig(device="cpu"), "unused")
    engine._engine = _RefusingEngineDouble(getattr(vllm.exceptions, error))
    with pytest.raises(EngineError, match="refused on arrival"):
        await _generate(engine, Sampling(max_tokens=7, seed=1), "refused")
    assert engine._engine.aborted == ["refused"]
