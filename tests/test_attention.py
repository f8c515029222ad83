"""GPU attention settings reach vLLM's own config objects, and the combinations vLLM would silently
ignore, fall back from, or fail on later are refused at start-up with the reason."""

from __future__ import annotations

import pytest

from llm_server.engine.attention import AttentionSettingError, attention_config
from llm_server.config import LlmServerConfig
from llm_server.engine.model_source import resolve_model
from llm_server.engine.vllm import engine_args
from processes import TINY_CACHE


def gpu_worker(**settings) -> LlmServerConfig:
    return LlmServerConfig(device="cuda", cache_dir=TINY_CACHE, max_model_len=1024, **settings)


@pytest.mark.parametrize("backend, trtllm, expected_backend, expected_trtllm", [
    ("auto", "auto", None, None),  # vLLM chooses (FlashAttention 3 on Hopper)
    ("auto", "on", "FLASHINFER", True),  # TRT-LLM kernels live in FlashInfer: on picks it
    ("FLASHINFER", "auto", "FLASHINFER", None),  # FlashInfer decides per GPU (XQA decode on Hopper)
    ("flashinfer", "off", "FLASHINFER", False),
    ("FLASH_ATTN", "off", "FLASH_ATTN", False),
    ("TRITON_ATTN", "auto", "TRITON_ATTN", None),
])
def test_each_setting_builds_vllms_engine_config(backend, trtllm, expected_backend, expected_trtllm):
    # vLLM imported here, not at collection: every pytest-xdist worker collects this module
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as Backend

    args = engine_args(gpu_worker(attention_backend=backend, trtllm_attention=trtllm), resolve_model("tiny", TINY_CACHE))
    vllm_config = args.create_engine_config()  # vLLM's own VllmConfig, validated by vLLM
    assert vllm_config.attention_config.backend == (Backend[expected_backend] if expected_backend else None)
    assert vllm_config.attention_config.use_trtllm_attention is expected_trtllm


@pytest.mark.parametrize("settings, env, device, reason", [
    (dict(attention_backend="FLASH_ATTN", trtllm_attention="on"), {}, "cuda", "needs attention_backend FLASHINFER"),
    (dict(trtllm_attention="on", kv_cache_dtype="fp8_e5m2"), {}, "cuda", "e4m3 only"),
    (dict(trtllm_attention="on"), {"VLLM_BATCH_INVARIANT": "1"}, "cuda", "batch-invariant mode"),
    (dict(trtllm_attention="off", kv_cache_dtype="nvfp4"), {}, "cuda", "runs only on FlashInfer's TRT-LLM path"),
    (dict(attention_backend="FLASHINFER"), {}, "cpu", "leave both auto on CPU"),
    (dict(trtllm_attention="on"), {}, "cpu", "leave both auto on CPU"),
    (dict(attention_backend="FLASH_ATTENTION_9"), {}, "cuda", "is not a vLLM backend"),
])
def test_refused_combinations_say_why(settings, env, device, reason):
    with pytest.raises(AttentionSettingError, match=reason):
        attention_config(gpu_worker(**settings), device, env)


def test_trtllm_attention_takes_auto_on_or_off():
    with pytest.raises(ValueError, match="'auto', 'on' or 'off'"):
        LlmServerConfig(trtllm_attention="yes")
