"""SNAC codec tier benchmark: the streaming decoder versus the reference decoder, in one run.

Both policies run through the same real gRPC server (in-process, on loopback), on the same seeded
frames, in two regimes:

- trickle: the regime of an LLM tier at capacity. Streams send frames in lockstep: frame k of every
  stream goes out once every stream has received the audio frame k - 1 made final, so no stream
  ever has a backlog to batch (each decode step takes one frame per stream).
- unpaced: every stream sends all its frames as fast as the server reads them.

For each it prints audio-seconds decoded per wall-second, the ratio streaming / reference, and the
frames the decoder ran per frame of audio it emitted (the server's own counters: ~1.0 streaming,
4.0 reference), and writes JSON.

`--forward-sizes` instead times one decoder forward of ROWS streaming steps of 4 frames (`--step-frames`), for each
size side by side, and writes ms per frame by frames per forward (why the CPU runner caps frames
per forward: snac_server/runner.py CPU_STEP_FRAMES). With `--threads` it does so at each intra-op
thread count, and with `--busy K` again beside K busy loops in a session of their own (why a replica
runs one thread unless told more: snac_server/config.py cpu_threads).

    .venv/bin/python benchmarks/snac_tier.py --quick
    .venv/bin/python benchmarks/snac_tier.py --quick --compile-step on    # the compiled step (2-4 min more on a CPU)
    .venv/bin/python benchmarks/snac_tier.py --forward-sizes 1,2,4,8,12,48 --device cpu    # ~1 min on 2 cores
    .venv/bin/python benchmarks/snac_tier.py --forward-sizes 1,4 --threads 1,2 --busy 2 --device cpu
    .venv/bin/python benchmarks/snac_tier.py --forward-sizes 4 --step-frames 1 --threads 1,2 --busy 2 --device cpu
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.contention import busy_cores
from benchmarks.provenance import REPO_ROOT, cpu_model, record
from codec_contract.api import codec_pb2, codec_pb2_grpc
from codec_contract.audio import CODEBOOK_SIZE, CODES_PER_FRAME, FRAME_SECONDS, POLICIES, final_samples
from codec_contract.client import END_REQUEST, channel, frames_request, header_request
from snac_server.codec_model import build_decoder
from snac_server.config import SnacServerConfig
from snac_server.runner import DecoderRunner
from snac_server.server import SnacServer, build_server
from snac_server.session import StreamStep
from snac_server.streaming import OPEN_END, StreamingDecoder

QUICK_FRAMES = 48  # per stream, --quick
DEFAULT_FRAMES = 160
SEED = 1234
REGIMES = ("trickle", "unpaced")
FORWARD_REPEATS = 3  # --forward-sizes: timed forwards a size


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"{QUICK_FRAMES} frames per stream")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--frames", type=int, default=None, help=f"frames per stream (default {DEFAULT_FRAMES})")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    p.add_argument("--compile-step", default="auto", choices=("auto", "on", "off"),
                   help="the streaming step through torch.compile (auto: on a GPU; a CPU compiles for 2-3 minutes)")
    p.add_argument("--model", default="random-24khz")
    p.add_argument("--forward-sizes", default="", metavar="ROWS,ROWS",
                   help="instead: ms per frame of one forward of ROWS steps of 4 frames, each size in turn")
    p.add_argument("--step-frames", type=int, default=4,
                   help="with --forward-sizes: frames a streaming step (1: the trickle of real-time streams)")
    p.add_argument("--threads", default="", metavar="N,N",
                   help="with --forward-sizes: at each of these intra-op thread counts (default: torch's own)")
    p.add_argument("--busy", type=int, default=0, metavar="K",
                   help="with --forward-sizes: each size again beside K busy loops in a session of their own")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default benchmarks/results/snac_tier-<device>.json; forward_cost-<device>.json)")
    args = p.parse_args(argv)
    args.frames = args.frames or (QUICK_FRAMES if args.quick else DEFAULT_FRAMES)
    if args.streams < 1 or args.frames < 1:
        p.error("--streams and --frames must be >= 1")
    return args


@dataclass
class Stream:
    """One stream's frames, the audio it got back, and when."""

    seed: int
    frames: np.ndarray
    samples: int = 0  # received so far
    started: float = 0.0
    arrivals: list[float] = field(default_factory=list)
    progress: asyncio.Event = field(default_factory=asyncio.Event)


def make_streams(count: int, frames: int) -> list[Stream]:
    return [Stream(SEED + i, np.random.default_rng(SEED + i).integers(0, CODEBOOK_SIZE, (frames, CODES_PER_FRAME)))
            for i in range(count)]


