"""The SNAC 24 kHz decoder, prepared for serving.

Loading does three things once: build or load the model, fold the weight-norm
parametrization into plain weights (before any CUDA Graph capture), and swap every
NoiseBlock for PositionalNoise so the output depends only on codes, seed and position.
"""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from snac import SNAC
from snac.layers import NoiseBlock
from torch import nn
from torch.nn.utils import parametrize

from .frames import frames_to_levels, levels_to_frames
from .noise import NoiseContext, PositionalNoise, fold_seed

log = logging.getLogger(__name__)

# The published config of hubertsiuzdak/snac_24khz; `random-24khz` builds exactly this.
SNAC_24KHZ_CONFIG = {
    "sampling_rate": 24000,
    "encoder_dim": 48,
    "encoder_rates": [2, 4, 8, 8],
    "decoder_dim": 1024,
    "decoder_rates": [8, 8, 4, 2],
    "attn_window_size": None,
    "codebook_size": 4096,
    "codebook_dim": 8,
    "vq_strides": [4, 2, 1],
    "noise": True,
    "depthwise": True,
}
# Random weights, no download: `random-24khz` is the real architecture, at its real cost;
# `random-24khz-small` the same layout (rates, strides, codebooks: the same frames, the same 2048
# samples per frame, the same streaming state machinery) at 1/16 of the decoder's width, about
# 1/37 of its decode cost on a CPU core: for tests and demos where the codec's cost is not measured.
RANDOM_MODELS = {"random-24khz": SNAC_24KHZ_CONFIG, "random-24khz-small": {**SNAC_24KHZ_CONFIG, "decoder_dim": 64}}


def load_snac(model: str, seed: int = 0) -> SNAC:
    """Load SNAC from a local directory or a Hugging Face id (cache first), or build it random.

    A RANDOM_MODELS name builds its architecture with weights seeded by `seed`, so a fresh machine
    with no download gets a model of the right shape (`random-24khz`: and cost).
    """
    if model in RANDOM_MODELS:
        torch.manual_seed(seed)
        snac = SNAC(**RANDOM_MODELS[model])
    else:  # a local directory, or a Hugging Face id resolved through the local cache first
        snac = SNAC.from_pretrained(model)
    if snac.sampling_rate != 24000 or list(snac.vq_strides) != [4, 2, 1]:
        found = {"sampling_rate": snac.sampling_rate, "vq_strides": list(snac.vq_strides)}
        raise ValueError(f"{model} is not a 24 kHz SNAC with strides [4, 2, 1]: {json.dumps(found)}")
    return snac.eval()


def fold_weight_norm(module: nn.Module) -> None:
    """Replace every weight-norm parametrization with the plain weight it computes."""
    for sub in module.modules():
        if parametrize.is_parametrized(sub, "weight"):
            parametrize.remove_parametrizations(sub, "weight", leave_parametrized=True)


def install_positional_noise(decoder: nn.Module, context: NoiseContext) -> int:
    """Swap each NoiseBlock in the decoder for PositionalNoise; return how many were swapped."""
    swapped = 0
    for parent in list(decoder.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, NoiseBlock):
                setattr(parent, name, PositionalNoise(child.linear, swapped, context))
                swapped += 1
    return swapped


