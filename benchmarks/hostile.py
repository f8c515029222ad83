"""Hostile clients beside a live stream (issue 41): what a stream playing at a worker of `megapod up` hears while
someone uploads crafted recordings, floods a socket door, or fills the voices directory with clones.

Starts `megapod up` (LocalStack: 1 worker, its own voices directory) and, in phases, plays one PCM stream at the
worker (POST /v1/audio/speech, read as it comes, every chunk timed) while something happens beside it:

- `quiet`: nothing (the reference: the stream's usual chunk gaps on this machine, at this engine's pace);
- `uploads`: the hostile corpus (benchmarks/hostile_audio.py: the 384 kHz tiny-frame FLAC that froze a worker for
  54 s, the 48 kHz one, the hour of near-silence, lying WAVs, 32 channels ...) posted one after another to
  POST /v1/voices: each answer's status, reason and time;
- `floods`: 100,000 tiny messages on each socket door (benchmarks/hostile_sockets.py), as fast as the socket takes
  them, from a flooder process of its own at niceness 19 (and held to `--flooder-cpu` of a core by a cgroup quota
  when given: a stand-in for an attacker's own machine), each door `--flood-rounds` times with a quiet window
  before every flood, all beside one stream: the stream's gaps in each door's floods against those in the quiet
  windows between them, the worker process's CPU a second in each, and how the door answered and closed;
- `voices`: 10,000 clone voices written into the voices directory, then a new one every 0.5 s: when each is
  offered by the worker; `quiet-end`: the reference again, at the end;
- on a second stack whose voices directory holds a LoRA adapter at start (so the engine has LoRA on), `lora-quiet`
  and `lora-added`: PEFT adapters (benchmarks/lora_adapters.py) copied in one every 2 s, each loaded by vLLM's
  runtime loading in the engine's process between steps: what that costs the stream.

Per phase: the stream's chunk gaps over the hostile work's window (p50, p99, max; a request's first audio is not a
gap), the stack's CPU seconds by tier and the worker's own event-loop lag over the phase
(`orpheus_event_loop_lag_seconds`, p50/p99 from its buckets, as soak.py reads it). The issue's bounds: a gap
within the quiet gap plus one frame (85 ms), loop lag p99 under 20 ms with 10,000 voices. JSON to
benchmarks/results/hostile-cpu.json. Run from the repository root:

    .venv/bin/python benchmarks/hostile.py
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx
import psutil

from benchmarks.concurrency_bench.metrics import percentiles
from benchmarks.concurrency_bench.stack import LocalStack, cpu_seconds
from benchmarks.hostile_audio import corpus
from benchmarks.hostile_sockets import BUDGET_SAID, DOORS, FLOOD, flood
from benchmarks.provenance import REPO_ROOT, record
from benchmarks.soak import loop_lag, loop_lag_summary, post_corpus

FRAME_S = 2048 / 24000
AFTERMATH_S = 0.5  # after a flooder is done, what the server still does for it counts as the flood's
# ~2 minutes of speech: one request outlasts a phase (a new request's first audio is not counted as a gap)
STREAM_TEXT = " ".join(["This sentence keeps a stream playing while hostile clients knock on the worker."] * 24)
WORST = ("flac_tiny_frames_384k", "flac_tiny_frames_48k", "flac_tiny_frames_48k_within_bounds",
         "opus_tiny_frames_undeclared", "flac_hour_of_near_silence", "flac_hour_of_near_silence_undeclared",
         "wav_32_channels", "wav_unknown_length_holds_40s", "mkv_20_audio_streams", "png_header_and_noise")
PACKAGES = ("torch", "vllm", "av", "soxr", "uvicorn", "websockets", "httpx")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quiet-s", type=float, default=20.0, help="the reference phases' length")
    p.add_argument("--voices", type=int, default=10_000, help="clone voices written into the voices directory")
    p.add_argument("--new-voices", type=int, default=10, help="voices added one by one, every 0.5 s, after those")
    p.add_argument("--flood", type=int, default=FLOOD, help="messages sent in each flood")
    p.add_argument("--flood-rounds", type=int, default=3, help="floods of each socket door")
    p.add_argument("--flood-quiet-s", type=float, default=3.0, help="the quiet window before each flood")
    p.add_argument("--flooder-cpu", type=float, default=0.0,
                   help="hold the flooder to this share of one core (a cgroup's CPU quota: its CPU stands in for an "
                        "attacker's own machine's); 0: niceness 19 only")
    p.add_argument("--items", default=",".join(WORST), help="corpus items to upload (comma-separated), or 'all'")
    p.add_argument("--adapters", type=int, default=4, help="LoRA adapters added while the LoRA stack serves (0: none)")
    p.add_argument("--megapod-args", default="--replicas 2 --enforce-eager true", help="more `megapod up` flags")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "hostile-cpu.json")
    args = p.parse_args(argv)
    if args.flood_rounds < 1:
        p.error("--flood-rounds must be at least 1: the floods' quiet windows are the reference")
    return args


class Stream:
    """PCM speech played at the worker, one request after another until stopped, every chunk timed. A wait counts
    within a request only: a request's first audio is its time to first audio, not a gap."""

    def __init__(self, worker: str) -> None:
        self.worker, self.requests, self.bytes = worker, [], 0
        self.failed: str | None = None  # why the stream stopped before it was stopped, if it did
        self.first = asyncio.Event()
        self.task = asyncio.create_task(self._play())

    async def _play(self) -> None:
        body = {"model": "tts-1", "input": STREAM_TEXT, "voice": "tara", "response_format": "pcm"}
        async with httpx.AsyncClient(timeout=None, trust_env=False) as client:
            while True:
                arrivals: list[float] = []
                self.requests.append(arrivals)
                async with client.stream("POST", f"{self.worker}/v1/audio/speech", json=body) as reply:
                    reply.raise_for_status()
                    async for chunk in reply.aiter_raw():
                        arrivals.append(time.perf_counter())
                        self.bytes += len(chunk)
                        self.first.set()

    def gaps(self, start: float, end: float, ending: bool = False) -> list[float]:
        """The waits between chunks that overlap [start, end] (`ending`: that end within it, so that windows side by
        side share none)."""
        return [b - a for arrivals in self.requests for a, b in zip(arrivals, arrivals[1:])
                if (start <= b <= end if ending else b >= start and a <= end)]

    def longest_gap_s(self, start: float, end: float) -> float | None:
        gaps = self.gaps(start, end)
        return round(max(gaps), 3) if gaps else None

    def heard(self, windows: list[tuple[float, float]], ending: bool = False) -> dict[str, object]:
        """What the stream heard during the windows: chunks, and the waits that overlap them (p50, p99, max;
        `ending`: those that end within one)."""
        gaps = [g for start, end in windows for g in self.gaps(start, end, ending)]
        chunks = sum(start <= t <= end for start, end in windows for arrivals in self.requests for t in arrivals)
        # requests that were playing in a window (more than one a window: a request's first audio fell in it, uncounted)
        playing = sum(bool(a) and a[0] <= end and a[-1] >= start for start, end in windows for a in self.requests)
        return {"chunks": chunks, "requests_playing": playing, "failed": self.failed,
                "gap_s": {**percentiles(gaps, (50, 99), digits=3), "max": round(max(gaps), 3) if gaps else None}}

    async def stop(self) -> None:
        if self.task.done() and not self.task.cancelled() and self.task.exception() is not None:
            self.failed = repr(self.task.exception())[:300]  # a request refused or cut: the stream stopped
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def phase(stack: LocalStack, worker: str, work) -> dict[str, object]:
    """`work()` beside a stream that played a while first; the stream's gaps, the worker's loop lag and the
    stack's CPU seconds by tier over the work's window (the stream's own start, before it, is not the work's)."""
    stream = Stream(worker)
    await asyncio.wait_for(stream.first.wait(), 300)
    await asyncio.sleep(2.0)
    lag_before = await loop_lag(stack)
    cpu_before = stack.cpu_seconds()
    started = time.perf_counter()
    done = await work()
    ended = time.perf_counter()
    cpu = {tier: round(s - cpu_before[tier], 2) for tier, s in stack.cpu_seconds().items()}
    await stream.stop()
    for answer in done if isinstance(done, list) else ():  # uploads: the stream's longest gap while each was handled
        if isinstance(answer, dict) and "window" in answer:
            answer["stream_gap_s"] = stream.longest_gap_s(*answer.pop("window"))
    lag = loop_lag_summary(lag_before, await loop_lag(stack))
    await stack.wait_idle()
    return {"wall_s": round(ended - started, 2), "stream": stream.heard([(started, ended)]), "cpu_s": cpu,
            **{k: v for k, v in lag.items() if k.startswith("worker")}, **({"work": done} if done is not None else {})}


