"""Which attention kernels vLLM runs on a GPU, and what "TRT-LLM kernels" means in this stack.

Inside vLLM 0.33 the TensorRT-LLM attention kernels are FlashInfer's: on Hopper (H100, H200) the XQA
decode kernel, on Blackwell (SM100) trtllm-gen for prefill and decode. They run only under vLLM's
FLASHINFER attention backend (on Hopper auto-selection picks FlashAttention 3 first) and only when
FlashInfer's cubins are installed or downloadable at start-up. vLLM refuses none of these settings:
where it cannot honour one it logs a warning and falls back. So the combinations that would fall
back, or fail later on the GPU, are refused here at start-up, with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config.attention import AttentionConfig

    from ..config import LlmServerConfig

TRTLLM_ATTENTION = {"auto": None, "on": True, "off": False}  # -> AttentionConfig.use_trtllm_attention
FLASHINFER = "FLASHINFER"


class AttentionSettingError(ValueError):
    """An attention setting vLLM would ignore, fall back from, or fail on later."""


def _refusal(config: LlmServerConfig, device: str, env: Mapping[str, str]) -> str | None:
    backend, trtllm, kv = config.attention_backend.upper(), config.trtllm_attention, config.kv_cache_dtype
    if device == "cpu" and (backend != "AUTO" or trtllm != "auto"):
        return ("attention_backend and trtllm_attention choose CUDA kernels; vLLM's CPU backend has its own "
                "attention: leave both auto on CPU")
    if trtllm == "on" and backend not in ("AUTO", FLASHINFER):
        return (f"trtllm_attention on runs FlashInfer's TRT-LLM kernels, so it needs attention_backend {FLASHINFER} "
                f"(or auto), not {config.attention_backend}: vLLM would silently ignore it")
    if trtllm == "on" and kv == "fp8_e5m2":
        return "TRT-LLM attention reads fp8 KV caches as e4m3 only: use kv_cache_dtype fp8 (e4m3) or auto, not fp8_e5m2"
    if trtllm == "on" and env.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0"):
        return "batch-invariant mode (VLLM_BATCH_INVARIANT) turns TRT-LLM attention and the FlashInfer backend off"
    if trtllm == "off" and kv.startswith("nvfp4"):
        return f"a {kv} KV cache runs only on FlashInfer's TRT-LLM path (SM100): trtllm_attention off cannot serve it"
    return None


def attention_config(config: LlmServerConfig, device: str, env: Mapping[str, str]) -> AttentionConfig:
    """vLLM's AttentionConfig for this worker; raises AttentionSettingError for a refused combination.

    `trtllm_attention on` with `attention_backend auto` selects FLASHINFER, the only backend that runs them.
    """
    from vllm.config.attention import AttentionConfig

    reason = _refusal(config, device, env)
    if reason is not None:
        raise AttentionSettingError(reason)
    backend = config.attention_backend
    if config.trtllm_attention == "on" and backend.lower() == "auto":
        backend = FLASHINFER
    try:
        return AttentionConfig(backend=backend, use_trtllm_attention=TRTLLM_ATTENTION[config.trtllm_attention])
    except (KeyError, ValueError) as exc:  # a backend name vLLM does not know
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        known = ", ".join(b.name for b in AttentionBackendEnum)
        raise AttentionSettingError(f"attention_backend {backend!r} is not a vLLM backend (auto, {known})") from exc
