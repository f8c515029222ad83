"""The audio-only head (llm_server/engine/audio_head.py, issue 44): its logits exactly the whole head's on the rows it
computes, and where it cannot apply, vLLM computes the whole head. On the real vLLM CPU engine (the same tokens as
the whole head, alone and batched; LoRA on, the whole head): tests/test_vllm_engine.py, whose engines they share."""

from __future__ import annotations

import torch

from llm_server.engine.audio_head import HEAD_ROWS, AudioRows
from llm_server.engine.audio_tokens import END_OF_SPEECH


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
