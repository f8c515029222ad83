"""The load: N closed-loop streams (or Poisson arrivals) on /v1/audio/speech, every chunk timed.

Closed loop: stream i starts at i * stagger / N, sends a request, reads it to its end, sends the
next; after a refusal, once the Retry-After passed, with its count of refusals in a row as the openai SDK
counts its retries (RETRY_COUNT). Requests sent before the warm-up is over are not counted. The measuring window then stays
open for `window_s`, and at least until every stream has sent a counted request; the requests sent
inside it are the level's sample. The streams keep the load on (their later requests are not
counted) until every counted request has ended, then everything still open is cancelled.

A level ends early once its counted requests already miss a target for certain (a stream ran
dry, errors past the allowed share, too many slow first audios): on a slow CPU a failing level
would otherwise take minutes to run to its end. A level told not to (`fail_early=False`: an
overload level, which its refusals fail at once, is judged by other figures) runs its course.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from orpheus_common.http import RETRY_COUNT

from . import metrics
from .corpus import Corpus
from .metrics import Chunk, Counts, Targets, Timeline

REFUSED = (429, 503)  # statuses of a request the server refused (at its limit; no worker reachable)

WAV_HEADER_BYTES = 44


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible speech endpoint and what each request asks of it."""

    name: str
    url: str  # base URL: http://host:port
    model: str = "orpheus"
    voice: str = "tara"
    response_format: str = "pcm"  # pcm | wav (the 44-byte header is skipped)
    api_key: str | None = None
    send_seed: bool = True  # `seed` is this stack's extension; strict OpenAI-compatible servers may refuse it

    def __post_init__(self) -> None:
        if self.response_format not in ("pcm", "wav"):
            raise ValueError("response_format must be pcm or wav: audio bytes must map to audio seconds")

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, text: str, seed: int) -> dict[str, Any]:
        """The JSON of one POST /v1/audio/speech."""
        body = {"model": self.model, "input": text, "voice": self.voice, "response_format": self.response_format}
        if self.send_seed:
            body["seed"] = seed
        return body


@dataclass(frozen=True)
class LoadShape:
    """How a level is driven and for how long."""

    mode: str = "closed"  # closed | poisson
    stagger_s: float = 3.0  # closed: starts spread over this
    warmup_s: float = 10.0  # requests sent before t0 + warmup_s are not counted
    window_s: float = 60.0  # counted requests are those sent in [warm-up end, window close)
    max_level_s: float = 900.0  # counted requests still open then are failures
    read_timeout_s: float = 120.0  # longest silence inside one response
    retry_s: float = 0.5  # closed: pause after a request that failed or was refused
    rate: float = 1.0  # poisson: arrivals per second
    max_in_flight: int = 4096  # poisson: arrivals past this fail at the client
    seed: int = 1234
    audible_threshold: int = 328  # |sample| >= this (-40 dBFS) is audible

    def __post_init__(self) -> None:
        if self.mode not in ("closed", "poisson"):
            raise ValueError(f"mode must be closed or poisson, not {self.mode!r}")
        if min(self.stagger_s, self.warmup_s, self.window_s) < 0 or self.max_level_s <= 0 or self.rate <= 0:
            raise ValueError("stagger, warm-up and window must be >= 0; max_level_s and rate > 0")