class SnacDecoder(nn.Module):
    """Codes of whole frames -> PCM, batched, deterministic.

    forward(frames, seeds, frame0): frames (B, W, 7) int64, seeds (B,) int64,
    frame0 (B,) int64 absolute index of each row's first frame -> (B, W * 2048) float32.
    """

    def __init__(self, snac: SNAC, max_batch: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        fold_weight_norm(snac)
        self.noise = NoiseContext(max_batch, device)
        if install_positional_noise(snac.decoder, self.noise) == 0:
            raise ValueError("this SNAC has no NoiseBlocks; expected the 24 kHz noise config")
        self.quantizer = snac.quantizer
        self.decoder = snac.decoder
        self.to(device=device, dtype=dtype)
        self.device = device
        self.dtype = dtype
        self.snr_db = float("inf")  # against fp32 on the same weights (measured at load for half precision)

    @torch.inference_mode()
    def forward(self, frames: torch.Tensor, seeds: torch.Tensor, frame0: torch.Tensor) -> torch.Tensor:
        self.noise.set(seeds, frame0, frames.shape[1])
        l0, l1, l2 = frames_to_levels(frames)
        z = self.quantizer.from_codes([l0, l1, l2])
        audio = self.decoder(z.to(self.dtype))
        return audio[:, 0, :].float()

    def decode_full(self, frames: np.ndarray, seed: int) -> np.ndarray:
        """Decode one whole stream in one forward: the ground truth for chunked decoding."""
        batch = torch.as_tensor(frames[None], dtype=torch.int64, device=self.device)
        seeds = torch.tensor([fold_seed(seed)], dtype=torch.int64, device=self.device)
        start = torch.zeros(1, dtype=torch.int64, device=self.device)
        return self(batch, seeds, start)[0].cpu().numpy()


class SnacEncoder:
    """PCM -> frames with SNAC's own encoder (a clone voice's reference), always in fp32: it runs once a voice,
    and its codes are what every request of that voice is prompted with.

    Encodes run one at a time on a thread of their own (on a GPU, that thread's own CUDA stream), beside the
    decode thread, never on it: a 30 s recording takes seconds on a CPU core, and the decode thread's steps
    must not wait for it."""

    def __init__(self, snac: SNAC, device: torch.device) -> None:
        fold_weight_norm(snac)
        self.snac = snac.to(device=device, dtype=torch.float32)
        self.device = device
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="snac-encode", initializer=self._bind)

    def _bind(self) -> None:
        if self.device.type == "cuda":  # the thread's current device, and a stream apart from the decode thread's
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(torch.cuda.Stream(self.device))

    async def encode_async(self, pcm: np.ndarray) -> np.ndarray:
        """encode() on the encoder's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, self.encode, pcm)

    @torch.inference_mode()
    def encode(self, pcm: np.ndarray) -> np.ndarray:
        """24 kHz float32 PCM -> (n, 7) int32 frames; SNAC pads the end to a whole frame with silence."""
        audio = torch.from_numpy(np.array(pcm, dtype=np.float32)).to(self.device)[None, None]  # a copy: the request's is read-only
        l0, l1, l2 = (level[0] for level in self.snac.encode(audio))
        return levels_to_frames(l0, l1, l2).cpu().numpy().astype(np.int32)


def use_exact_fp32() -> None:
    """Make fp32 convolutions and matmuls really fp32 on GPUs, for this process.

    cuDNN runs fp32 convolutions in TF32 by default (10 mantissa bits): the same codes would then
    decode differently by batch shape, by more than one s16 step. With IEEE fp32 the remaining
    differences (the algorithm cuDNN picks per shape) stay within one s16 step.

    The legacy flags are turned off first, so that the legacy getters still answer (False) after the
    new API is set: `torch.backends.cudnn.allow_tf32` (torch.compile's conv lowering reads it) raises
    unless conv's and rnn's precisions agree with a legacy cuDNN flag that only its own setter clears
    (it stays True whatever the new API says), and `torch.backends.cuda.matmul.allow_tf32` likewise
    checks the new matmul precision against the legacy matmul precision ("high" under
    TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1).
    """
    torch.backends.cudnn.allow_tf32 = False  # legacy flag off; conv and rnn both become not-TF32
    torch.set_float32_matmul_precision("highest")  # legacy matmul precision: no TF32
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    torch.backends.cuda.matmul.fp32_precision = "ieee"


# Half precision against fp32, on the served weights, at start-up. bf16 measures ~39 dB (the noise
# floor of 8-bit mu-law telephony: audible hiss in quiet passages on wideband playback), fp16 ~58 dB
# (better than 8-bit linear PCM). Below WARN the server says so; below REFUSE the numbers are broken
# (overflow, a Snake alpha whose +1e-9 guard vanished in half precision), not merely coarse.
WARN_SNR_DB = 50.0
REFUSE_SNR_DB = 30.0
_SNR_CHECK_FRAMES = 8


class HalfPrecisionTooNoisy(ValueError):
    """The half-precision decoder is too far from fp32 on these weights to serve."""


def snr_db(reference: np.ndarray, other: np.ndarray) -> float:
    """Signal-to-noise ratio of `other` against `reference`, in dB (inf when equal)."""
    noise = float(np.sum((other.astype(np.float64) - reference) ** 2))
    return float("inf") if noise == 0 else 10.0 * np.log10(float(np.sum(reference.astype(np.float64) ** 2)) / noise)


def check_half_precision(model: str, decoder: SnacDecoder) -> float:
    """SNR of `decoder` (fp16/bf16) against an fp32 copy of the same weights; refuse below REFUSE_SNR_DB."""
    reference = SnacDecoder(load_snac(model), 1, decoder.device, torch.float32)
    frames = np.random.default_rng(0).integers(0, 4096, size=(_SNR_CHECK_FRAMES, 7))
    snr = snr_db(reference.decode_full(frames, seed=0), decoder.decode_full(frames, seed=0))
    del reference
    if not snr >= REFUSE_SNR_DB:  # NaN output fails here too
        raise HalfPrecisionTooNoisy(f"{decoder.dtype} decoding is {snr:.1f} dB from fp32 on {model} (< {REFUSE_SNR_DB} dB): use float32")
    level = logging.WARNING if snr < WARN_SNR_DB else logging.INFO
    log.log(level, "%s decoding is %.1f dB from fp32 on %s (warn below %.0f dB)", decoder.dtype, snr, model, WARN_SNR_DB)
    return snr


def build_decoder(model: str, device: str, dtype: str, max_batch: int) -> SnacDecoder:
    """Load, fold and wrap SNAC on the given device and dtype ('float32', 'float16', 'bfloat16').

    Half precision is checked against fp32 on the same weights first (check_half_precision).
    """
    torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    use_exact_fp32()  # the reference of a half-precision check is fp32 too
    decoder = SnacDecoder(load_snac(model), max_batch, torch.device(device), torch_dtype)
    if torch_dtype != torch.float32:
        decoder.snr_db = check_half_precision(model, decoder)
    return decoder
