"""What the engine actually runs, asked of vLLM's own workers, and their CPU priority set there.

The attention backend and kernels are chosen in the worker processes, after the front end built
its config (which keeps `None` for an auto-selected backend), and vLLM reports them only in worker
log lines. This class is mixed into vLLM's worker (engine argument `worker_extension_cls`), so
`AsyncLLM.collective_rpc("megapod_attention")` returns the worker's own answer, and
`collective_rpc("megapod_nice", args=(n,))` runs in the thread that runs the model.
"""

from __future__ import annotations

import os

from . import cpu_lora

WORKER_EXTENSION = f"{__name__}.WorkerProbe"
# vLLM imports this module in the engine's process to build its worker: the one place our code runs there.
cpu_lora.apply()


class WorkerProbe:
    """Worker extension: the attention backends and FlashInfer decode kernel the model runner built, and the
    logits head its model computes; the model's thread's niceness."""

    def megapod_nice(self, increment: int) -> int:
        """Add `increment` to the niceness of this thread, the one that runs the model (Linux: niceness is a thread's;
        the threads it starts later inherit it); returns the new one. On a CPU the model's intra-op work runs here
        (one intra-op thread: vllm.py's _cpu_environment)."""
        return os.nice(increment)

    def megapod_attention(self) -> dict[str, object]:
        groups = [g for per_cache in getattr(self.model_runner, "attn_groups", []) for g in per_cache]
        backends = sorted({g.backend.get_name() for g in groups})
        decode = sorted({
            b.flashinfer_trtllm_api_decode_kernel.value
            for g in groups for b in g.metadata_builders
            if getattr(b, "use_trtllm_decode_attention", False) and getattr(b, "flashinfer_trtllm_api_decode_kernel", None)
        })
        report: dict[str, object] = {"backends": backends, "trtllm_decode": decode[0] if decode else "none",
                                     "head": _head(self.model_runner.get_model())}
        if "FLASHINFER" in backends:
            report["flashinfer_cubins"] = cubin_status()
        return report


def _head(model) -> str:
    """`audio`: the logits are the audio rows' (engine/audio_head.py); `full`: Llama's whole head."""
    from .audio_head import OrpheusAudioHeadForCausalLM, audio_only_head_applies

    return "audio" if isinstance(model, OrpheusAudioHeadForCausalLM) and audio_only_head_applies(model) else "full"


def cubin_status() -> str:
    """Whether FlashInfer will load its precompiled kernels: a flashinfer-cubin of exactly its version.

    Any other version is ignored by FlashInfer, which then downloads kernels at start-up (and, where
    NVIDIA's artifactory is out of reach, vLLM turns TRT-LLM attention off).
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        cubin = version("flashinfer-cubin")
    except PackageNotFoundError:
        return "missing (kernels are downloaded at start-up)"
    flashinfer = version("flashinfer-python")
    return f"installed {cubin}" if cubin == flashinfer else f"ignored: {cubin} does not match flashinfer {flashinfer}"
