"""Deterministic noise for SNAC's NoiseBlocks.

SNAC's decoder adds `randn * linear(x)` after every upsampling stage, drawing fresh noise
on each call: the same codes would give different audio per call, and a chunked decode
could never equal a full one. Here the noise at a position depends only on
(stream seed, noise layer, absolute position at that layer's rate), so any chunking or
batching of a stream gives the same audio. The generator is a counter-based hash
(pure elementwise integer ops), so it runs inside CUDA Graphs and needs no RNG state.
"""

from __future__ import annotations

import math

import torch
from torch import nn

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (lowbias32) on int64 tensors holding values < 2**32.

    Products may overflow int64; the wrap-around keeps the low 32 bits exact, which are
    the only bits kept.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def fold_seed(seed: int) -> int:
    """A stream's 64-bit seed folded to the 32 bits the noise hash takes."""
    return (seed ^ (seed >> 32)) & _MASK32


def positional_gaussian(seed: torch.Tensor, layer: int, positions: torch.Tensor) -> torch.Tensor:
    """Standard normal samples keyed by (seed[b], layer, positions[b, t]).

    seed: (B,) int64 in 0..2**32-1; positions: (B, T) int64, absolute. Returns (B, T) float32.
    """
    key = _mix32((seed[:, None] ^ (layer * 0x9E3779B9)) & _MASK32)
    h1 = _mix32((positions & _MASK32) ^ key)
    h2 = _mix32(h1 ^ 0x68E31DA4)
    # 24-bit uniforms in (0, 1) are exact in float32; Box-Muller turns two into a normal.
    u1 = ((h1 >> 8).to(torch.float32) + 0.5) * 2.0**-24
    u2 = ((h2 >> 8).to(torch.float32) + 0.5) * 2.0**-24
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)


class NoiseContext:
    """Per-batch inputs of the positional noise: one seed and one window start per row.

    The tensors are reused buffers so a captured CUDA Graph reads fresh values on replay.
    """

    def __init__(self, max_batch: int, device: torch.device) -> None:
        self.seeds = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.frame0 = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.window_frames = 1

    def set(self, seeds: torch.Tensor, frame0: torch.Tensor, window_frames: int) -> None:
        """Copy this batch's rows in (non-blocking: the copy is ordered before the decode)."""
        b = seeds.shape[0]
        self.seeds[:b].copy_(seeds, non_blocking=True)
        self.frame0[:b].copy_(frame0, non_blocking=True)
        self.window_frames = window_frames


class PositionalNoise(nn.Module):
    """Drop-in for snac.layers.NoiseBlock: x + noise(seed, layer, position) * linear(x)."""

    def __init__(self, linear: nn.Module, layer: int, context: NoiseContext) -> None:
        super().__init__()
        self.linear = linear
        self.layer = layer
        self.context = context

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, _, length = x.shape
        per_frame = length // self.context.window_frames
        t = torch.arange(length, device=x.device, dtype=torch.int64)
        positions = self.context.frame0[:batch, None] * per_frame + t
        noise = positional_gaussian(self.context.seeds[:batch], self.layer, positions)
        return x + noise[:, None, :].to(x.dtype) * self.linear(x)
