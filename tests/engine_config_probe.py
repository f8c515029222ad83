"""Run with vLLM's CUDA release first on the path (deploy/tools/fetch_vllm_gpu.py): builds that release's own config
objects from a worker's settings, as the worker's engine_args() hands them over, and prints what they resolve to.

    python tests/engine_config_probe.py SETTINGS_LIST_JSON MODEL_DIR    # one result (or error) per settings
    python tests/engine_config_probe.py frame-constraint-v2             # the V2 processor through vLLM's loader

Two test doubles, named as such: an empty module stands in for the compiled kernels' registration (CUDA's
libraries cannot load here), and a Hopper stand-in platform answers what a CUDA device would be asked (compute
capability 9.0, 80 GiB; Triton with an active driver). The model's config (ModelConfig) is not built: vLLM inspects the model's class by
importing its module, which loads kernels; every other config is vLLM's own, validated by its own code,
VllmConfig's checks across them included (async scheduling is refused there when something does not support it).
"""

from __future__ import annotations

import json
import os
import sys
import types

KERNELS = "vllm._C_stable_libtorch"
sys.modules[KERNELS] = types.ModuleType(KERNELS)  # stand-in: kernels are registered on import, never called here

import vllm.platforms  # noqa: E402
from vllm.platforms.cuda import NonNvmlCudaPlatform  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402


class HopperStandIn(NonNvmlCudaPlatform):
    """A test double of an H100 for vLLM's platform questions (the real class asks torch.cuda)."""

    @classmethod
    def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
        return DeviceCapability(major=9, minor=0)

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "NVIDIA H100 80GB HBM3 (stand-in)"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return 80 * 2**30


vllm.platforms._current_platform = HopperStandIn()  # before anything reads vllm.platforms.current_platform

import vllm  # noqa: E402
import vllm.config.vllm  # noqa: E402
from vllm.config import CacheConfig, CompilationConfig, DeviceConfig, SchedulerConfig, VllmConfig  # noqa: E402

# Part of the stand-in: Triton here has no active driver, so vLLM counts it absent; a CUDA machine's has one (Model
# Runner V2, the CUDA default, is chosen only where Triton works).
vllm.config.vllm.HAS_TRITON = True
from vllm.config.quantization import _ONLINE_SHORTHANDS  # noqa: E402
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS  # noqa: E402

from llm_server.config import LlmServerConfig  # noqa: E402
from llm_server.engine.vllm import engine_args, v1_runner_on_cuda  # noqa: E402


def resolve(settings: dict, model_dir: str) -> dict:
    config = LlmServerConfig.model_validate(settings)
    args = engine_args(config, model_dir)  # vLLM's AsyncEngineArgs: an unknown or mistyped field raises here
    scheduler = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                enable_chunked_prefill=True if args.enable_chunked_prefill is None
                                else args.enable_chunked_prefill,  # vLLM's default for a decoder
                                async_scheduling=args.async_scheduling, max_model_len=args.max_model_len,
                                is_encoder_decoder=False)
    cache = CacheConfig(cache_dtype=args.kv_cache_dtype, enable_prefix_caching=args.enable_prefix_caching,
                        gpu_memory_utilization=args.gpu_memory_utilization)
    compilation = CompilationConfig(max_cudagraph_capture_size=args.max_cudagraph_capture_size)
    # VllmConfig sizes the graphs from the model's config, not built here (it would leave 0): read it as asked
    capture = compilation.max_cudagraph_capture_size
    built = VllmConfig(scheduler_config=scheduler, cache_config=cache, compilation_config=compilation,
                       attention_config=args.attention_config, device_config=DeviceConfig("cuda"))
    quantization = args.quantization
    return {
        # after engine_args set the worker's environment: whether Model Runner V2's sampler (and its warm-up) takes
        # FlashInfer's fused top-k/top-p kernels, which compile at start where none are precompiled
        "flashinfer_sampler": _flashinfer_sampler(),
        "v1_runner_warning": _v1_runner_warnings(built),
        "vllm": vllm.__version__, "platform": type(vllm.platforms.current_platform).__name__,
        "max_num_seqs": built.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": built.scheduler_config.max_num_batched_tokens,
        "chunked_prefill": built.scheduler_config.enable_chunked_prefill,
        "async_scheduling": built.scheduler_config.async_scheduling,
        "scheduler": built.scheduler_config.get_scheduler_cls().__name__,
        "prefix_caching": built.cache_config.enable_prefix_caching,
        "kv_cache_dtype": built.cache_config.cache_dtype,
        "max_cudagraph_capture_size": capture,
        "cudagraph_mode": str(built.compilation_config.cudagraph_mode),
        "attention_backend": str(built.attention_config.backend), "trtllm_attention": built.attention_config.use_trtllm_attention,
        "quantization": quantization, "quantization_known": quantization in QUANTIZATION_METHODS if quantization else None,
        "quantization_online": quantization in _ONLINE_SHORTHANDS if quantization else None,
        "logits_processors": [p.__name__ for p in args.logits_processors],
    }


