"""The vLLM engine adapter in-process, on the real vLLM CPU engine: frame-constrained tokens, seeds, abort, both
logits processor paths (the slot sampler and the plain mask), the audio-only head against Llama's whole head, and
LoRA voices. Two engines for all of it (vLLM's start is most of these tests' cost): LoRA off with the audio head,
and LoRA on (max_loras 2, the CPU LoRA fix's case), whose head is the whole one."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time

import numpy as np
import pytest
import pytest_asyncio
from processes import TINY_CACHE

from benchmarks.lora_adapters import make_adapter
from llm_server.config import LlmServerConfig
from llm_server.engine import Adapter, EngineError, Sampling
from llm_server.engine.audio_tokens import CODES_PER_FRAME, frame_violations
from llm_server.engine.model_source import resolve_model
from llm_server.engine.vllm import VllmEngine
from llm_server.speech.prompt import clone_prompt_ids
from llm_server.voices import VoiceRegistry, VoicesDirectory

PROMPT = [128259, 128000, 83, 64, 81, 64, 25, 128009, 128260, 128261, 128257]


@pytest_asyncio.fixture(scope="module")
async def engine():
    config = LlmServerConfig(cache_dir=TINY_CACHE, device="cpu", enforce_eager=True, max_model_len=1024, max_num_seqs=16)
    eng = VllmEngine(config, resolve_model("tiny", TINY_CACHE))
    await eng.start()
    yield eng
    await eng.shutdown()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Two rank-8 adapters of the tiny checkpoint, and one of rank 32 (above the engine's max_lora_rank 16)."""
    root, base = tmp_path_factory.mktemp("adapters"), resolve_model("tiny", TINY_CACHE)
    return {name: make_adapter(base, root / name, seed, rank) for name, seed, rank in
            (("ava", 1, 8), ("bob", 2, 8), ("wide", 3, 32))}


@pytest_asyncio.fixture(scope="module")
async def lora_engine():
    config = LlmServerConfig(cache_dir=TINY_CACHE, device="cpu", enforce_eager=True, max_model_len=1024, max_num_seqs=8,
                             enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=4)
    engine = VllmEngine(config, resolve_model("tiny", TINY_CACHE))
    await engine.start()
    yield engine
    await engine.shutdown()


async def _generate(engine, sampling: Sampling, request_id: str, adapter=None, prompt=PROMPT) -> list[int]:
    tokens: list[int] = []
    async for delta in engine.generate(prompt, sampling, request_id, adapter):
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


# --- the audio-only head (llm_server/engine/audio_head.py, issue 44): the same tokens as Llama's whole head, which a
# LoRA engine runs (its base voice is the reference); with LoRA on, the whole head ----------------------------------

def _twelve_frames(seed: int) -> Sampling:
    return Sampling(max_tokens=7 * 12 + 1, seed=seed)


async def test_the_audio_head_gives_the_whole_heads_tokens_alone_and_batched(engine, lora_engine):
    """Before the LoRA tests below in file order: the LoRA engine has no adapter loaded yet, so its base voice is
    Llama's whole head and nothing else (later, with every LoRA slot taken, engine/cpu_lora.py would be in the path)."""
    audio, full = engine, lora_engine
    assert audio.describe()["head"] == "audio" and full.describe()["head"] == "full"
    ours = [await _generate(audio, _twelve_frames(i), f"alone-{i}") for i in range(4)]
    theirs = [await _generate(full, _twelve_frames(i), f"alone-{i}") for i in range(4)]
    assert ours == theirs
    ours_batched = await asyncio.gather(*(_generate(audio, _twelve_frames(i), f"batched-{i}") for i in range(8)))
    theirs_batched = await asyncio.gather(*(_generate(full, _twelve_frames(i), f"batched-{i}") for i in range(8)))
    assert ours_batched == theirs_batched and ours_batched[:4] == ours
    assert all(frame_violations(tokens) == [] for tokens in ours_batched)
    assert audio.num_unfinished() == full.num_unfinished() == 0


async def test_with_lora_on_the_whole_head_runs_and_a_lora_voice_speaks_differently(lora_engine, adapters):
    """vLLM wraps the logits processor for LoRA on lm_head (LogitsProcessorWithLoRA) whenever LoRA is on; the audio
    rows would skip an adapter's head delta, so a LoRA engine computes the whole head. The adapter's id is one no
    voice registry of this process hands out (they count from 1): vLLM caches an adapter by its id."""
    ava = Adapter("head-test-ava@9001", 9001, str(adapters["ava"]))
    await lora_engine.load_adapter(ava)
    assert lora_engine.describe()["head"] == "full"
    base = await _generate(lora_engine, _twelve_frames(1), "lora-base")
    voiced = await _generate(lora_engine, _twelve_frames(1), "lora-voiced", ava)
    assert voiced != base and frame_violations(voiced) == []


# --- LoRA voices (issue 26, item 2) on the real engine: adapters made here for the `tiny` checkpoint
# (benchmarks/lora_adapters.py), read by the voices directory as a worker reads them --------------------------------

