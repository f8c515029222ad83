"""The decode scheduler shared by every stream, on one dedicated thread: continuous batching of steps.

Each stream has at most one row queued or decoding; a stream with new frames submits its next row
as soon as its last one is back. Loop: block for work only when idle; gather rows until the batch
is full or the first one has waited max_wait; decode them in one step; hand each row's PCM back to
the event loop that asked. The asyncio side never waits on the model, only on futures.

A step that raises is retried row by row, so only the row that fails fails: the streaming decoder
writes state back only after a whole forward succeeded, so a retry starts from the same state.
State slots are handed out on the event loop and taken back here, in queue order, after every row
their stream submitted is done (a slot reused sooner could share a step with its old stream's row).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .metrics import SnacMetrics
from .runner import DecoderRunner
from .session import Row, StreamStep

log = logging.getLogger(__name__)


class WarmUpFailed(RuntimeError):
    """The decoder could not warm up (graph capture, a bad device): the server must not start."""


@dataclass
class DecodeJob:
    """A row waiting to be decoded and the future its stream awaits."""

    row: Row
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    enqueued: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class _Release:
    """Take a slot back once everything queued before it is done."""

    slot: int


class SlotPool:
    """The streaming decoder's state slots: taken on the event loop, given back on the decode thread."""

    def __init__(self, size: int) -> None:
        self._free = list(range(size - 1, -1, -1))  # a stack: low slots first, so few pages are ever touched
        self._lock = threading.Lock()
        self.size = size

    def acquire(self) -> int | None:
        """A free slot, or None when every slot holds a stream."""
        with self._lock:
            return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def in_use(self) -> int:
        with self._lock:
            return self.size - len(self._free)


def _resolve(results: list[tuple[asyncio.Future, np.ndarray | BaseException]]) -> None:
    for future, result in results:
        if future.done():  # the stream went away while its row was decoding
            continue
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)


def _hand_back(jobs: list[DecodeJob], results: list[np.ndarray | BaseException]) -> None:
    """Resolve the jobs' futures on their event loops: one wake-up of each loop for all of its rows,
    not one per row (each call_soon_threadsafe writes the loop's self-pipe: a syscall on both sides)."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for job, result in zip(jobs, results):
        by_loop.setdefault(job.loop, []).append((job.future, result))
    for loop, pairs in by_loop.items():
        try:
            loop.call_soon_threadsafe(_resolve, pairs)
        except RuntimeError:  # that event loop is closed
            pass


class MicroBatcher:
    """Owns the decode thread. submit() is called from the event loop; results come back as futures."""

    def __init__(self, runner: DecoderRunner, max_batch: int, max_wait_s: float, metrics: SnacMetrics) -> None:
        self._runner = runner
        self._max_batch = max_batch
        self._max_wait_s = max_wait_s
        self._metrics = metrics
        self.slots = SlotPool(runner.streaming.num_slots)
        metrics.slots_in_use.set_function(self.slots.in_use)
        self._queue: queue.SimpleQueue[DecodeJob | _Release | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="snac-decode", daemon=True)
        self._warmed_up = threading.Event()
        self._warm_up_error: BaseException | None = None

    def start(self) -> None:
        """Start the decode thread; it warms up the runner before taking any work."""
        self._thread.start()

    def wait_ready(self) -> None:
        """Block until warm-up is done; raise WarmUpFailed if it failed (the thread has then exited)."""
        self._warmed_up.wait()
        if self._warm_up_error is not None:
            raise WarmUpFailed(f"decoder warm-up failed: {self._warm_up_error!r}") from self._warm_up_error

    def stop(self) -> None:
        """Ask the thread to finish what is queued and exit; wait for it."""
        self._queue.put(None)
        self._thread.join()

    def submit(self, row: Row) -> asyncio.Future:
        """Queue a row; the returned future resolves to its float32 PCM."""
        loop = asyncio.get_running_loop()
        job = DecodeJob(row, loop.create_future(), loop)
        self._queue.put(job)
        return job.future

    def release_slot(self, slot: int) -> None:
        """A stream is done with its slot: it goes back after the stream's queued rows."""
        self._queue.put(_Release(slot))

    def _loop(self) -> None:
        try:
            self._runner.bind_thread()  # CUDA's current device is per thread: this one's must be the runner's
            self._runner.warm_up()
        except BaseException as exc:  # handed to wait_ready(): a server must never wait forever for this thread
            self._warm_up_error = exc
            return
        finally:
            self._warmed_up.set()
        while True:
            first = self._queue.get()  # block only when idle
            if first is None:
                return
            if isinstance(first, _Release):  # nothing of its stream is left in the queue
                self.slots.release(first.slot)
                continue
            jobs, releases, stopping = self._gather(first)
            self._step(jobs)
            for release in releases:
                self.slots.release(release.slot)
            if stopping:
                return

    def _gather(self, first: DecodeJob) -> tuple[list[DecodeJob], list[_Release], bool]:
        """Collect jobs until the batch is full or the first one has waited max_wait."""
        jobs, releases = [first], []
        deadline = first.enqueued + self._max_wait_s
        while len(jobs) < self._max_batch:
            try:
                item = self._queue.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                break
            if item is None:
                return jobs, releases, True
            if isinstance(item, _Release):
                releases.append(item)
            else:
                jobs.append(item)
        return jobs, releases, False

    def _step(self, jobs: list[DecodeJob]) -> None:
        """Decode one batch and hand every row's result back; a failure is retried row by row."""
        jobs = [j for j in jobs if not j.future.cancelled()]
        if not jobs:
            return
        started = time.perf_counter()
        for job in jobs:
            self._metrics.queue_wait.observe(started - job.enqueued)
        frames = sum(len(j.row.codes) if isinstance(j.row, StreamStep) else len(j.row.frames) for j in jobs)
        self._metrics.count_step(len(jobs), frames)
        done: set[int] = set()

        def publish(indices: list[int], pcms: list[np.ndarray]) -> None:
            done.update(indices)
            _hand_back([jobs[i] for i in indices], pcms)

        try:
            self._runner.decode([j.row for j in jobs], publish)
        except Exception:  # find the row that fails; the others' state was not touched
            log.exception("decode step of %d rows failed; retrying them one by one", len(jobs) - len(done))
            for i, job in enumerate(jobs):
                if i not in done:
                    self._decode_alone(job)
        self._metrics.step_latency.observe(time.perf_counter() - started)

    def _decode_alone(self, job: DecodeJob) -> None:
        try:
            self._runner.decode([job.row], lambda _, pcms: _hand_back([job], pcms[:1]))
        except Exception as exc:
            log.error("decode of one stream's row failed: %s", exc)
            _hand_back([job], [exc])
