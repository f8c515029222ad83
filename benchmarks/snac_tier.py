"""SNAC codec tier benchmark: the micro-batched gRPC server versus the reference streaming decode.

Two modes, each measured in one run on one machine:

- throughput (default): N concurrent streams send seeded random frames as fast as the server
  reads them, through the real gRPC server on loopback (in-process). Compared with the
  reference way of streaming SNAC: one 4-frame window per emitted frame, batch 1, in-process,
  on the same model and the same frames. Prints audio-seconds decoded per wall-second for both
  and their ratio.
- --realtime-search: streams paced like an LLM producing them (one frame every 85.33 ms);
  doubles the number of streams until the p99 chunk latency passes --p99-target-ms or a stream
  underruns, then bisects; reports the most streams that stay real time.

Run from the repository root:
    PYTHONPATH=. .venv/bin/python benchmarks/snac_tier.py --quick
    PYTHONPATH=. .venv/bin/python benchmarks/snac_tier.py --realtime-search --device cuda
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Run as a script from the repository root: make `snac_server` (and, when loaded by a test, the
# benchmarks' own modules) importable without PYTHONPATH.
REPO_ROOT = Path(__file__).resolve().parent.parent
for _path in (REPO_ROOT, REPO_ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from provenance import cpu_model, git_commit, machine_busy_s, timestamp, versions  # noqa: E402
from snac_server.api import codec_pb2, codec_pb2_grpc  # noqa: E402
from snac_server.chunking import EXACT_CONTEXT, REFERENCE_RIGHT  # noqa: E402
from snac_server.client import END_REQUEST, channel, frames_request, header_request  # noqa: E402
from snac_server.codec_model import SnacDecoder, build_decoder  # noqa: E402
from snac_server.config import SnacServerConfig  # noqa: E402
from snac_server.frames import CODEBOOK_SIZE, CODES_PER_FRAME, FRAME_SAMPLES, FRAME_SECONDS  # noqa: E402
from snac_server.server import SnacServer, build_server  # noqa: E402

DEFAULT_FRAMES = 256  # per stream, full run
QUICK_FRAMES = 64  # per stream, --quick: ~1.5 min on 2 CPU cores
REALTIME_FRAMES = 96  # per stream and trial of --realtime-search (8.2 s of audio)
WARMUP_FRAMES = 12  # per stream of the server warm-up (not timed)
WARMUP_WINDOWS = 4  # reference warm-up decodes (not timed)
STREAMS_PER_CHANNEL = 64  # spread many streams over a few HTTP/2 connections
SEED = 1234


# -- arguments and environment ----------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command line of the benchmark; server settings left unset take SnacServerConfig's defaults."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"{QUICK_FRAMES} frames per stream (< 3 min on 2 CPU cores)")
    p.add_argument("--streams", type=int, default=8, help="concurrent streams (throughput mode)")
    p.add_argument("--frames", type=int, default=None, help=f"frames per stream (default {DEFAULT_FRAMES}; "
                   f"--quick {QUICK_FRAMES}; --realtime-search {REALTIME_FRAMES} per trial)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--max-batch", type=int, default=None, help="server rows per decode step")
    p.add_argument("--max-wait-ms", type=float, default=None, help="server wait for a batch to fill")
    p.add_argument("--policy", default="adaptive", choices=("adaptive", "exact", "reference"),
                   help="server-side chunk policy the streams ask for")
    p.add_argument("--chunk-frames", type=int, default=0, help="chunk size the streams ask for (0 = server default)")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="torch intra-op threads for both sides (0 = torch's default, one per core)")
    p.add_argument("--model", default="random-24khz", help="SNAC model: random-24khz, a local dir or a HF id")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default benchmarks/results/snac_tier[_realtime]-<device>.json)")
    p.add_argument("--realtime-search", action="store_true", help="find the most streams paced at real time")
    p.add_argument("--p99-target-ms", type=float, default=50.0, help="realtime: p99 chunk latency limit")
    p.add_argument("--max-streams-search", type=int, default=1024, help="realtime: largest N tried")
    p.add_argument("--playout-buffer-ms", type=float, default=100.0,
                   help="realtime: audio a listener buffers before playing; a stream underruns when playback stalls")
    p.add_argument("--pace", type=float, default=1.0,
                   help="realtime: frame rate as a multiple of real time (how fast the LLM produces)")
    args = p.parse_args(argv)
    if args.frames is None:
        args.frames = REALTIME_FRAMES if args.realtime_search else QUICK_FRAMES if args.quick else DEFAULT_FRAMES
    if args.streams < 1 or args.frames < 1 or args.max_streams_search < 1 or args.pace <= 0:
        p.error("--streams, --frames and --max-streams-search must be >= 1, --pace > 0")
    return args


def server_config(args: argparse.Namespace) -> SnacServerConfig:
    """Loopback, ephemeral port, no metrics HTTP; the flags given override the server defaults."""
    overrides = {"max_batch": args.max_batch, "max_wait_ms": args.max_wait_ms}
    return SnacServerConfig(
        host="127.0.0.1", port=0, metrics_port=-1, model=args.model, device=args.device, dtype=args.dtype,
        policy=args.policy, max_streams=max(1024, args.max_streams_search),
        **{k: v for k, v in overrides.items() if v is not None},
    )


def describe_device(device: str) -> str:
    """A human description of where the decode runs: GPU name, or CPU model and cores."""
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(torch.device(device))} (CUDA {torch.version.cuda})"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cpu_model()}, {cores} cores, torch threads {torch.get_num_threads()}"


def device_slug(device: str) -> str:
    """File-name part for the device: `cpu`, or the GPU's name in lower-case-with-dashes."""
    if not device.startswith("cuda"):
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(torch.device(device)).lower()).strip("-")


