"""DecoderRunner on CPU: steps split under max_step_frames change nothing but the forwards; the
decode thread runs on the decoder's GPU; a step that raises fails only its own row."""

import asyncio
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import random_frames
from processes import TEST_CODEC
from orpheus_common.sync_detector import host_syncs
from snac_server.batcher import DecodeJob, MicroBatcher, _Release, _Waiting
from snac_server.codec_model import build_decoder
from snac_server.metrics import SnacMetrics
from snac_server.runner import CPU_STEP_FRAMES, DecoderRunner
from snac_server.session import StreamStep, Window
from snac_server.streaming import OPEN_END, StreamingDecoder

BUCKETS = (1, 2, 4, 8, 16)


@pytest.fixture(scope="module")
def decoder():
    """The small test codec: how the runner splits, shares and fails steps does not depend on the width."""
    return build_decoder(TEST_CODEC, "cpu", "float32", max_batch=8)


@pytest.fixture(scope="module")
def streaming(decoder):
    return StreamingDecoder(decoder, num_slots=16)


def runner_of(decoder, streaming, **kw) -> DecoderRunner:
    kw = {"max_batch": 8, "frame_buckets": BUCKETS, "cuda_graphs": False, **kw}
    return DecoderRunner(decoder, streaming, **kw)


def steps(n: int, frames: int) -> list[StreamStep]:
    return [StreamStep(i, random_frames(frames, seed=i).astype(np.int32), 10 * i, OPEN_END, 100 + i, True) for i in range(n)]


def decode_all(runner: DecoderRunner, rows) -> tuple[list[np.ndarray], list[list[int]]]:
    out: list = [None] * len(rows)
    calls: list[list[int]] = []

    def publish(indices, pcms):
        calls.append(list(indices))
        for i, pcm in zip(indices, pcms):
            out[i] = pcm

    runner.decode(rows, publish)
    return out, calls


def test_cpu_default_caps_frames_per_forward(decoder, streaming):
    runner = runner_of(decoder, streaming, max_batch=32, cuda_graphs=True)
    assert runner.max_step_frames == CPU_STEP_FRAMES and not runner.use_graphs
    assert runner.rows_per_forward(16) == CPU_STEP_FRAMES // 16
    assert runner.rows_per_forward(1) == min(32, CPU_STEP_FRAMES)  # one-frame rows: the frame cap binds first on CPU
    assert runner_of(decoder, streaming, max_step_frames=8).rows_per_forward(16) == 1


def test_split_step_gives_the_same_audio_and_hands_rows_back_per_forward(decoder, streaming):
    rows = steps(5, 4)
    whole, _ = decode_all(runner_of(decoder, streaming, max_step_frames=10_000), rows)
    split, calls = decode_all(runner_of(decoder, streaming, max_step_frames=8), rows)  # 2 rows a forward
    assert calls == [[0, 1], [2, 3], [4]]
    for e, g in zip(whole, split):
        assert g.shape == (4 * 2048,)
        np.testing.assert_allclose(g, e, atol=1e-4)


def test_rows_of_each_shape_share_a_forward(decoder, streaming):
    rows = [*steps(2, 1), Window(random_frames(4, seed=1).astype(np.int32), 0, 3), *steps(1, 2)]
    out, calls = decode_all(runner_of(decoder, streaming), rows)
    assert sorted(calls) == [[0, 1], [2], [3]]
    assert [len(p) for p in out] == [2048, 2048, 4 * 2048, 2 * 2048]


def test_the_forward_as_dispatched_never_syncs(decoder, streaming):
    """The runner's per-forward path between staging and the one read-back (a graph replay on GPU)."""
    runner = runner_of(decoder, streaming)
    args = runner._stage("step", steps(3, 2))
    assert host_syncs(runner._forward, "step", 2, args) == []


class FailsOnSeed:
    """A test double of the streaming decoder that raises on any step holding one stream's seed."""

    def __init__(self, inner: StreamingDecoder, seed: int) -> None:
        self.inner, self.seed, self.num_slots = inner, seed, inner.num_slots

    def __call__(self, slots, codes, frame0, end, seeds, fresh):
        if (seeds == self.seed).any():
            raise RuntimeError("scripted failure of one stream's row")
        return self.inner(slots, codes, frame0, end, seeds, fresh)


