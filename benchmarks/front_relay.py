"""How many concurrent streams one front (orpheus_front) relays whole, and at what cost, measured against the same
streams taken straight from the workers (the reference) in the same run.

- workers: --workers test doubles of an llm-server worker (benchmarks/paced_worker.py): every speech POST gets
  paced silent PCM, CHUNKS chunks INTERVAL_S apart (3 s of audio), and the double counts how each ended;
- the front: the product's front (`python -m orpheus_front`, as its image runs it), in its own process, over those workers, on its defaults;
- clients: N streams from this process (httpx), all opened at once, while /ready is probed every 0.2 s
  with the chart's readiness timeout (3 s).

For each N, through the front and then straight at the workers (spread over them as the front spreads
them): streams whole, time to first chunk (p50, p99, max), whether any stream waited for another to end
(a first chunk after the first end), and through the front: /ready probes answered, the front's
CPU-ms per relayed stream (user + system over the level, /proc), its cores used and its RSS. Writes JSON
and a plot.

    .venv/bin/python benchmarks/front_relay.py --streams 100,300,600 --workers 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from benchmarks.concurrency_bench.metrics import percentiles
from benchmarks.paced_worker import CHUNK_BYTES, CHUNKS, INTERVAL_S  # the double's own constants
from benchmarks.provenance import REPO_ROOT, record
from megapod.launcher import Child, free_ports

PACKAGES = ("httpx", "httpcore", "uvicorn", "starlette", "fastapi", "websockets", "anyio")
READY_TIMEOUT_S = 3.0  # the chart's readinessProbe timeoutSeconds
BODY = {"input": "Hello there.", "voice": "tara"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", default="100,300,600", help="concurrent streams per level, comma-separated")
    p.add_argument("--workers", type=int, default=3, help="worker doubles behind the front")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "front_relay-cpu.json")
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def _quantiles(values: list[float]) -> dict[str, float | None]:
    return {**percentiles(values, (50, 99), digits=4), "max": round(max(values), 4) if values else None}


async def _stream(http: httpx.AsyncClient, url: str, started: float, firsts: list[float], ends: list[float]) -> int:
    size = 0
    async with http.stream("POST", f"{url}/v1/audio/speech", json=BODY) as reply:
        if reply.status_code != 200:
            return -reply.status_code
        async for chunk in reply.aiter_raw():
            if not size:
                firsts.append(time.perf_counter() - started)
            size += len(chunk)
    ends.append(time.perf_counter() - started)
    return size


async def _probe(url: str, done: asyncio.Future, statuses: list[int], latencies: list[float]) -> None:
    async with httpx.AsyncClient(timeout=READY_TIMEOUT_S) as prober:
        while not done.done():
            began = time.perf_counter()
            try:
                statuses.append((await prober.get(f"{url}/ready")).status_code)
                latencies.append(time.perf_counter() - began)
            except httpx.TimeoutException:
                statuses.append(0)
            await asyncio.sleep(0.2)


async def run_level(urls: list[str], streams: int, ready_url: str | None) -> dict[str, object]:
    """`streams` streams at once over `urls` (round robin); /ready of `ready_url` probed throughout."""
    firsts: list[float] = []
    ends: list[float] = []
    statuses: list[int] = []
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=streams + 10, max_keepalive_connections=streams + 10)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        started = time.perf_counter()
        gathered = asyncio.gather(*(_stream(http, urls[i % len(urls)], started, firsts, ends) for i in range(streams)))
        probing = [_probe(ready_url, gathered, statuses, latencies)] if ready_url else []
        await asyncio.gather(gathered, *probing)
        seconds = time.perf_counter() - started
    sizes = gathered.result()
    whole = sum(size == CHUNKS * CHUNK_BYTES for size in sizes)
    out: dict[str, object] = {
        "streams": streams, "whole": whole, "refused": sum(size < 0 for size in sizes), "seconds": round(seconds, 2),
        "first_chunk_s": _quantiles(firsts),
        "a_stream_waited_for_another": bool(firsts and ends and max(firsts) >= min(ends)),
    }
    if ready_url:
        out["ready_probes"] = {"sent": len(statuses), "answered_200": statuses.count(200), "latency_s": _quantiles(latencies)}
    return out


def _front_cost(front: psutil.Process, level: dict, cpu_s: float, wall_s: float) -> None:
    level["front_cpu_ms_per_stream"] = round(1000 * cpu_s / level["streams"], 2)
    level["front_cores"] = round(cpu_s / wall_s, 3)
    level["front_rss_mib"] = round(front.memory_info().rss / 2**20, 1)


def measure(levels: list[int], workers: int, logs: Path) -> list[dict[str, object]]:
    ports = free_ports(workers + 1)
    worker_urls = [f"http://127.0.0.1:{p}" for p in ports[:workers]]
    doubles = [Child(f"paced-worker-{i}", [sys.executable, "-m", "benchmarks.paced_worker", str(p)],
                     logs / f"worker-{i}.log", f"{url}/ready") for i, (p, url) in enumerate(zip(ports, worker_urls))]
    front_url = f"http://127.0.0.1:{ports[-1]}"
    front = Child("front", [sys.executable, "-m", "orpheus_front", "--host", "127.0.0.1", "--port", str(ports[-1]),
                            "--workers", ",".join(worker_urls)], logs / "front.log", f"{front_url}/ready")
    results = []
    try:
        for child in [*doubles, front]:
            child.start().wait_ready(60)
        process = psutil.Process(front.pid)
        for streams in levels:
            cpu_before, began = sum(process.cpu_times()[:2]), time.perf_counter()
            through = asyncio.run(run_level([front_url], streams, front_url))
            _front_cost(process, through, sum(process.cpu_times()[:2]) - cpu_before, time.perf_counter() - began)
            direct = asyncio.run(run_level(worker_urls, streams, None))
            extra = {q: (round(through["first_chunk_s"][q] - direct["first_chunk_s"][q], 4)
                         if through["first_chunk_s"][q] is not None and direct["first_chunk_s"][q] is not None else None)
                     for q in ("p50", "p99")}
            results.append({"streams": streams, "through_front": through, "straight_at_workers": direct,
                            "first_chunk_added_by_front_s": extra})
            print(json.dumps(results[-1]), flush=True)
    finally:
        for child in [front, *doubles]:
            child.stop()
    return results


def plot(results: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streams = [r["streams"] for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("through_front", "through the front"), ("straight_at_workers", "straight at the workers")):
        left.plot(streams, [r[key]["first_chunk_s"]["p99"] for r in results], marker="o", label=label)
    left.set(xlabel="concurrent streams", ylabel="time to first chunk, p99 (s)", title="First chunk")
    left.legend()
    right.plot(streams, [r["through_front"]["front_cpu_ms_per_stream"] for r in results], marker="o")
    right.set(xlabel="concurrent streams", ylabel="front CPU-ms per relayed stream", title=f"{CHUNKS} chunks a stream")
    fig.tight_layout()
    path = out.with_suffix(".png")
    fig.savefig(path)
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    levels = [int(s) for s in args.streams.split(",") if s.strip()]
    with tempfile.TemporaryDirectory(prefix="front-relay-") as logs:
        results = measure(levels, args.workers, Path(logs))
    passed = all(r["through_front"]["whole"] == r["streams"] and not r["through_front"]["a_stream_waited_for_another"]
                 and r["through_front"]["ready_probes"]["answered_200"] == r["through_front"]["ready_probes"]["sent"]
                 for r in results)
    out = {"what": "the front (python -m orpheus_front) relaying paced streams from worker doubles (benchmarks/paced_worker.py), against the same "
                   "streams straight at the doubles", "stream": {"chunks": CHUNKS, "interval_s": INTERVAL_S, "chunk_bytes": CHUNK_BYTES},
           "workers": args.workers, "passed": passed, "levels": results, "provenance": record(PACKAGES)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if not args.no_plot:
        path = plot(results, args.out).resolve()
        out["plot"] = str(path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out} (passed={passed})")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
