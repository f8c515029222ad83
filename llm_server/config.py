"""LlmServerConfig: every setting of one llm-server worker, validated once, passed down.

Flags and environment variables map one-to-one onto its fields (orpheus_common/settings.py): field `max_streams`
is flag `--max-streams` and variable `ORPHEUS_MAX_STREAMS`.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from codec_contract.audio import Policy
from orpheus_common.settings import CommaList
from orpheus_common.socket_budget import SocketLimits
from orpheus_common.tls import TlsSettings

from .capacity import LISTENER_LAG_S, TARGET_MARGIN

ORPHEUS_VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
# OpenAI voice names -> the Orpheus voice that stands in for them, so clients work unchanged.
# All 13 that Pipecat's OpenAITTSService accepts.
OPENAI_VOICE_ALIASES = (
    "alloy=tara,ash=dan,ballad=leo,cedar=zac,coral=leah,echo=zac,fable=mia,marin=jess,nova=jess,onyx=leo,sage=zoe,"
    "shimmer=mia,verse=dan"
)


def parse_aliases(text: str) -> dict[str, str]:
    """'a=b,c=d' -> {'a': 'b', 'c': 'd'}."""
    pairs = [p.split("=", 1) for p in text.split(",") if p.strip()]
    if any(len(p) != 2 for p in pairs):
        raise ValueError(f"aliases must look like name=target,...: {text!r}")
    return {k.strip(): v.strip() for k, v in pairs}


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM takes (vllm/config/lora.py)
GPU_TARGET_PACE = TARGET_MARGIN  # streams decode 3 % ahead of real time
CPU_TARGET_PACE = GPU_TARGET_PACE / 10  # a tenth of that: slow motion
ADMISSION_QUEUE_S = 0.3  # the longest wait for a slot at the GPU's target pace (slowed as the target is)
CODEC_STALL_TIMEOUT_S = 10.0  # owed codec audio none for this long at the GPU's target pace: a hung replica


class LlmServerConfig(TlsSettings):
    """Settings of one llm-server worker (HTTP API + engine + codec client); TLS on its HTTP port from the
    ssl_* fields (orpheus_common/tls.py)."""

    model_config = SettingsConfigDict(env_prefix="ORPHEUS_", cli_prog_name="llm-server")

    host: str = "0.0.0.0"
    port: int = 8000
    # Model: `tiny` (generated once into the cache dir, random weights), a local dir, or a HF id.
    model: str = "tiny"
    tokenizer: str = ""  # defaults to the model's own
    cache_dir: str = os.path.join(os.path.expanduser("~"), ".cache", "orpheus-megapod")
    backend: Literal["vllm", "trtllm"] = "vllm"
    served_model_name: str = "orpheus"
    model_aliases: CommaList[str] = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
    # The checkpoint's voices when it has no voices.json (voices.py), and their language.
    voices: CommaList[str] = Field(ORPHEUS_VOICES, min_length=1)
    voices_language: str = "en"
    voice_aliases: str = OPENAI_VOICE_ALIASES
    # Another vendor's stock voice id on its door (a Cartesia UUID, Deepgram's aura-2-thalia-en): spoken in the
    # default voice (true), or refused like an unknown OpenAI voice (false).
    vendor_voice_fallback: bool = True
    # Voices of the operator's own (voices.py): a directory whose sub-directories are voices (a PEFT LoRA adapter
    # each), re-read every voices_poll_s while serving.
    voices_dir: str = ""
    voices_poll_s: float = Field(1.0, gt=0)
    # Clone voices (clones.py, POST /v1/voices): the longest reference recording, its upload's size, its transcript.
    max_reference_s: float = Field(30.0, gt=0)
    max_reference_bytes: int = Field(16 << 20, ge=1)
    max_transcript_chars: int = Field(1000, ge=1)
    # Codec tier
    snac: str = "127.0.0.1:50051"  # host:port[,host:port...] or a DNS name resolving to replicas
    codec_policy: Policy = "streaming"  # reference: for comparison
    # Owed audio none for this long: the replica is hung and the stream resumes on another. Unset: 10 s on a GPU,
    # slowed as the target pace is (100 s on a CPU, whose codec serves in slow motion by design, not hung).
    codec_stall_timeout_s: float | None = Field(None, gt=0)
    # The most audio a replica decodes a stream ahead of its listener at the target pace while another of its
    # streams needs its next row, or did within this bound's time (0: as far as it can, always;
    # snac_server.service.OpenStreams). Replicas share a GPU (or, on a CPU, the cores) and round robin opens as many
    # streams on each, not as many open: one decoding its streams at twice the target while its sibling's fell behind
    # ended its streams sooner and got fewer (issue 43, run 46's 3x level: streams at 0.21-0.29 against others at
    # 0.09-0.10 where 0.1 was needed, 17 of them past the buffer; 27 streams against 16 on a pinned level of 44; held
    # always at 0.5, run 47: none past it). With no other stream in need a replica decodes ahead: held always, a body
    # read whole (a file, the tests) ended no sooner than the target pace.
    codec_listener_ahead_s: float = Field(0.5, ge=0)
    # TLS to the codec tier: a CA file turns it on; cert+key add a client certificate.
    codec_tls_ca: str = ""
    codec_tls_cert: str = ""
    codec_tls_key: str = ""
    codec_tls_server_name: str = ""  # the name replicas' certificates carry, if not the address
    # Admission and input limits
    # The streams admitted at once follow the pace the engine keeps (capacity.py): from initial_streams (few: the
    # limit then rises to what the engine keeps in real time, doubling a window until first cut, then by at most
    # its square root), between min_streams (never above the ceiling) and max_streams (default: the engine's max_num_seqs, a
    # ceiling only). The limit moves each capacity_window_s towards the streams that decode at target_pace x
    # real time. min_streams = max_streams: a fixed limit.
    max_streams: int | None = Field(None, ge=1)
    min_streams: int = Field(1, ge=1)
    initial_streams: int = Field(4, ge=1)
    # Unset: 1.03 on a GPU; on a CPU, 0.103 (no CPU keeps even one stream in real time: it is served
    # in slow motion, the pace benchmarks/concurrency.py --quick judges it by). Growth needs it, and each stream's
    # listener plays at it; the engine's pace cuts the limit only below it less its 3 % margin (capacity.TARGET_MARGIN).
    target_pace: float | None = Field(None, gt=0)
    capacity_window_s: float = Field(1.0, gt=0)
    # Past the limit a request waits this long at most for a slot, first come first served (admission.py), then
    # is refused with 429. Unset: 0.3 s on a GPU, slowed as the target pace is (3 s on a CPU); 0: never.
    admission_queue_s: float | None = Field(None, ge=0)
    # An admitted stream whose listener at the target pace (no playout buffer) waited this many audio seconds in all
    # is behind: the limit is cut and does not grow while listeners wait (capacity.Listeners); 0: not judged.
    listener_lag_s: float = Field(LISTENER_LAG_S, ge=0)
    # The share of the limit held back while requests are being refused (admission.py, REFUSING_S): where refused
    # requests take their cores from the streams' (`megapod up` with no GPU sets it; on a GPU node they run on the host's
    # cores, the streams on the GPU: 0).
    refusal_reserve: float = Field(0.0, ge=0, le=0.5)
    max_input_chars: int = Field(4096, ge=1)
    max_segment_chars: int = Field(280, ge=16)
    max_body_bytes: int = 65536
    # What one client socket may send (orpheus_common/socket_budget.py): messages and text a second, sustained, with
    # bursts of five seconds' worth; over it, messages are refused unread and a flood that goes on is closed.
    socket_messages_per_s: float = Field(200.0, gt=0)
    socket_bytes_per_s: int = Field(256 * 1024, ge=65536)
    # Clone uploads (clones.py): decoded in a process of their own, at most this many at once, each within this.
    max_reference_uploads: int = Field(2, ge=1)
    reference_decode_timeout_s: float = Field(10.0, gt=0)
    # A client this many seconds of audio behind real time, while audio waits for it, is cut off.
    max_client_lag_s: float = Field(30.0, gt=0)
    # Security: API keys file (lines `name:key[:max_streams[:permissions]]`, re-read when it changes); empty: open.
    api_keys_file: str = ""
    log_input_text: bool = False  # request text stays out of logs unless asked for
    # Leading silence (Orpheus often opens with a few hundred ms): dropped up to the first sample above
    # the threshold, at most max_ms of it. Off by default; time to first audible audio is measured either way.
    trim_silence: bool = False
    trim_silence_dbfs: float = -40.0
    trim_silence_max_ms: float = 500.0
    # Sampling defaults (the reference's; repetition penalty >= 1.1 keeps speech stable)
    temperature: float = Field(0.6, ge=0)
    top_p: float = Field(0.8, gt=0, le=1)
    repetition_penalty: float = Field(1.1, ge=1)
    # Engine
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"
    max_num_seqs: int = Field(64, ge=1)
    max_model_len: int = 2048
    # Tokens one engine step may hold (decodes plus chunks of new prompts; chunked prefill): unset, vLLM's
    # default. Room for a new prompt's chunk beside a full batch of decodes keeps admitted streams real time.
    max_num_batched_tokens: int | None = Field(None, ge=1)
    # vLLM schedules step n+1 while step n runs: unset, vLLM decides (0.33: on wherever it is supported).
    async_scheduling: bool | None = None
    # The largest batch a CUDA Graph is captured for (vLLM's max_cudagraph_capture_size): unset, vLLM's
    # default, min(2 x max_num_seqs, 512); a decode step of more streams runs without a graph.
    max_cudagraph_capture_size: int | None = Field(None, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    cpu_kv_cache_gb: float = 2.0
    # The niceness added to the thread that runs the model, where the codec replicas share its cores (`megapod up`
    # on a machine with no GPU sets it): the codec's work is audio owed now, the engine's frames ahead of it.
    engine_nice: int = Field(0, ge=0, le=19)
    enable_prefix_caching: bool = True
    # Logits for the ids speech can use only (engine/audio_head.py): the head's audio rows, not Llama's whole
    # 156,940-id head; the same tokens. false: vLLM's own Llama head.
    audio_head: bool = True
    quantization: str = ""  # e.g. fp8_per_tensor (on-the-fly FP8 of a bf16 checkpoint)
    kv_cache_dtype: str = "auto"
    # GPU attention (llm_server/engine/attention.py): a vLLM backend name (FLASHINFER, FLASH_ATTN, ...) or auto,
    # and FlashInfer's TRT-LLM kernels (XQA decode on Hopper): auto | on | off.
    attention_backend: str = "auto"
    trtllm_attention: Literal["auto", "on", "off"] = "auto"
    load_format: str = "auto"  # `dummy`: real architecture, random weights (GPU benchmarks)
    enforce_eager: bool = False
    # vLLM's multi-LoRA, for LoRA voices. Unset: on when the voices directory holds an adapter at start (LoRA costs
    # every step, used or not); true: on from the start, for adapters added later to an empty directory.
    enable_lora: bool | None = None
    max_loras: int = Field(4, ge=1)  # different adapters in one batch
    # An adapter of a higher rank is refused; 32 is the rank Canopy's own LoRA recipe trains (finetune/lora.py).
    max_lora_rank: int = Field(32, json_schema_extra={"enum": list(LORA_RANKS)})
    max_cpu_loras: int | None = Field(None, ge=1)  # adapters kept loaded (least recently used go); unset: max_loras
    speculative_config: str = ""  # JSON, passed through to the engine
    grace_s: float = 30.0

    @model_validator(mode="after")
    def _consistent(self) -> LlmServerConfig:
        parse_aliases(self.voice_aliases)  # well-formed; aliases of voices the checkpoint lacks are left out (voices.py)
        if bool(self.codec_tls_cert) != bool(self.codec_tls_key):
            raise ValueError("codec_tls_cert and codec_tls_key go together")
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of vLLM's {LORA_RANKS}")
        if (self.codec_tls_cert or self.codec_tls_server_name) and not self.codec_tls_ca:
            raise ValueError("codec_tls_cert and codec_tls_server_name need codec_tls_ca (TLS to the codec tier)")
        return self

    @property
    def socket_limits(self) -> SocketLimits:
        return SocketLimits(messages_per_s=self.socket_messages_per_s, message_burst=5 * self.socket_messages_per_s,
                            bytes_per_s=self.socket_bytes_per_s, byte_burst=4 * self.socket_bytes_per_s)

    @property
    def stream_ceiling(self) -> int:
        """The most streams ever admitted at once: max_streams, else all the engine batches."""
        return self.max_streams or self.max_num_seqs

    @property
    def resolved_target_pace(self) -> float:
        """target_pace, or its default for the device."""
        if self.target_pace is not None:
            return self.target_pace
        return CPU_TARGET_PACE if self.resolved_device == "cpu" else GPU_TARGET_PACE

    def slowed(self, seconds_on_gpu: float) -> float:
        """A time set for the GPU's target pace, slowed as this worker's target is (ten times on a CPU)."""
        return seconds_on_gpu * GPU_TARGET_PACE / self.resolved_target_pace

    @property
    def resolved_codec_stall_timeout_s(self) -> float:
        """codec_stall_timeout_s, or its default for the target pace."""
        return self.codec_stall_timeout_s if self.codec_stall_timeout_s is not None else self.slowed(CODEC_STALL_TIMEOUT_S)

    @property
    def resolved_admission_queue_s(self) -> float:
        """admission_queue_s, or its default for the target pace."""
        return self.admission_queue_s if self.admission_queue_s is not None else self.slowed(ADMISSION_QUEUE_S)

    @property
    def stream_floor(self) -> int:
        """The fewest streams the limit admits, however slow the engine: min_streams, up to the ceiling."""
        return min(self.min_streams, self.stream_ceiling)

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.model_aliases)

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