async def test_a_step_that_raises_fails_only_the_row_that_caused_it(decoder, streaming):
    rows = steps(4, 1)
    expected, _ = decode_all(runner_of(decoder, StreamingDecoder(decoder, num_slots=16)), rows)
    runner = runner_of(decoder, FailsOnSeed(streaming, seed=102))
    batcher = MicroBatcher(runner, max_batch=8, max_wait_s=0.2, metrics=SnacMetrics())
    batcher.start()
    batcher.wait_ready()
    try:
        results = await asyncio.gather(*(batcher.submit(r) for r in rows), return_exceptions=True)
    finally:
        batcher.stop()
    assert isinstance(results[2], RuntimeError)
    for i in (0, 1, 3):
        np.testing.assert_allclose(results[i], expected[i], atol=1e-6)


@pytest.mark.parametrize("device, main_threads_gpu, bound_to", [("cuda:1", 0, 1), ("cuda", 0, 0), ("cuda", 2, 2)])
def test_the_decode_thread_makes_the_decoders_gpu_its_current_device(monkeypatch, device, main_threads_gpu, bound_to):
    """On cuda:N the decode thread must not run on device 0 (a new thread's default): streams,
    graph capture and the memory pool all follow the current device. A bare `cuda` (what every entry
    point passes) is the GPU current where the runner is built; torch.cuda.set_device's own argument
    check runs (it refuses an index-less device), only the driver call is recorded."""
    bound: list[tuple[str, int]] = []
    monkeypatch.setattr(torch._C, "_cuda_setDevice", lambda i: bound.append((threading.current_thread().name, i)),
                        raising=False)  # a CPU build has no CUDA bindings: the recorder stands in for the driver call
    monkeypatch.setattr(torch.cuda, "current_device", lambda: main_threads_gpu)
    on_gpu = SimpleNamespace(device=torch.device(device))  # test doubles: a decoder placed on `device`...
    runner = DecoderRunner(on_gpu, SimpleNamespace(num_slots=1), max_batch=1, frame_buckets=BUCKETS, cuda_graphs=True)
    monkeypatch.setattr(runner, "warm_up", lambda: None)
    batcher = MicroBatcher(runner, 1, 0.0, SnacMetrics())
    batcher.start()
    batcher.wait_ready()
    batcher.stop()
    assert bound == [("snac-decode", bound_to)]


