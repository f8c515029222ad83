"""The Engine over TensorRT-LLM's LLM API (second backend, `--backend trtllm`).

Written against the LLM API (tensorrt_llm.LLM.generate_async with streaming=True, per-request
logits processors). Not run in this project's CI: TensorRT-LLM's PyPI package is a stub that
fetches its wheel from NVIDIA's registry, which these machines cannot reach. On a GPU host
with tensorrt_llm installed it plugs in behind the same interface as vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import torch

from ..config import LlmServerConfig
from . import Adapter, EngineError, Sampling
from .audio_tokens import CODES_PER_FRAME, STOP_TOKEN_IDS
from .slot_mask import blocked_ids

log = logging.getLogger(__name__)


class FrameMask:
    """Per-request TensorRT-LLM logits processor: the same frame mask as the vLLM paths.

    The slot is a count of this processor's own calls, one per generated token, not the length of
    `token_ids`: TensorRT-LLM's overlap scheduler (its default) calls processors before the previous
    step's token is appended, so from the second token on that length is one short. The count holds
    while a prompt is prefilled in one forward, so the engine runs with chunked prefill off.
    """

    def __init__(self) -> None:
        self.generated = 0

    def __call__(self, req_id: int, logits: torch.Tensor, token_ids: list[list[int]], stream_ptr: int | None,
                 client_id: int | None) -> None:
        if logits.is_cuda and stream_ptr:  # the TensorRT engine backend names its stream; PyTorch's passes None
            with torch.cuda.stream(torch.cuda.ExternalStream(stream_ptr)):
                self._mask(logits)
        else:
            self._mask(logits)
        self.generated += 1

    def _mask(self, logits: torch.Tensor) -> None:
        # One view of the precomputed table (a Python int index is a view, not an upload) and one fill.
        blocked = blocked_ids(logits.shape[-1], logits.device)[self.generated % CODES_PER_FRAME]
        logits.masked_fill_(blocked, float("-inf"))


class TrtLlmEngine:
    """tensorrt_llm.LLM behind the narrow Engine interface."""

    def __init__(self, config: LlmServerConfig, model_dir: str) -> None:
        self._config = config
        self._model_dir = model_dir
        self._llm = None
        self._running: dict[str, object] = {}

    async def start(self) -> None:
        try:
            from tensorrt_llm import LLM
            from tensorrt_llm.llmapi import KvCacheConfig
        except ImportError as exc:
            raise EngineError("--backend trtllm needs tensorrt_llm installed (NVIDIA's wheel, GPU hosts only)") from exc
        self._llm = LLM(
            model=self._model_dir,
            tokenizer=self._config.tokenizer or self._model_dir,
            dtype=self._config.dtype,
            max_batch_size=self._config.max_num_seqs,
            max_seq_len=self._config.max_model_len,
            kv_cache_config=KvCacheConfig(
                free_gpu_memory_fraction=self._config.gpu_memory_utilization,
                enable_block_reuse=self._config.enable_prefix_caching,
            ),
            enable_chunked_prefill=False,  # FrameMask counts one call per generated token (see there)
        )
        log.info("TensorRT-LLM engine up")

    async def load_adapter(self, adapter: Adapter) -> None:
        raise EngineError("LoRA voices are served by the vLLM backend (--backend vllm)")

    async def generate(self, prompt_ids: list[int], sampling: Sampling, request_id: str,
                       adapter: Adapter | None = None) -> AsyncIterator[list[int]]:
        from tensorrt_llm import SamplingParams

        if adapter is not None:  # the registry offers no LoRA voice here: load_adapter refused them all
            raise EngineError("LoRA voices are served by the vLLM backend (--backend vllm)")

        params = SamplingParams(
            max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            repetition_penalty=sampling.repetition_penalty, seed=sampling.seed, stop_token_ids=list(STOP_TOKEN_IDS),
            detokenize=False, logits_processor=FrameMask() if sampling.frame_constrained else None,
        )
        result = self._llm.generate_async(prompt_ids, params, streaming=True)
        self._running[request_id] = result
        sent = 0
        try:
            async for output in result:
                tokens = list(output.outputs[0].token_ids)
                if len(tokens) > sent:
                    yield tokens[sent:]
                    sent = len(tokens)
        finally:
            if not result.finished:  # the consumer left early: free the KV cache now
                result.abort()
            self._running.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        result = self._running.pop(request_id, None)
        if result is not None:
            result.abort()

    def num_unfinished(self) -> int:
        return len(self._running)

    def describe(self) -> dict[str, object]:
        return {"engine": "trtllm", "attention": "TensorRT-LLM's own (its LLM API chooses)"}

    async def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
