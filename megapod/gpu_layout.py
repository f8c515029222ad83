"""Which GPU each process of a local MegaPod runs on: the chart's layout, on one machine.

Worker i gets GPU i to itself and the codec replicas share the next GPU, as in the cluster
MegaPod (N LLM GPUs + one codec GPU). Each process sees only its GPU (CUDA_VISIBLE_DEVICES),
so a worker's `gpu_memory_utilization` is a share of that GPU alone. A layout that would put
more vLLM memory claims on one GPU than it holds is refused before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .topology import MegaPodConfig

# What one codec replica with snac-server's defaults (max_batch 32, 1,024 stream slots) held on its GPU
# once it had served 16 streams, its graphs, state and CUDA context included: 1,891 MiB on an H200
# (benchmarks/results/gpu-first-contact-h200.json, codec_replica_serves.memory.process_gpu_mib; its
# allocator's peak while serving, peak_reserved_mib, was 1,542 MiB). A larger max_batch needs more: the doctor's
# codec_warm_up.graph_pool_mib says how much (3,956 MiB of graphs at 256).
REPLICA_GPU_MIB = 1891
SMALLEST_GPU_MIB = 81559  # an H100 80 GB, the smallest GPU a MegaPod is laid out for: shares are of it


def codec_share(replicas: int) -> float:
    """The share of a GPU that `replicas` codec replicas hold (measured, on the smallest GPU)."""
    return replicas * REPLICA_GPU_MIB / SMALLEST_GPU_MIB


class GpuLayoutError(ValueError):
    """A layout that would oversubscribe a GPU, or name one that is not there."""


@dataclass(frozen=True)
class GpuLayout:
    """GPU index per worker and for the codec replicas; empty when the MegaPod runs on CPU."""

    workers: tuple[int, ...] = ()
    codec: int | None = None

    @property
    def on_cpu(self) -> bool:
        """Both tiers on the CPU, sharing its cores."""
        return not self.workers and self.codec is None

    def worker_env(self, i: int) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": str(self.workers[i])} if self.workers else {}

    def codec_env(self) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": str(self.codec)} if self.codec is not None else {}

    def worker_shares_codec_gpu(self, i: int) -> bool:
        """Whether worker i runs on the GPU that holds the codec replicas."""
        return bool(self.workers) and self.codec is not None and self.workers[i] == self.codec


def _indices(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise GpuLayoutError(f"{what} must be GPU indices like 0,1,2, not {text!r}") from None


def plan_gpus(config: MegaPodConfig, gpu_count: int) -> GpuLayout:
    """Place the MegaPod's workers and codec replicas on `gpu_count` GPUs (a tier on `cpu` gets none).

    `llm_gpus` ("auto" or one index per worker) and `snac_gpu` ("auto" or an index) choose by hand;
    auto puts worker i on GPU i (wrapping around when workers outnumber GPUs) and the replicas on
    the first GPU no worker has, or on the last worker's when every GPU has one. Raises GpuLayoutError for oversubscribed or missing GPUs.
    """
    llm_on_gpu, codec_on_gpu = config.llm_device != "cpu", config.snac_device != "cpu"
    if gpu_count == 0 or not (llm_on_gpu or codec_on_gpu):
        return GpuLayout()
    utilization = config.llm_gpu_memory_utilization
    chosen = tuple(i % gpu_count for i in range(config.workers)) if config.llm_gpus == "auto" else _indices(config.llm_gpus, "llm_gpus")
    if len(chosen) != config.workers:
        raise GpuLayoutError(f"llm_gpus names {len(chosen)} GPUs for {config.workers} workers: give one per worker")
    if not llm_on_gpu:
        chosen, utilization = (), 0.0
    free = [g for g in range(gpu_count) if g not in chosen]
    auto_codec = free[0] if free else chosen[-1]
    codec = auto_codec if config.snac_gpu == "auto" else _indices(config.snac_gpu, "snac_gpu")[0]
    if not codec_on_gpu:
        codec = None
    used = (*chosen, *(() if codec is None else (codec,)))
    missing = sorted({g for g in used if not 0 <= g < gpu_count})
    if missing:
        raise GpuLayoutError(f"GPU(s) {missing} requested but this machine has {gpu_count} (0..{gpu_count - 1})")
    share = codec_share(config.replicas)
    for gpu in sorted(set(used)):
        claimed = utilization * chosen.count(gpu) + (share if gpu == codec else 0.0)
        if claimed > 1.0 + 1e-9:
            who = [f"worker {i}" for i, g in enumerate(chosen) if g == gpu] + (["the codec replicas"] if gpu == codec else [])
            raise GpuLayoutError(
                f"GPU {gpu} would be oversubscribed: {', '.join(who)} claim {claimed:.0%} of its memory "
                f"(gpu_memory_utilization {utilization} per worker, {share:.1%} for {config.replicas} codec replica(s)). "
                "Run fewer workers, give each its own GPU (--llm-gpus), or lower --llm-gpu-memory-utilization."
            )
    return GpuLayout(chosen, codec)
