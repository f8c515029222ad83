"""The micro-batch scheduler shared by every stream, on one dedicated decode thread.

Loop: block for work only when idle; gather rows until the batch is full or the oldest
row has waited max_wait; decode them in one step; publish each row's PCM back to the
event loop that asked. The asyncio side never waits on the model, only on futures.
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
from .session import DecodeRow

log = logging.getLogger(__name__)


class WarmUpFailed(RuntimeError):
    """The decoder could not warm up (graph capture, a bad device): the server must not start."""


@dataclass
class DecodeJob:
    """A row waiting to be decoded and the future its stream awaits."""

    row: DecodeRow
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    enqueued: float = field(default_factory=time.perf_counter)


def _resolve(future: asyncio.Future, result: np.ndarray | BaseException) -> None:
    if future.done():  # the stream went away while its row was decoding
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


class MicroBatcher:
    """Owns the decode thread. submit() is called from the event loop; results come back as futures."""

    def __init__(self, runner: DecoderRunner, max_batch: int, max_wait_s: float, metrics: SnacMetrics) -> None:
        self._runner = runner
        self._max_batch = max_batch
        self._max_wait_s = max_wait_s
        self._metrics = metrics
        self._queue: queue.SimpleQueue[DecodeJob | None] = queue.SimpleQueue()
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

    def submit(self, row: DecodeRow) -> asyncio.Future:
        """Queue a row; the returned future resolves to its float32 PCM."""
        loop = asyncio.get_running_loop()
        job = DecodeJob(row, loop.create_future(), loop)
        self._queue.put(job)
        return job.future

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
            jobs, stopping = self._gather(first)
            self._step(jobs)
            if stopping:
                return

    def _gather(self, first: DecodeJob) -> tuple[list[DecodeJob], bool]:
        """Collect jobs until the batch is full or the first one has waited max_wait."""
        jobs = [first]
        deadline = first.enqueued + self._max_wait_s
        while len(jobs) < self._max_batch:
            try:
                job = self._queue.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                break
            if job is None:
                return jobs, True
            jobs.append(job)
        return jobs, False

    def _step(self, jobs: list[DecodeJob]) -> None:
        """Decode one batch and publish every row's result (or the error) to its loop."""
        jobs = [j for j in jobs if not j.future.cancelled()]
        if not jobs:
            return
        started = time.perf_counter()
        for job in jobs:
            self._metrics.queue_wait.observe(started - job.enqueued)
        published = [False] * len(jobs)

        def publish(indices: list[int], pcms: list[np.ndarray]) -> None:
            for i, pcm in zip(indices, pcms):
                published[i] = True
                _hand_back(jobs[i], pcm)

        try:
            self._runner.decode([j.row for j in jobs], publish)
        except Exception as exc:  # a model failure fails this batch's streams, not the server
            log.exception("decode step failed")
            for job, done in zip(jobs, published):
                if not done:
                    _hand_back(job, exc)
        self._metrics.observe_step(len(jobs), sum(j.row.keep_end - j.row.keep_start for j in jobs), started)


def _hand_back(job: DecodeJob, result: np.ndarray | BaseException) -> None:
    """Resolve the job's future on its own event loop (thread-safe)."""
    try:
        job.loop.call_soon_threadsafe(_resolve, job.future, result)
    except RuntimeError:  # that stream's event loop is closed
        pass
