"""SNAC's decoder as a stateful streaming decoder: each frame is computed once, for many streams at once.

SNAC's 24 kHz decoder is a stack of centred convolutions with a finite receptive field. Here each
convolution keeps its last inputs, each transposed convolution the overlap tail of its outputs,
and each residual skip a delay line as long as its branch's delay, so a stream fed frame by frame
(or in any chunks) gives exactly the audio of one decode of the whole sequence, at 1x the compute.
The price is a fixed delay: a step's output ends `delay` samples (4,757, 2.32 frames) before the
end of its input, since the last samples still wait for their right context.

Every stream's state lives in slot-indexed buffers (one per state tensor, a row per slot), so a
step gathers its rows' slots, advances them together, and writes them back; streams at different
positions share a step. The start of a stream is the full decode's zero padding: a fresh slot is
zeroed and every intermediate signal is masked to zero at positions before 0. The end is its right
padding: the stream is flushed with frames past its end, masked to zero the same way. The state
is written back only after the whole step succeeded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from snac.layers import DecoderBlock, ResidualUnit, Snake1d
from torch import nn

from .codec_model import SnacDecoder
from .frames import FRAME_SAMPLES, frames_to_levels
from .noise import PositionalNoise, positional_gaussian

LATENT_STEPS_PER_FRAME = 4  # SNAC's finest code level: 4 latent steps per frame, 512 samples each
OPEN_END = 2**40  # `end` of a stream whose end is not known yet (frames; far past any real stream)


class _Conv(nn.Module):
    """A centred Conv1d, streaming: it keeps its last (kernel - 1) * dilation inputs."""

    def __init__(self, conv: nn.Conv1d) -> None:
        super().__init__()
        self.conv = conv
        self.context = (conv.kernel_size[0] - 1) * conv.dilation[0]
        self.delay = self.context // 2
        if conv.padding[0] != self.delay or conv.stride[0] != 1:
            raise ValueError(f"not a centred stride-1 convolution: {conv}")

    def state_shape(self) -> tuple[int, int]:
        return self.conv.in_channels, self.context

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        full = torch.cat([cache, x], dim=-1)
        c = self.conv
        y = F.conv1d(full, c.weight, c.bias, dilation=c.dilation, groups=c.groups)
        return y, full[..., full.shape[-1] - self.context :]


class _Snake(nn.Module):
    """SNAC's Snake activation, x + sin(alpha x)^2 / alpha, in four passes over x and two new tensors where snac's
    (a TorchScript function, not fused on a CPU) makes five of each: py-spy of a CPU replica at 28 streams found it in
    110 of the forward's 372 samples (549 busy in all). Equal to snac's within float rounding."""

    def __init__(self, snake: Snake1d) -> None:
        super().__init__()
        self.alpha = snake.alpha  # the same parameter: weights loaded or cast later are the ones used

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.mul(x, self.alpha)
        t.sin_()
        t.square_()
        return torch.addcmul(x, t, (self.alpha + 1e-9).reciprocal())


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(B, C, L) -> (B * L, C): every row's positions as the rows of one GEMM."""
    return x.transpose(1, 2).reshape(-1, x.shape[1])


class _Pointwise(nn.Module):
    """A 1x1 Conv1d at the frame rate (SNAC's widening 768 -> 1024) as one GEMM over every row's positions. A
    convolution reads its 3 MiB of weights once per row (7.3 ms for 8 rows of a frame on one EPYC core, 0.6 as a
    GEMM); where positions are many (the blocks' 1x1s) the convolution is as fast or faster: they stay convolutions."""

    def __init__(self, conv: nn.Conv1d) -> None:
        super().__init__()
        if conv.kernel_size[0] != 1 or conv.groups != 1:
            raise ValueError(f"not a pointwise convolution: {conv}")
        self.conv = conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.conv
        y = torch.addmm(c.bias, _rows(x), c.weight[:, :, 0].t())  # (B * L, out)
        return y.view(x.shape[0], x.shape[2], -1).transpose(1, 2)