@dataclass
class Request:
    """One request's client-side record; times are perf_counter seconds."""

    stream: int
    seq: int
    utterance: str
    counted: bool
    sent_s: float
    chunks: list[Chunk] = field(default_factory=list)
    status: int | None = None
    ended_s: float | None = None
    completed: bool = False
    error: str | None = None
    cut: bool = False  # still open when the level ended (cancelled, never judged)
    audible_offset: int | None = None  # audio byte offset of the first audible sample
    audio_bytes: int = 0
    pcm: bytearray | None = None  # the audio itself, kept only when set to a bytearray (soak's replay check)
    _scanned: int = 0
    _tail: bytes = b""
    _counts: Counts | None = None  # cached once ended

    def feed(self, t: float, data: bytes, threshold: int) -> None:
        self.chunks.append((t, len(data)))
        self.audio_bytes += len(data)
        if self.pcm is not None:
            self.pcm += data
        if self.audible_offset is not None:
            return
        buf = self._tail + data
        usable = len(buf) - len(buf) % metrics.SAMPLE_BYTES
        index = metrics.first_audible_sample(buf, threshold)  # it ignores the odd trailing byte
        if index is not None:
            self.audible_offset = self._scanned + index * metrics.SAMPLE_BYTES
        self._scanned += usable
        self._tail = buf[usable:]

    def timeline(self) -> Timeline:
        return Timeline(self.sent_s, tuple(self.chunks), self.ended_s, self.completed, self.error)

    def counts(self, targets: Targets, now: float) -> Counts:
        """This request's certain misses at `now` (fixed once it has ended)."""
        if self._counts is not None:
            return self._counts
        c = metrics.count([self.timeline()], targets, now)
        if self.ended_s is not None:
            self._counts = c
        return c


@dataclass
class LevelRun:
    """Everything one run of one level produced."""

    endpoint: str
    n: int
    run: int
    mode: str
    t0: float
    window_open_s: float
    window_close_s: float | None
    ended_by: str  # complete | failed early | time limit
    wall_s: float
    requests: list[Request]
    loop_lag_ms: dict[str, float | None]
    client_cpu_cores: float

    @property
    def counted(self) -> list[Request]:
        return [r for r in self.requests if r.counted]