def _flashinfer_sampler() -> bool | str:
    """vLLM's own answer (v1/sample/ops/topk_topp_sampler.py), or why it could not give one (FlashInfer itself is
    not installed here: asking past the environment switch imports it)."""
    from vllm.v1.sample.ops.topk_topp_sampler import flashinfer_sampler_supported

    try:
        return flashinfer_sampler_supported()
    except Exception as exc:  # noqa: BLE001 - reported as the answer
        return f"{type(exc).__name__}: {exc}"


def _v1_runner_warnings(built: VllmConfig) -> dict[str, str | None]:
    """What the worker warns of this engine's runner as built, and with the V1 runner forced."""
    default = v1_runner_on_cuda(built)
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    try:
        return {"default": default, "forced": v1_runner_on_cuda(built)}
    finally:
        del os.environ["VLLM_USE_V2_MODEL_RUNNER"]


def main(settings_list: str, model_dir: str) -> list[dict]:
    out = []
    for settings in json.loads(settings_list):  # one vLLM import for all of them
        try:
            out.append(resolve(settings, model_dir))
        except Exception as exc:  # noqa: BLE001 - reported per settings, as vLLM or the worker refused them
            out.append({"error": f"{type(exc).__name__}: {exc}"})
    return out


class RequestStateStandIn:
    """A test double of Model Runner V2's RequestState (v1/worker/gpu/states.py), whose buffers need a GPU: the
    fields vLLM's LogitsProcRequestState.from_request_state reads, as CPU tensors."""

    def __init__(self, max_num_reqs: int, vocab_size: int, prompt_lens: list[int]) -> None:
        import torch

        self.device, self.max_num_reqs, self.vocab_size = torch.device("cpu"), max_num_reqs, vocab_size
        self.prompt_len = types.SimpleNamespace(gpu=torch.tensor(prompt_lens, dtype=torch.int32))
        self.all_token_ids = self.prefill_len = self.total_len = None  # not read by the frame constraint


def frame_constraint_v2() -> dict:
    """FrameConstraintV2 built by vLLM's own loader for Model Runner V2 (build_custom_logits_processors: the class
    checked against the V2 interface, constructed as the runner does) and stepped through its API with vLLM's
    LogitsContext: two requests opted in, one not, each past its prompt by a different count."""
    import numpy as np
    import torch
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext
    from vllm.v1.worker.gpu.sample.logits_processor.loader import build_custom_logits_processors

    from llm_server.engine.audio_tokens import slot_range
    from llm_server.engine.frame_constraint import OPT_IN, FrameConstraintV2

    vocab = 156_940
    (processor,) = build_custom_logits_processors(None, RequestStateStandIn(4, vocab, [10, 20, 30, 0]), False,
                                                  [FrameConstraintV2])
    opted = [processor.add_request(0, SamplingParams(extra_args={OPT_IN: True})),
             processor.add_request(1, SamplingParams(extra_args={OPT_IN: True})),
             processor.add_request(2, SamplingParams())]
    processor.apply_staged_writes()
    rows = torch.tensor([0, 1, 2])
    pos = torch.tensor([9, 22, 40])  # generated = pos + 1 - prompt length: 0, 3, 11 tokens so far
    ctx = LogitsContext(expanded_idx_mapping=rows, idx_mapping=rows, idx_mapping_np=rows.numpy(),
                        expanded_local_pos=torch.zeros(3, dtype=torch.int64), input_ids=torch.zeros(3, dtype=torch.int64),
                        pos=pos, seq_lens_upper_bound_np=np.array([10, 23, 41]))
    logits = processor.apply(torch.zeros(3, vocab), ctx)
    allowed = [torch.isfinite(row).nonzero().flatten() for row in logits]
    return {"class": type(processor).__name__, "opted": opted,
            "allowed": [[int(a.min()), int(a.max()), len(a)] for a in allowed],
            "slot_ranges": [list(slot_range(0)), list(slot_range(3))]}


if __name__ == "__main__":
    if sys.argv[1] == "frame-constraint-v2":
        print(json.dumps(frame_constraint_v2()))
    else:
        print(json.dumps(main(sys.argv[1], sys.argv[2])))