async def run_one(stub, stream: Stream, policy: str, send) -> None:
    """One Decode stream: `send(stream)` yields its requests; chunks are counted as they arrive."""
    stream.started = time.perf_counter()
    async for chunk in stub.Decode(send(stream)):
        stream.arrivals.append(time.perf_counter())
        stream.samples += len(chunk.pcm) // 2
        stream.progress.set()


def unpaced(policy: str):
    async def send(stream: Stream):
        yield header_request(stream.seed, policy, sample_format=codec_pb2.SAMPLE_FORMAT_S16LE)
        for frame in stream.frames:
            yield frames_request([frame])
        yield END_REQUEST
    return send


def trickle(policy: str, streams: list[Stream]):
    """Lockstep: frame k of every stream goes out once every stream has the audio frames 0..k-1 made final."""
    rounds = [asyncio.Event() for _ in range(len(streams[0].frames) + 1)]
    rounds[0].set()
    owed = [final_samples(POLICIES[policy], k, ended=False) for k in range(len(rounds))]

    async def barrier() -> None:
        for k in range(1, len(rounds)):
            for s in streams:
                while s.samples < owed[k]:
                    s.progress.clear()
                    await s.progress.wait()
            rounds[k].set()

    async def send(stream: Stream):
        yield header_request(stream.seed, policy, sample_format=codec_pb2.SAMPLE_FORMAT_S16LE)
        for k, frame in enumerate(stream.frames):
            await rounds[k].wait()
            yield frames_request([frame])
        yield END_REQUEST
    return send, barrier


def counters(server: SnacServer) -> dict[str, float]:
    value = server.metrics.registry.get_sample_value
    return {name: value(f"snac_{name}") or 0.0 for name in (
        "decoded_frames_total", "emitted_frames_total", "batch_size_sum", "batch_size_count", "decode_step_seconds_sum")}