class Level:
    """One run of one level against one endpoint."""

    def __init__(self, endpoint: Endpoint, shape: LoadShape, targets: Targets, corpus: Corpus, n: int, run: int = 1,
                 progress: Progress | None = None, fail_early: bool = True) -> None:
        self.endpoint, self.shape, self.targets, self.corpus, self.n, self.run = endpoint, shape, targets, corpus, n, run
        self.fail_early = fail_early
        self.progress = progress or Progress(f"{endpoint.name} N={n}")
        self.requests: list[Request] = []
        self.counted: list[Request] = []
        self.streams_counted: set[int] = set()
        self.stop = asyncio.Event()
        self.t0 = self.t_open = 0.0
        self.closed_at: float | None = None
        self.retry_after: dict[int, float] = {}

    async def run_level(self) -> LevelRun:
        self.t0 = time.perf_counter() + 0.05
        self.t_open = self.t0 + self.shape.warmup_s
        cpu0 = time.process_time()
        lag = LoopLag()
        limits = httpx.Limits(max_connections=self.n + 16 if self.shape.mode == "closed" else self.shape.max_in_flight,
                              max_keepalive_connections=self.n + 16 if self.shape.mode == "closed" else 256)
        timeout = httpx.Timeout(connect=10.0, read=self.shape.read_timeout_s, write=10.0, pool=None)
        async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
            lag.start()
            self.tasks: set[asyncio.Task] = set()
            if self.shape.mode == "closed":
                for i in range(self.n):
                    self._spawn(self._stream(client, i, self.t0 + self.shape.stagger_s * i / self.n))
            else:
                self._spawn(self._arrivals(client))
            ended_by = await self._watch()
            self.stop.set()
            for task in list(self.tasks):
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            lag.stop()
        wall = time.perf_counter() - self.t0
        self.progress.finish()
        return LevelRun(self.endpoint.name, self.n, self.run, self.shape.mode, self.t0, self.t_open - self.t0,
                        None if self.closed_at is None else self.closed_at - self.t0, ended_by, wall,
                        self.requests, lag.summary(), (time.process_time() - cpu0) / wall)

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    # -- traffic ---------------------------------------------------------------------------------

    async def _stream(self, client: httpx.AsyncClient, stream: int, start_at: float) -> None:
        """One closed-loop client: the next request as soon as the last one ended."""
        await _sleep_until(start_at)
        seq = refusals = 0  # refusals since it was last admitted
        while not self.stop.is_set():
            req, text = self._new_request(stream, seq)
            await self._send(client, req, text, refusals)
            seq += 1
            if req.status is not None:
                refusals = refusals + 1 if req.status in REFUSED else 0
            if not req.completed and not self.stop.is_set():  # refused or failed: do not hammer
                await asyncio.sleep(self.retry_after.pop(stream, self.shape.retry_s))

    async def _arrivals(self, client: httpx.AsyncClient) -> None:
        """Open loop: Poisson arrivals at `rate`, each its own request, whatever the server does."""
        rng = random.Random(self.shape.seed * 1000 + self.n)
        due, k = self.t0, 0
        while not self.stop.is_set():
            due += rng.expovariate(self.shape.rate)
            await _sleep_until(due)
            req, text = self._new_request(k, 0)
            k += 1
            if sum(1 for r in self.requests if r.ended_s is None and not r.cut) > self.shape.max_in_flight:
                req.error, req.ended_s = "client in-flight cap reached", time.perf_counter()
                continue
            self._spawn(self._send(client, req, text))

    def _new_request(self, stream: int, seq: int) -> tuple[Request, str]:
        """The record of stream's seq-th request, and the text it speaks."""
        now = time.perf_counter()
        utterance = self.corpus.pick(stream, seq)
        counted = now >= self.t_open and self.closed_at is None
        req = Request(stream, seq, utterance.id, counted, now)
        self.requests.append(req)
        if counted:
            self.counted.append(req)
            self.streams_counted.add(stream)
        return req, utterance.text

    async def _send(self, client: httpx.AsyncClient, req: Request, text: str, retries: int = 0) -> None:
        """POST one utterance and time every chunk of audio until the response ends; `retries`: the client's
        refusals since it was last admitted, sent as the openai SDK counts its retries (RETRY_COUNT)."""
        ep = self.endpoint
        body = ep.body(text, self.shape.seed + req.stream * 1000 + req.seq)
        skip = WAV_HEADER_BYTES if ep.response_format == "wav" else 0
        threshold = self.shape.audible_threshold
        req.sent_s = time.perf_counter()
        try:
            async with client.stream("POST", f"{ep.url}/v1/audio/speech", json=body,
                                     headers={**ep.headers, RETRY_COUNT: str(retries)}) as reply:
                req.status = reply.status_code
                if reply.status_code != 200:
                    detail = (await reply.aread())[:200].decode(errors="replace")
                    req.error = f"HTTP {reply.status_code}: {detail}"
                    self._note_retry_after(req.stream, reply.headers.get("retry-after"))
                else:
                    async for data in reply.aiter_raw():
                        t = time.perf_counter()
                        if skip:
                            cut = min(skip, len(data))
                            data, skip = data[cut:], skip - cut
                        if data:
                            req.feed(t, data, threshold)
                    req.completed = True
        except httpx.HTTPError as exc:
            req.error = f"{type(exc).__name__}: {exc}"[:300]
        except asyncio.CancelledError:
            req.cut = True
            raise
        req.ended_s = time.perf_counter()

    def _note_retry_after(self, stream: int, value: str | None) -> None:
        try:
            self.retry_after[stream] = min(max(float(value), 0.0), 10.0) if value else self.shape.retry_s
        except ValueError:
            self.retry_after[stream] = self.shape.retry_s

    # -- when the level is over -----------------------------------------------------------------

    async def _watch(self) -> str:
        """Close the window when due; end the level when its sample is complete or has already failed."""
        shape, last_check = self.shape, 0.0
        while True:
            await asyncio.sleep(0.1)
            now = time.perf_counter()
            if self.closed_at is None and now >= self.t_open + shape.window_s and (
                    shape.mode == "poisson" or len(self.streams_counted) == self.n):
                self.closed_at = now
            if now >= self.t0 + shape.max_level_s:
                self.closed_at = self.closed_at or now
                for req in self.counted:
                    if req.ended_s is None:
                        req.error, req.ended_s = "still open at the level's time limit", now
                return "time limit"
            if now - last_check < 0.5:
                continue
            last_check = now
            totals = self._live_counts(now)
            self.progress.update(self._status(now, totals))
            if self.closed_at is not None:
                if self.fail_early and self.counted and totals.over(self.targets):
                    return "failed early"
                if all(r.ended_s is not None for r in self.counted):
                    return "complete"

    def _live_counts(self, now: float) -> Counts:
        parts = [r.counts(self.targets, now) for r in self.counted]
        return Counts(len(parts), sum(c.failed for c in parts), sum(c.not_real_time for c in parts),
                      sum(c.slow_first_audio for c in parts))

    def _status(self, now: float, c: Counts) -> str:
        open_ = sum(1 for r in self.requests if r.ended_s is None)
        done = sum(1 for r in self.counted if r.ended_s is not None)
        window = "open" if self.closed_at is None else "closed"
        audio = sum(r.audio_bytes for r in self.requests) / metrics.BYTES_PER_AUDIO_S
        return (f"t={now - self.t0:5.1f}s in flight {open_:3d} | window {window}, counted {c.streams} "
                f"(ended {done}) | failed {c.failed} dry@B {c.not_real_time} slow-first {c.slow_first_audio} "
                f"| audio {audio:.1f}s")


