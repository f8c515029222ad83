"""The MegaPod on Kubernetes: its profiles, each a MegaPodConfig plus what only a cluster has.

The topology knobs (replica counts, ports, batch limits, policy, drain time) stay in
MegaPodConfig, the object `megapod up` runs; a profile adds the accelerators each tier requests
and checks that the pods fit the node's GPUs. The Helm chart's values files are these profiles
written out (tests/test_deploy_chart.py holds them equal), and `megapod deploy` renders the chart
with values taken from here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .topology import MegaPodConfig

ORPHEUS_3B = "canopylabs/orpheus-3b-0.1-ft"
SNAC_24KHZ = "hubertsiuzdak/snac_24khz"
WHOLE_GPU = "nvidia.com/gpu"
MIG_PREFIX = "nvidia.com/mig-"
# Instances of each MIG profile one GPU holds (NVIDIA MIG user guide, H100 80GB and H200 141GB).
MIG_INSTANCES_PER_GPU = {
    "1g.10gb": 7, "1g.20gb": 4, "2g.20gb": 3, "3g.40gb": 2, "4g.40gb": 1, "7g.80gb": 1,
    "1g.18gb": 7, "1g.35gb": 4, "2g.35gb": 3, "3g.71gb": 2, "4g.71gb": 1, "7g.141gb": 1,
}
# A pod drains for longer than a local Ctrl-C (MegaPodConfig.grace_s = 15): an agent's reply of
# up to a minute of audio finishes on the pod that started it.
CLUSTER_GRACE_S = 60.0
# How long a terminating pod keeps serving while its address leaves the Services' endpoints, DNS and
# the load balancers (kube-proxy and ingress controllers learn of it a few seconds late).
CLUSTER_ENDPOINT_DELAY_S = 10.0


@dataclass(frozen=True)
class ClusterProfile:
    """One way to run the MegaPod on a cluster."""

    name: str
    megapod: MegaPodConfig
    values_file: str  # the chart's values file for this profile (values.yaml is the default profile)
    gpus_per_node: int  # 0 on a CPU-only cluster
    llm_accelerator: str = ""  # extended resource each LLM pod requests, one unit ("" = none)
    snac_accelerator: str = ""

    def __post_init__(self) -> None:
        if self.gpus_per_node < self.gpus_needed():
            raise ValueError(
                f"profile {self.name}: {self.megapod.workers} LLM workers and {self.megapod.replicas} SNAC "
                f"replicas need {self.gpus_needed()} GPUs, the node has {self.gpus_per_node}"
            )

    @property
    def mig_profile(self) -> str | None:
        """e.g. 2g.20gb when the SNAC replicas run on MIG instances."""
        if self.snac_accelerator.startswith(MIG_PREFIX):
            return self.snac_accelerator.removeprefix(MIG_PREFIX)
        return None

    def snac_gpus(self) -> int:
        """Whole GPUs the SNAC replicas occupy: MIG instances pack several onto one GPU."""
        if self.mig_profile is not None:
            return math.ceil(self.megapod.replicas / MIG_INSTANCES_PER_GPU[self.mig_profile])
        return self.megapod.replicas if self.snac_accelerator == WHOLE_GPU else 0

    def gpus_needed(self) -> int:
        llm = self.megapod.workers if self.llm_accelerator == WHOLE_GPU else 0
        return llm + self.snac_gpus()


def _cluster_megapod(**changes: object) -> MegaPodConfig:
    """MegaPodConfig with real checkpoints and the cluster drain; `megapod up` keeps its own defaults."""
    base = {"llm_model": ORPHEUS_3B, "snac_model": SNAC_24KHZ, "grace_s": CLUSTER_GRACE_S,
            "endpoint_delay_s": CLUSTER_ENDPOINT_DELAY_S}
    return MegaPodConfig(**{**base, **changes})  # type: ignore[arg-type]


# The engine of an H100 worker at full tilt (values.yaml says why each): 512 streams a step, a step's tokens for
# 512 decodes and a 512-token chunk of new prompts, CUDA Graphs up to every step it schedules, async scheduling.
# tests/test_deploy_chart.py builds vLLM 0.33's configs from the rendered profiles.
FULL_TILT = {"max_num_seqs": 512, "max_cudagraph_capture_size": 1024, "max_num_batched_tokens": 1024,
             "async_scheduling": True}
# One 8-GPU node: 7 LLM workers on a GPU each, 3 SNAC replicas on MIG instances of the 8th. Decode
# attention runs TensorRT-LLM's XQA kernel through FlashInfer (the image carries its cubins).
H100 = ClusterProfile(
    name="h100",
    megapod=_cluster_megapod(workers=7, replicas=3, llm_device="cuda", snac_device="cuda",
                             attention_backend="FLASHINFER", trtllm_attention="on", **FULL_TILT),
    values_file="values.yaml",
    gpus_per_node=8,
    llm_accelerator=WHOLE_GPU,
    snac_accelerator=MIG_PREFIX + "2g.20gb",
)
# The same node with FP8: weights quantized as they load and an FP8 (e4m3) KV cache (values-h100-fp8.yaml).
H100_FP8 = dataclasses.replace(H100, name="h100-fp8", values_file="values-h100-fp8.yaml",
                               megapod=H100.megapod.replace(quantization="fp8_per_tensor", kv_cache_dtype="fp8"))
# No GPU: fewer, smaller pods; eager engine (the CPU image ships no compiler for torch.compile).
CPU = ClusterProfile(
    name="cpu",
    megapod=_cluster_megapod(workers=2, replicas=2, llm_device="cpu", snac_device="cpu", enforce_eager=True),
    values_file="values-cpu.yaml",
    gpus_per_node=0,
)
PROFILES = {p.name: p for p in (H100, H100_FP8, CPU)}