class _ConvTranspose(nn.Module):
    """SNAC's upsampling ConvTranspose1d (kernel 2s, stride s), streaming by overlap-add: it keeps the
    partial sums of the s outputs that still wait for the next input.

    `one_gemm`: the first block's (1024 -> 512, 32 MiB of weights, 4 positions a frame) as one GEMM over every row's
    positions, each input's 2s outputs added to its block of s and the next's. The convolution reads the weights
    once per row: 33 ms for 8 rows of a frame on one EPYC core, 47 for a lone row, against 9 and 4 as a GEMM
    (benchmarks/README.md, the compiled step). The later blocks' convolutions, with more positions and smaller
    weights, are as fast as the GEMM or faster."""

    def __init__(self, conv: nn.ConvTranspose1d, one_gemm: bool = False) -> None:
        super().__init__()
        self.conv = conv
        self.stride = conv.stride[0]
        self.one_gemm = one_gemm
        if conv.kernel_size[0] != 2 * self.stride or conv.padding[0] != self.stride // 2 or conv.output_padding[0]:
            raise ValueError(f"not SNAC's even-stride upsampling convolution: {conv}")
        self.delay = conv.padding[0]  # at its output rate

    def state_shape(self) -> tuple[int, int]:
        return self.conv.out_channels, self.stride

    def forward(self, x: torch.Tensor, tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.one_gemm:
            return self._one_gemm(x, tail)
        y = F.conv_transpose1d(x, self.conv.weight, None, stride=self.stride)  # (B, C, (m + 1) * s)
        done = x.shape[-1] * self.stride
        out = y[..., :done]
        out[..., : self.stride] += tail
        return out + self.conv.bias[:, None], y[..., done:]

    def _one_gemm(self, x: torch.Tensor, tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (b, k, m), c, s = x.shape, self.conv.out_channels, self.stride
        y = (_rows(x) @ self.conv.weight.reshape(k, c * 2 * s)).view(b, m, c, 2, s)
        later = torch.cat([tail[:, None], y[:, :-1, :, 1]], dim=1)  # what the input before each one left to add
        out = (y[:, :, :, 0] + later).permute(0, 2, 1, 3).reshape(b, c, m * s)
        return out + self.conv.bias[:, None], y[:, -1, :, 1]


class _Residual(nn.Module):
    """A ResidualUnit, streaming: its branch's convolution caches inputs, its skip is a delay line."""

    def __init__(self, unit: ResidualUnit) -> None:
        super().__init__()
        snake1, conv, snake2, self.pointwise = unit.block
        self.snake1, self.snake2 = _Snake(snake1), _Snake(snake2)
        self.conv = _Conv(conv)
        self.delay = self.conv.delay

    def state_shapes(self) -> list[tuple[int, int]]:
        channels = self.conv.conv.in_channels
        return [self.conv.state_shape(), (channels, self.delay)]

    def forward(self, x: torch.Tensor, cache: torch.Tensor, skip: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y, cache = self.conv(self.snake1(x), cache)
        y = self.pointwise(self.snake2(y))
        line = torch.cat([skip, x], dim=-1)
        return line[..., : x.shape[-1]] + y, cache, line[..., x.shape[-1] :]


class _Block(nn.Module):
    """A DecoderBlock: Snake, upsampling, positional noise, three residual units."""

    def __init__(self, block: DecoderBlock, one_gemm: bool) -> None:
        super().__init__()
        snake, up, noise, *units = block.block
        self.snake = _Snake(snake)
        if not isinstance(noise, PositionalNoise) or len(units) != 3:
            raise ValueError("expected SNAC's noise DecoderBlock with positional noise installed")
        self.up = _ConvTranspose(up, one_gemm)
        self.noise = noise
        self.units = nn.ModuleList(_Residual(u) for u in units)


class StreamingDecoder(nn.Module):
    """Steps of many streams through SNAC's decoder, each stream's state in its slot.

    forward(slots, codes, frame0, end, seeds, fresh): slots (B,) int64 in 0..num_slots (num_slots is a
    scratch slot for padding rows); codes (B, F, 7) int64, the frames [frame0, frame0 + F) of each row's
    stream; end (B,) the stream's length in frames (OPEN_END while unknown; frames past it are flush
    frames whose codes are ignored); seeds (B,) noise seeds (32-bit); fresh (B,) bool, a stream's first
    step (its slot is zeroed). Returns (B, F * 2048) float32: each row's samples
    [frame0 * 2048 - delay, (frame0 + F) * 2048 - delay), zero where before 0 or past the end.
    """

    def __init__(self, decoder: SnacDecoder, num_slots: int) -> None:
        super().__init__()
        layers = list(decoder.decoder.model)
        blocks = [b for b in layers if isinstance(b, DecoderBlock)]
        if len(layers) != len(blocks) + 5 or not isinstance(layers[-3], Snake1d):
            raise ValueError("expected SNAC's depthwise decoder: conv, conv, blocks, snake, conv, tanh")
        self.quantizer = decoder.quantizer
        self.dtype = decoder.dtype
        self.first = _Conv(layers[0])
        self.widen = _Pointwise(layers[1])
        self.blocks = nn.ModuleList(_Block(b, one_gemm=i == 0) for i, b in enumerate(blocks))  # the frame rate's
        self.last_snake = _Snake(layers[-3])
        self.last = _Conv(layers[-2])
        self.num_slots = num_slots
        self.delay = self._delay()
        shapes = [self.first.state_shape()]
        for block in self.blocks:
            shapes.append(block.up.state_shape())
            shapes += [s for unit in block.units for s in unit.state_shapes()]
        shapes.append(self.last.state_shape())
        device = next(decoder.parameters()).device
        # One more row than slots: padding rows of a fixed-size step read and write only that one.
        self.state = [torch.zeros(num_slots + 1, c, n, dtype=self.dtype, device=device) for c, n in shapes]

    def _delay(self) -> int:
        rate, delay = LATENT_STEPS_PER_FRAME, self.first.delay
        for block in self.blocks:
            rate *= block.up.stride
            delay = delay * block.up.stride + block.up.delay + sum(u.delay for u in block.units)
        if rate != FRAME_SAMPLES:
            raise ValueError(f"the decoder makes {rate} samples per frame, not {FRAME_SAMPLES}")
        return delay + self.last.delay

    def floats_per_slot(self) -> int:
        return sum(s[0].numel() for s in self.state)

    @torch.no_grad()  # not inference_mode: torch.compile cannot trace that (an inference tensor's version counter)
    def forward(self, slots: torch.Tensor, codes: torch.Tensor, frame0: torch.Tensor, end: torch.Tensor,
                seeds: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        blank = fresh[:, None, None]
        states = iter([torch.where(blank, 0.0, s.index_select(0, slots)) for s in self.state])
        written: list[torch.Tensor] = []

        def valid(x: torch.Tensor, rate: int, delay: int) -> torch.Tensor:
            """x with every position outside [0, end) zeroed: the full decode's zero padding."""
            pos = frame0[:, None] * rate - delay + torch.arange(x.shape[-1], device=x.device)
            inside = (pos >= 0) & (pos < end[:, None] * rate)
            return x * inside[:, None, :].to(x.dtype)

        rate, delay = LATENT_STEPS_PER_FRAME, 0
        z = self.quantizer.from_codes(list(frames_to_levels(codes))).to(self.dtype)
        x, cache = self.first(valid(z, rate, delay), next(states))
        written.append(cache)
        delay += self.first.delay
        x = valid(self.widen(x), rate, delay)
        for block in self.blocks:
            x, tail = block.up(block.snake(x), next(states))
            written.append(tail)
            rate, delay = rate * block.up.stride, delay * block.up.stride + block.up.delay
            x = valid(x, rate, delay)
            pos = frame0[:, None] * rate - delay + torch.arange(x.shape[-1], device=x.device)
            x = x + positional_gaussian(seeds, block.noise.layer, pos)[:, None, :].to(x.dtype) * block.noise.linear(x)
            for unit in block.units:
                x, cache, skip = unit(x, next(states), next(states))
                written += [cache, skip]
                delay += unit.delay
                x = valid(x, rate, delay)
        x, cache = self.last(self.last_snake(x), next(states))
        written.append(cache)
        audio = torch.tanh(x)[:, 0, :].float()
        for buffer, new in zip(self.state, written):  # only now: a step that raised changed no stream
            buffer.index_copy_(0, slots, new.to(buffer.dtype))
        return audio


def flush_frames(delay: int) -> int:
    """Frames of padding past a stream's end that push its last sample out."""
    return -(-delay // FRAME_SAMPLES)

