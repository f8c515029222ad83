"""`serving_cpu.py --capacity`: does a worker with no stream count configured find its GPU's capacity?

The worker is llm-server's app and runtime over serving_cpu's StepEngineDouble, whose step time
grows with its batch by a curve (FIXED_MS,PER_STREAM_MS) whose real-time crossing is known (the
default, 2.0 + 0.085 ms a stream: 119 streams get a token every 12.19 ms); the codec replica is
snac-server over the decoder double. 1.5 x that many closed-loop clients ask for streams at once; a
refused client waits its Retry-After (1 s) and asks again. Admission is the product's default: no
max_streams, the limit the capacity controller measures (llm_server/capacity.py).

Reported at the top of the JSON: `capacity_known` (the curve's real-time batch), `admitted_settled`
(the limit's median over the last third of the run), `realtime_share` (admitted streams whose every
chunk came in time for a player started 0.3 s after the first byte), `refusal_p95_ms`; with the
limit, active streams and engine pace sampled twice a second (and a plot of them).

    .venv/bin/python benchmarks/serving_cpu.py --capacity --seconds 90 --out benchmarks/results/serving_cpu-capacity.json
    .venv/bin/python benchmarks/serving_cpu.py --capacity --step-curve 4.0,0.12 --seconds 90 \\
        --out benchmarks/results/serving_cpu-capacity-slower.json   # a slower GPU: real time for 68

`--capacity-url URL --capacity-known N` floods a worker already running (llm-server on vLLM's CPU
engine, its limit unconfigured) with 3 x N streams, N the N_max benchmarks/concurrency.py found for it;
`--capacity-pace 0.1` judges them as its `--quick` listener does (slow motion, buffer 3 s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import time
from collections import Counter
from pathlib import Path

import httpx

from benchmarks.concurrency_bench.metrics import percentiles, required_buffer_s
from benchmarks.concurrency_bench.stack import gauge
from benchmarks.provenance import record
from benchmarks.serving_kit import BUFFER_S, PACKAGES, TEXT, StepCurve, one_stream, real_time, start
from megapod.launcher import free_ports

RETRY_S = 1.0  # what a refused client waits: the worker's Retry-After
SAMPLE_S = 0.5


def capacity_run(args: argparse.Namespace, logs: Path) -> None:
    if args.capacity_url:
        return capacity_of(args)
    curve = StepCurve.parse(args.step_curve)
    known = curve.realtime_streams()
    offered = math.ceil(1.5 * known)
    ports = dict(zip(("codec", "codec_metrics", "worker"), free_ports(3)))
    codec = start(["--role", "codec", "--port", str(ports["codec"]), "--metrics-port", str(ports["codec_metrics"])],
                  logs / "codec.log")
    started = [codec]
    try:
        worker = start(["--role", "worker", "--measured", "--port", str(ports["worker"]),
                        "--snac", f"127.0.0.1:{ports['codec']}", "--step-ms", str(curve.fixed_ms),
                        "--step-per-stream-ms", str(curve.per_stream_ms), "--frames", str(args.frames),
                        "--stream-interval", str(args.stream_interval), "--lag-file", str(logs / "lag.jsonl")],
                       logs / "worker.log", f"http://127.0.0.1:{ports['worker']}/ready")
        started.append(worker)
        worker.wait_ready(120)
        measured = asyncio.run(flood(ports["worker"], offered, args.seconds))
    finally:
        for proc in started:
            proc.stop(timeout_s=30)
    write({"benchmark": "serving_cpu --capacity", "step_curve_ms": str(curve), "capacity_known": known,
           **summary(measured, offered, args.seconds), "frames_per_reply": args.frames, "seconds": args.seconds,
           "logs": str(logs)}, Path(args.out), f"step {curve} ms")


def capacity_of(args: argparse.Namespace) -> None:
    """--capacity-url: flood a running worker (e.g. on vLLM's CPU engine, its limit unconfigured) with
    3 x --capacity-known streams, the N_max benchmarks/concurrency.py found for it."""
    port = int(args.capacity_url.rstrip("/").rsplit(":", 1)[1])
    offered = 3 * args.capacity_known
    measured = asyncio.run(flood(port, offered, args.seconds))
    write({"benchmark": "serving_cpu --capacity-url", "worker": args.capacity_url, "capacity_known": args.capacity_known,
           **summary(measured, offered, args.seconds, args.capacity_pace), "seconds": args.seconds},
          Path(args.out), args.capacity_url)


def write(result: dict, out: Path, title: str) -> None:
    """The JSON (with provenance), its figures on stdout, and the plot beside it."""
    result["provenance"] = record(PACKAGES)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("timeline", "provenance")}, indent=1))
    plot(result, out.with_suffix(".png"), title)


async def flood(port: int, clients: int, seconds: float) -> dict:
    """`clients` closed-loop clients for `seconds`, the worker's gauges sampled meanwhile."""
    body = json.dumps({"model": "tts-1", "input": TEXT, "voice": "tara", "response_format": "pcm"}).encode()
    stop_at, t0 = time.perf_counter() + seconds, time.perf_counter()
    admitted: list[dict] = []
    refusals: list[float] = []
    errors: list[str] = []  # anything but a 429

    async def client(k: int) -> None:
        await asyncio.sleep(k * 0.005)  # 200 clients a second come in, not one thundering step
        while time.perf_counter() < stop_at:
            sent = time.perf_counter()
            result = await one_stream(port, body)
            if "error" not in result:
                admitted.append(result)
                continue
            if " 429 " in result["error"]:
                refusals.append(time.perf_counter() - sent)
            else:
                errors.append(result["error"])
            await asyncio.sleep(RETRY_S)

    timeline: list[dict] = []
    sampler = asyncio.create_task(sample(port, t0, timeline))
    try:
        await asyncio.gather(*(client(k) for k in range(clients)))
    finally:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    return {"admitted": admitted, "refusals": refusals, "errors": errors, "timeline": timeline, "t0": t0}


async def sample(port: int, t0: float, rows: list[dict]) -> None:
    """Every SAMPLE_S, a row: the worker's limit, active streams and engine pace."""
    async with httpx.AsyncClient(timeout=5, trust_env=False) as http:
        while True:
            text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
            rows.append({"t": round(time.perf_counter() - t0, 2), "limit": gauge(text, "megapod_worker_capacity_streams"),
                         "active": gauge(text, "orpheus_active_streams"),
                         "pace": _finite(gauge(text, "megapod_worker_pace_ratio"))})
            await asyncio.sleep(SAMPLE_S)


def _finite(value: float) -> float | None:
    return round(value, 3) if math.isfinite(value) else None


def summary(measured: dict, offered: int, seconds: float, pace: float = 1.0) -> dict:
    """`pace`: the listener's (0.1: the slow motion of benchmarks/concurrency.py --quick, its buffer 10 x longer)."""
    admitted, refusals, timeline = measured["admitted"], measured["refusals"], measured["timeline"]
    settled = [row["limit"] for row in timeline if row["t"] >= seconds * 2 / 3]
    in_time = [real_time(r, pace) for r in admitted]
    # when the late ones started, by 10 s: a ramp, or all along
    late_by_10s = Counter(10 * int((r["sent"] - measured["t0"]) // 10) for r, ok in zip(admitted, in_time) if not ok)
    needed = [required_buffer_s(r["chunks"], pace) for r in admitted if r["chunks"]]
    return {
        "admitted_settled": statistics.median(settled) if settled else None,
        "realtime_share": round(sum(in_time) / len(in_time), 4) if in_time else None,
        "refusal_p95_ms": percentiles([1000 * s for s in refusals], (95,), 1)["p95"],
        "offered_clients": offered, "streams_admitted": len(admitted), "streams_late": in_time.count(False),
        "late_by_start_s": dict(sorted(late_by_10s.items())),
        "buffer_needed_p99_s": percentiles(needed, (99,), 3)["p99"],
        "refusals": len(refusals), "errors": len(measured["errors"]), "listener_pace": pace,
        "player_buffer_s": BUFFER_S / pace, "timeline": timeline,
    }


def plot(result: dict, path: Path, title: str) -> None:
    """The limit and the active streams over time, against the curve's real-time batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["timeline"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["t"] for r in rows], [r["limit"] for r in rows], label="admission limit")
    ax.plot([r["t"] for r in rows], [r["active"] for r in rows], label="active streams", alpha=0.7)
    ax.axhline(result["capacity_known"], color="grey", linestyle="--", linewidth=0.8,
               label=f"known real-time capacity ({result['capacity_known']})")
    ax.set_xlabel("seconds")
    ax.set_ylabel("streams")
    ax.set_title(f"{title}: settled {result['admitted_settled']}, "
                 f"real-time share {result['realtime_share']}")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