async def measure(server: SnacServer, address: str, policy: str, regime: str, args: argparse.Namespace) -> dict[str, Any]:
    """One policy in one regime: audio-s/s, the decoder's redundancy, batch and step figures."""
    streams = make_streams(args.streams, args.frames)
    before, cpu0, t0 = counters(server), time.process_time(), time.perf_counter()
    async with channel(address) as ch:
        stub = codec_pb2_grpc.SnacCodecStub(ch)
        if regime == "trickle":
            send, barrier = trickle(policy, streams)
            pacer = asyncio.create_task(barrier())
            await asyncio.gather(*(run_one(stub, s, policy, send) for s in streams))
            pacer.cancel()
        else:
            await asyncio.gather(*(run_one(stub, s, policy, unpaced(policy)) for s in streams))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    d = {k: v - before[k] for k, v in counters(server).items()}
    audio_s = args.streams * args.frames * FRAME_SECONDS
    assert all(s.samples == args.frames * 2048 for s in streams), "every sample of every stream came back"
    return {
        "audio_s_per_s": round(audio_s / wall, 3),
        "wall_s": round(wall, 3),
        "decoded_per_emitted_frame": round(d["decoded_frames_total"] / d["emitted_frames_total"], 3),
        "decode_steps": int(d["batch_size_count"]),
        "mean_batch_rows": round(d["batch_size_sum"] / max(1, d["batch_size_count"]), 2),
        "mean_step_ms": round(1000 * d["decode_step_seconds_sum"] / max(1, d["batch_size_count"]), 2),
        "decode_busy_fraction": round(d["decode_step_seconds_sum"] / wall, 3),
        "process_cpu_s_per_audio_s": round(cpu / audio_s, 3),
        "time_to_first_chunk_ms_p50": round(1000 * float(np.median([s.arrivals[0] - s.started for s in streams])), 1),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    config = SnacServerConfig(host="127.0.0.1", port=0, metrics_port=-1, model=args.model, device=args.device,
                              dtype=args.dtype, max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
                              compile_step=args.compile_step)
    server, port = build_server(config)
    started = time.perf_counter()
    await server.start()  # warm-up: the compile, where the step is compiled
    warm_up_s = time.perf_counter() - started
    address = f"127.0.0.1:{port}"
    try:
        await measure(server, address, "streaming", "unpaced", argparse.Namespace(streams=2, frames=6))  # warm-up
        results: dict[str, Any] = {}
        for regime in REGIMES:
            results[regime] = {p: await measure(server, address, p, regime, args) for p in ("streaming", "reference")}
            r = results[regime]
            r["ratio"] = round(r["streaming"]["audio_s_per_s"] / r["reference"]["audio_s_per_s"], 3)
    finally:
        await server.stop(grace_s=1.0)
    device = config.resolved_device
    return {
        "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else f"{cpu_model()}, torch threads {torch.get_num_threads()}",
        "device_type": device, "streams": args.streams, "frames_per_stream": args.frames, "dtype": args.dtype,
        "max_batch": args.max_batch, "max_wait_ms": args.max_wait_ms, "frame_buckets": list(config.frame_buckets),
        "compiled_step": bool(server.metrics.registry.get_sample_value("snac_compiled_step")), "warm_up_s": round(warm_up_s, 1),
        "model": args.model, "regimes": results,
        "definitions": {
            "trickle": "frame k of every stream is sent once every stream has the audio frames 0..k-1 made final",
            "unpaced": "every stream sends all its frames as fast as the server reads them",
            "decoded_per_emitted_frame": "snac_decoded_frames_total / snac_emitted_frames_total over the run",
        },
    }


def forward_cost(args: argparse.Namespace) -> dict[str, Any]:
    """ms per frame of one decoder forward of ROWS streaming steps, for each size in --forward-sizes."""
    sizes = [int(x) for x in args.forward_sizes.split(",")]
    device = SnacServerConfig(device=args.device).resolved_device
    decoder = build_decoder(args.model, device, args.dtype, max_batch=max(sizes))
    runner = DecoderRunner(decoder, StreamingDecoder(decoder, num_slots=max(sizes)), max(sizes), (args.step_frames,),
                           cuda_graphs=False, max_step_frames=10_000)
    rng = np.random.default_rng(SEED)

    def ms_per_frame(rows: int) -> float:
        batch = [StreamStep(i, rng.integers(0, CODEBOOK_SIZE, (args.step_frames, CODES_PER_FRAME)).astype(np.int32),
                            30 * i, OPEN_END, 1, False) for i in range(rows)]
        runner.decode(batch, lambda *_: None)  # a shape's first call: allocator and oneDNN set-up, not timed
        started = time.perf_counter()
        for _ in range(FORWARD_REPEATS):
            runner.decode(batch, lambda *_: None)
        return round((time.perf_counter() - started) / FORWARD_REPEATS / (rows * args.step_frames) * 1000, 1)

    def by_size() -> dict[int, float]:
        return {rows * args.step_frames: ms_per_frame(rows) for rows in sizes}

    load = os.getloadavg()[0]
    by_threads: dict[int, dict[str, dict[int, float]]] = {}
    for threads in [int(x) for x in args.threads.split(",")] if args.threads else [torch.get_num_threads()]:
        torch.set_num_threads(threads)
        by_threads[threads] = {"alone": by_size()}
        if args.busy:
            with busy_cores(args.busy):
                by_threads[threads][f"beside {args.busy} busy loops"] = by_size()
    figures = next(iter(by_threads.values()))["alone"]
    return {"benchmark": "snac_tier --forward-sizes", "device_type": device, "model": args.model, "dtype": args.dtype,
            "step_frames": args.step_frames, "ms_per_frame_by_forward_frames": figures, "cheapest_forward_frames": min(figures, key=figures.get),
            "ms_per_frame_by_threads": by_threads, "load_average_start": round(load, 2),
            "cores": len(os.sched_getaffinity(0))}


def summary(result: dict[str, Any]) -> str:
    if "ms_per_frame_by_forward_frames" in result:
        return "\n".join(f"{threads} threads, {where:18s} {frames:4d} frames a forward: {ms:6.1f} ms per frame"
                         for threads, runs in result["ms_per_frame_by_threads"].items()
                         for where, figures in runs.items() for frames, ms in figures.items())
    lines = [f"snac-tier on {result['device']}: {result['streams']} streams x {result['frames_per_stream']} frames"]
    for regime, r in result["regimes"].items():
        s, ref = r["streaming"], r["reference"]
        lines.append(f"  {regime:8s} streaming {s['audio_s_per_s']:.2f} audio-s/s ({s['decoded_per_emitted_frame']} decoded/emitted, "
                     f"batch {s['mean_batch_rows']}) vs reference {ref['audio_s_per_s']:.2f} "
                     f"({ref['decoded_per_emitted_frame']} decoded/emitted, batch {ref['mean_batch_rows']}): ratio {r['ratio']:.2f}x")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    t0 = time.perf_counter()
    result = forward_cost(args) if args.forward_sizes else asyncio.run(run(args))
    result["benchmark_wall_s"] = round(time.perf_counter() - t0, 1)
    result["provenance"] = record(("torch", "snac", "grpcio", "numpy"), argv)
    name = "forward_cost" if args.forward_sizes else "snac_tier"
    out = args.out or REPO_ROOT / "benchmarks" / "results" / f"{name}-{result['device_type'].split(':')[0]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(summary(result))
    print(f"wrote {out} ({result['benchmark_wall_s']} s)")
    return result


if __name__ == "__main__":
    main()
