"""The decode scheduler shared by every stream, on one dedicated thread: continuous batching of steps.

Each stream has at most one row queued or decoding; a stream with new frames submits its next row
as soon as its last one is back, with the time its listener needs that audio (its due time). Loop: block
for work only when idle; gather rows until the batch is full, every stream's row is in, or the first one has
waited max_wait; decode in one step the rows due first, up to max_batch rows and one forward's frames (the runner's
max_step_frames), the rest staying queued for the next step; hand each row's PCM back to the event loop that asked.
The asyncio side never waits on the model, only on futures.

Due first, not first come: a stream far ahead of its listener asks for its next frames as soon as its last
row is back, so in arrival order every step decoded a row of every stream, and a new stream's first audio
waited a whole round (on two CPU cores beside the engine, 16 streams' rounds of 16 frames took seconds: its
first audio past a 5 s target while the others were seconds ahead). Earliest due first gives it the next step.

A step that raises is retried row by row, so only the row that fails fails: the streaming decoder
writes state back only after a whole forward succeeded, so a retry starts from the same state.
State slots are handed out on the event loop and taken back here, in queue order, after every row
their stream submitted is done (a slot reused sooner could share a step with its old stream's row).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
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
    due: float | None = None  # when the stream's listener needs this row's audio (perf_counter); None: its arrival

    def __post_init__(self) -> None:
        if self.due is None:
            self.due = self.enqueued

    @property
    def frames(self) -> int:
        return len(self.row.codes) if isinstance(self.row, StreamStep) else len(self.row.frames)

    @property
    def slot(self) -> int | None:
        return self.row.slot if isinstance(self.row, StreamStep) else None


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


class _Waiting:
    """The rows queued for the decode thread, due first, and the slots to give back once their rows are done."""

    def __init__(self) -> None:
        self.jobs: list[tuple[float, int, DecodeJob]] = []  # a heap by due time, then arrival
        self._order = itertools.count()
        self._releases: list[int] = []

    def take(self, item: DecodeJob | _Release | None) -> bool:
        """One item from the queue; True for stop()'s None."""
        if item is None:
            return True
        if isinstance(item, _Release):
            self._releases.append(item.slot)
        else:
            heapq.heappush(self.jobs, (item.due, next(self._order), item))
        return False

    def every_stream_in(self, slots_in_use: int) -> bool:
        """Whether every slot in use has its stream's row queued or waits to go back (its stream ended): no other row
        can come before this step (a stream has one row at a time), only a new stream's. Reference windows hold no
        slot, so a queue with one never is."""
        slots = set(self._releases)
        for _, _, job in self.jobs:
            if job.slot is None:
                return False
            slots.add(job.slot)
        return len(slots) >= slots_in_use

    @property
    def first_enqueued(self) -> float:
        return min((job.enqueued for _, _, job in self.jobs), default=time.perf_counter())

    def due_first(self, max_rows: int, max_frames: int) -> list[DecodeJob]:
        """The rows due first, up to max_rows and max_frames (0: no bound) together; the first always."""
        jobs: list[DecodeJob] = []
        frames = 0
        while self.jobs and len(jobs) < max_rows:
            job = self.jobs[0][2]
            if jobs and max_frames and frames + job.frames > max_frames:
                break
            heapq.heappop(self.jobs)
            jobs.append(job)
            frames += job.frames
        return jobs

    def releasable(self) -> list[int]:
        """The slots released whose stream has no row waiting any more (their release came after its last)."""
        if not self._releases:
            return []
        held = {job.slot for _, _, job in self.jobs}
        free = [slot for slot in self._releases if slot not in held]
        self._releases = [slot for slot in self._releases if slot in held]
        return free


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

    def submit(self, row: Row, due: float | None = None) -> asyncio.Future:
        """Queue a row, needed by `due` (perf_counter; None: now); the returned future resolves to its float32 PCM."""
        loop = asyncio.get_running_loop()
        job = DecodeJob(row, loop.create_future(), loop, due=due)
        self._queue.put(job)
        return job.future

    def release_slot(self, slot: int) -> None:
        """A stream is done with its slot: it goes back after the stream's queued rows."""
        self._queue.put(_Release(slot))

    def _loop(self) -> None:
        try:
            self._runner.bind_thread()  # CUDA's current device is per thread: this one's must be the runner's
            self._runner.warm_up()
            self._metrics.compiled_step.set(int(getattr(self._runner, "compiled", False)))  # a benchmark's double has none
        except BaseException as exc:  # handed to wait_ready(): a server must never wait forever for this thread
            self._warm_up_error = exc
            return
        finally:
            self._warmed_up.set()
        waiting = _Waiting()
        stopping = False
        while not (stopping and not waiting.jobs):
            if not waiting.jobs:
                stopping = waiting.take(self._queue.get())  # block only when idle
            if waiting.jobs:
                stopping = self._gather(waiting) or stopping
                self._step(waiting.due_first(self._max_batch, self._runner.max_step_frames))
            for slot in waiting.releasable():
                self.slots.release(slot)

    def _gather(self, waiting: _Waiting) -> bool:
        """Take what was queued meanwhile, and more until the batch is full, every stream's row is in, or the
        longest-waiting row has waited max_wait (rows left from the last step have: no wait). Returns whether stop()
        was called."""
        deadline = waiting.first_enqueued + self._max_wait_s
        stopping = False
        while not stopping:
            wait = len(waiting.jobs) < self._max_batch and not waiting.every_stream_in(self.slots.in_use())
            timeout = deadline - time.perf_counter() if wait else 0.0
            try:
                item = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            stopping = waiting.take(item)
        return stopping

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