def worker_process(stack: LocalStack) -> psutil.Process:
    """The worker's own process (its doors, sessions and event loop), not its engine core."""
    stack.remember()
    return next(proc for proc in stack.procs.values()
                if "llm_server" in " ".join(proc.cmdline()) and "EngineCore" not in proc.name())


async def floods(stack: LocalStack, worker: str, rounds: int, count: int, quiet_s: float,
                 flooder_cpu: float = 0.0) -> dict[str, object]:
    """Each socket door flooded `rounds` times beside one stream, a quiet window of `quiet_s` before every flood:
    the stream's waits during each door's floods (from the first message to AFTERMATH_S after the flooder is done:
    the server's work after its close counts) against its waits in the quiet windows between them (each wait in
    the window it ends in: the windows touch, and a wait is counted once), and the CPU a second of the worker
    process, of the whole stack and of the flooder in each. One flooder process, started before: its start-up is
    not a flood's; held to `flooder_cpu` of a core when given (cpu_quota)."""
    stream = Stream(worker)
    await asyncio.wait_for(stream.first.wait(), 300)
    windows: dict[str, list[tuple[float, float]]] = {}
    cpu: dict[str, dict[str, float]] = {}  # window name -> {worker, stack, flooder}: CPU seconds summed
    answers: dict[str, list[dict]] = {}
    loop, server = asyncio.get_running_loop(), worker_process(stack)
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn) as flooder, contextlib.ExitStack() as held:
        attacker = psutil.Process(await loop.run_in_executor(flooder, os.getpid))
        await loop.run_in_executor(flooder, os.nice, 19)  # an attacker's CPU is not the stack's
        if flooder_cpu:
            held.enter_context(cpu_quota(attacker.pid, flooder_cpu))

        def used() -> dict[str, float]:
            return {"worker": cpu_seconds(server), "stack": sum(stack.cpu_seconds().values()),
                    "flooder": cpu_seconds(attacker)}

        async def window(name: str, work) -> None:
            before, started = used(), time.perf_counter()
            await work
            windows.setdefault(name, []).append((started, time.perf_counter()))
            summed = cpu.setdefault(name, dict.fromkeys(before, 0.0))
            for what, seconds in used().items():
                summed[what] += seconds - before[what]

        async def flood_of(door: str) -> None:
            answers.setdefault(door, []).append(await loop.run_in_executor(flooder, door_flood, worker, door, count))
            await asyncio.sleep(AFTERMATH_S)

        for _ in range(rounds):
            for door in sorted(DOORS):
                await window("quiet", asyncio.sleep(quiet_s))
                await window(door, flood_of(door))
    await stream.stop()
    await stack.wait_idle()
    out = {}
    for name, spans in windows.items():
        seconds = sum(end - start for start, end in spans)
        out[name] = {"windows": len(spans), "seconds": round(seconds, 2), "stream": stream.heard(spans, ending=True),
                     **{f"{what}_cpu_per_s": round(v / seconds, 3) for what, v in cpu[name].items()},
                     **({"floods": answers[name]} if name in answers else {})}
    return out