# -- workload -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamInput:
    """One stream's seed and its frames (n, 7) of codes in 0..4095."""

    seed: int
    frames: np.ndarray


def make_streams(count: int, frames: int, base_seed: int = SEED) -> list[StreamInput]:
    """Seeded random frames: the same inputs for the server and the reference."""
    shape = (frames, CODES_PER_FRAME)
    return [
        StreamInput(base_seed + i, np.random.default_rng(base_seed + i).integers(0, CODEBOOK_SIZE, shape))
        for i in range(count)
    ]


def audio_seconds(streams: Sequence[StreamInput]) -> float:
    """Seconds of 24 kHz audio all the streams' frames make."""
    return sum(len(s.frames) for s in streams) * FRAME_SECONDS


# -- one stream through the gRPC server --------------------------------------------------------


@dataclass
class StreamRun:
    """Client-side timeline of one Decode stream (perf_counter seconds)."""

    started: float = 0.0  # header handed to gRPC
    frame_sent: list[float] = field(default_factory=list)  # per frame
    frame_due: list[float] = field(default_factory=list)  # per frame: when pacing wanted it sent
    end_sent: float = 0.0
    arrivals: list[float] = field(default_factory=list)  # per chunk
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (first_frame, num_frames)
    error: str | None = None


async def paced_frames(run: StreamRun, stream: StreamInput, policy: str, chunk_frames: int,
                       interval_s: float, start_at: float) -> AsyncIterator[codec_pb2.DecodeRequest]:
    """Header, one frame per message on an absolute schedule (none when interval is 0), end of stream.

    Sending times are recorded as the generator hands each message to gRPC.
    """
    run.started = time.perf_counter()
    yield header_request(stream.seed, policy, chunk_frames)
    for k, frame in enumerate(stream.frames):
        due = start_at + k * interval_s
        if interval_s and due > time.perf_counter():
            await asyncio.sleep(due - time.perf_counter())
        run.frame_due.append(due)
        run.frame_sent.append(time.perf_counter())
        yield frames_request([frame])
    run.end_sent = time.perf_counter()
    yield END_REQUEST


