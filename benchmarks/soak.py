"""Soak: the local CPU stack at most of its capacity for a set time. Is any audio lost, does anything fail,
does memory grow?

Starts `megapod up` on free ports (LocalStack, as the concurrency benchmark does), or with `--attach PID` soaks
one already running (its workers' cap fixed; every slot beyond `--max-streams` is held by a silent Cartesia
context for the whole soak, so the bigger stack refuses where the soak's own would), warms it up, then
drives `--concurrency` closed-loop streams (the concurrency benchmark's load client and corpus)
through the front endpoint for `--minutes`, with the worker's admission cap set to that
concurrency, plus a trickle of over-cap probes (and, with `--disconnect-every-s`, clients that
leave mid-stream). At the end no new request is sent and every one in flight runs to its end.

Reported (JSON, default benchmarks/results/soak-cpu.json, and a one-screen summary):

- streams served, errors by kind (HTTP status or exception), over-cap probes (429 + Retry-After +
  OpenAI error shape, and how fast);
- audio lost: 2048 samples per frame the workers generated (`orpheus_frames_total` deltas) against
  the samples the clients received; exact when no stream was cut. Per stream: every reply is whole
  frames, and a few replies are replayed on the idle stack with the same seed (same length, same
  audio to s16 rounding);
- memory (RSS) of every process of the stack, vLLM's children included: after warm-up, at the end,
  peak, growth, and MB/hour from a linear fit over periodic samples;
- the servers' own event-loop lag (`orpheus_event_loop_lag_seconds`, orpheus_common/loop_lag.py), the workers'
  together and the front's: p50 and p99 over the soak (the histogram's buckets read after warm-up and after the
  drain, interpolated as Prometheus's histogram_quantile does) and the largest since each process started
  (`orpheus_event_loop_lag_max_seconds`), in ms: `worker_loop_lag_p99_ms`, `worker_loop_lag_max_ms`, `front_...`;
- provenance (versions, git commit, CPU, machine load) and the cores each part used.

After the soak, on the idle stack, `--doors N` measures what a voice agent waits for at the front
doors: time to first byte of POST /v1/audio/speech for each response_format against pcm (same text
and seed, formats in rotating order, each request closed at its first byte, the stack idle before
the next; N rounds), and N barge-ins: a Cartesia context on /tts/websocket cancelled at its first
audio chunk, timed until no worker holds a stream or an engine request (its KV cache freed) and no
codec replica a stream or a state slot (polled every 10 ms). `--overload` then holds every slot and
floods the front with over-cap requests, /health asked beside them.

Exit status 1 when audio was lost, errors passed `--max-error-share`, a probe was not refused
properly, a process died, a barge-in was not released, or the stack did not end idle and healthy.
Run from the repository root:

    .venv/bin/python benchmarks/soak.py --minutes 10
    .venv/bin/python benchmarks/soak.py --minutes 0.5 --out /tmp/soak.json     # a quick check
    .venv/bin/python benchmarks/soak.py --minutes 0.5 --doors 5 --overload --out benchmarks/results/doors-cpu.json
    .venv/bin/python benchmarks/soak.py --minutes 0.5 --attach "$(pgrep -o -f 'megapod up')"   # a stack already up
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import math
import os
import random
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect

from benchmarks.concurrency_bench import report
from benchmarks.concurrency_bench.corpus import DEFAULT_CORPUS, Corpus, load_corpus
from benchmarks.concurrency_bench.flood import Knock, flood
from benchmarks.concurrency_bench.load import Endpoint, Level, LevelRun, LoadShape, Request, warm_up
from benchmarks.concurrency_bench.metrics import BYTES_PER_AUDIO_S, Targets, percentiles
from benchmarks.concurrency_bench.stack import LocalStack, cpu_cores, cpu_snapshot, gauge
from benchmarks.provenance import REPO_ROOT, record

SAMPLES_PER_FRAME = 2048
SAMPLE_BYTES = 2
FORMATS = ("pcm", "wav", "mp3", "opus", "aac", "flac")
DOOR_TEXT = "Thanks for calling, how can I help you today?"
LONG_TEXT = " ".join(["This is a long answer that keeps the stream busy while others knock."] * 6)
HELD = ("orpheus_active_streams", "orpheus_engine_unfinished_requests", "snac_active_streams", "snac_state_slots_in_use")
RELEASE_DEADLINE_S = 30.0
LOOP_LAG = "orpheus_event_loop_lag_seconds"  # orpheus_common/loop_lag.py: on the workers' and the front's /metrics


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="how long new requests are sent (fractions allowed)")
    p.add_argument("--concurrency", type=int, default=2,
                   help="closed-loop streams; the concurrency benchmark found N_max 1-2 on a 2-core CPU")
    p.add_argument("--max-streams", type=int, default=None,
                   help="the worker's admission cap (default: the concurrency, +1 with --disconnect-every-s)")
    p.add_argument("--probe-every-s", type=float, default=3.0,
                   help="an over-cap request this often (0: none); with --disconnect-every-s, one per leaving client")
    p.add_argument("--disconnect-every-s", type=float, default=0.0,
                   help="a client that leaves after its first audio this often (0: none; cut streams make the "
                        "audio check a bound instead of an equality)")
    p.add_argument("--kinds", default="short,medium", help="utterance kinds of the corpus to speak")
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--megapod-args", default="--replicas 2 --enforce-eager true", help="more `megapod up` flags")
    p.add_argument("--attach", type=int, default=None, metavar="PID",
                   help="soak a `megapod up` already running (its pid; workers with a fixed cap) instead of starting "
                        "one: the slots beyond --max-streams are held by silent contexts, and it is left running")
    p.add_argument("--hostile-uploads-every-s", type=float, default=0.0, metavar="S",
                   help="during the soak, a crafted recording (benchmarks/hostile_audio.py, the worst first) posted to "
                        "the worker's POST /v1/voices every S seconds (0: none; the soak's own stack gets a voices "
                        "directory)")
    p.add_argument("--memory-every-s", type=float, default=5.0, help="RSS sampling period")
    p.add_argument("--replays", type=int, default=3, help="replies replayed at the end with the same seed (0: none)")
    p.add_argument("--doors", type=int, default=0, metavar="N",
                   help="after the soak: time to first byte by response_format (N rounds) and N barge-ins")
    p.add_argument("--overload", action="store_true",
                   help="after the soak: the admitted streams' pace alone and under a flood of over-cap requests")
    p.add_argument("--overload-rounds", type=int, default=2, help="alone/flooded pairs of --overload")
    p.add_argument("--flood-burst", type=int, default=20, help="concurrent over-cap requests per burst of the flood")
    p.add_argument("--max-error-share", type=float, default=0.01, help="failed requests allowed, as a share")
    p.add_argument("--drain-timeout-s", type=float, default=300.0, help="wait this long for in-flight requests")
    p.add_argument("--read-timeout-s", type=float, default=120.0)
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "soak-cpu.json")
    p.add_argument("--keep-logs", action="store_true", help="keep the stack's logs (their folder is printed)")
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.concurrency < 1:
        p.error("--minutes must be > 0 and --concurrency >= 1")
    if args.max_streams is None:
        args.max_streams = args.concurrency + (1 if args.disconnect_every_s > 0 else 0)
    return args


# -- memory -------------------------------------------------------------------------------------


class MemoryWatch:
    """RSS of every process under the launcher, sampled in a thread of its own (no client event-loop lag)."""

    def __init__(self, stack: LocalStack, period_s: float) -> None:
        self.stack, self.period_s = stack, period_s
        self.samples: list[tuple[float, dict[str, float]]] = []  # (seconds since start, {label: MB})
        self.labels: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-watch", daemon=True)

    def start(self) -> MemoryWatch:
        self.t0 = time.perf_counter()
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()  # the end point is taken after the drain

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def sample(self) -> None:
        row = {}
        for proc in self._tree():
            try:
                row[self._label(proc)] = proc.memory_info().rss / 2**20
            except psutil.Error:
                pass  # gone between listing and reading
        self.samples.append((time.perf_counter() - self.t0, row))

    def _tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.stack.pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def _label(self, proc: psutil.Process) -> str:
        """front | llm-0 | snac-1 | llm-0/VLLM::EngineCore: names that survive a restart (pids do not)."""
        if proc.pid not in self.labels:
            self.labels[proc.pid] = self._name(proc)
        return self.labels[proc.pid]

    def _name(self, proc: psutil.Process) -> str:
        if proc.pid == self.stack.pid:
            return "front"  # `megapod up`: the launcher and the front endpoint in one process
        cfg = self.stack.config
        tops = {**{f"llm-{i}": p for i, p in enumerate(cfg.worker_ports())},
                **{f"snac-{j}": p for j, p in enumerate(cfg.snac_ports())}}
        try:
            argv = proc.cmdline()
            name = next((name for name, port in tops.items() if "-m" in argv and str(port) in argv
                         and argv[argv.index("-m") + 1] == name.split("-")[0] + "_server"), None)
            if name is None:  # vLLM names its processes (VLLM::EngineCore); others go by executable
                title = argv[0] if argv and not argv[0].startswith("/") else proc.name()
                name = f"{self._label(proc.parent())}/{title.split()[0]}"
        except (IndexError, AttributeError):  # psutil.Error goes up: sample() skips a process that left
            return f"pid {proc.pid}"
        taken = set(self.labels.values())  # a restarted process gets a new label: the old one shows as gone
        return name if name not in taken else f"{name}#{proc.pid}"

    def summary(self) -> dict[str, Any]:
        labels = sorted({k for _, row in self.samples for k in row})
        per = {k: _series_summary([(t, row[k]) for t, row in self.samples if k in row]) for k in labels}
        end_t = self.samples[-1][0]
        for k, s in per.items():  # a process missing from the last sample died (or was replaced)
            s["alive_at_end"] = k in self.samples[-1][1]
        groups = {"stack total": lambda k: True}
        for top in labels:
            if "/" not in top:
                groups[f"{top} (with children)"] = lambda k, top=top: k == top or k.startswith(top + "/")
        totals = {name: _series_summary([(t, sum(v for k, v in row.items() if match(k))) for t, row in self.samples])
                  for name, match in groups.items()}
        return {"period_s": self.period_s, "samples": len(self.samples), "span_s": round(end_t, 1),
                "processes": per, "groups": totals}


def _series_summary(points: list[tuple[float, float]]) -> dict[str, Any]:
    """Start, end, peak, growth and a least-squares slope (MB/hour), overall and over the second half
    (the first minutes hold allocator and cache warm-up; a leak keeps its slope in the second half)."""
    ts = np.array([t for t, _ in points])
    mb = np.array([v for _, v in points])
    out = {"start_mb": round(float(mb[0]), 1), "end_mb": round(float(mb[-1]), 1), "peak_mb": round(float(mb.max()), 1),
           "growth_mb": round(float(mb[-1] - mb[0]), 1), "mb_per_hour": _slope(ts, mb), "mb_per_hour_second_half": None}
    half = ts >= (ts[0] + ts[-1]) / 2
    out["mb_per_hour_second_half"] = _slope(ts[half], mb[half])
    return out


def _slope(ts: np.ndarray, mb: np.ndarray) -> float | None:
    if len(ts) < 3 or ts[-1] - ts[0] <= 0:
        return None
    return round(float(np.polyfit(ts / 3600.0, mb, 1)[0]), 1)


# -- the load -----------------------------------------------------------------------------------


@dataclass
class Probe:
    """One trickle request: an over-cap probe (should be refused) or a client that leaves early."""

    kind: str  # over-cap | disconnect
    sent_s: float
    status: int | None = None
    latency_s: float | None = None  # request sent -> response headers
    retry_after: str | None = None
    openai_error: bool = False  # {"error": {"message", "type", "code"}}
    audio_bytes: int = 0
    ended_s: float | None = None
    error: str | None = None
    cut: bool = False  # left while the server was still sending (by design for disconnects)


class SoakLevel(Level):
    """The concurrency benchmark's closed-loop level, run for a fixed time and then drained, never cut:
    exact audio accounting needs every request that got audio to run to its end."""

    def __init__(self, endpoint: Endpoint, shape: LoadShape, corpus: Corpus, n: int, duration_s: float,
                 probe_every_s: float, disconnect_every_s: float, drain_timeout_s: float) -> None:
        # Targets only feed the progress line here: the soak judges audio, errors and memory.
        super().__init__(endpoint, shape, Targets(ttfa_s=60.0, buffer_s=60.0, pace=0.1), corpus, n)
        self.duration_s, self.drain_timeout_s = duration_s, drain_timeout_s
        self.probe_every_s, self.disconnect_every_s = probe_every_s, disconnect_every_s
        self.probes: list[Probe] = []
        self.drained: bool | None = None

    def _new_request(self, stream: int, seq: int) -> tuple[Request, str]:
        req, text = super()._new_request(stream, seq)
        if seq & (seq - 1) == 0:  # keep the audio of requests 0, 1, 2, 4, 8...: replay candidates
            req.pcm = bytearray()
        return req, text

    async def _watch(self) -> str:
        """Run for duration_s with the trickles on; then send nothing new and let everything end."""
        trickles = []
        if self.probe_every_s > 0 and self.disconnect_every_s <= 0:
            trickles.append(asyncio.create_task(self._trickle("over-cap", self.probe_every_s)))
        if self.disconnect_every_s > 0:  # each leaving client sends the over-cap probe (see _probe)
            trickles.append(asyncio.create_task(self._trickle("disconnect", self.disconnect_every_s)))
        end = self.t0 + self.duration_s
        while time.perf_counter() < end:
            await asyncio.sleep(0.5)
            now = time.perf_counter()
            self.progress.update(self._status(now, self._live_counts(now)))
        self.closed_at = time.perf_counter()
        self.stop.set()
        deadline = self.closed_at + self.drain_timeout_s
        while time.perf_counter() < deadline and not self._all_ended():
            await asyncio.sleep(0.5)
            now = time.perf_counter()
            self.progress.update("draining: " + self._status(now, self._live_counts(now)))
        self.drained = self._all_ended()
        for task in trickles:
            task.cancel()
        await asyncio.gather(*trickles, return_exceptions=True)
        return "complete" if self.drained else "drain timeout"

    def _all_ended(self) -> bool:
        return all(r.ended_s is not None for r in self.requests) and all(p.ended_s is not None for p in self.probes)

    async def _trickle(self, kind: str, every_s: float) -> None:
        """Requests of one kind at random moments (exponential gaps, mean every_s), each on its own task."""
        rng = random.Random(f"{self.shape.seed}-{kind}")
        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=self.shape.read_timeout_s),
                                     trust_env=False) as client:
            pending: set[asyncio.Task] = set()
            while not self.stop.is_set():
                await asyncio.sleep(rng.expovariate(1.0 / every_s))
                if self.stop.is_set():
                    break
                task = asyncio.create_task(self._probe(client, kind))
                pending.add(task)
                task.add_done_callback(pending.discard)
            await asyncio.gather(*pending, return_exceptions=True)  # admitted probes run to their end

    async def _probe(self, client: httpx.AsyncClient, kind: str, tries: int = 5) -> None:
        """One trickle request. A leaving client holds the spare slot (the cap is one above the streams), so
        it sends the over-cap probe itself before it leaves: a probe of its own could take that slot and
        starve the disconnects. Refused (a stream's gap), it retries after Retry-After."""
        probe = Probe(kind, time.perf_counter())
        self.probes.append(probe)
        k = len(self.probes)
        utterance = self.corpus.pick(10_000 + k, 0)
        body = self.endpoint.body(utterance.text, self.shape.seed + 10_000_000 + k)
        try:
            async with client.stream("POST", f"{self.endpoint.url}/v1/audio/speech", json=body) as reply:
                probe.status, probe.latency_s = reply.status_code, time.perf_counter() - probe.sent_s
                probe.retry_after = reply.headers.get("retry-after")
                if reply.status_code != 200:
                    probe.openai_error = _openai_error(await reply.aread())
                else:
                    # Admitted (a slot was free for a moment): a real stream now, its audio counts.
                    async for data in reply.aiter_raw():
                        probe.audio_bytes += len(data)
                        if probe.kind == "disconnect":
                            if self.probe_every_s > 0:
                                await self._probe(client, "over-cap")  # every slot is held now
                            probe.cut = True  # leave with the server mid-stream: it must abort and free the slot
                            break
        except httpx.HTTPError as exc:
            probe.error = f"{type(exc).__name__}: {exc}"[:300]
        probe.ended_s = time.perf_counter()
        if kind == "disconnect" and probe.status == 429 and tries > 1 and not self.stop.is_set():
            await asyncio.sleep(1.0)
            await self._probe(client, kind, tries - 1)


def _openai_error(body: bytes) -> bool:
    try:
        error = json.loads(body)["error"]
        return all(isinstance(error.get(k), str) and error[k] for k in ("message", "type", "code"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return False


# -- the stack's own counters --------------------------------------------------------------------


async def loop_lag(stack: LocalStack) -> dict[str, dict[str, Any]]:
    """The event-loop lag histogram ({le: cumulative count}, the workers' summed) and the largest lag since start
    (the workers' largest) of the workers and of the front, from one scrape of each; a page that cannot be read
    or lacks the metric gives no buckets and a nan max."""
    host = stack.config.host
    pages = {"worker": [f"http://{host}:{p}/metrics" for p in stack.config.worker_ports()],
             "front": [f"{stack.url}/metrics"]}
    out: dict[str, dict[str, Any]] = {}
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
        for server, urls in pages.items():
            buckets: dict[float, float] = {}
            peak = float("nan")
            for url in urls:
                try:
                    families = list(text_string_to_metric_families((await client.get(url)).text))
                except (httpx.HTTPError, ValueError):
                    continue
                for sample in (s for f in families for s in f.samples):
                    if sample.name == f"{LOOP_LAG}_bucket":
                        le = float(sample.labels["le"])
                        buckets[le] = buckets.get(le, 0.0) + sample.value
                    elif sample.name == "orpheus_event_loop_lag_max_seconds":
                        peak = sample.value if math.isnan(peak) else max(peak, sample.value)
            out[server] = {"buckets": buckets, "max_s": peak}
    return out


def bucket_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus's histogram_quantile of cumulative bucket counts: linear within the bucket the rank falls in,
    the largest finite bound when it falls in +Inf's; None without observations."""
    total = buckets.get(math.inf, 0.0)
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for le in sorted(buckets):
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            return le if count == below else lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def loop_lag_summary(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """worker_/front_loop_lag_{p50,p99,max}_ms: quantiles of the lag observed between the two scrapes, and the
    largest since each process started (None where the metric was not read)."""
    out: dict[str, Any] = {}
    for server in ("worker", "front"):
        start, end = before[server]["buckets"], after[server]["buckets"]
        delta = {le: n - start.get(le, 0.0) for le, n in end.items()}
        if any(n < 0 for n in delta.values()):  # a process restarted between the scrapes: its counts since then
            delta = end
        for q in (50, 99):
            v = bucket_quantile(q / 100, delta)
            out[f"{server}_loop_lag_p{q}_ms"] = None if v is None else round(v * 1000, 2)
        out[f"{server}_loop_lag_observed"] = int(delta.get(math.inf, 0))
        peak = after[server]["max_s"]
        out[f"{server}_loop_lag_max_ms"] = None if math.isnan(peak) else round(peak * 1000, 2)
    return out


# -- hostile uploads beside the soak (issue 41) ------------------------------------------------------------

# The corpus items that cost the most to refuse (hostile_audio.py), then a legal one that makes a voice.
HOSTILE_FIRST = ("flac_tiny_frames_384k", "flac_tiny_frames_48k", "flac_hour_of_near_silence_undeclared",
                 "opus_tiny_frames_undeclared", "wav_32_channels", "mkv_20_audio_streams", "flac_corrupt_throughout",
                 "flac_tiny_frames_48k_within_bounds")


async def post_corpus(worker: str, items: Sequence[str], every_s: float = 0.0, forever: bool = False
                      ) -> list[dict[str, Any]]:
    """Post each item to the worker's POST /v1/voices in turn (over and over with `forever`, until cancelled),
    `every_s` apart; a voice made is deleted again. Each answer: the item, its status, what it said, how long, and
    when (`window`: perf_counter at the post and at the answer)."""
    from benchmarks.hostile_audio import corpus

    made = corpus()  # made before the first post: encoding them is this client's CPU, not the worker's
    payloads = {name: await asyncio.to_thread(made[name]) for name in dict.fromkeys(items)}
    answers = []
    async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
        try:
            for i, name in enumerate(itertools.cycle(items) if forever else items):
                audio = payloads[name]
                started = time.perf_counter()
                reply = await client.post(f"{worker}/v1/voices", data={"name": f"hostile-{i}", "transcript": "Hello."},
                                          files={"audio": ("reference", audio, "application/octet-stream")})
                answers.append({"item": name, "bytes": len(audio), "status": reply.status_code,
                                "answer_s": round(time.perf_counter() - started, 3), "window": (started, time.perf_counter()),
                                "said": reply.json().get("error", {}).get("message") if reply.status_code >= 400 else None})
                if reply.status_code == 201:
                    await client.delete(f"{worker}/v1/voices/hostile-{i}")
                await asyncio.sleep(every_s)
        except asyncio.CancelledError:
            pass
    return answers


async def stop_posting(task: asyncio.Task | None) -> list[dict[str, Any]]:
    if task is None:
        return []
    task.cancel()
    return await task


def upload_summary(answers: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not answers:
        return None
    slowest = max(answers, key=lambda a: a["answer_s"])
    return {"posted": len(answers), "by_status": dict(Counter(str(a["status"]) for a in answers)),
            "answer_s_max": slowest["answer_s"], "slowest": {k: v for k, v in slowest.items() if k != "window"}}


async def health(stack: LocalStack) -> dict[str, Any]:
    """/health and /ready of the front and every worker, and the launcher still running."""
    host, out = stack.config.host, {"launcher_running": stack.running()}
    urls = {"front": stack.url, **{f"llm-{i}": f"http://{host}:{p}" for i, p in enumerate(stack.config.worker_ports())}}
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
        for name, url in urls.items():
            try:
                out[name] = [(await client.get(f"{url}/{path}")).status_code for path in ("health", "ready")]
            except httpx.HTTPError as exc:
                out[name] = f"{type(exc).__name__}: {exc}"
    out["ok"] = out["launcher_running"] and all(v == [200, 200] for k, v in out.items() if k not in
                                                ("launcher_running", "ok"))
    return out


async def replay(endpoint: Endpoint, corpus: Corpus, shape: LoadShape, requests: list[Request],
                 count: int) -> list[dict[str, Any]]:
    """Per-stream check: the latest kept replies again, one at a time on the idle stack, same text and seed.
    Same tokens give the same number of frames, and the same audio to s16 rounding (chunking may differ)."""
    kept = [r for r in requests if r.completed and r.pcm]
    chosen = sorted(kept, key=lambda r: r.sent_s)[-count:] if count else []
    out = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=shape.read_timeout_s), trust_env=False) as client:
        for r in chosen:
            body = endpoint.body(corpus.pick(r.stream, r.seq).text, shape.seed + r.stream * 1000 + r.seq)
            reply = await client.post(f"{endpoint.url}/v1/audio/speech", json=body)
            if reply.status_code != 200:  # an error body is not audio to compare
                out.append({"stream": r.stream, "seq": r.seq, "status": reply.status_code, "same": False})
                continue
            again = reply.content
            a, b = np.frombuffer(bytes(r.pcm), "<i2"), np.frombuffer(again, "<i2")
            n = min(len(a), len(b))
            diff = int(np.abs(a[:n].astype(np.int32) - b[:n].astype(np.int32)).max()) if n else None
            out.append({"stream": r.stream, "seq": r.seq, "utterance": r.utterance, "samples_under_load": len(a),
                        "samples_replayed": len(b), "max_s16_diff": diff, "same": len(a) == len(b) and diff is not None
                        and diff <= 2})
    return out


# -- --overload: the admitted streams alone and under a flood, side by side ------------------------


async def overload(stack: LocalStack, endpoint: Endpoint, corpus: Corpus, n: int, rounds: int, burst: int,
                   read_timeout_s: float) -> dict[str, Any]:
    """Rounds of: n requests (the cap) alone, then the same n (same texts and seeds) while bursts of
    over-cap requests arrive until one of them ends. Alternating, so a drift of the machine hits both.
    Each run starts on an idle stack: a knock admitted as a slot freed holds it until its cancel lands."""
    runs = []
    for r in range(rounds):
        for flooded in (False, True):
            await stack.wait_idle()
            run = await _admitted(endpoint, corpus, n, flooded, burst, read_timeout_s)
            runs.append({"round": r, "flooded": flooded, **run})
            print(f"overload round {r + 1}/{rounds} {'flooded' if flooded else 'alone'}: wall-s per audio-s "
                  f"{[s['wall_s_per_audio_s'] for s in run['streams']]}", file=sys.stderr, flush=True)

    def mean_rtf(flooded: bool) -> float | None:
        v = [s["wall_s_per_audio_s"] for x in runs if x["flooded"] == flooded for s in x["streams"]
             if s["wall_s_per_audio_s"] is not None]
        return round(sum(v) / len(v), 3) if v else None

    alone, flooded = mean_rtf(False), mean_rtf(True)
    floods = [x["flood"] for x in runs if x["flooded"]]
    statuses = Counter(k for f in floods for k in f["statuses"].elements())
    return {"rounds": rounds, "burst": burst, "wall_s_per_audio_s_alone": alone, "wall_s_per_audio_s_flooded": flooded,
            "flooded_over_alone": round(flooded / alone, 3) if alone and flooded else None,
            "flood_statuses": dict(statuses), "flood_errors": sorted({e for f in floods for e in f["errors"]}),
            "runs": runs}


async def _admitted(endpoint: Endpoint, corpus: Corpus, n: int, flooded: bool, burst: int,
                    read_timeout_s: float) -> dict[str, Any]:
    streams = [{"sent": 0.0, "status": None, "first": None, "ended": None, "bytes": 0} for _ in range(n)]
    admitted = [asyncio.Event() for _ in range(n)]

    async def speak(i: int, client: httpx.AsyncClient) -> None:
        s = streams[i]
        body = endpoint.body(corpus.pick(20_000 + i, 0).text, 20_000 + i)
        s["sent"] = time.perf_counter()
        async with client.stream("POST", f"{endpoint.url}/v1/audio/speech", json=body) as reply:
            s["status"] = reply.status_code
            admitted[i].set()
            if reply.status_code != 200:
                return  # refused: its body is no audio
            async for data in reply.aiter_raw():
                s["first"] = s["first"] or time.perf_counter()
                s["bytes"] += len(data)
        s["ended"] = time.perf_counter()

    limits = httpx.Limits(max_connections=n + burst + 4, max_keepalive_connections=n + burst + 4)
    knocks: list[Knock] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=read_timeout_s), limits=limits,
                                 trust_env=False) as client:
        tasks = [asyncio.create_task(speak(i, client)) for i in range(n)]
        if flooded:
            await asyncio.gather(*(e.wait() for e in admitted))
            ended = lambda: any(t.done() for t in tasks)  # a slot freed: knocks would be admitted
            knocks, pings = await asyncio.gather(
                flood(client, endpoint.url, burst, stop=ended, body=lambda _: endpoint.body("Room for one more?", 1)),
                _health_pings(client, endpoint.url, ended))
        await asyncio.gather(*tasks)
    out = {"streams": [{"status": s["status"], "audio_s": round(s["bytes"] / BYTES_PER_AUDIO_S, 2),
                        "ttfa_s": round(s["first"] - s["sent"], 3) if s["first"] else None,
                        "wall_s_per_audio_s": round((s["ended"] - s["sent"]) / (s["bytes"] / BYTES_PER_AUDIO_S), 3)
                        if s["bytes"] else None} for s in streams]}
    if flooded:
        out["flood"] = {"requests": len(knocks), "statuses": Counter(str(k.status) for k in knocks),
                        "errors": sorted({k.error for k in knocks if k.error}),
                        "latency_s": percentiles([k.latency_s for k in knocks], (50, 95, 100), 4),
                        "health_latency_s": percentiles(pings, (50, 95, 100), 4)}
    return out


async def _health_pings(client: httpx.AsyncClient, url: str, stop: Callable[[], bool]) -> list[float]:
    """GET /health every 50 ms until stop(): what any request costs on the machine beside the refusals."""
    times = []
    while not stop():
        t0 = time.perf_counter()
        (await client.get(f"{url}/health")).raise_for_status()
        times.append(time.perf_counter() - t0)
        await asyncio.sleep(0.05)
    return times


# -- --doors: what a voice agent waits for at the front doors --------------------------------------


async def doors(stack: LocalStack, rounds: int) -> dict[str, Any]:
    return {"ttfb_s": await _ttfb_by_format(stack, rounds), "barge_in": await _barge_ins(stack, rounds)}


async def _ttfb_by_format(stack: LocalStack, rounds: int) -> dict[str, Any]:
    """Time to first byte per format, and each format's median minus pcm's (issue 14: mp3 and opus within 50 ms)."""
    times: dict[str, list[float]] = {f: [] for f in FORMATS}

    async def first_byte(fmt: str) -> float:
        body = {"model": "tts-1", "input": DOOR_TEXT, "voice": "tara", "response_format": fmt, "seed": 7}
        t0 = time.perf_counter()
        async with client.stream("POST", f"{stack.url}/v1/audio/speech", json=body) as reply:
            reply.raise_for_status()
            async for _ in reply.aiter_raw():
                return time.perf_counter() - t0
        raise RuntimeError(f"{fmt}: no audio")

    async with httpx.AsyncClient(timeout=120.0, trust_env=False) as client:
        await first_byte("pcm")  # first-request costs are nobody's format
        for r in range(rounds):
            for fmt in FORMATS[r % len(FORMATS):] + FORMATS[: r % len(FORMATS)]:
                await stack.wait_idle()
                times[fmt].append(await first_byte(fmt))
    pcm = statistics.median(times["pcm"])
    return {f: {**percentiles(v, (50, 95, 100), 4), "p50_minus_pcm": round(statistics.median(v) - pcm, 4)}
            for f, v in times.items()}


async def _barge_ins(stack: LocalStack, trials: int) -> dict[str, Any]:
    cfg = stack.config
    urls = [f"http://{cfg.host}:{p}/metrics" for p in cfg.worker_ports()]
    urls += [f"http://{cfg.host}:{cfg.snac_metrics_base_port + j}/metrics" for j in range(cfg.replicas)]
    runs = []
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        for k in range(trials):
            await stack.wait_idle()
            runs.append(await _barge_in(stack.url.replace("http://", "ws://") + "/tts/websocket", client, urls, k,
                                        stack.held))
    released = [r["released_s"] for r in runs if r["released_s"] is not None]
    return {"runs": runs, "all_released": len(released) == len(runs),
            "released_s": percentiles(released, (50, 95, 100), 4)}


async def _barge_in(ws_url: str, client: httpx.AsyncClient, urls: list[str], k: int,
                    baseline: dict[str, float]) -> dict[str, Any]:
    """One context cancelled at its first chunk: seconds until it holds nothing (None: still held at the deadline)."""
    context = f"barge-{k}"
    async with connect(ws_url, additional_headers={"X-API-Key": "unused"}) as ws:
        t_sent = time.perf_counter()
        await ws.send(cartesia_message(context, LONG_TEXT, more=False))
        while not ((reply := json.loads(await ws.recv()))["type"] == "chunk" and base64.b64decode(reply["data"])):
            pass
        first_chunk_s, during = time.perf_counter() - t_sent, await _held(client, urls, baseline)
        t_cancel = time.perf_counter()
        await ws.send(json.dumps({"context_id": context, "cancel": True}))
        released_s = None
        while time.perf_counter() - t_cancel < RELEASE_DEADLINE_S:  # each poll's scrape counts: an upper bound
            if not any((await _held(client, urls, baseline)).values()):
                released_s = round(time.perf_counter() - t_cancel, 4)
                break
            await asyncio.sleep(0.01)
    return {"first_chunk_s": round(first_chunk_s, 4), "held_at_cancel": during, "released_s": released_s}


async def _held(client: httpx.AsyncClient, urls: list[str], baseline: dict[str, float]) -> dict[str, float]:
    """What the stack holds beyond the baseline (the slots a SlotHolder keeps taken)."""
    totals = {name: -baseline.get(name, 0.0) for name in HELD}
    for page in [(await client.get(u)).text for u in urls]:
        for name in HELD:
            value = gauge(page, name)
            totals[name] += 0.0 if math.isnan(value) else value  # a page without the gauge holds none
    return totals


def cartesia_message(context_id: str, transcript: str, more: bool) -> str:
    """A Cartesia context's text (`more`: the context stays open), raw PCM at 24 kHz."""
    return json.dumps({"transcript": transcript, "continue": more, "context_id": context_id, "model_id": "sonic-3",
                       "voice": {"mode": "id", "id": "tara"},
                       "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}})


# -- an attached stack's spare slots ---------------------------------------------------------------


class SlotHolder:
    """Takes every stream slot of the stack beyond the soak's own `keep` and holds it until the soak ends,
    with Cartesia contexts that have no text yet (a context keeps its slot until its client ends it; it
    generates nothing). A bigger stack the soak is attached to then refuses over-cap requests exactly where
    its own one-worker stack would. The slots kept free go to the first workers, whole."""

    def __init__(self, stack: LocalStack, keep: int) -> None:
        self.stack, self.keep = stack, keep
        self.sockets: list[Any] = []
        self.count = 0

    async def __aenter__(self) -> SlotHolder:
        cfg = self.stack.config
        cap = cfg.max_streams_per_worker
        if cap is None or cfg.min_streams_per_worker != cap:
            raise SystemExit("the stack's workers need a fixed cap (--min-streams-per-worker = "
                             "--max-streams-per-worker) for the soak to hold the slots beyond its own")
        if self.keep > cap * cfg.workers:
            raise SystemExit(f"--max-streams {self.keep} is more than the stack's {cap * cfg.workers} slots")
        free = self.keep
        try:
            for port in cfg.worker_ports():
                kept = min(cap, free)
                free -= kept
                if cap > kept:
                    ws = await connect(f"ws://{cfg.host}:{port}/tts/websocket", additional_headers={"X-API-Key": "unused"})
                    self.sockets.append(ws)
                    for k in range(cap - kept):
                        await ws.send(cartesia_message(f"held-{k}", "", more=True))
                    self.count += cap - kept
            deadline = time.perf_counter() + 60.0
            while (await self.stack.worker_metrics("orpheus_active_streams"))["orpheus_active_streams"] < self.count:
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"the stack did not take the {self.count} held contexts within 60 s")
                await asyncio.sleep(0.1)
        except BaseException:
            await self.__aexit__()  # not entered: give back what was taken
            raise
        self.stack.held = {"orpheus_active_streams": float(self.count)}
        if self.count:
            print(f"holding {self.count} slots of the stack's {cap * cfg.workers}: {self.keep} left for the soak",
                  file=sys.stderr, flush=True)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for ws in self.sockets:
            await ws.close()  # the socket gone ends its contexts: their slots are free again
        self.stack.held = {}


# -- judging --------------------------------------------------------------------------------------


def error_kind(req: Request | Probe) -> str | None:
    """None for success; otherwise 'HTTP 503', 'ReadTimeout', 'cut', 'partial frame'..."""
    if req.status is not None and req.status != 200:
        return f"HTTP {req.status}"
    if req.error:
        return req.error.split(":")[0]
    if req.ended_s is None or req.cut:
        return "cut"
    return None


def audio_check(run: LevelRun, probes: list[Probe], frames: float) -> dict[str, Any]:
    """Samples the workers generated (2048 per frame) against samples the clients received."""
    delivered = sum(r.audio_bytes for r in run.requests) + sum(p.audio_bytes for p in probes)
    cut = sum(1 for r in run.requests if r.cut or (r.error and r.audio_bytes)) + sum(1 for p in probes if p.cut)
    partial = [f"{r.stream}/{r.seq}" for r in run.requests if r.completed and r.audio_bytes % (SAMPLES_PER_FRAME * 2)]
    expected = int(round(frames)) * SAMPLES_PER_FRAME
    got = delivered // SAMPLE_BYTES
    out = {"frames_generated": int(round(frames)), "samples_expected": expected, "samples_delivered": got,
           "samples_lost": expected - got, "audio_s_delivered": round(delivered / BYTES_PER_AUDIO_S, 2),
           "streams_cut": cut, "replies_not_whole_frames": partial,
           "exact": cut == 0}
    # A stream cut on purpose had frames generated that nobody read: then only a bound holds.
    out["ok"] = (expected == got if cut == 0 else got <= expected) and not partial
    return out


def judge(args: argparse.Namespace, result: dict[str, Any]) -> list[str]:
    """Why the soak failed (empty: it passed)."""
    why = []
    audio, load, probes = result["audio"], result["load"], result["probes"]
    if not audio["ok"]:
        why.append(f"audio: {audio['samples_lost']} samples lost of {audio['samples_expected']} "
                   f"({audio['streams_cut']} streams cut, {len(audio['replies_not_whole_frames'])} not whole frames)")
    if load["errors"] > args.max_error_share * max(load["requests"], 1):
        why.append(f"errors: {load['errors']} of {load['requests']} requests ({load['errors_by_kind']})")
    if probes["over-cap"]["badly_refused"] or probes["other_errors"]:
        why.append(f"over-cap probes: {probes['over-cap']['badly_refused']} refused without Retry-After or an "
                   f"OpenAI error; errors {probes['other_errors']}")
    if not result["drained"]:
        why.append(f"requests still open {args.drain_timeout_s:.0f} s after the load stopped")
    end = result["end_state"]
    if end["active_streams"] != 0 or end["engine_unfinished"] != 0 or not end["health"]["ok"]:
        why.append(f"end state: {end}")
    dead = [k for k, v in result["memory"]["processes"].items() if "/" not in k and not v["alive_at_end"]]
    if dead:
        why.append(f"processes gone before the end: {dead}")
    if any(not r["same"] for r in result["replays"]):
        why.append("a replayed reply differs from the one under load")
    if result["doors"] and not result["doors"]["barge_in"]["all_released"]:
        why.append(f"--doors: a barge-in still held resources {RELEASE_DEADLINE_S:.0f} s after its cancel")
    if result["overload"]:
        bad = {k: v for k, v in result["overload"]["flood_statuses"].items() if k not in ("429", "200")}
        streams = [s["status"] for x in result["overload"]["runs"] for s in x["streams"]]
        if bad or any(st != 200 for st in streams):
            why.append(f"--overload: flood got {bad} {result['overload']['flood_errors']}, admitted streams got {streams}")
    return why


def load_summary(run: LevelRun) -> dict[str, Any]:
    main = run.requests
    kinds = Counter(k for r in main if (k := error_kind(r)))
    refused = kinds.pop("HTTP 429", 0)  # a probe took the slot between two of our requests: expected
    done = [r for r in main if r.completed]
    ttfa = [r.chunks[0][0] - r.sent_s for r in done if r.chunks]
    rtf = [(r.ended_s - r.sent_s) / (r.audio_bytes / BYTES_PER_AUDIO_S) for r in done if r.audio_bytes]
    return {"requests": len(main), "served": len(done), "refused_429": refused, "errors": sum(kinds.values()),
            "errors_by_kind": dict(kinds), "audio_s": round(sum(r.audio_bytes for r in done) / BYTES_PER_AUDIO_S, 1),
            "audio_s_per_s": round(sum(r.audio_bytes for r in main) / BYTES_PER_AUDIO_S / run.wall_s, 3),
            "ttfa_s": percentiles(ttfa, digits=3), "wall_s_per_audio_s": percentiles(rtf, digits=3),
            "by_minute": by_minute(run)}


def by_minute(run: LevelRun) -> list[dict[str, Any]]:
    """Throughput and time to first audio per minute of the run: a slow drift is a soak finding too."""
    rows: dict[int, dict[str, Any]] = {}
    for r in run.requests:
        for t, n in r.chunks:
            rows.setdefault(int((t - run.t0) // 60), {"bytes": 0, "ttfa": []})["bytes"] += n
        if r.chunks:
            rows.setdefault(int((r.sent_s - run.t0) // 60), {"bytes": 0, "ttfa": []})["ttfa"].append(
                r.chunks[0][0] - r.sent_s)
    return [{"minute": m, "audio_s": round(v["bytes"] / BYTES_PER_AUDIO_S, 1),
             "ttfa_s_p50": percentiles(v["ttfa"], (50,), 3)["p50"]} for m, v in sorted(rows.items())]


def probe_summary(probes: list[Probe]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("over-cap", "disconnect"):
        ps = [p for p in probes if p.kind == kind]
        refused = [p for p in ps if p.status == 429]
        out[kind] = {"sent": len(ps), "refused_429": len(refused), "admitted": sum(1 for p in ps if p.status == 200),
                     "left_mid_stream": sum(1 for p in ps if p.cut),
                     "badly_refused": sum(1 for p in refused if not (p.retry_after and p.openai_error)),
                     "refusal_latency_s": percentiles([p.latency_s for p in refused], (50, 95, 100), 4)}
    out["other_errors"] = dict(Counter(k for p in probes if (k := error_kind(p)) not in (None, "cut", "HTTP 429")))
    return out


# -- main -----------------------------------------------------------------------------------------


async def soak(args: argparse.Namespace, stack: LocalStack, corpus: Corpus) -> dict[str, Any]:
    endpoint = Endpoint("soak", stack.url)
    shape = LoadShape(stagger_s=2.0, warmup_s=0.0, window_s=0.0, max_level_s=10**9,
                      read_timeout_s=args.read_timeout_s, seed=args.seed)
    # Two rounds of short requests, all streams at once, so vLLM and every codec replica (streams go round
    # robin) have served before memory is first read. A replica's RSS still rose by 0.4-0.7 GB over its
    # first minute of the soak in our runs (new batch and window shapes) and kept rising, more slowly, over
    # the 10-minute run: read the second-half slope.
    shortest = sorted(corpus.utterances, key=lambda u: len(u.text))
    async with SlotHolder(stack, args.max_streams):  # nothing to hold on the soak's own stack
        await warm_up(endpoint, [u.text for u in shortest[: 2 * args.concurrency]], args.concurrency,
                      args.read_timeout_s)
        await stack.wait_idle()
        frames_before = (await stack.worker_metrics("orpheus_frames_total"))["orpheus_frames_total"]
        lag_before = await loop_lag(stack)
        memory = MemoryWatch(stack, args.memory_every_s).start()  # "start" = after warm-up
        cpu_before = cpu_snapshot([stack])
        level = SoakLevel(endpoint, shape, corpus, args.concurrency, args.minutes * 60, args.probe_every_s,
                          args.disconnect_every_s, args.drain_timeout_s)
        uploading = asyncio.create_task(post_corpus(f"http://{stack.config.host}:{stack.config.worker_ports()[0]}",
                                                    HOSTILE_FIRST, args.hostile_uploads_every_s, forever=True)) \
            if args.hostile_uploads_every_s else None
        run = await level.run_level()
        uploads = await stop_posting(uploading)
        idle_wait_s = await stack.wait_idle()
        cores = cpu_cores(cpu_before, cpu_snapshot([stack]))
        frames = (await stack.worker_metrics("orpheus_frames_total"))["orpheus_frames_total"] - frames_before
        lag = loop_lag_summary(lag_before, await loop_lag(stack))
        memory.stop()
        replays = await replay(endpoint, corpus, shape, run.requests, args.replays)
        door = await doors(stack, args.doors) if args.doors else None
        flood = await overload(stack, endpoint, corpus, args.max_streams, args.overload_rounds, args.flood_burst,
                               args.read_timeout_s) if args.overload else None
    released_wait_s = await stack.wait_idle()  # the held slots, freed
    held = await stack.worker_metrics("orpheus_active_streams", "orpheus_engine_unfinished_requests")
    end_state = {"active_streams": held["orpheus_active_streams"],
                 "engine_unfinished": held["orpheus_engine_unfinished_requests"],
                 "idle_wait_s": round(idle_wait_s, 2), "released_wait_s": round(released_wait_s, 2),
                 "health": await health(stack)}
    return {"wall_s_load": round(run.wall_s, 1), "drained": level.drained, "load": load_summary(run),
            "probes": probe_summary(level.probes), "audio": audio_check(run, level.probes, frames),
            "replays": replays, "doors": door, "overload": flood, "memory": memory.summary(), "end_state": end_state, "cores": cores,
            "client_loop_lag_ms": run.loop_lag_ms, **lag, "hostile_uploads": upload_summary(uploads)}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind like Ctrl-C: the stack gets stopped
    t_start = time.perf_counter()
    corpus = load_corpus(args.corpus, tuple(k.strip() for k in args.kinds.split(",")), args.seed)
    log_dir = Path(tempfile.mkdtemp(prefix="soak-"))
    if args.attach:
        stack = LocalStack.attach(args.attach, log_dir)
    else:
        flags = [*shlex.split(args.megapod_args), "--workers", "1", "--max-streams-per-worker", str(args.max_streams),
                 "--min-streams-per-worker", str(args.max_streams)]  # a fixed cap: the overload phase probes it
        if args.hostile_uploads_every_s:
            flags += ["--voices-dir", str(log_dir / "voices")]
        stack = LocalStack("soak", flags, log_dir)
        stack.plan(set())
    load_start = [round(x, 2) for x in os.getloadavg()]
    failed = True
    try:
        if args.attach:
            print(f"attached to pid {args.attach}: {stack.command}", file=sys.stderr, flush=True)
        else:
            print(f"starting: {stack.command}", file=sys.stderr, flush=True)
            stack.start()
            print(f"ready after {stack.wait_ready():.0f} s", file=sys.stderr, flush=True)
        print(f"soaking {args.minutes:g} min at {args.concurrency} streams (cap {args.max_streams})",
              file=sys.stderr, flush=True)
        measured = asyncio.run(soak(args, stack, corpus))
        failed = False
    finally:
        if failed:
            print(f"--- logs ({log_dir}) ---\n{stack.tail()}", file=sys.stderr)
        stack.stop()
        if args.keep_logs or failed:
            print(f"logs kept in {log_dir}", file=sys.stderr)
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
    result = {
        "benchmark": "soak",
        "provenance": record(report.PACKAGES, argv),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "megapod_up": stack.command, "attached": bool(args.attach),
        "topology": stack.topology, "startup_s": round(stack.startup_s, 1) if stack.startup_s else None,
        "corpus": corpus.describe(),
        "contention": {"load_average_start": load_start, "load_average_end": [round(x, 2) for x in os.getloadavg()]},
        **measured,
    }
    result["failures"] = judge(args, result)
    result["passed"] = not result["failures"]
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print_summary(result, args.out)
    return 0 if result["passed"] else 1


def print_summary(r: dict[str, Any], out: Path) -> None:
    load, audio, probes, mem = r["load"], r["audio"], r["probes"], r["memory"]
    oc = probes["over-cap"]
    print(f"\nsoak {r['config']['minutes']:g} min, {r['config']['concurrency']} streams, cap "
          f"{r['config']['max_streams']} ({r['provenance']['machine']['cpu']}, {r['provenance']['machine']['cores_usable']} cores; load "
          f"{r['contention']['load_average_start'][0]} -> {r['contention']['load_average_end'][0]}; other processes "
          f"{r['cores']['other_processes']} cores)")
    print(f"  streams   {load['served']} served of {load['requests']}, {load['audio_s']} audio-s "
          f"({load['audio_s_per_s']} audio-s/s); TTFA p50/p95 {load['ttfa_s']['p50']}/{load['ttfa_s']['p95']} s; "
          f"wall-s per audio-s p50 {load['wall_s_per_audio_s']['p50']}")
    print(f"  errors    {load['errors']} {load['errors_by_kind'] or ''}; "
          f"our streams refused (429) {load['refused_429']}")
    print(f"  over-cap  {oc['sent']} probes: {oc['refused_429']} refused (429; bad {oc['badly_refused']}), "
          f"{oc['admitted']} admitted; refusal p50/p95/max {'/'.join(map(str, oc['refusal_latency_s'].values()))} s")
    if probes["disconnect"]["sent"]:
        d = probes["disconnect"]
        print(f"  leaving   {d['left_mid_stream']} clients left mid-stream ({d['sent']} sent, "
              f"{d['refused_429']} refused and retried)")
    check = "exact" if audio["exact"] else f"bound ({audio['streams_cut']} streams cut)"
    print(f"  audio     {audio['frames_generated']} frames x 2048 = {audio['samples_expected']} samples expected, "
          f"{audio['samples_delivered']} delivered: lost {audio['samples_lost']} [{check}: "
          f"{'OK' if audio['ok'] else 'FAIL'}]")
    if r["replays"]:
        same = sum(1 for x in r["replays"] if x["same"])
        print(f"  replays   {same}/{len(r['replays'])} same length and audio (s16 diff <= 2) on the idle stack")
    if r["doors"]:
        d = r["doors"]
        print("  doors     TTFB p50 (minus pcm): " + ", ".join(f"{f} {v['p50'] * 1000:.0f} ms ({v['p50_minus_pcm'] * 1000:+.0f})"
                                                         for f, v in d["ttfb_s"].items()))
        print(f"            barge-in released p50/max {d['barge_in']['released_s']['p50']}/"
              f"{d['barge_in']['released_s']['p100']} s, all released: {d['barge_in']['all_released']}")
    if r["overload"]:
        o = r["overload"]
        flooded = [x["flood"] for x in o["runs"] if x["flooded"]]
        print(f"  overload  wall-s per audio-s of the admitted streams: alone {o['wall_s_per_audio_s_alone']}, "
              f"flooded {o['wall_s_per_audio_s_flooded']} (x{o['flooded_over_alone']}); flood {o['flood_statuses']}, "
              f"p95 {[x['latency_s']['p95'] for x in flooded]} s, /health beside it p95 "
              f"{[x['health_latency_s']['p95'] for x in flooded]} s")
    print(f"  memory    RSS MB (after warm-up -> end, peak; MB/h fit over {mem['samples']} samples, second half)")
    for name, s in {**mem["groups"], **mem["processes"]}.items():
        print(f"    {name:<34s} {s['start_mb']:8.1f} -> {s['end_mb']:8.1f}  peak {s['peak_mb']:8.1f}  "
              f"{s['growth_mb']:+7.1f} MB  {_fmt(s['mb_per_hour'])} MB/h ({_fmt(s['mb_per_hour_second_half'])})"
              + ("" if s.get("alive_at_end", True) else "  GONE"))
    lag = ["{}: p50/p99 {}/{} ms over the soak, max {} ms since start".format(
        name, *(r[f"{name}_loop_lag_{x}_ms"] for x in ("p50", "p99", "max"))) for name in ("worker", "front")]
    print(f"  loop lag  {'; '.join(lag)} (a frame is 85 ms)")
    end = r["end_state"]
    print(f"  end       active streams {end['active_streams']:g}, engine requests {end['engine_unfinished']:g}, "
          f"health {'OK' if end['health']['ok'] else end['health']}")
    print(f"{'PASS' if r['passed'] else 'FAIL'}" + "".join(f"\n  - {w}" for w in r["failures"])
          + f"\nwrote {out} ({r['wall_s']:.0f} s)")


def _fmt(v: float | None) -> str:
    return "   n/a" if v is None else f"{v:+6.0f}"


if __name__ == "__main__":
    sys.exit(main())