VOICE_SAMPLING = _twelve_frames(5)


async def _lora_voices(engine, root) -> VoiceRegistry:
    registry = VoiceRegistry.of(LlmServerConfig())
    await VoicesDirectory(str(root)).refresh(registry, engine.load_adapter)
    return registry


async def test_a_lora_voice_speaks_differently_from_the_base_and_the_same_each_time(lora_engine, adapters, tmp_path):
    from transformers import AutoTokenizer

    for name in ("ava", "bob"):
        shutil.copytree(adapters[name], tmp_path / name)
    registry = await _lora_voices(lora_engine, tmp_path)
    ava, bob = registry.resolve("ava").adapter, registry.resolve("bob").adapter
    base = await _generate(lora_engine, VOICE_SAMPLING, "base")
    first, again, other = [await _generate(lora_engine, VOICE_SAMPLING, request_id, adapter)
                           for request_id, adapter in (("ava-1", ava), ("ava-2", ava), ("bob-1", bob))]
    assert first == again  # same text, same seed
    assert len({tuple(base), tuple(first), tuple(other)}) == 3  # each adapter changes what is generated
    assert frame_violations(first) == frame_violations(other) == []  # the frame constraint holds under LoRA

    # A clone voice's stream: the zero-shot prompt (a reference turn of 12 frames), no adapter.
    clone_prompt = clone_prompt_ids(AutoTokenizer.from_pretrained(resolve_model("tiny", TINY_CACHE)), "A reference.",
                                    np.random.default_rng(3).integers(0, 4096, size=(12, 7)), "Hello.")
    clone = await _generate(lora_engine, VOICE_SAMPLING, "clone-alone", prompt=clone_prompt)
    assert clone not in (base, first, other)

    # One batch of base, ava, bob and clone streams (two of each): every stream gets the tokens it got alone.
    voices = [(None, PROMPT), (ava, PROMPT), (bob, PROMPT), (None, clone_prompt)] * 2
    mixed = await asyncio.gather(*(_generate(lora_engine, VOICE_SAMPLING, f"mixed-{i}", adapter, prompt)
                                   for i, (adapter, prompt) in enumerate(voices)))
    assert mixed == [base, first, other, clone] * 2
    assert lora_engine.num_unfinished() == 0


async def test_an_adapter_vllm_cannot_load_is_refused_when_found_and_never_reaches_a_request(lora_engine, adapters,
                                                                                             tmp_path, caplog):
    shutil.copytree(adapters["wide"], tmp_path / "wide")  # rank 32 > max_lora_rank 16
    shutil.copytree(adapters["ava"], tmp_path / "weightless")
    (tmp_path / "weightless" / "adapter_model.safetensors").unlink()
    # Canopy's own recipe (finetune/lora.py in canopyai/Orpheus-TTS) also saves the LM head and the embeddings
    shutil.copytree(adapters["ava"], tmp_path / "canopy")
    config = json.loads((tmp_path / "canopy" / "adapter_config.json").read_text())
    (tmp_path / "canopy" / "adapter_config.json").write_text(
        json.dumps({**config, "modules_to_save": ["lm_head", "embed_tokens"]}))
    with caplog.at_level(logging.WARNING, logger="llm_server.voices"):
        registry = await _lora_voices(lora_engine, tmp_path)
    assert registry.get("wide") is None and registry.get("weightless") is None and registry.get("canopy") is None
    assert "'wide'" in caplog.text and "rank" in caplog.text.lower() and "'weightless'" in caplog.text
    # vLLM's own reasons, in GET /v1/voices beside the name (issue 44, finding 4)
    why = {v["id"]: v["reason"] for v in registry.listing()["unavailable"]}
    assert sorted(why) == ["canopy", "weightless", "wide"]
    assert "LoRA rank 32 is greater than max_lora_rank 16" in why["wide"]
    assert "modules_to_save" in why["canopy"] and "lm_head" in why["canopy"]
    assert await _generate(lora_engine, VOICE_SAMPLING, "still-serving") == \
        await _generate(lora_engine, VOICE_SAMPLING, "still-serving-2")


async def test_an_adapter_added_while_the_engine_runs_serves_and_its_removal_lets_running_requests_finish(
        lora_engine, adapters, tmp_path):
    voices = VoicesDirectory(str(tmp_path))
    registry = VoiceRegistry.of(LlmServerConfig())
    await voices.refresh(registry, lora_engine.load_adapter)
    shutil.copytree(adapters["bob"], tmp_path / "late")
    await voices.refresh(registry, lora_engine.load_adapter)
    late = registry.resolve("late").adapter
    alone = await _generate(lora_engine, VOICE_SAMPLING, "late-alone", late)

    running = lora_engine.generate(PROMPT, VOICE_SAMPLING, "late-running", late)
    tokens = list(await anext(running))
    shutil.rmtree(tmp_path / "late")
    await voices.refresh(registry, lora_engine.load_adapter)
    assert registry.get("late") is None
    tokens += [t async for delta in running for t in delta]
    assert tokens == alone
