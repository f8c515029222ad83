"""The audio-only head (llm_server/engine/audio_head.py) on the real vLLM CPU engine: the same tokens as Llama's whole
head for the same seeds, alone and batched; with LoRA on, vLLM's whole head, LoRA voices unchanged; the head's logits exactly the whole head's on
the rows it computes; and where it cannot apply, vLLM computes the whole head (issue 44, the audio-only head)."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
import torch
from processes import TINY_CACHE

from benchmarks.lora_adapters import make_adapter
from llm_server.config import LlmServerConfig
from llm_server.engine import Adapter, Sampling
from llm_server.engine.audio_head import HEAD_ROWS, AudioRows
from llm_server.engine.audio_tokens import END_OF_SPEECH, frame_violations
from llm_server.engine.model_source import resolve_model
from llm_server.engine.vllm import VllmEngine

PROMPT = [128259, 128000, 83, 64, 81, 64, 25, 128009, 128260, 128261, 128257]
TOKENS = 7 * 12 + 1


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Adapter:
    path = make_adapter(resolve_model("tiny", TINY_CACHE), tmp_path_factory.mktemp("adapter") / "ava", seed=1)
    return Adapter("ava@1", 1, str(path))


@pytest_asyncio.fixture(scope="module")
async def engines(adapter):
    """The audio head and Llama's whole head, LoRA off; and the audio head asked for with LoRA on."""
    started = {}
    for name, head, lora in (("audio", True, False), ("full", False, False), ("audio-lora", True, True)):
        config = LlmServerConfig(cache_dir=TINY_CACHE, device="cpu", enforce_eager=True, max_model_len=1024,
                                 max_num_seqs=8, enable_lora=lora, max_loras=2, max_lora_rank=16, audio_head=head)
        engine = VllmEngine(config, resolve_model("tiny", TINY_CACHE))
        await engine.start()
        started[name] = engine
    await started["audio-lora"].load_adapter(adapter)
    yield started
    for engine in started.values():
        await engine.shutdown()


async def _tokens(engine, request_id: str, seed: int, adapter=None) -> list[int]:
    return [t async for d in engine.generate(PROMPT, Sampling(max_tokens=TOKENS, seed=seed), request_id, adapter)
            for t in d]


async def test_the_audio_head_gives_the_whole_heads_tokens_alone_and_batched(engines):
    audio, full = engines["audio"], engines["full"]
    assert audio.describe()["head"] == "audio" and full.describe()["head"] == "full"
    ours = [await _tokens(audio, f"alone-{i}", i) for i in range(4)]
    theirs = [await _tokens(full, f"alone-{i}", i) for i in range(4)]
    assert ours == theirs
    ours_batched = await asyncio.gather(*(_tokens(audio, f"batched-{i}", i) for i in range(8)))
    theirs_batched = await asyncio.gather(*(_tokens(full, f"batched-{i}", i) for i in range(8)))
    assert ours_batched == theirs_batched and ours_batched[:4] == ours
    assert all(frame_violations(tokens) == [] for tokens in ours_batched)
    assert audio.num_unfinished() == full.num_unfinished() == 0


async def test_with_lora_on_the_whole_head_runs_and_lora_voices_speak_as_before(engines, adapter):
    """vLLM wraps the logits processor for LoRA on lm_head (LogitsProcessorWithLoRA) whenever LoRA is on; the audio
    rows would skip an adapter's head delta, so a LoRA engine computes the whole head: its voices unchanged."""
    lora = engines["audio-lora"]
    assert lora.describe()["head"] == "full"
    base, voiced = await _tokens(lora, "lora-base", 1), await _tokens(lora, "lora-voiced", 1, adapter)
    assert base == await _tokens(engines["full"], "base-again", 1)  # LoRA on, unused: the base voice's tokens
    assert voiced != base and frame_violations(voiced) == []


def test_the_audio_rows_logits_are_the_whole_heads_on_their_rows_and_minus_infinity_elsewhere():
    torch.manual_seed(0)
    weight, hidden = torch.randn(156_940, 32), torch.randn(5, 32)
    logits = AudioRows(weight).logits(hidden, 156_940)
    whole = hidden @ weight.T
    assert torch.allclose(logits[:, HEAD_ROWS], whole[:, HEAD_ROWS], rtol=1e-5, atol=1e-5)
    assert torch.isneginf(logits[:, : END_OF_SPEECH]).all() and torch.isneginf(logits[:, HEAD_ROWS.stop:]).all()
    # a view of the head's weight, not a copy: tied embeddings stay tied, and nothing is held twice
    assert AudioRows(weight).weight.data_ptr() == weight[HEAD_ROWS].data_ptr()


def test_a_head_it_does_not_read_is_left_to_vllm():
    """A LoRA adapter on lm_head wraps vLLM's logits processor, a checkpoint may soft-cap or scale its logits: the
    audio rows would not be what vLLM computes, so the whole head runs."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    from llm_server.engine.audio_head import audio_only_head_applies

    def processor(**changes) -> LogitsProcessor:  # vLLM's own class, its fields set without a vLLM config
        made = LogitsProcessor.__new__(LogitsProcessor)
        made.__dict__.update({"soft_cap": None, "scale": 1.0, "logits_as_input": False, "head_dtype": None, **changes})
        return made

    head = SimpleNamespace(weight=torch.zeros(2, 2))
    wrapped = SimpleNamespace(logits_processor=SimpleNamespace(soft_cap=None, scale=1.0), lm_head=head)
    capped = SimpleNamespace(logits_processor=processor(soft_cap=30.0), lm_head=head)
    scaled = SimpleNamespace(logits_processor=processor(scale=0.5), lm_head=head)
    assert not any(audio_only_head_applies(m) for m in (wrapped, capped, scaled))
