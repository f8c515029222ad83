"""The decoder runner: padded bucket shapes in, PCM out; CUDA Graphs on GPU.

Runs only on the batcher's thread. Rows are grouped by window length into fixed buckets;
on GPU each (batch size, window) bucket replays a CUDA Graph captured at start-up (the
SNAC decoder is ~320 small kernels, so launch overhead, not FLOPs, bounds it).
"""

from __future__ import annotations

import bisect
import logging
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import torch

from .codec_model import SnacDecoder
from .frames import CODES_PER_FRAME, FRAME_SAMPLES
from .session import DecodeRow

log = logging.getLogger(__name__)

Publish = Callable[[list[int], list[np.ndarray]], None]
CPU_STEP_FRAMES = 48  # per frame, a 192-frame forward costs ~2x a 48-frame one on CPU: benchmarks/forward_cost.py


def batch_ladder(max_batch: int) -> tuple[int, ...]:
    """Batch sizes with a captured graph: powers of two up to max_batch, and max_batch."""
    sizes = {max_batch}
    b = 1
    while b < max_batch:
        sizes.add(b)
        b *= 2
    return tuple(sorted(sizes))


class _Graph:
    """One captured decode of a fixed (batch, window) shape and its static buffers."""

    def __init__(self, decoder: SnacDecoder, batch: int, window: int, pool: object) -> None:
        device = decoder.device
        self.frames = torch.zeros(batch, window, CODES_PER_FRAME, dtype=torch.int64, device=device)
        self.seeds = torch.zeros(batch, dtype=torch.int64, device=device)
        self.frame0 = torch.zeros(batch, dtype=torch.int64, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up on a side stream before capture, as CUDA Graphs require
            for _ in range(2):
                decoder(self.frames, self.seeds, self.frame0)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = decoder(self.frames, self.seeds, self.frame0)

    def run(self, frames: torch.Tensor, seeds: torch.Tensor, frame0: torch.Tensor) -> torch.Tensor:
        b = frames.shape[0]
        if frames.shape[1:] != self.frames.shape[1:] or b > self.frames.shape[0]:
            raise ValueError(
                f"frames shape {tuple(frames.shape)} does not fit graph input {tuple(self.frames.shape)}"
            )
        self.frames[:b].copy_(frames, non_blocking=True)
        self.frames[b:].zero_()
        self.seeds[:b].copy_(seeds, non_blocking=True)
        self.frame0[:b].copy_(frame0, non_blocking=True)
        self.graph.replay()
        return self.out[:b]


class DecoderRunner:
    """Decode DecodeRows in bucketed batches; eager on CPU, CUDA Graphs on GPU when enabled."""

    def __init__(
        self,
        decoder: SnacDecoder,
        window_buckets: tuple[int, ...],
        max_batch: int,
        cuda_graphs: bool,
        max_step_frames: int = 0,
    ) -> None:
        self.decoder = decoder
        self.window_buckets = tuple(sorted(window_buckets))
        self.max_batch = max_batch
        self.use_graphs = cuda_graphs and decoder.device.type == "cuda"
        if max_step_frames == 0:
            max_step_frames = CPU_STEP_FRAMES if decoder.device.type == "cpu" else 0
        self.max_step_frames = max_step_frames
        self.batch_sizes = batch_ladder(max_batch)
        self._graphs: dict[tuple[int, int], _Graph] = {}

    def bind_thread(self) -> None:
        """Make the calling thread's current CUDA device the decoder's (the decode thread calls this).

        A new thread starts on device 0: without this, a decoder on cuda:N would capture its graphs
        and run its side streams on device 0's streams.
        """
        if self.decoder.device.type == "cuda":
            torch.cuda.set_device(self.decoder.device)

    def warm_up(self) -> None:
        """Capture every bucket's graph (GPU) or run each window once (CPU) before serving."""
        if not self.use_graphs:
            for window in self.window_buckets:
                frames = torch.zeros(1, window, CODES_PER_FRAME, dtype=torch.int64, device=self.decoder.device)
                zeros = torch.zeros(1, dtype=torch.int64, device=self.decoder.device)
                self.decoder(frames, zeros, zeros)
            return
        pool = torch.cuda.graph_pool_handle()
        # Largest first, so smaller graphs reuse the memory pool the largest one sized.
        for window in reversed(self.window_buckets):
            for batch in reversed(self.batch_sizes):
                self._graphs[(batch, window)] = _Graph(self.decoder, batch, window, pool)
        torch.cuda.synchronize()
        log.info("captured %d CUDA graphs", len(self._graphs))

    def bucket_of(self, row: DecodeRow) -> int:
        """The window length a row is decoded at: its bucket, or its exact length."""
        n = len(row.frames)
        i = bisect.bisect_left(self.window_buckets, n)
        if i == len(self.window_buckets):
            return n
        width = self.window_buckets[i]
        return width if (row.pad_ok or width == n) else n

    def rows_per_forward(self, window: int) -> int:
        """How many rows of this window one forward takes: max_batch, or fewer under max_step_frames."""
        if not self.max_step_frames:
            return self.max_batch
        return max(1, min(self.max_batch, self.max_step_frames // window))

    def decode(self, rows: list[DecodeRow], publish: Publish | None = None) -> list[np.ndarray]:
        """PCM (float32, the kept frames only) for each row, in the order given.

        `publish(indices, pcms)` is called after each forward, so a step split into several
        forwards hands its first rows back without waiting for the last.
        """
        groups: dict[int, list[int]] = defaultdict(list)
        for i, row in enumerate(rows):
            groups[self.bucket_of(row)].append(i)
        out: list[np.ndarray] = [np.empty(0, np.float32)] * len(rows)
        for window, idx in groups.items():
            step = self.rows_per_forward(window)
            for lo in range(0, len(idx), step):
                part = idx[lo : lo + step]
                pcms = self._decode_group([rows[i] for i in part], window)
                for i, pcm in zip(part, pcms):
                    out[i] = pcm
                if publish is not None:
                    publish(part, pcms)
        return out

    def _decode_group(self, rows: list[DecodeRow], window: int) -> list[np.ndarray]:
        frames = np.zeros((len(rows), window, CODES_PER_FRAME), dtype=np.int64)
        for i, row in enumerate(rows):
            frames[i, : len(row.frames)] = row.frames
        seeds = torch.tensor([(r.seed ^ (r.seed >> 32)) & 0xFFFFFFFF for r in rows], dtype=torch.int64)
        frame0 = torch.tensor([r.frame0 for r in rows], dtype=torch.int64)
        audio = self._forward(torch.from_numpy(frames), seeds, frame0)
        audio = audio.cpu().numpy()  # the one device-to-host copy of the step
        return [
            audio[i, r.keep_start * FRAME_SAMPLES : r.keep_end * FRAME_SAMPLES].copy() for i, r in enumerate(rows)
        ]

    def _forward(self, frames: torch.Tensor, seeds: torch.Tensor, frame0: torch.Tensor) -> torch.Tensor:
        device = self.decoder.device
        if device.type == "cuda":
            # Pinned host memory lets the host-to-device copies run without blocking the thread.
            frames, seeds, frame0 = (t.pin_memory() for t in (frames, seeds, frame0))
        b, window = frames.shape[0], frames.shape[1]
        if self.use_graphs:
            i = bisect.bisect_left(self.batch_sizes, b)
            graph = self._graphs.get((self.batch_sizes[i], window)) if i < len(self.batch_sizes) else None
            if graph is not None:
                return graph.run(frames, seeds, frame0)
        return self.decoder(*(t.to(device, non_blocking=True) for t in (frames, seeds, frame0)))