class LoopLag:
    """How late this event loop wakes a 50 ms timer: the client's own load, seen from inside."""

    PERIOD_S = 0.05

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._tick())

    def stop(self) -> None:
        if self._task:
            self._task.cancel()

    async def _tick(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(self.PERIOD_S)
            self.samples.append(time.perf_counter() - t - self.PERIOD_S)

    def summary(self) -> dict[str, float | None]:
        pct = metrics.percentiles(self.samples, (50, 99))
        out = {k: None if v is None else round(v * 1000, 2) for k, v in pct.items()}
        out["max"] = round(max(self.samples) * 1000, 2) if self.samples else None
        return out


class Progress:
    """A live status line on a terminal; a line every 15 s otherwise (logs, CI)."""

    def __init__(self, label: str, stream: Any = sys.stderr) -> None:
        self.label, self.out = label, stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self._last_print = 0.0
        self._shown = False

    def update(self, text: str) -> None:
        line = f"[{self.label}] {text}"
        if self.tty:
            self.out.write("\r" + line[:160].ljust(160))
            self.out.flush()
            self._shown = True
        elif time.perf_counter() - self._last_print >= 15.0:
            self._last_print = time.perf_counter()
            print(line, file=self.out, flush=True)

    def finish(self) -> None:
        if self.tty and self._shown:
            self.out.write("\r" + " " * 160 + "\r")
            self.out.flush()


async def warm_up(endpoint: Endpoint, texts: Sequence[str], at_once: int, read_timeout_s: float) -> None:
    """Untimed requests, `at_once` at a time, so first-request costs stay out of the figures; an endpoint
    that cannot speak stops the run here."""

    async def one(client: httpx.AsyncClient, seed: int, text: str) -> None:
        reply = await client.post(f"{endpoint.url}/v1/audio/speech", json=endpoint.body(text, seed),
                                  headers=endpoint.headers)
        if reply.status_code != 200 or not reply.content:
            raise RuntimeError(f"{endpoint.name}: warm-up request got HTTP {reply.status_code}: {reply.text[:300]}")

    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=read_timeout_s), trust_env=False) as client:
        for k in range(0, len(texts), at_once):
            await asyncio.gather(*(one(client, k + i, text) for i, text in enumerate(texts[k : k + at_once])))


async def _sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