async def run_stream(stub: codec_pb2_grpc.SnacCodecStub, stream: StreamInput, policy: str, chunk_frames: int,
                     interval_s: float = 0.0, start_at: float | None = None) -> StreamRun:
    """One Decode stream to its final chunk, timing every chunk's arrival."""
    run = StreamRun()
    if start_at is not None and start_at > time.perf_counter():
        await asyncio.sleep(start_at - time.perf_counter())
    requests = paced_frames(run, stream, policy, chunk_frames, interval_s, start_at or time.perf_counter())
    try:
        async for chunk in stub.Decode(requests):
            run.arrivals.append(time.perf_counter())
            run.chunks.append((chunk.first_frame, chunk.num_frames))
    except Exception as exc:  # a failed stream is reported, not fatal to the benchmark
        run.error = f"{type(exc).__name__}: {exc}"
    return run


async def run_streams(address: str, streams: Sequence[StreamInput], policy: str, chunk_frames: int,
                      interval_s: float = 0.0, stagger_s: float = 0.0) -> list[StreamRun]:
    """All streams concurrently over a few loopback channels; stream i starts i*stagger_s/N late."""
    channels = [channel(address) for _ in range(math.ceil(len(streams) / STREAMS_PER_CHANNEL))]
    try:
        t0 = time.perf_counter() + 0.01
        tasks = [
            run_stream(codec_pb2_grpc.SnacCodecStub(channels[i // STREAMS_PER_CHANNEL]), s, policy, chunk_frames,
                       interval_s, t0 + stagger_s * i / len(streams))
            for i, s in enumerate(streams)
        ]
        return await asyncio.gather(*tasks)
    finally:
        for ch in channels:
            await ch.close()


# -- statistics ---------------------------------------------------------------------------------


class CpuMeter:
    """CPU used over an interval, in cores: by this process, and by everything else on the machine.

    The second figure is the one to watch on a shared machine: PyTorch's OpenMP threads slow down
    far more than proportionally when another process takes a core.
    """

    def __init__(self) -> None:
        self._wall, self._own, self._busy = time.perf_counter(), time.process_time(), machine_busy_s()

    def read(self) -> dict[str, float]:
        wall = time.perf_counter() - self._wall
        own = (time.process_time() - self._own) / wall
        other = max(0.0, (machine_busy_s() - self._busy) / wall - own)
        return {"process_cores": round(own, 3), "other_processes_cores": round(other, 3)}


def pct(values: Sequence[float], *ps: float, scale: float = 1000.0) -> dict[str, float | None]:
    """Percentiles p<q> of `values` times `scale` (seconds -> ms by default); None when empty."""
    arr = np.asarray(values, dtype=np.float64)
    return {f"p{p:g}": (round(float(np.percentile(arr, p)) * scale, 3) if arr.size else None) for p in ps}


def histogram_samples(metric: Any) -> dict[str, float]:
    """A prometheus Histogram's samples as {'name{le}': value}, for before/after differences."""
    return {s.name + s.labels.get("le", ""): s.value for s in metric.collect()[0].samples}


@dataclass
class ServerStats:
    """Server-side figures over one timed interval (metrics registry deltas and window counts)."""

    batch: dict[str, float] = field(default_factory=dict)
    step: dict[str, float] = field(default_factory=dict)
    queue_wait: dict[str, float] = field(default_factory=dict)
    window_frames: int = 0
    emitted_frames: int = 0
    rows: int = 0


class WindowCounter:
    """Counts the frames the server's decoder actually runs (window buckets) per emitted frame.

    Wraps the runner's decode() in place, on the decode thread; it only reads the rows it is given,
    so the figures cost nothing measurable. Unavailable if the server's internals change.
    """

    def __init__(self, server: SnacServer) -> None:
        self.available = False
        self.window_frames = self.emitted_frames = self.rows = 0
        runner = getattr(server.batcher, "_runner", None)
        if runner is None or not hasattr(runner, "bucket_of"):
            return
        decode = runner.decode

        def counted(rows, *args, **kwargs):
            self.rows += len(rows)
            self.window_frames += sum(runner.bucket_of(r) for r in rows)
            self.emitted_frames += sum(r.keep_end - r.keep_start for r in rows)
            return decode(rows, *args, **kwargs)

        runner.decode = counted
        self.available = True

    def snapshot(self) -> tuple[int, int, int]:
        return self.window_frames, self.emitted_frames, self.rows


def server_delta(server: SnacServer, counter: WindowCounter, before: dict[str, dict[str, float]],
                 windows_before: tuple[int, int, int]) -> ServerStats:
    """Batch size, step time and queue wait over the interval since `before` was taken."""
    after = metric_snapshot(server)
    stats = ServerStats()
    for name, key in (("batch", "snac_batch_size"), ("step", "snac_decode_step_seconds"),
                      ("queue_wait", "snac_queue_wait_seconds")):
        count = after[name][f"{key}_count"] - before[name][f"{key}_count"]
        total = after[name][f"{key}_sum"] - before[name][f"{key}_sum"]
        getattr(stats, name).update(count=count, sum=total, mean=(total / count if count else 0.0))
    # Batch size histogram: how many steps had <= le rows (cumulative buckets).
    stats.batch["steps_le"] = {
        k.removeprefix("snac_batch_size_bucket"): after["batch"][k] - before["batch"][k]
        for k in after["batch"] if k.startswith("snac_batch_size_bucket")
    }
    w = counter.snapshot()
    stats.window_frames, stats.emitted_frames, stats.rows = (a - b for a, b in zip(w, windows_before))
    return stats


def metric_snapshot(server: SnacServer) -> dict[str, dict[str, float]]:
    """The histograms the benchmark reports, read from the server's own registry."""
    m = server.metrics
    return {"batch": histogram_samples(m.batch_size), "step": histogram_samples(m.step_latency),
            "queue_wait": histogram_samples(m.queue_wait)}


# -- (a) the server -----------------------------------------------------------------------------


async def start_server(config: SnacServerConfig) -> tuple[SnacServer, str, WindowCounter, float]:
    """Build and start the real server in-process (model load and runner warm-up included)."""
    t = time.perf_counter()
    server, port = build_server(config)
    counter = WindowCounter(server)
    await server.start()
    return server, f"127.0.0.1:{port}", counter, time.perf_counter() - t


async def server_throughput(server: SnacServer, address: str, counter: WindowCounter, streams: list[StreamInput],
                            policy: str, chunk_frames: int) -> dict[str, Any]:
    """Audio-s per wall-s for concurrent streams sent as fast as the server reads them."""
    warm = make_streams(len(streams), min(WARMUP_FRAMES, len(streams[0].frames)), base_seed=SEED + 10_000)
    await run_streams(address, warm, policy, chunk_frames)  # not timed: first batch shapes, channel setup
    before, windows_before = metric_snapshot(server), counter.snapshot()
    meter = CpuMeter()
    runs = await run_streams(address, streams, policy, chunk_frames)
    wall = max((r.arrivals[-1] if r.arrivals else time.perf_counter()) for r in runs) - min(r.started for r in runs)
    cpu = meter.read()
    errors = [r.error for r in runs if r.error]
    delivered = sum(n for r in runs for _, n in r.chunks)
    stats = server_delta(server, counter, before, windows_before)
    gaps = [b - a for r in runs for a, b in zip(r.arrivals, r.arrivals[1:])]
    ttfc = [r.arrivals[0] - r.started for r in runs if r.arrivals]
    sizes = Counter(n for r in runs for _, n in r.chunks)
    return {
        "wall_s": round(wall, 3),
        "audio_s": round(audio_seconds(streams), 3),
        "audio_s_per_s": audio_seconds(streams) / wall,
        "frames_delivered": delivered,
        "errors": errors,
        "cpu": cpu,  # process_cores: decode thread + gRPC loop + client together
        "decode_thread_busy_fraction": round(stats.step["sum"] / wall, 3),
        "chunk_gap_ms": pct(gaps, 50, 95, 99),
        "time_to_first_chunk_ms": pct(ttfc, 50, 95),
        "chunk_frames_histogram": {str(k): v for k, v in sorted(sizes.items())},
        "chunks": sum(sizes.values()),
        "decode_steps": stats.batch["count"],
        "mean_batch_rows": round(stats.batch["mean"], 3),
        "batch_steps_le": stats.batch["steps_le"],
        "mean_step_ms": round(stats.step["mean"] * 1000, 3),
        "mean_queue_wait_ms": round(stats.queue_wait["mean"] * 1000, 3),
        "window_frames_decoded": stats.window_frames if counter.available else None,
        "window_frames_per_emitted_frame": (round(stats.window_frames / stats.emitted_frames, 3)
                                            if counter.available and stats.emitted_frames else None),
    }


# -- (b) the reference --------------------------------------------------------------------------


def reference_window(j: int, n: int) -> tuple[int, int]:
    """The reference's 4-frame window for frame j: [j-1, j+3), shifted to lie inside the stream."""
    width = min(4, n)
    start = max(0, min(j - 1, n - width))
    return start, start + width


def reference_decode_stream(decoder: SnacDecoder, stream: StreamInput) -> int:
    """Decode every frame of a stream from its own 4-frame window, batch 1; returns samples kept."""
    device = decoder.device
    frames = torch.as_tensor(stream.frames, dtype=torch.int64, device=device)
    seed = torch.tensor([stream.seed & 0xFFFFFFFF], dtype=torch.int64, device=device)
    kept = 0
    for j in range(len(stream.frames)):
        start, end = reference_window(j, len(stream.frames))
        audio = decoder(frames[None, start:end], seed, torch.tensor([start], dtype=torch.int64, device=device))
        offset = (j - start) * FRAME_SAMPLES
        kept += audio[0, offset : offset + FRAME_SAMPLES].cpu().numel()  # the copy a streaming client makes
    return kept


def reference_throughput(decoder: SnacDecoder, streams: list[StreamInput]) -> dict[str, Any]:
    """Audio-s per wall-s of the reference way over the same frames, sequentially."""
    warm = make_streams(1, WARMUP_WINDOWS, base_seed=SEED + 20_000)[0]
    reference_decode_stream(decoder, warm)  # not timed
    meter, t0 = CpuMeter(), time.perf_counter()
    samples = sum(reference_decode_stream(decoder, s) for s in streams)
    wall = time.perf_counter() - t0
    frames = sum(len(s.frames) for s in streams)
    assert samples == frames * FRAME_SAMPLES, "the reference must emit every frame"
    return {
        "wall_s": round(wall, 3),
        "audio_s": round(audio_seconds(streams), 3),
        "audio_s_per_s": audio_seconds(streams) / wall,
        "window_frames_per_emitted_frame": sum(min(4, len(s.frames)) * len(s.frames) for s in streams) / frames,
        "mean_window_ms": round(wall / frames * 1000, 3),
        "cpu": meter.read(),
    }


# -- realtime search ----------------------------------------------------------------------------


def needed_send_time(run: StreamRun, first: int, count: int, policy: str) -> float:
    """When the client had sent everything a chunk depends on: its frames and right context, or the end.

    exact/adaptive chunks need 3 frames after their last one; reference chunks 2 (and frame 3 for
    frame 0). A chunk whose context runs past the stream's last frame needs end-of-stream.
    """
    right = REFERENCE_RIGHT if policy == "reference" else EXACT_CONTEXT
    last_needed = first + count - 1 + right
    if policy == "reference":
        last_needed = max(last_needed, 3)
    return run.end_sent if last_needed >= len(run.frame_sent) else run.frame_sent[last_needed]


def playback_stall_s(run: StreamRun, buffer_s: float) -> float:
    """Total time a listener's playback stalls: play starts buffer_s after the first chunk arrives."""
    if not run.arrivals:
        return math.inf
    cursor = run.arrivals[0] + buffer_s  # when the next chunk's first sample is due to play
    stalled = 0.0
    for arrival, (_, count) in zip(run.arrivals, run.chunks):
        if arrival > cursor:
            stalled += arrival - cursor
            cursor = arrival
        cursor += count * FRAME_SECONDS
    return stalled


async def realtime_trial(address: str, n: int, args: argparse.Namespace, trial: int) -> dict[str, Any]:
    """N streams paced at real time (starts staggered over one frame); latency and underruns."""
    streams = make_streams(n, args.frames, base_seed=SEED + 100_000 * (trial + 1))
    interval = FRAME_SECONDS / args.pace
    meter = CpuMeter()
    runs = await run_streams(address, streams, args.policy, args.chunk_frames, interval, stagger_s=interval)
    cpu = meter.read()
    latencies = [
        arrival - needed_send_time(r, first, count, args.policy)
        for r in runs for arrival, (first, count) in zip(r.arrivals, r.chunks)
    ]
    stalls = [playback_stall_s(r, args.playout_buffer_ms / 1000) for r in runs]
    send_lag = [sent - due for r in runs for sent, due in zip(r.frame_sent, r.frame_due)]
    errors = [r.error for r in runs if r.error]
    p = pct(latencies, 50, 95, 99)
    ok = not errors and p["p99"] is not None and p["p99"] <= args.p99_target_ms and max(stalls) == 0.0
    return {
        "streams": n,
        "ok": ok,
        "chunk_latency_ms": p,
        "underrun_streams": sum(s > 0 for s in stalls),
        "max_stall_ms": round(max(stalls) * 1000, 3) if not math.isinf(max(stalls)) else None,
        "time_to_first_chunk_ms": pct([r.arrivals[0] - r.started for r in runs if r.arrivals], 50, 95),
        "chunk_frames_histogram": {str(k): v for k, v in sorted(Counter(c for r in runs for _, c in r.chunks).items())},
        "client_send_lag_ms": pct(send_lag, 50, 99),  # large values: the in-process client, not the server, is late
        "cpu": cpu,
        "errors": errors[:5],
    }


async def realtime_search(address: str, args: argparse.Namespace) -> dict[str, Any]:
    """Double N until a trial fails (or the cap), then bisect between the last pass and first fail."""
    trials: list[dict[str, Any]] = []

    async def trial(n: int) -> bool:
        result = await realtime_trial(address, n, args, len(trials))
        trials.append(result)
        p99 = result["chunk_latency_ms"]["p99"]
        print(f"  {n:5d} streams: p99 chunk latency {p99} ms, underruns {result['underrun_streams']}, "
              f"{'ok' if result['ok'] else 'FAIL'}", flush=True)
        return result["ok"]

    good, bad, n = 0, None, 1
    while n <= args.max_streams_search:
        if not await trial(n):
            bad = n
            break
        good = n
        n = min(n * 2, args.max_streams_search) if n < args.max_streams_search else n + 1
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if await trial(mid) else (good, mid)
    return {
        "max_realtime_streams": good,
        "capped": bad is None,  # every N up to --max-streams-search passed
        "latency_definition": "chunk arrival at the client minus the time the client handed gRPC the last "
                              "message the chunk needs (its last frame + right context, or end-of-stream)",
        "underrun_definition": f"playback starts {args.playout_buffer_ms:g} ms after the first chunk arrives; "
                               "any chunk arriving after its first sample is due to play is an underrun",
        "p99_target_ms": args.p99_target_ms,
        "frames_per_stream": args.frames,
        "pace": args.pace,
        "trials": trials,
    }


# -- main ---------------------------------------------------------------------------------------


def common_fields(args: argparse.Namespace, config: SnacServerConfig, startup_s: float) -> dict[str, Any]:
    """Settings, versions and provenance every result file carries."""
    device = config.resolved_device
    return {
        "device": describe_device(device),
        "device_type": device,
        "streams": args.streams,
        "frames_per_stream": args.frames,
        "policy": args.policy,
        "chunk_frames": args.chunk_frames or config.chunk_frames,
        "dtype": config.dtype,
        "max_batch": config.max_batch,
        "max_wait_ms": config.max_wait_ms,
        "torch_threads": torch.get_num_threads(),
        "cuda_graphs": config.cuda_graphs and device.startswith("cuda"),
        "window_buckets": list(config.window_buckets),
        "model": config.model,
        "versions": versions(("torch", "snac", "grpcio", "numpy")),
        "git_commit": git_commit(),
        "timestamp": timestamp(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "server_startup_s": round(startup_s, 3),
    }


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Start the server, run the chosen mode, stop the server; returns the result document."""
    config = server_config(args)
    server, address, counter, startup_s = await start_server(config)
    result = common_fields(args, config, startup_s)
    try:
        if args.realtime_search:
            result.pop("streams")
            result["realtime"] = await realtime_search(address, args)
            return result
        streams = make_streams(args.streams, args.frames)
        result["server"] = await server_throughput(server, address, counter, streams, args.policy, args.chunk_frames)
    finally:
        await server.stop(grace_s=1.0)
    # The reference runs after the server has stopped, so the two never share the CPU or GPU.
    decoder = build_decoder(config.model, config.resolved_device, config.dtype, max_batch=1)
    result["reference"] = reference_throughput(decoder, streams)
    result["server_audio_s_per_s"] = round(result["server"]["audio_s_per_s"], 4)
    result["reference_audio_s_per_s"] = round(result["reference"]["audio_s_per_s"], 4)
    result["ratio"] = round(result["server_audio_s_per_s"] / result["reference_audio_s_per_s"], 3)
    result["latency_definitions"] = {
        "chunk_gap_ms": "time between consecutive chunk arrivals of one stream, all streams pooled",
        "time_to_first_chunk_ms": "per stream, from its header being handed to gRPC to its first chunk arriving",
    }
    result["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return result


def default_out(args: argparse.Namespace, device: str) -> Path:
    name = "snac_tier_realtime" if args.realtime_search else "snac_tier"
    return REPO_ROOT / "benchmarks" / "results" / f"{name}-{device_slug(device)}.json"


def summary_line(result: dict[str, Any]) -> str:
    """The one-line result."""
    if "realtime" in result:
        rt = result["realtime"]
        return (f"snac-tier realtime on {result['device']}: {rt['max_realtime_streams']}"
                f"{'+' if rt['capped'] else ''} streams stay real time "
                f"(p99 chunk latency <= {rt['p99_target_ms']:g} ms, no underrun; "
                f"policy {result['policy']}, {result['dtype']}, max_batch {result['max_batch']})")
    s = result["server"]
    gap, first = s["chunk_gap_ms"], s["time_to_first_chunk_ms"]
    return (f"snac-tier on {result['device']}: server {result['server_audio_s_per_s']:.2f} audio-s/s "
            f"({result['streams']} streams x {result['frames_per_stream']} frames, {result['policy']}, "
            f"{s['window_frames_per_emitted_frame']} decoded frames/emitted frame, "
            f"mean batch {s['mean_batch_rows']:.2f} rows) vs reference {result['reference_audio_s_per_s']:.2f} "
            f"audio-s/s (4-frame windows, batch 1): ratio {result['ratio']:.2f}x; "
            f"chunk gap p50/p99 {_ms(gap['p50'])}/{_ms(gap['p99'])} ms, first chunk p50 {_ms(first['p50'])} ms")


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def contended(result: dict[str, Any], limit_cores: float = 0.1) -> list[str]:
    """The timed parts during which other processes used more than `limit_cores` of the machine."""
    parts = {k: result[k] for k in ("server", "reference") if k in result}
    for trial in result.get("realtime", {}).get("trials", []):
        parts[f"{trial['streams']}-stream trial"] = trial
    return [name for name, part in parts.items() if part["cpu"]["other_processes_cores"] > limit_cores]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the summary and write the JSON; returns the result document."""
    args = parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)  # process-wide: the server's decode thread and the reference
    t0 = time.perf_counter()
    result = asyncio.run(run_benchmark(args))
    result["benchmark_wall_s"] = round(time.perf_counter() - t0, 3)
    result["command"] = " ".join(["benchmarks/snac_tier.py", *(sys.argv[1:] if argv is None else argv)])
    result["contended"] = contended(result)
    out = args.out or default_out(args, result["device_type"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(summary_line(result))
    if result["contended"]:
        print(f"warning: other processes used CPU during the {', '.join(result['contended'])} timing; the figures "
              "are skewed (see cpu.other_processes_cores in the JSON): rerun on an idle machine")
    print(f"wrote {out} ({result['benchmark_wall_s']:.1f} s)")
    return result


if __name__ == "__main__":
    main()