@contextlib.contextmanager
def cpu_quota(pid: int, share: float) -> Iterator[None]:
    """Process `pid` held to `share` of one core by a cgroup's CPU quota (cgroup v1's cpu hierarchy, as this machine
    has it), for as long as the block runs: the flooder on the stack's own two cores stands in for one on another
    machine. Root only."""
    period_us, root = 100_000, Path("/sys/fs/cgroup/cpu")
    if not (root / "cpu.cfs_quota_us").exists():
        raise SystemExit("--flooder-cpu needs cgroup v1's cpu controller (/sys/fs/cgroup/cpu) and root")
    group = root / f"megapod-flooder-{pid}"
    group.mkdir()
    (group / "cpu.cfs_period_us").write_text(str(period_us))
    (group / "cpu.cfs_quota_us").write_text(str(round(share * period_us)))
    (group / "cgroup.procs").write_text(str(pid))
    try:
        yield
    finally:
        (root / "cgroup.procs").write_text(str(pid))  # back where it was, so that the group can go
        group.rmdir()


def door_flood(worker: str, door: str, count: int) -> dict[str, object]:
    """One flood, in the flooder's process (a thread of this one would take the GIL from the stream timed here)."""
    path, first, message = DOORS[door]
    started = time.perf_counter()
    sent, code, texts = flood(worker.replace("http://", "ws://") + path, first, message, count)
    took = time.perf_counter() - started
    return {"sent": sent, "close_code": code, "told": any(BUDGET_SAID in t for t in texts),
            "closed_after_s": round(took, 2), "sent_per_s": round(sent / took) if took else None}


