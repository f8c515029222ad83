"""The Engine over vLLM's V1 async engine, in-process: ids in, streamed token ids out.

The engine is driven from the event loop that started it, for its whole life (V1 breaks
with a loop per request). A request whose consumer stops early is aborted, which frees its
KV cache at once.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncIterator

from ..config import LlmServerConfig
from . import Adapter, EngineError, Sampling
from .attention import attention_config
from .audio_tokens import STOP_TOKEN_IDS, STREAM_INTERVAL
from .frame_constraint import OPT_IN, FrameConstraintV1, FrameConstraintV2
from .model_source import TINY
from .probe import WORKER_EXTENSION
from .vllm_plugin import AUDIO_HEAD

log = logging.getLogger(__name__)


def engine_dtype(config: LlmServerConfig) -> str:
    """The tiny checkpoint is float32 and runs so: vLLM's `auto` would downcast it to bfloat16, whose CPU
    matmul without AVX-512 BF16 is the slow path it is float32 to avoid (benchmarks/engine_step_cpu.py)."""
    return "float32" if config.dtype == "auto" and config.model == TINY else config.dtype


def _cpu_environment(config: LlmServerConfig) -> None:
    """vLLM's CPU backend reads these from the environment; an operator's own values win.

    Its default thread binding (`auto`) pins each engine's worker process to the first NUMA node's cores
    but one, the same cores for every engine on the host: `megapod up`'s workers and the tests' engines
    all queued on core 0 of a two-core machine (a worker's start took minutes beside two others'). Unbound,
    with one intra-op thread (the codec replica's rule too), the OS spreads them.

    Unbound, the model also runs inside the EngineCore process, as on a GPU: the CPU backend moves it to a
    process of its own (the `mp` executor, for its binding) unless V1 multiprocessing is off, which for
    AsyncLLM changes only that. That process costs a vLLM import per start, and EngineCore's queue to it
    spins on sched_yield for a second after every message (47% of a decoding engine's CPU samples).
    AsyncLLM keeps EngineCore in its own process either way, so vLLM's start-up warning that "the global
    random seed ... may affect the random state of the Python process that launched vLLM" does not apply
    here: only the worker seeds (vllm/v1/worker/cpu_worker.py), and it runs in EngineCore."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(config.cpu_kv_cache_gb))))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind":
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _cuda_environment() -> None:
    """FlashInfer's fused top-k/top-p sampler off (an operator's own value wins): Model Runner V2 warms its sampler
    with unseeded top-k/top-p requests (v1/worker/gpu/warmup.py), which take that sampler, and where FlashInfer has
    no precompiled sampling kernels it compiles them at start-up (minutes; it needs nvcc and ninja) or the start
    fails (vllm#42393): vLLM 0.33's `flashinfer_sampler_supported` checks for neither. Every request of ours
    carries a seed (speech/stream.py), and a seeded row never takes the fused sampler
    (v1/worker/gpu/sample/sampler.py: any_explicit_seed), so serving loses nothing."""
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


def engine_args(config: LlmServerConfig, model_dir: str):
    """AsyncEngineArgs from the worker config; every engine setting maps one-to-one."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    device = config.resolved_device
    if device == "cpu":
        _cpu_environment(config)
    else:
        _cuda_environment()
    return AsyncEngineArgs(
        model=model_dir,
        tokenizer=config.tokenizer or model_dir,
        dtype=engine_dtype(config),
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        async_scheduling=config.async_scheduling,
        max_cudagraph_capture_size=config.max_cudagraph_capture_size,
        gpu_memory_utilization=config.gpu_memory_utilization,
        enable_prefix_caching=config.enable_prefix_caching,
        quantization=config.quantization or None,
        kv_cache_dtype=config.kv_cache_dtype,
        load_format=config.load_format,
        enforce_eager=config.enforce_eager,
        enable_lora=bool(config.enable_lora),  # the runtime's decision (runtime.lora_enabled)
        max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank,
        max_cpu_loras=config.max_cpu_loras,
        speculative_config=json.loads(config.speculative_config) if config.speculative_config else None,
        attention_config=attention_config(config, device, os.environ),
        logits_processors=[FrameConstraintV1],
        hf_overrides={"architectures": [AUDIO_HEAD]} if config.audio_head else {},
        worker_extension_cls=WORKER_EXTENSION,
        disable_log_stats=True,
        enable_log_requests=False,
    )


def refuse_speculation_on_v1(vllm_config) -> None:
    """The frame constraint is a custom logits processor, which vLLM's V1 runner refuses alongside any
    speculative config (at worker start, after minutes of loading): refuse here, at once, instead."""
    spec = vllm_config.speculative_config
    if spec is None or vllm_config.use_v2_model_runner:
        return
    why = "vLLM's CPU backend" if vllm_config.device_config.device_type == "cpu" else (
        "VLLM_USE_V2_MODEL_RUNNER=0" if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0" else f"method {spec.method!r}")
    raise EngineError(
        f"speculative decoding with the frame constraint needs vLLM's Model Runner V2, and this configuration "
        f"runs the V1 runner ({why}), which refuses custom logits processors under speculation. Supported: "
        "Model Runner V2 (the CUDA default) with method eagle, eagle3, ngram, mtp or draft_model; not suffix "
        "decoding or custom proposers, not VLLM_USE_V2_MODEL_RUNNER=0, not CPU."
    )


def v1_runner_on_cuda(vllm_config) -> str | None:
    """What a CUDA engine forced onto the V1 runner (VLLM_USE_V2_MODEL_RUNNER=0) costs, or None: its sampler draws
    each seeded row's noise with a kernel of its own, launched from Python, every step (v1/sample/ops/
    topk_topp_sampler.py, random_sample), and every request of ours is seeded: 512 launches a step at full tilt."""
    if vllm_config.device_config.device_type != "cuda" or vllm_config.use_v2_model_runner:
        return None
    return ("vLLM's V1 runner on CUDA (VLLM_USE_V2_MODEL_RUNNER=0): its sampler launches one kernel per seeded "
            "stream per step from Python, and every stream here is seeded; unset VLLM_USE_V2_MODEL_RUNNER for "
            "Model Runner V2, which draws every row's noise in one kernel")


class VllmEngine:
    """vLLM AsyncLLM behind the narrow Engine interface."""

    def __init__(self, config: LlmServerConfig, model_dir: str) -> None:
        self._config = config
        self._model_dir = model_dir
        self._engine = None
        # Sample the slot in the logits processor where that pays: the CPU (V1 runner). On a GPU it
        # would read every row back each step; there the processor masks and vLLM samples.
        self._slot_sampler = config.resolved_device == "cpu"
        self.attention: dict[str, object] = {}

    async def start(self) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.loggers import PrometheusStatLogger

        args = engine_args(self._config, self._model_dir)
        vllm_config = args.create_engine_config()
        if vllm_config.use_v2_model_runner:  # GPU default: that runner has its own processor API
            args.logits_processors = [FrameConstraintV2]
            vllm_config = args.create_engine_config()
            self._slot_sampler = False
        refuse_speculation_on_v1(vllm_config)
        if (why := v1_runner_on_cuda(vllm_config)) is not None:
            log.warning(why)
        # No per-request logging from vLLM: a prompt's ids spell out the input text, which stays
        # out of logs (llm-server --log-input-text is the one switch for it). Its Prometheus stat
        # logger only (no periodic log lines): the vllm:* metrics the worker's /metrics also serves.
        self._engine = AsyncLLM.from_vllm_config(vllm_config, stat_loggers=[PrometheusStatLogger],
                                                 disable_log_stats=True, enable_log_requests=False)
        runner = "V2" if vllm_config.use_v2_model_runner else "V1"
        self.attention = {"runner": runner, **(await self._engine.collective_rpc("megapod_attention"))[0]}
        log.info("vLLM engine up (%s runner); attention %s", runner, self.attention)
        if self._config.engine_nice:
            nice = await self._engine.collective_rpc("megapod_nice", args=(self._config.engine_nice,))
            log.info("the engine's model thread runs at niceness %s, below the codec replicas beside it", nice[0])

    def _params(self, sampling: Sampling):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        common = dict(
            max_tokens=sampling.max_tokens,
            stop_token_ids=list(STOP_TOKEN_IDS),
            output_kind=RequestOutputKind.DELTA,
            stream_interval=STREAM_INTERVAL,
            detokenize=False,
            seed=sampling.seed,
        )
        if sampling.frame_constrained and self._slot_sampler:
            spec = {"temperature": sampling.temperature, "top_p": sampling.top_p,
                    "repetition_penalty": sampling.repetition_penalty, "seed": sampling.seed}
            return SamplingParams(temperature=0.0, extra_args={OPT_IN: spec}, **common)
        return SamplingParams(
            temperature=sampling.temperature, top_p=sampling.top_p, repetition_penalty=sampling.repetition_penalty,
            extra_args={OPT_IN: True} if sampling.frame_constrained else None, **common,
        )

    async def load_adapter(self, adapter: Adapter) -> None:
        """vLLM's runtime adapter loading (what its /v1/load_lora_adapter does): the engine reads and checks the
        PEFT directory (rank, target modules) now, so a bad adapter is refused here, not in a request."""
        if not self._engine.vllm_config.lora_config:
            raise EngineError("LoRA is off in this engine: it is on when the voices directory holds an adapter at "
                              "start, or with --enable-lora true")
        try:
            await self._engine.add_lora(_lora_request(adapter))
        except Exception as exc:
            raise EngineError(f"vLLM cannot load the adapter: {exc}") from exc

    async def generate(self, prompt_ids: list[int], sampling: Sampling, request_id: str,
                       adapter: Adapter | None = None) -> AsyncIterator[list[int]]:
        from vllm.exceptions import VLLMServerError
        from vllm.inputs import TokensPrompt

        finished = False
        lora = _lora_request(adapter) if adapter is not None else None
        try:
            async for output in self._engine.generate(TokensPrompt(prompt_token_ids=prompt_ids), self._params(sampling),
                                                      request_id, lora_request=lora):
                tokens = list(output.outputs[0].token_ids)
                if tokens:
                    yield tokens
                finished = output.finished
        except VLLMServerError as exc:
            # The engine's failures, not the request's: EngineDeadError, EngineGenerateError, and 0.33's
            # GenerationError (a request refused on arrival by a paused engine; vllm/outputs.py, RequestError)
            raise EngineError(f"engine failed request {request_id}: {exc}") from exc
        finally:
            if not finished:  # the consumer left early: free the KV cache now
                await self.abort(request_id)

    def describe(self) -> dict[str, object]:
        return {"engine": "vllm", **self.attention}

    async def abort(self, request_id: str) -> None:
        if self._engine is not None:
            await self._engine.abort(request_id)

    def num_unfinished(self) -> int:
        if self._engine is None:
            return 0
        return self._engine.output_processor.get_num_unfinished_requests()

    async def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None


def _lora_request(adapter: Adapter):
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=adapter.name, lora_int_id=adapter.id, lora_path=adapter.path)
