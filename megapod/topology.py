"""MegaPodConfig: the shape of one MegaPod, shared by `megapod up` and the Kubernetes rendering.

Replica counts, ports, batch limits, policies and model sources live here once, so a local
run and a cluster deployment describe the same MegaPod.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from codec_contract.audio import Policy
from orpheus_common.settings import as_flags, camel
from orpheus_common.tls import TlsSettings

RANDOM_LLM = "tiny"
RANDOM_SNAC = "random-24khz"
Device = Literal["auto", "cuda", "cpu"]  # a pod owns its GPUs: choose them with llm_gpus / snac_gpu, not cuda:N


@dataclass(frozen=True)
class Sets:
    """Where a MegaPodConfig field goes, written beside the field: the tiers' settings it is (`llm`, an
    LlmServerConfig field; `snac`, a SnacServerConfig field), passed as flags by `megapod up` and as
    `{tier}.server.<camelCase>` chart values by `megapod deploy`, or `chart`, the values it sets instead."""

    llm: str = ""
    snac: str = ""
    chart: tuple[str, ...] | None = None


LOCAL = Sets(chart=())  # `megapod up`'s own: addresses on one machine, GPU indices, restarts


class MegaPodConfig(TlsSettings):
    """One MegaPod: N LLM workers and M SNAC replicas behind one front endpoint; the front over TLS from the ssl_*
    fields (orpheus_common/tls.py) or tls_dir."""

    model_config = SettingsConfigDict(env_prefix="MEGAPOD_", cli_prog_name="megapod up")

    workers: Annotated[int, Sets(chart=("llm.replicas",))] = Field(1, ge=1)
    replicas: Annotated[int, Sets(chart=("snac.replicas",))] = Field(2, ge=1)
    host: str = "127.0.0.1"
    front_port: Annotated[int, Sets(chart=("front.server.port", "service.port"))] = 8000  # the endpoint voice agents use
    worker_base_port: int = 8100  # worker i listens on worker_base_port + i
    snac_base_port: Annotated[int, Sets(chart=("snac.server.port",))] = 50051  # replica j listens on snac_base_port + j
    snac_metrics_base_port: Annotated[int, Sets(chart=("snac.server.metricsPort",))] = 9091
    # Models (random weights by default: the audio is noise until real checkpoints are given)
    llm_model: Annotated[str, Sets(llm="model", chart=("llm.model.id",))] = RANDOM_LLM
    snac_model: Annotated[str, Sets(snac="model")] = RANDOM_SNAC
    llm_device: Annotated[Device, Sets(llm="device")] = "auto"  # on GPUs, worker i gets a GPU of its own (llm_gpus)
    snac_device: Annotated[Device, Sets(snac="device")] = "auto"  # on GPUs, the codec replicas share one (snac_gpu)
    llm_gpus: str = "auto"  # one GPU index per worker, e.g. 0,1,2; auto: worker i on GPU i
    snac_gpu: str = "auto"  # the codec replicas' GPU; auto: the one after the last worker's
    llm_gpu_memory_utilization: Annotated[float, Sets(llm="gpu_memory_utilization")] = Field(0.9, gt=0, le=1)  # each worker's vLLM share of its GPU
    attention_backend: Annotated[str, Sets(llm="attention_backend")] = "auto"  # vLLM's attention backend on GPUs (llm_server/engine/attention.py)
    trtllm_attention: Annotated[Literal["auto", "on", "off"], Sets(llm="trtllm_attention")] = "auto"  # FlashInfer's TRT-LLM kernels
    # Limits and policies
    # Each worker admits the streams its engine keeps in real time (llm_server/capacity.py), measured; these
    # bound it: a ceiling (unset: the engine's max_num_seqs) and a floor (unset: 1; both the same: a fixed limit).
    max_streams_per_worker: Annotated[int | None, Sets(llm="max_streams")] = Field(None, ge=1)
    min_streams_per_worker: Annotated[int | None, Sets(llm="min_streams")] = Field(None, ge=1)
    snac_max_batch: Annotated[int, Sets(snac="max_batch")] = Field(32, ge=1)
    snac_max_wait_ms: Annotated[float, Sets(snac="max_wait_ms")] = Field(5.0, ge=0)
    codec_policy: Annotated[Policy, Sets(llm="codec_policy", snac="policy")] = "streaming"  # reference: for comparison
    max_model_len: Annotated[int, Sets(llm="max_model_len")] = 2048
    enforce_eager: Annotated[bool, Sets(llm="enforce_eager")] = False
    # The engine at full tilt (each unset: the worker's own default; megapod/cluster.py's H100 profile sets them)
    max_num_seqs: Annotated[int | None, Sets(llm="max_num_seqs")] = Field(None, ge=1)
    max_num_batched_tokens: Annotated[int | None, Sets(llm="max_num_batched_tokens")] = Field(None, ge=1)
    async_scheduling: Annotated[bool | None, Sets(llm="async_scheduling")] = None
    max_cudagraph_capture_size: Annotated[int | None, Sets(llm="max_cudagraph_capture_size")] = Field(None, ge=1)
    quantization: Annotated[str | None, Sets(llm="quantization")] = None  # e.g. fp8_per_tensor
    kv_cache_dtype: Annotated[str | None, Sets(llm="kv_cache_dtype")] = None  # e.g. fp8 (e4m3)
    grace_s: Annotated[float, Sets(llm="grace_s", snac="grace_s", chart=("drain.graceS",))] = Field(15.0, ge=0)  # drain budget of every tier (workers, codec replicas, front): streams in flight finish
    # Cluster only (the chart's preStop): how long a terminating pod keeps serving while its address
    # leaves the Services' endpoints and DNS. On one machine nothing routes by endpoints: 0.
    endpoint_delay_s: Annotated[float, Sets(chart=("drain.endpointDelayS",))] = Field(0.0, ge=0)
    restart_dead: bool = True  # the launcher restarts a process that dies
    # With no GPU, the niceness each worker's engine runs at (llm_server's engine_nice) beside the codec replicas on
    # the same cores: frames the engine generates ahead of the codec took the cores the codec needed for the audio
    # owed now (issue 43, run 37: over the first 5 s of pinned levels of 34-37 streams, 8-10 s of audio generated a second,
    # 1.4-2.0 decoded).
    cpu_engine_nice: int = Field(5, ge=0, le=19)
    # With no GPU, the share of each worker's limit held back while it refuses requests (llm_server's refusal_reserve):
    # the refusals' work (the front's, the worker's, a client's on the same machine) takes the codec's cores. Over issue
    # 43's run 55 the codec replicas had 2-3 % fewer cores at 2x the capacity than at it, 5 % fewer at 3x, and held back
    # only once refusals went on (5 % in run 58), the limit an overload met first ran streams it admitted past the buffer.
    cpu_refusal_reserve: float = Field(0.10, ge=0, le=0.5)
    # The voices directory every worker reads (LoRA adapters, clones made through POST /v1/voices): one for all,
    # so a voice made through one worker is every worker's. The chart's is a volume of its own.
    voices_dir: Annotated[str, Sets(llm="voices_dir", chart=())] = os.path.join(
        os.path.expanduser("~"), ".cache", "orpheus-megapod", "voices")

    # A local CA and a certificate for this machine's loopback names made (once) in this directory, the front served
    # over TLS with them (megapod/local_tls.py): instead of ssl_certfile/ssl_keyfile. Workers and codec replicas
    # stay on loopback in the clear either way.
    tls_dir: str = ""

    @model_validator(mode="after")
    def _one_certificate(self) -> MegaPodConfig:
        if self.tls_dir and self.ssl_certfile:
            raise ValueError("tls_dir makes the front's certificate: give it or ssl_certfile/ssl_keyfile, not both")
        return self

    @property
    def front_scheme(self) -> str:
        return "https" if self.tls or self.tls_dir else "http"

    @property
    def random_weights(self) -> bool:
        return self.llm_model == RANDOM_LLM or self.snac_model.startswith(RANDOM_SNAC)  # random-24khz[-small]

    def worker_ports(self) -> list[int]:
        return [self.worker_base_port + i for i in range(self.workers)]

    def snac_ports(self) -> list[int]:
        return [self.snac_base_port + j for j in range(self.replicas)]

    def snac_addresses(self) -> str:
        return ",".join(f"{self.host}:{p}" for p in self.snac_ports())

    @classmethod
    @functools.cache  # a field's annotation never changes: found once, not on every launch or render
    def sets(cls, name: str) -> Sets:
        return next((m for m in cls.model_fields[name].metadata if isinstance(m, Sets)), LOCAL)

    def tier_settings(self, tier: str) -> dict[str, object]:
        """The settings of tier `llm` or `snac` this MegaPod sets, by their names there (a field left None
        sets nothing: the tier's own default holds)."""
        return {field: value for name in type(self).model_fields
                if (field := getattr(self.sets(name), tier)) and (value := getattr(self, name)) is not None}

    @classmethod
    def chart_paths(cls) -> dict[str, list[str]]:
        """Field -> the chart values (dotted paths) `megapod deploy` sets from it."""
        paths = {}
        for name in cls.model_fields:
            sets = cls.sets(name)
            tiers = [f"{tier}.server.{camel(field)}" for tier, field in (("llm", sets.llm), ("snac", sets.snac)) if field]
            if found := list(sets.chart if sets.chart is not None else tiers):
                paths[name] = found
        return paths

    def helm_values(self) -> dict[str, object]:
        """This MegaPod as chart values (dotted path -> value)."""
        return {path: value for name, paths in self.chart_paths().items() if (value := getattr(self, name)) is not None
                for path in paths}  # None: the tier's own default

    def replica_flags(self, j: int) -> list[str]:
        """snac-server flags of replica j."""
        return as_flags({"host": self.host, "port": self.snac_ports()[j], "metrics_port": self.snac_metrics_base_port + j,
                         **self.tier_settings("snac")})

    def worker_flags(self, i: int, on_cpu: bool = False) -> list[str]:
        """llm-server flags of worker i (`on_cpu`: both tiers share this machine's cores)."""
        shared = {"engine_nice": self.cpu_engine_nice, "refusal_reserve": self.cpu_refusal_reserve} if on_cpu else {}
        return as_flags({"host": self.host, "port": self.worker_ports()[i], "snac": self.snac_addresses(),
                         **self.tier_settings("llm"), **{k: v for k, v in shared.items() if v}})