def test_on_a_gpu_no_graph_holds_more_frames_than_a_full_step_of_one_frame_rows(monkeypatch):
    """A graph's memory grows with its frames: capturing 256 rows of 16 frames took a 52 GiB pool on an
    H200 (benchmarks/results/gpu-first-contact-h200-run1.json). On a GPU a forward holds at most
    max_batch frames, and only the batch sizes decode can send a shape are captured."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    on_gpu = SimpleNamespace(device=torch.device("cuda", 0))  # test double: a decoder placed on a GPU
    runner = DecoderRunner(on_gpu, SimpleNamespace(num_slots=256), max_batch=256, frame_buckets=BUCKETS, cuda_graphs=True)
    ladders = runner.graph_ladders()
    assert runner.max_step_frames == 256 and set(ladders) == {1, 2, 4, 8, 16}
    assert {n: max(sizes) for n, sizes in ladders.items()} == {1: 256, 2: 128, 4: 64, 8: 32, 16: 16}
    assert max(n * max(sizes) for n, sizes in ladders.items()) == 256


async def test_a_steps_frames_are_counted_before_its_audio_is_handed_back(decoder):
    """A client holding its audio finds the frames counted: CI once read the counter as its stream
    ended and missed the last step, which was counted only after the hand-back."""
    runner = runner_of(decoder, StreamingDecoder(decoder, num_slots=16))
    step_may_return = threading.Event()
    decode = runner.decode

    def decode_then_hold(rows, publish):  # the decode thread, late after handing back: a busy machine's timing
        decode(rows, publish)
        step_may_return.wait(timeout=30)

    runner.decode = decode_then_hold
    metrics = SnacMetrics()
    batcher = MicroBatcher(runner, max_batch=8, max_wait_s=0.0, metrics=metrics)
    batcher.start()
    batcher.wait_ready()
    try:
        pcm = await batcher.submit(steps(1, 3)[0])
        counted = metrics.registry.get_sample_value("snac_decoded_frames_total")
    finally:
        step_may_return.set()
        batcher.stop()
    assert pcm.shape == (3 * 2048,) and counted == 3


class RecordsSteps:
    """A test double of DecoderRunner: records each step's rows (by seed) and holds the first step until told, so
    that rows queue behind it; PCM of the right length (zeros)."""

    max_step_frames = CPU_STEP_FRAMES

    def __init__(self) -> None:
        self.streaming = SimpleNamespace(num_slots=16)
        self.steps: list[list[int]] = []
        self.first_step_may_end = threading.Event()
        self.first_step_started = threading.Event()

    def bind_thread(self) -> None:
        pass

    def warm_up(self) -> None:
        pass

    def decode(self, rows, publish) -> None:
        self.steps.append([r.seed for r in rows])
        if len(self.steps) == 1:
            self.first_step_started.set()
            self.first_step_may_end.wait(timeout=30)
        publish(list(range(len(rows))), [np.zeros(len(r.codes) * 2048, np.float32) for r in rows])


async def test_the_rows_due_first_are_decoded_first_one_forwards_frames_a_step():
    """Eight streams far ahead of their listeners queue 16-frame rows; a new stream's first row (due now) queues
    last. It goes into the next step, and each step holds one forward's frames (CPU_STEP_FRAMES), the rest due
    first after it: in arrival order, the new stream's first audio waited for every other stream's row (a
    round: seconds on a busy CPU, its time to first audio past the target, issue 43)."""
    runner = RecordsSteps()
    batcher = MicroBatcher(runner, max_batch=32, max_wait_s=0.0, metrics=SnacMetrics())
    batcher.start()
    batcher.wait_ready()
    now = time.perf_counter()

    def row(seed: int, frames: int) -> StreamStep:
        return StreamStep(seed, np.zeros((frames, 7), np.int32), 0, OPEN_END, seed, False)

    try:
        first = batcher.submit(row(0, 1))
        await asyncio.to_thread(runner.first_step_started.wait, 30)
        ahead = [batcher.submit(row(seed, 16), due=now + 100.0 - seed) for seed in range(1, 9)]  # 8 due last
        new = batcher.submit(row(9, 4), due=now)
        runner.first_step_may_end.set()
        await asyncio.wait_for(asyncio.gather(first, new, *ahead), timeout=30)
    finally:
        runner.first_step_may_end.set()
        batcher.stop()
    assert runner.steps == [[0], [9], [8], [7], [6], [5], [4], [3], [2], [1]]


async def test_a_row_without_a_due_time_is_due_when_it_came_and_one_of_a_frame_each_share_a_step():
    runner = RecordsSteps()
    batcher = MicroBatcher(runner, max_batch=32, max_wait_s=0.0, metrics=SnacMetrics())
    batcher.start()
    batcher.wait_ready()
    try:
        first = batcher.submit(StreamStep(0, np.zeros((1, 7), np.int32), 0, OPEN_END, 0, False))
        await asyncio.to_thread(runner.first_step_started.wait, 30)
        later = [batcher.submit(StreamStep(s, np.zeros((1, 7), np.int32), 0, OPEN_END, s, False)) for s in range(1, 21)]
        runner.first_step_may_end.set()
        await asyncio.wait_for(asyncio.gather(first, *later), timeout=30)
    finally:
        runner.first_step_may_end.set()
        batcher.stop()
    assert runner.steps == [[0], list(range(1, 17)), list(range(17, 21))]  # arrival order, 16 frames a step


async def test_a_step_starts_once_every_stream_holding_a_slot_has_its_row_in():
    """A stream has one row at a time: once every stream holding a slot has queued its row, waiting on (max_wait)
    only delays them all (5 ms a step of ~135 ms in snac_tier's trickle on this CPU). Before, each step waited out
    max_wait: here a minute, past the test's 30 s."""
    runner = RecordsSteps()
    runner.first_step_may_end.set()
    batcher = MicroBatcher(runner, max_batch=32, max_wait_s=60.0, metrics=SnacMetrics())
    batcher.start()
    batcher.wait_ready()
    a, b, c = (batcher.slots.acquire() for _ in range(3))

    def row(slot: int) -> StreamStep:
        return StreamStep(slot, np.zeros((1, 7), np.int32), 0, OPEN_END, slot, False)

    try:
        first = [batcher.submit(row(a)), batcher.submit(row(b))]
        await asyncio.sleep(0.2)  # c's stream holds a slot: its row is waited for
        first.append(batcher.submit(row(c)))
        await asyncio.wait_for(asyncio.gather(*first), timeout=30)
        batcher.release_slot(c)  # c's stream ended: a and b are every stream left
        await asyncio.wait_for(asyncio.gather(batcher.submit(row(a)), batcher.submit(row(b))), timeout=30)
    finally:
        batcher.stop()
    assert runner.steps == [[a, b, c], [a, b]]


def test_a_queue_holding_a_reference_window_never_has_every_stream_in():
    """Windows hold no slot: the streams they come from cannot be counted, so they wait for company as before."""
    waiting = _Waiting()
    waiting.take(DecodeJob(Window(np.zeros((4, 7), np.int32), 0, 0), None, None))
    assert not waiting.every_stream_in(slots_in_use=0)
    waiting = _Waiting()
    waiting.take(DecodeJob(StreamStep(0, np.zeros((1, 7), np.int32), 0, OPEN_END, 0, False), None, None))
    assert waiting.every_stream_in(slots_in_use=1) and not waiting.every_stream_in(slots_in_use=2)
    waiting.take(_Release(0))  # slot 0's stream ended, its row still queued: one slot, not two
    assert waiting.every_stream_in(slots_in_use=1) and not waiting.every_stream_in(slots_in_use=2)
    waiting.take(_Release(1))  # slot 1's stream ended with nothing queued: it sends nothing more
    assert waiting.every_stream_in(slots_in_use=2)


class CopyDone:
    """A test double of the CUDA event recorded after a forward's PCM copy: it notes when the host waits on it."""

    def __init__(self, events: list) -> None:
        self.events = events

    def synchronize(self) -> None:
        self.events.append(("waited", None))


def test_a_gpus_forward_is_handed_back_once_the_next_forward_is_launched(decoder, streaming):
    """Host work beside the GPU's (issue 45): a step's next forward is staged and launched before the host waits
    for the last one's PCM and hands it out; the last forward's at the end. (A GPU's path, its event a double.)"""
    runner = runner_of(decoder, streaming, max_step_frames=8)  # 2 rows of 4 frames a forward
    events: list[tuple[str, object]] = []
    launch = runner._forward

    def logged(kind, n, args):
        events.append(("forward", args[0].shape[0]))
        return launch(kind, n, args)

    runner._forward = logged
    runner._to_host = lambda audio: (audio, CopyDone(events))
    runner.decode(steps(5, 4), lambda part, pcms: events.append(("handed back", list(part))))
    assert events == [("forward", 2), ("forward", 2), ("waited", None), ("handed back", [0, 1]), ("forward", 1),
                      ("waited", None), ("handed back", [2, 3]), ("waited", None), ("handed back", [4])]


def test_a_cpus_forward_is_handed_back_at_once(decoder, streaming):
    """A CPU's forward is done when it returns: holding its rows for the next forward would only delay them."""
    runner = runner_of(decoder, streaming, max_step_frames=8)
    events: list[tuple[str, object]] = []
    launch = runner._forward
    runner._forward = lambda kind, n, args: events.append(("forward", args[0].shape[0])) or launch(kind, n, args)
    runner.decode(steps(5, 4), lambda part, pcms: events.append(("handed back", list(part))))
    assert events == [("forward", 2), ("handed back", [0, 1]), ("forward", 2), ("handed back", [2, 3]), ("forward", 1),
                      ("handed back", [4])]


def test_a_forward_that_raises_still_hands_back_the_forward_before_it(decoder, streaming):
    runner = runner_of(decoder, streaming, max_step_frames=8)
    launch, calls = runner._forward, []

    def second_fails(kind, n, args):
        calls.append(n)
        if len(calls) == 2:
            raise RuntimeError("scripted failure of the second forward")
        return launch(kind, n, args)

    runner._forward = second_fails
    handed: list[list[int]] = []
    with pytest.raises(RuntimeError, match="second forward"):
        runner.decode(steps(5, 4), lambda part, pcms: handed.append(list(part)))
    assert handed == [[0, 1]]
