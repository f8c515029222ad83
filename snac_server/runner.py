"""The decoder runner: rows in, PCM out, on the batcher's thread; CUDA Graphs on GPU.

Rows of the same shape share a forward: streaming steps by frames per row, reference windows by
window length. On GPU each (batch size, shape) replays a CUDA Graph captured at start-up (SNAC's
decoder is hundreds of small kernels: launches, not FLOPs, bound it); a batch is padded up to the
next captured size, its padding rows pointed at the streaming decoder's scratch slot. The host
stages each forward's inputs in pinned memory, copies them in without blocking, and copies the PCM
back into pinned memory without blocking too: a step's next forward is staged and launched before the
host waits for the last one's PCM and hands it out, so host work and GPU work overlap (on a CPU, where a
forward is done when it returns, each forward's PCM goes out at once).

The streaming step may be compiled (torch.compile, Inductor: the Snake activations, masks, noise and
residual adds fuse around the convolutions; benchmarks/README.md). Its batch and frame dimensions are
marked dynamic, so a few graphs serve every shape (dynamic shapes still specialize a dimension of 1: a
lone row, a 1-frame row); warm-up runs each frame bucket at 1, 2 and its most rows, so that every graph
is compiled before serving. A compile that fails at warm-up (no C compiler on the node, an Inductor bug)
is logged and the eager step serves.
"""

from __future__ import annotations

import bisect
import logging
from collections import defaultdict, deque
from collections.abc import Callable, Sequence

import numpy as np
import torch

from .codec_model import SnacDecoder
from .frames import CODES_PER_FRAME
from .noise import fold_seed
from .session import Row, StreamStep, Window
from .streaming import OPEN_END, StreamingDecoder

log = logging.getLogger(__name__)

Publish = Callable[[list[int], list[np.ndarray]], None]
CPU_STEP_FRAMES = 16  # on CPU a frame costs least in small forwards (8.6-10 ms up to 16 frames, 38.5 at 192): benchmarks/snac_tier.py --forward-sizes
REFERENCE_WINDOW = 4


def batch_ladder(max_batch: int) -> tuple[int, ...]:
    """Batch sizes with a captured graph: powers of two up to max_batch, and max_batch."""
    sizes = {max_batch}
    b = 1
    while b < max_batch:
        sizes.add(b)
        b *= 2
    return tuple(sorted(sizes))


