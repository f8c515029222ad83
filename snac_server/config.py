"""SnacServerConfig: every setting of the codec tier, validated once, passed down.

CLI flags and environment variables map one-to-one onto its fields:
field `max_batch` is flag `--max-batch` and variable `SNAC_MAX_BATCH`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from codec_contract.audio import POLICIES
from orpheus_common.settings import config_from_args

DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class SnacServerConfig:
    """Settings of one snac-server process."""

    host: str = "0.0.0.0"
    port: int = 50051  # 0 picks a free port (tests)
    metrics_port: int = 9091  # Prometheus /metrics over HTTP; -1 disables, 0 picks a free port
    # Plaintext grpc.health.v1 only (no Decode), for the kubelet's gRPC probes, which cannot speak TLS:
    # the same statuses as `port`. -1 disables (like metrics_port), 0 picks a free port.
    health_port: int = -1
    model: str = "random-24khz"  # local dir, Hugging Face id, or random-24khz[-small] (no download)
    device: str = "auto"  # auto, cpu, cuda, cuda:N
    dtype: str = "float32"
    max_batch: int = 32  # rows per decode step
    max_wait_ms: float = 5.0  # how long the first row of a step waits for company
    # Frames (rows x frames per row) per forward; a step's rows are split above it. On CPU a big
    # forward's activations leave the cache and each frame costs more; on GPU a graph's memory grows
    # with its frames. 0: 16 on CPU, max_batch on GPU (a full step of 1-frame rows).
    max_step_frames: int = 0
    cuda_graphs: bool = True  # capture one graph per (batch size, frames per step) on GPU
    # PyTorch's intra-op threads for CPU work. A CPU step waits at every OpenMP barrier for all of them,
    # and one the scheduler parks (other processes busy on the replica's cores) stalls the step:
    # beside two busy loops on 2 cores, 2 threads decoded 1.7-2.2x slower than 1 (benchmarks/README.md,
    # "By intra-op threads"); alone, 1.2-1.5x faster. Raise it only where the replica has cores to itself.
    cpu_threads: int = 1
    # Frames one stream advances in a step: a stream with a backlog catches up in the largest that fits.
    frame_buckets: tuple[int, ...] = (1, 2, 4, 8, 16)
    policy: str = "streaming"  # default for sessions that do not choose: streaming | reference
    max_streams: int = 1024  # concurrent streams, and decoder state slots (485 KiB each in fp32)
    max_connection_age_s: float = 300.0  # clients reconnect, so new replicas get traffic
    grace_s: float = 30.0  # SIGTERM: how long in-flight streams may finish
    # TLS: cert+key turn it on (re-read when the files change); a client CA also requires client certs.
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, not {self.dtype!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, not {self.policy!r}")
        if self.health_port < -1 or self.metrics_port < -1:
            raise ValueError("health_port and metrics_port are a port, 0 (a free one) or -1 (off)")
        fixed = [p for p in (self.port, self.metrics_port, self.health_port) if p > 0]
        if len(set(fixed)) != len(fixed):  # one would fail to bind at start-up
            raise ValueError(f"port, metrics_port and health_port {fixed}: each needs a port of its own")
        if self.max_batch < 1 or self.max_streams < 1 or self.max_wait_ms < 0 or self.max_step_frames < 0:
            raise ValueError("max_batch and max_streams must be >= 1, max_wait_ms and max_step_frames >= 0")
        if self.cpu_threads < 1:
            raise ValueError("cpu_threads must be >= 1")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca needs tls_cert and tls_key (client certificates need TLS)")
        if not self.frame_buckets or 1 not in self.frame_buckets or min(self.frame_buckets) < 1:
            raise ValueError("frame_buckets must include 1 (every stream can advance by one frame), all >= 1")

    @property
    def resolved_device(self) -> str:
        """`auto` becomes cuda when a GPU is visible, else cpu."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


def snac_config_from_cli(argv: Sequence[str] | None = None) -> SnacServerConfig:
    """The snac-server config from its command line and SNAC_* environment variables."""
    return config_from_args(SnacServerConfig, argv, os.environ, "SNAC_", "snac-server")