def write_clones(root: Path, names) -> None:
    clone = json.dumps({"transcript": "Hello.", "language": "en", "frames": [[1, 2, 3, 4, 5, 6, 7]]})
    for name in names:
        staging = root / f".{name}.staging"
        staging.mkdir()
        (staging / "clone.json").write_text(clone)
        staging.rename(root / name)


async def new_voices(worker_log: Path, root: Path, count: int) -> list[float]:
    """Voices written one every 0.5 s; how long after each was written the worker said it offers it (its log's
    "added:" line: asking the worker would put a 10,000-voice listing on its loop, which is not what is measured)."""
    picked_up = []
    for i in range(count):
        name = f"newcomer-{i}"
        written = time.perf_counter()
        await asyncio.to_thread(write_clones, root, [name])
        while f"added: {name}" not in worker_log.read_text(errors="replace"):
            await asyncio.sleep(0.1)
        picked_up.append(round(time.perf_counter() - written, 2))
        await asyncio.sleep(max(0.0, 0.5 - (time.perf_counter() - written)))
    return picked_up


def start_stack(name: str, args: argparse.Namespace, work_dir: Path, voices_dir: Path) -> LocalStack:
    stack = LocalStack(name, [*shlex.split(args.megapod_args), "--workers", "1", "--voices-dir", str(voices_dir)],
                       work_dir / "logs")
    stack.plan(set())
    stack.start()
    stack.wait_ready()
    return stack


def worker_of(stack: LocalStack) -> str:
    return f"http://{stack.config.host}:{stack.config.worker_ports()[0]}"


async def hostile_phases(args: argparse.Namespace, work_dir: Path) -> tuple[str, dict[str, dict], dict[str, object]]:
    voices_dir = work_dir / "voices"
    voices_dir.mkdir()
    stack = start_stack("hostile", args, work_dir, voices_dir)
    try:
        worker = worker_of(stack)
        items = list(corpus()) if args.items == "all" else args.items.split(",")
        phases = {"quiet": await phase(stack, worker, lambda: asyncio.sleep(args.quiet_s)),
                  "uploads": await phase(stack, worker, lambda: post_corpus(worker, items))}
        flooded = await floods(stack, worker, args.flood_rounds, args.flood, args.flood_quiet_s, args.flooder_cpu)
        started = time.perf_counter()
        await asyncio.to_thread(write_clones, voices_dir, (f"clone-{i:05d}" for i in range(args.voices)))
        written_s = time.perf_counter() - started
        log = work_dir / "logs" / "hostile" / "llm-0.log"
        phases["voices"] = await phase(stack, worker, lambda: new_voices(log, voices_dir, args.new_voices))
        phases["voices"].update(clones_in_directory=args.voices, written_s=round(written_s, 1))
        phases["quiet-end"] = await phase(stack, worker, lambda: asyncio.sleep(args.quiet_s))
        return stack.command, phases, flooded
    finally:
        stack.stop()


