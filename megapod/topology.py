"""MegaPodConfig: the shape of one MegaPod, shared by `megapod up` and the Kubernetes rendering.

Replica counts, ports, batch limits, policies and model sources live here once, so a local
run and a cluster deployment describe the same MegaPod.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from codec_contract.audio import POLICIES
from orpheus_common.settings import config_from_args

RANDOM_LLM = "tiny"
RANDOM_SNAC = "random-24khz"


@dataclass(frozen=True)
class MegaPodConfig:
    """One MegaPod: N LLM workers and M SNAC replicas behind one front endpoint."""

    workers: int = 1
    replicas: int = 2
    host: str = "127.0.0.1"
    front_port: int = 8000  # the endpoint voice agents use
    worker_base_port: int = 8100  # worker i listens on worker_base_port + i
    snac_base_port: int = 50051  # replica j listens on snac_base_port + j
    snac_metrics_base_port: int = 9091
    # Models (random weights by default: the audio is noise until real checkpoints are given)
    llm_model: str = RANDOM_LLM
    snac_model: str = RANDOM_SNAC
    llm_device: str = "auto"  # auto | cuda | cpu: on GPUs, worker i gets a GPU of its own (llm_gpus)
    snac_device: str = "auto"  # auto | cuda | cpu: on GPUs, the codec replicas share one (snac_gpu)
    llm_gpus: str = "auto"  # one GPU index per worker, e.g. 0,1,2; auto: worker i on GPU i
    snac_gpu: str = "auto"  # the codec replicas' GPU; auto: the one after the last worker's
    llm_gpu_memory_utilization: float = 0.9  # each worker's vLLM share of its GPU
    attention_backend: str = "auto"  # vLLM's attention backend on GPUs (llm_server/attention.py)
    trtllm_attention: str = "auto"  # FlashInfer's TRT-LLM kernels: auto | on | off
    # Limits and policies
    max_streams_per_worker: int = 16
    snac_max_batch: int = 32
    snac_max_wait_ms: float = 5.0
    codec_policy: str = "streaming"  # streaming | reference (for comparison)
    max_model_len: int = 2048
    enforce_eager: bool = False
    grace_s: float = 15.0  # drain budget of every tier (workers, codec replicas, front): streams in flight finish
    # Cluster only (the chart's preStop): how long a terminating pod keeps serving while its address
    # leaves the Services' endpoints and DNS. On one machine nothing routes by endpoints: 0.
    endpoint_delay_s: float = 0.0
    restart_dead: bool = True  # the launcher restarts a process that dies

    def __post_init__(self) -> None:
        if self.workers < 1 or self.replicas < 1:
            raise ValueError("a MegaPod needs at least one worker and one replica")
        if self.codec_policy not in POLICIES:
            raise ValueError(f"codec_policy must be one of {sorted(POLICIES)}, not {self.codec_policy!r}")
        for name in ("llm_device", "snac_device"):
            if getattr(self, name) not in ("auto", "cuda", "cpu"):
                raise ValueError(f"{name} is auto, cuda or cpu (choose GPUs with llm_gpus/snac_gpu), not {getattr(self, name)!r}")
        if self.grace_s < 0 or self.endpoint_delay_s < 0:
            raise ValueError("grace_s and endpoint_delay_s are seconds, >= 0")
        if not 0 < self.llm_gpu_memory_utilization <= 1:
            raise ValueError("llm_gpu_memory_utilization must be in (0, 1]")

    @property
    def random_weights(self) -> bool:
        return self.llm_model == RANDOM_LLM or self.snac_model.startswith(RANDOM_SNAC)  # random-24khz[-small]

    def worker_ports(self) -> list[int]:
        return [self.worker_base_port + i for i in range(self.workers)]

    def snac_ports(self) -> list[int]:
        return [self.snac_base_port + j for j in range(self.replicas)]

    def snac_addresses(self) -> str:
        return ",".join(f"{self.host}:{p}" for p in self.snac_ports())

    def snac_args(self, j: int) -> list[str]:
        """snac-server flags of replica j."""
        return [
            "--host", self.host, "--port", str(self.snac_ports()[j]),
            "--metrics-port", str(self.snac_metrics_base_port + j),
            "--model", self.snac_model, "--device", self.snac_device,
            "--max-batch", str(self.snac_max_batch), "--max-wait-ms", str(self.snac_max_wait_ms),
            "--policy", self.codec_policy, "--grace-s", str(self.grace_s),
        ]

    def worker_args(self, i: int) -> list[str]:
        """llm-server flags of worker i."""
        return [
            "--host", self.host, "--port", str(self.worker_ports()[i]), "--snac", self.snac_addresses(),
            "--model", self.llm_model, "--device", self.llm_device, "--max-streams", str(self.max_streams_per_worker),
            "--gpu-memory-utilization", str(self.llm_gpu_memory_utilization),
            "--attention-backend", self.attention_backend, "--trtllm-attention", self.trtllm_attention,
            "--codec-policy", self.codec_policy, "--max-model-len", str(self.max_model_len),
            "--enforce-eager", str(self.enforce_eager).lower(), "--grace-s", str(self.grace_s),
        ]


def megapod_config_from_cli(argv: Sequence[str] | None) -> MegaPodConfig:
    """`megapod up` flags over MEGAPOD_* environment variables over defaults."""
    return config_from_args(MegaPodConfig, argv, os.environ, "MEGAPOD_", "megapod up")