def indexed(device: torch.device) -> torch.device:
    """`device` with its index: a bare `cuda` (what users write) is the current GPU of the calling
    thread, which torch.cuda.set_device cannot take (it wants an index) and a new thread would read as 0."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class _Graph:
    """One captured forward of a fixed batch size and its static input buffers."""

    def __init__(self, forward: Callable[..., torch.Tensor], inputs: list[torch.Tensor], pad: list[int], pool: object) -> None:
        self.inputs, self.pad = inputs, pad
        side = torch.cuda.Stream(inputs[0].device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up on a side stream before capture, as CUDA Graphs require
            for _ in range(2):
                forward(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = forward(*inputs)

    def run(self, args: Sequence[torch.Tensor]) -> torch.Tensor:
        b = args[0].shape[0]
        for static, arg, pad in zip(self.inputs, args, self.pad):
            if arg.shape[1:] != static.shape[1:] or b > static.shape[0]:
                raise ValueError(f"input of shape {tuple(arg.shape)} does not fit graph input {tuple(static.shape)}")
            static[:b].copy_(arg, non_blocking=True)  # pinned host memory: no wait
            static[b:].fill_(pad)
        self.graph.replay()
        return self.out[:b]


class DecoderRunner:
    """Decode rows: streaming steps through `streaming`, reference windows through `full`."""

    def __init__(self, full: SnacDecoder, streaming: StreamingDecoder, max_batch: int, frame_buckets: tuple[int, ...],
                 cuda_graphs: bool, max_step_frames: int = 0, compile_step: bool = False) -> None:
        self.full = full
        self.streaming = streaming
        self.compiled = compile_step
        self._step: Callable[..., torch.Tensor] = torch.compile(streaming, dynamic=False) if compile_step else streaming
        if compile_step:  # the graphs a ladder of batch sizes x frame buckets needs, before dynamo gives up and runs eager
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.device = indexed(full.device)
        self.max_batch = max_batch
        self.frame_buckets = tuple(sorted(frame_buckets))
        self.use_graphs = cuda_graphs and self.device.type == "cuda"
        if max_step_frames == 0:
            # On a GPU a forward holds at most a full step of 1-frame rows: a graph's memory grows with its
            # frames (13-15 MiB a frame in fp32 on an H200), and the pool of a 256-row step of 16-frame rows
            # was 52 GiB (benchmarks/results/gpu-first-contact-h200-run1.json; 3,956 MiB once capped at 256
            # frames: gpu-first-contact-h200.json). A backlog of 16 frames
            # catches up in max_batch // 16 rows a forward instead.
            max_step_frames = CPU_STEP_FRAMES if self.device.type == "cpu" else max_batch
        self.max_step_frames = max_step_frames
        self.batch_sizes = batch_ladder(max_batch)
        self._graphs: dict[tuple[str, int, int], _Graph] = {}
        self._ladders = self.graph_ladders()  # frames per row -> the batch sizes captured for it

    def bind_thread(self) -> None:
        """Make the calling thread's current CUDA device the decoder's (the decode thread calls this).

        A new thread starts on device 0: without this, a decoder on cuda:N would capture its graphs
        and run its side streams on device 0's streams.
        """
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def warm_up(self) -> None:
        """Capture every graph (GPU) or run each shape once (CPU) before serving; compile the step first if asked,
        or serve the eager step if that fails."""
        if self.compiled:
            try:
                return self._warm_up()
            except Exception:
                log.exception("warm-up with the compiled streaming step failed: warming up again with the eager step")
                self.compiled, self._step = False, self.streaming
                self._graphs.clear()
                self._ladders = self.graph_ladders()
        self._warm_up()

    def _warm_up(self) -> None:
        shapes = [("step", f) for f in self.frame_buckets] + [("window", REFERENCE_WINDOW)]
        if not self.use_graphs:
            for kind, n in shapes:
                for batch in self._warm_up_batches(kind, n):
                    self._forward(kind, n, self._example(kind, batch, n))
            return
        pool = torch.cuda.graph_pool_handle()
        # Largest first, so smaller graphs reuse the memory pool the largest one sized.
        for kind, n in sorted(shapes, key=lambda s: -s[1]):
            for batch in reversed(self._ladders[n]):
                inputs = self._dynamic(kind, [t.to(self.device) for t in self._example(kind, batch, n)])
                pad = [self.streaming.num_slots, 0, 0, OPEN_END, 0, 1] if kind == "step" else [0, 0, 0]
                self._graphs[(kind, batch, n)] = _Graph(self._model(kind), inputs, pad, pool)
        torch.cuda.synchronize()
        log.info("captured %d CUDA graphs", len(self._graphs))

    def _warm_up_batches(self, kind: str, n: int) -> list[int]:
        """The batch sizes a CPU runs a shape at before serving: 1, or for a compiled step every graph its dynamic
        shapes need (a size of 1 is specialized: 1, 2 and the most rows a forward of `n` frames takes)."""
        return sorted({1, 2, self.rows_per_forward(n)}) if self.compiled and kind == "step" else [1]

    def graph_ladders(self) -> dict[int, tuple[int, ...]]:
        """Frames per row (each bucket, and the reference window) -> the batch sizes to capture for it:
        up to rows_per_forward, as decode never gives a forward more rows."""
        return {n: batch_ladder(self.rows_per_forward(n)) for n in (*self.frame_buckets, REFERENCE_WINDOW)}

    def rows_per_forward(self, frames: int) -> int:
        """How many rows of `frames` frames one forward takes: max_batch, or fewer under max_step_frames."""
        if not self.max_step_frames:
            return self.max_batch
        return max(1, min(self.max_batch, self.max_step_frames // frames))

    def decode(self, rows: list[Row], publish: Publish) -> None:
        """Decode `rows`, one forward per shape group (split to rows_per_forward); after each forward,
        `publish(indices, pcms)` hands those rows' float32 PCM back: on a GPU once the next forward is launched (the
        last at the end), on a CPU at once. Raises what a forward raised, after handing back the forwards before it."""
        groups: dict[tuple[str, int], list[int]] = defaultdict(list)
        for i, row in enumerate(rows):
            groups[("step", len(row.codes)) if isinstance(row, StreamStep) else ("window", len(row.frames))].append(i)
        pending: deque[tuple[list[int], torch.Tensor, torch.cuda.Event | None]] = deque()
        try:
            for (kind, n), idx in groups.items():
                step = self.rows_per_forward(n)
                for lo in range(0, len(idx), step):
                    part = idx[lo : lo + step]
                    audio = self._forward(kind, n, self._stage(kind, [rows[i] for i in part]))
                    pending.append((part, *self._to_host(audio)))
                    self._hand_back(pending, publish, everything=False)
        finally:  # the forwards that ran are handed back, even when a later one raised
            self._hand_back(pending, publish, everything=True)

    def _to_host(self, audio: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The forward's PCM copied to pinned host memory without waiting, and an event after the copy (a GPU's);
        on a CPU the PCM itself. The copy follows the forward on the stream, so a graph's next replay, later on the
        same stream, cannot overwrite its output first."""
        if self.device.type != "cuda":
            return audio, None
        host = torch.empty(audio.shape, dtype=audio.dtype, pin_memory=True)
        host.copy_(audio, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done

    @staticmethod
    def _hand_back(pending: deque[tuple[list[int], torch.Tensor, torch.cuda.Event | None]], publish: Publish,
                   everything: bool) -> None:
        """Publish the forwards in `pending` in order: all of them, or all but a GPU's last, which runs on meanwhile
        (a CPU's forward, without an event, is done: out at once)."""
        while pending and (everything or len(pending) > 1 or pending[0][2] is None):
            part, host, done = pending[0]
            if done is not None:
                done.synchronize()  # the host's one wait for this forward: its PCM is here
            publish(part, list(host.numpy()))
            pending.popleft()  # only once handed back: rows whose hand-back raised fail with the step

    def _model(self, kind: str) -> Callable[..., torch.Tensor]:
        return self._step if kind == "step" else self.full

    def _dynamic(self, kind: str, args: list[torch.Tensor]) -> list[torch.Tensor]:
        """A compiled step's inputs with their batch and frames marked dynamic (past 1: a size of 1 is specialized)."""
        if kind == "step" and self.compiled:
            for t, dims in zip(args, ((0,), (0, 1), (0,), (0,), (0,), (0,))):
                for d in dims:
                    if t.shape[d] > 1:
                        torch._dynamo.mark_dynamic(t, d)
        return args

    def _forward(self, kind: str, n: int, args: list[torch.Tensor]) -> torch.Tensor:
        b = args[0].shape[0]
        if self.use_graphs:
            ladder = self._ladders.get(n, ())
            i = bisect.bisect_left(ladder, b)
            graph = self._graphs.get((kind, ladder[i], n)) if i < len(ladder) else None
            if graph is not None:
                return graph.run(args)
        args = self._dynamic(kind, [t.to(self.device, non_blocking=True) for t in args])
        return self._model(kind)(*args)

    def _stage(self, kind: str, rows: list[Row]) -> list[torch.Tensor]:
        """The forward's inputs as host tensors (pinned on GPU, so the copies in do not block)."""
        seeds = np.array([fold_seed(r.seed) for r in rows], dtype=np.int64)
        frame0 = np.array([r.frame0 for r in rows], dtype=np.int64)
        if kind == "step":
            host = [np.array([r.slot for r in rows], dtype=np.int64), np.stack([r.codes for r in rows]).astype(np.int64),
                    frame0, np.array([r.end for r in rows], dtype=np.int64), seeds, np.array([r.fresh for r in rows])]
        else:
            host = [np.stack([r.frames for r in rows]).astype(np.int64), seeds, frame0]
        tensors = [torch.from_numpy(a) for a in host]
        return [t.pin_memory() for t in tensors] if self.device.type == "cuda" else tensors

    def _example(self, kind: str, batch: int, n: int) -> list[torch.Tensor]:
        """Inputs of one shape for warm-up and capture (padding rows on the scratch slot)."""
        if kind == "step":
            rows = [StreamStep(self.streaming.num_slots, np.zeros((n, CODES_PER_FRAME), np.int32), 0, OPEN_END, 0, True)]
        else:
            rows = [Window(np.zeros((n, CODES_PER_FRAME), np.int32), 0, 0)]
        return self._stage(kind, rows * batch)
