"""The MegaPod's codec layout measured as it runs (issue 45): N snac-server replicas on one device, each its own
process started as a pod starts it (`python -m snac_server`), driven from client processes of their own at the
pace of an LLM tier at real time, against one replica at the same totals.

Each level opens `streams` streams at once (spread over the replicas round-robin and over `--clients` client
processes, each with its own event loop and channels), each sending one frame every 85.3 ms (real time) for
`--seconds`, as a worker's codec client does, and plays what comes back as a real-time listener would
(llm_server/speech/playback.py: from its first audio on, at the audio's own rate, no playout buffer). A level
holds when at most 1 % of its streams had a gap longer than 100 ms (SGLang-Omni's TTS bar) and every stream got
all its audio; the levels run in order and stop at the first that does not hold. The MegaPod's total is 7 LLM
GPUs x 250 streams: 1,750.

    python benchmarks/snac_replicas.py --out OUT.json                      # a GPU: 3 replicas, then 1, fp32
    python benchmarks/snac_replicas.py --device cpu --out OUT.json         # the dry run: tiny levels, the small codec

On a CPU it is a dry run (the small codec, 1 and 2 replicas, 2 streams for 2 s) and the GPU figures are named and
marked `not measured: cpu`. Not measured: replicas under CUDA MPS, and one held to 2/7 of the SMs
(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) as the h100 profile's MIG 2g slice: that needs the MPS control daemon on the
node, which the GPU machines lent so far did not offer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import queue
import signal
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.provenance import REPO_ROOT, record, write_result
from codec_contract.audio import FRAME_SAMPLES, FRAME_SECONDS, SAMPLE_RATE
from megapod.launcher import Child, free_ports

GAP_S = 0.1  # a listener's gap that counts (SGLang-Omni's TTS benchmark passes a stream within 100 or 200 ms)
HOLD_SHARE = 0.01  # a level holds with at most this share of streams gapped
MEGAPOD_STREAMS = 7 * 250
GPU_LEVELS = (250, 500, 1000, 1750, 2500)
GPU_REPLICAS = (1, 3)
NOT_ON_CPU = "not measured: cpu"


@contextmanager
def replicas(n: int, args: argparse.Namespace, logs: Path):
    """n snac-server processes on the device, as pods start them; their addresses once all are SERVING, and the
    seconds that took."""
    children = []
    try:
        for i, port in enumerate(free_ports(n)):
            argv = [sys.executable, "-m", "snac_server", "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "-1",
                    "--device", args.device_resolved, "--dtype", args.dtype, "--max-batch", str(args.max_batch),
                    "--model", args.model, "--max-streams", str(max(args.levels) + 16), "--compile-step", args.compile_step]
            children.append(Child(f"replica {i + 1} of {n}", argv, logs / f"replica-{n}-{i}.log",
                                  ready_url=f"grpc://127.0.0.1:{port}", cwd=REPO_ROOT).start())
        start_s = max(child.wait_ready(args.start_timeout_s) for child in children)
        yield [f"127.0.0.1:{child.port}" for child in children], round(start_s, 1)
    finally:
        for child in children:  # at once: no stream is left to drain, and a time limit's SIGTERM allows 5 s
            child.stop(signal.SIGKILL)


async def _one_stream(stub, seed: int, frames: int, pace: float) -> dict[str, float]:
    from codec_contract.api import codec_pb2
    from codec_contract.audio import CODEBOOK_SIZE, CODES_PER_FRAME
    from codec_contract.client import END_REQUEST, frames_request, header_request
    from llm_server.speech.playback import Playback

    codes = np.random.default_rng(seed).integers(0, CODEBOOK_SIZE, (frames, CODES_PER_FRAME))
    started = time.monotonic()

    async def send():
        yield header_request(seed, "streaming", sample_format=codec_pb2.SAMPLE_FORMAT_S16LE, listener_pace=pace)
        for k, frame in enumerate(codes):  # frame k is due k frame-times after the start, as an LLM at `pace` makes it
            await asyncio.sleep(max(0.0, started + k * FRAME_SECONDS / pace - time.monotonic()))
            yield frames_request([frame])
        yield END_REQUEST

    playback, samples, first = Playback(), 0, None
    async for chunk in stub.Decode(send()):
        now = time.monotonic()
        n = len(chunk.pcm) // 2
        first = now - started if first is None and n else first
        playback.sent(now, n / SAMPLE_RATE / pace, text_at=started)  # a listener at the stream's pace (1.0: real time)
        samples += n
    return {"first_audio_s": first if first is not None else float("inf"), "worst_gap_s": playback.worst_gap_s,
            "complete": samples == frames * FRAME_SAMPLES}


async def _client(addresses: list[str], seeds: list[int], frames: int, pace: float) -> list[dict[str, float]]:
    import grpc

    from codec_contract.api import codec_pb2_grpc

    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    try:
        stubs = [codec_pb2_grpc.SnacCodecStub(c) for c in channels]
        found = await asyncio.gather(*(_one_stream(stubs[s % len(stubs)], s, frames, pace) for s in seeds),
                                     return_exceptions=True)
    finally:
        for c in channels:
            await c.close()
    return [f if isinstance(f, dict) else {"error": repr(f)[:200], "complete": False} for f in found]


def _client_process(addresses: list[str], seeds: list[int], frames: int, pace: float, out) -> None:
    out.put(asyncio.run(_client(addresses, seeds, frames, pace)))


def level(addresses: list[str], streams: int, args: argparse.Namespace) -> dict[str, Any]:
    """`streams` streams at once from `--clients` processes; what their listeners heard."""
    frames = max(2, round(args.seconds / FRAME_SECONDS))
    clients = max(1, min(args.clients, streams))
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_client_process, args=(addresses, list(range(c, streams, clients)), frames, args.pace, out),
                         daemon=True) for c in range(clients)]
    for p in procs:
        p.start()
    try:
        found = [r for _ in procs for r in out.get(timeout=args.seconds * 4 + 120)]
    except queue.Empty:  # a client process died or hung: the level did not hold
        found = [{"error": "a client process gave no result", "complete": False}]
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    gapped = sum(1 for r in found if r.get("worst_gap_s", float("inf")) > GAP_S)
    complete = sum(1 for r in found if r.get("complete"))
    first = [r["first_audio_s"] for r in found if "first_audio_s" in r]
    return {"streams": streams, "holds": complete == streams and gapped <= HOLD_SHARE * streams,
            "gapped_streams": gapped, "complete_streams": complete,
            "worst_gap_s": round(max((r.get("worst_gap_s", float("inf")) for r in found), default=0.0), 3),
            "first_audio_p50_s": round(float(np.percentile(first, 50)), 3) if first else None,
            "first_audio_p99_s": round(float(np.percentile(first, 99)), 3) if first else None,
            "errors": [r["error"] for r in found if "error" in r][:3]}


def layout(n: int, args: argparse.Namespace, logs: Path, measured: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Levels in order through n replicas, until one does not hold; `measured` called after the start and each level."""
    found: dict[str, Any] = {"replicas": n, "start_s": None, "levels": [], "realtime_streams": 0}
    with replicas(n, args, logs) as (addresses, start_s):
        found["start_s"] = start_s
        measured(found)
        for streams in args.levels:
            found["levels"].append(level(addresses, streams, args))
            held = [lv["streams"] for lv in found["levels"] if lv["holds"]]
            found["realtime_streams"] = max(held) if held else 0
            measured(found)
            if not found["levels"][-1]["holds"]:
                break
    return found


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    on_gpu = args.device_resolved.startswith("cuda")
    logs = args.out.parent / (args.out.stem + "-logs")  # each replica's log
    logs.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    why = "not measured: the run ended first" if on_gpu else NOT_ON_CPU
    figures: dict[str, Any] = {str(n): why for n in (args.replicas if on_gpu else GPU_REPLICAS)}
    result: dict[str, Any] = {
        "benchmark": "snac_replicas", "device": torch.cuda.get_device_name(0) if on_gpu else "cpu",
        "model": args.model, "dtype": args.dtype, "max_batch": args.max_batch, "compile_step": args.compile_step,
        "pace": args.pace, "seconds": args.seconds, "levels": list(args.levels), "megapod_streams": MEGAPOD_STREAMS,
        "figures": figures, "mps": "not measured: needs the MPS control daemon (nvidia-cuda-mps-control) on the node",
        "definitions": {"holds": f"every stream got all its audio and at most {HOLD_SHARE:.0%} had a gap over {GAP_S} s",
                        "realtime_streams": "the largest level that held, through that many replicas on one device"},
        "provenance": record(("torch", "snac", "grpcio"), args.argv),
    }
    measured = figures if on_gpu else result.setdefault("dry_run", {})  # the dry run: the same processes, tiny
    for n in args.replicas:

        def progress(found: dict[str, Any], n: int = n) -> None:  # each level as it ends: a cut run keeps them
            measured[str(n)] = found
            result["wall_s"] = round(time.perf_counter() - started, 1)
            write_result(args.out, result)

        layout(n, args, logs, progress)
    return result


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto, cuda or cpu (a dry run)")
    p.add_argument("--replicas", default=None, help="replica counts to compare, in order (GPU: 3,1; CPU: 1,2)")
    p.add_argument("--levels", default=None, help="total streams, in order (GPU: 250,500,1000,1750,2500; CPU: 2)")
    p.add_argument("--seconds", type=float, default=None, help="audio a stream sends (GPU: 6; CPU: 2)")
    p.add_argument("--pace", type=float, default=1.0, help="frames sent and listened to at this x real time")
    p.add_argument("--clients", type=int, default=8, help="client processes")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--model", default=None, help="GPU: random-24khz; CPU: random-24khz-small")
    p.add_argument("--compile-step", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--start-timeout-s", type=float, default=240.0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    args.argv = argv
    if args.device == "auto":
        import torch

        args.device_resolved = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        args.device_resolved = args.device
    gpu = args.device_resolved.startswith("cuda")
    # 3 first on a GPU: the MegaPod's layout is the figure a run cut by its time limit must not lose.
    args.replicas = [int(x) for x in (args.replicas or ("3,1" if gpu else "1,2")).split(",")]
    args.levels = [int(x) for x in (args.levels or (",".join(map(str, GPU_LEVELS)) if gpu else "2")).split(",")]
    args.seconds = args.seconds or (6.0 if gpu else 2.0)
    args.model = args.model or ("random-24khz" if gpu else "random-24khz-small")
    if not gpu:
        args.max_batch, args.clients = min(args.max_batch, 8), 1
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = run(args)
    shown = result["dry_run"] if "dry_run" in result else result["figures"]
    print(json.dumps({n: f["realtime_streams"] if isinstance(f, dict) else f for n, f in shown.items()}))
    print(f"wrote {args.out} ({result['wall_s']} s)")
    return result


if __name__ == "__main__":
    # A time limit's SIGTERM unwinds: the replicas are stopped (they would hold the GPU's memory for the next part).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
