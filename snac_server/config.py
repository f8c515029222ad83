"""SnacServerConfig: every setting of the codec tier, validated once, passed down.

Flags and environment variables map one-to-one onto its fields (orpheus_common/settings.py):
field `max_batch` is flag `--max-batch` and variable `SNAC_MAX_BATCH`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from codec_contract.audio import Policy
from orpheus_common.settings import CommaList, Settings


class SnacServerConfig(Settings):
    """Settings of one snac-server process."""

    model_config = SettingsConfigDict(env_prefix="SNAC_", cli_prog_name="snac-server")

    host: str = "0.0.0.0"
    port: int = Field(50051, ge=0)  # 0 picks a free port (tests)
    metrics_port: int = Field(9091, ge=-1)  # Prometheus /metrics over HTTP; -1 disables, 0 picks a free port
    # Plaintext grpc.health.v1 only (no Decode), for the kubelet's gRPC probes, which cannot speak TLS:
    # the same statuses as `port`. -1 disables (like metrics_port), 0 picks a free port.
    health_port: int = Field(-1, ge=-1)
    model: str = "random-24khz"  # local dir, Hugging Face id, or random-24khz[-small] (no download)
    device: str = "auto"  # auto, cpu, cuda, cuda:N
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    max_batch: int = Field(32, ge=1)  # rows per decode step
    max_wait_ms: float = Field(5.0, ge=0)  # how long the first row of a step waits for company
    # Frames (rows x frames per row) per forward; a step's rows are split above it. On CPU a big
    # forward's activations leave the cache and each frame costs more; on GPU a graph's memory grows
    # with its frames. 0: 16 on CPU, max_batch on GPU (a full step of 1-frame rows).
    max_step_frames: int = Field(0, ge=0)
    cuda_graphs: bool = True  # capture one graph per (batch size, frames per step) on GPU
    # The streaming step through torch.compile (Inductor: elementwise work fused around the convolutions). auto: on a
    # GPU; not on a CPU, where warm-up compiles for about 2 minutes on 2 cores and the step is 1.3-1.4x faster, with
    # glibc's MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ fixed (benchmarks/README.md, "The compiled step").
    # A compile that fails at warm-up is logged and the eager step serves (snac_compiled_step says which).
    compile_step: Literal["auto", "on", "off"] = "auto"
    # PyTorch's intra-op threads for CPU work. A CPU step waits at every OpenMP barrier for all of them,
    # and one the scheduler parks (other processes busy on the replica's cores) stalls the step:
    # beside two busy loops on 2 cores, 2 threads decoded 1.7-2.2x slower than 1 (benchmarks/README.md,
    # "By intra-op threads"); alone, 1.2-1.5x faster. Raise it only where the replica has cores to itself.
    cpu_threads: int = Field(1, ge=1)
    # Frames one stream advances in a step: a stream with a backlog catches up in the largest that fits, within
    # what its listener still has to play (4 frames at least; service._Stream.row_frames).
    # 1 among them: every stream can advance by one frame.
    frame_buckets: CommaList[Annotated[int, Field(ge=1)]] = Field((1, 2, 4, 8, 16), min_length=1,
                                                                json_schema_extra={"contains": {"const": 1}})
    policy: Policy = "streaming"  # default for sessions that do not choose
    max_streams: int = Field(1024, ge=1)  # concurrent streams, and decoder state slots (485 KiB each in fp32)
    # The longest recording Encode takes (a clone voice's reference); gRPC's 4 MiB message limit holds 43.6 s.
    max_encode_s: float = Field(30.0, gt=0, le=43.0)
    max_connection_age_s: float = 300.0  # clients reconnect, so new replicas get traffic
    # A connection past its age takes no new stream; those still on it get this long to finish before it is cut
    # (each one cut is a failover). Past the longest stream: one of a CPU's slow motion (target pace 0.103)
    # lasts minutes, and the drain's 15-30 s cut the streams in flight every 300 s (issue 43's admission runs).
    max_connection_age_grace_s: float = Field(900.0, ge=0)
    grace_s: float = 30.0  # SIGTERM: how long in-flight streams may finish
    # TLS: cert+key turn it on (re-read when the files change); a client CA also requires client certs.
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""

    @model_validator(mode="after")
    def _consistent(self) -> SnacServerConfig:
        fixed = [p for p in (self.port, self.metrics_port, self.health_port) if p > 0]
        if len(set(fixed)) != len(fixed):  # one would fail to bind at start-up
            raise ValueError(f"port, metrics_port and health_port {fixed}: each needs a port of its own")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca needs tls_cert and tls_key (client certificates need TLS)")
        if 1 not in self.frame_buckets:
            raise ValueError("frame_buckets must include 1 (every stream can advance by one frame)")
        return self

    @property
    def compiled_step(self) -> bool:
        """Whether the streaming step is compiled: `auto` compiles on a GPU."""
        return self.compile_step == "on" or (self.compile_step == "auto" and self.resolved_device.startswith("cuda"))

    @property
    def resolved_device(self) -> str:
        """`auto` becomes cuda when a GPU is visible, else cpu."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
