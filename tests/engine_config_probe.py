"""Run with vLLM's CUDA release first on the path (deploy/tools/fetch_vllm_gpu.py): builds that release's own config
objects from a worker's settings, as the worker's engine_args() hands them over, and prints what they resolve to.

    python tests/engine_config_probe.py SETTINGS_LIST_JSON MODEL_DIR    # one result (or error) per settings

Two test doubles, named as such: an empty module stands in for the compiled kernels' registration (CUDA's
libraries cannot load here), and a Hopper stand-in platform answers what a CUDA device would be asked (compute
capability 9.0, 80 GiB). The model's config (ModelConfig) is not built: vLLM inspects the model's class by
importing its module, which loads kernels; every other config is vLLM's own, validated by its own code,
VllmConfig's checks across them included (async scheduling is refused there when something does not support it).
"""

from __future__ import annotations

import json
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
from vllm.config import CacheConfig, CompilationConfig, DeviceConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.config.quantization import _ONLINE_SHORTHANDS  # noqa: E402
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS  # noqa: E402

from llm_server.config import LlmServerConfig  # noqa: E402
from llm_server.engine.vllm import engine_args  # noqa: E402


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


def main(settings_list: str, model_dir: str) -> list[dict]:
    out = []
    for settings in json.loads(settings_list):  # one vLLM import for all of them
        try:
            out.append(resolve(settings, model_dir))
        except Exception as exc:  # noqa: BLE001 - reported per settings, as vLLM or the worker refused them
            out.append({"error": f"{type(exc).__name__}: {exc}"})
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