async def lora_phases(args: argparse.Namespace, work_dir: Path) -> dict[str, dict]:
    """A stack with LoRA on (an adapter there at start), adapters copied in while a stream plays."""
    from benchmarks.lora_adapters import make_adapter

    from llm_server.config import LlmServerConfig
    from llm_server.engine.model_source import resolve_model

    base = resolve_model("tiny", LlmServerConfig().cache_dir)
    made = work_dir / "adapters"
    for i in range(args.adapters + 1):
        await asyncio.to_thread(make_adapter, base, made / f"lora-{i}", seed=i)
    voices_dir = work_dir / "lora-voices"
    voices_dir.mkdir()
    shutil.copytree(made / "lora-0", voices_dir / "lora-0")
    stack = start_stack("lora", args, work_dir, voices_dir)
    log = work_dir / "logs" / "lora" / "llm-0.log"

    async def add_adapters() -> list[float]:
        offered = []
        for i in range(1, args.adapters + 1):
            written = time.perf_counter()
            await asyncio.to_thread(shutil.copytree, made / f"lora-{i}", voices_dir / f".lora-{i}.staging")
            (voices_dir / f".lora-{i}.staging").rename(voices_dir / f"lora-{i}")
            while f"added: lora-{i}" not in log.read_text(errors="replace"):
                await asyncio.sleep(0.1)
            offered.append(round(time.perf_counter() - written, 2))
            await asyncio.sleep(max(0.0, 2.0 - (time.perf_counter() - written)))
        return offered

    try:
        worker = worker_of(stack)
        return {"lora-quiet": await phase(stack, worker, lambda: asyncio.sleep(args.quiet_s)),
                "lora-added": await phase(stack, worker, add_adapters)}
    finally:
        stack.stop()


def within_bounds(phases: dict[str, dict], reference: str) -> dict[str, bool]:
    """Each phase's longest gap within the reference phase's plus one frame."""
    allowed = (phases[reference]["stream"]["gap_s"]["max"] or 0) + FRAME_S
    within = {name: p["stream"]["failed"] is None and (p["stream"]["gap_s"]["max"] or 0) <= allowed
              for name, p in phases.items() if name != reference}  # no gap in a window the stream played through: 0
    for answer in phases.get("uploads", {}).get("work", []):
        within[f"uploads/{answer['item']}"] = (answer["stream_gap_s"] or 0) <= allowed
    return within


async def run(args: argparse.Namespace) -> dict[str, object]:
    work_dir = Path(tempfile.mkdtemp(prefix="hostile-"))
    command, phases, flooded = await hostile_phases(args, work_dir)
    lora = await lora_phases(args, work_dir) if args.adapters else {}
    bounds = {"gap_within_quiet_max_plus_a_frame": within_bounds(phases, "quiet"),
              "flood_gap_within_the_quiet_windows_max_plus_a_frame": within_bounds(flooded, "quiet"),
              "loop_lag_p99_under_20_ms_with_the_voices": (phases["voices"]["worker_loop_lag_p99_ms"] or 0) < 20}
    if lora:
        bounds["lora_gap_within_quiet_max_plus_a_frame"] = within_bounds(lora, "lora-quiet")
    return {"provenance": record(PACKAGES), "stack": command, "flooder_cpu_quota": args.flooder_cpu or None,
            "phases": {**phases, **lora}, "floods": flooded, "bounds": bounds}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for name, p in result["phases"].items():
        gaps = p["stream"]["gap_s"]
        print(f"{name:<18s} gaps p50 {gaps.get('p50')} p99 {gaps.get('p99')} max {gaps['max']} s; loop lag p99 "
              f"{p['worker_loop_lag_p99_ms']} ms, max since start {p['worker_loop_lag_max_ms']} ms")
    for name, p in result["floods"].items():
        gaps = p["stream"]["gap_s"]
        print(f"floods: {name:<10s} {p['windows']} windows, {p['seconds']} s: gaps p50 {gaps.get('p50')} p99 "
              f"{gaps.get('p99')} max {gaps['max']} s; CPU-s a second: worker process {p['worker_cpu_per_s']}, the "
              f"stack {p['stack_cpu_per_s']}, the flooder {p['flooder_cpu_per_s']}")
    print(json.dumps(result["bounds"], indent=2))
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
