"""The streaming decoder equals one decode of the whole sequence (fp32, CPU, within 1e-4), whatever
the steps: a frame at a time, random step sizes, many streams at different positions in shared
steps, a resumed stream, streams of 1 to 4 frames. Its step, as a CUDA Graph would capture it,
never syncs with the host."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from codec_contract.audio import FRAME_SAMPLES, RESUME_CONTEXT_FRAMES, STREAMING_DELAY_SAMPLES
from conftest import random_frames
from megapod.sync_detector import host_syncs
from snac_server.codec_model import build_decoder
from snac_server.noise import fold_seed
from snac_server.streaming import OPEN_END, StreamingDecoder, flush_frames

TOLERANCE = 1e-4
SLOTS = 16


@pytest.fixture(scope="module")
def decoder():
    return build_decoder("random-24khz", "cpu", "float32", max_batch=SLOTS)


@pytest.fixture(scope="module")
def streaming(decoder):
    return StreamingDecoder(decoder, num_slots=SLOTS)


class Stream:
    """One stream's frames, fed to the streaming decoder in steps; its samples collected by position."""

    def __init__(self, frames: np.ndarray, seed: int, slot: int, first_frame: int = 0) -> None:
        self.frames, self.seed, self.slot = frames, seed, slot
        self.first = self.fed = first_frame
        self.padded = np.concatenate([frames, np.zeros((flush_frames(STREAMING_DELAY_SAMPLES), 7), frames.dtype)])
        self.samples: dict[int, float] = {}

    @property
    def left(self) -> int:
        return len(self.padded) - self.fed

    def row(self, n: int) -> tuple:
        end = len(self.frames) if self.fed + n > len(self.frames) else OPEN_END
        return self.slot, self.padded[self.fed : self.fed + n], self.fed, end, fold_seed(self.seed), self.fed == self.first

    def take(self, n: int, pcm: np.ndarray, delay: int) -> None:
        start = self.fed * FRAME_SAMPLES - delay
        self.samples.update(zip(range(start, start + len(pcm)), pcm))
        self.fed += n

    def audio(self, from_sample: int = 0) -> np.ndarray:
        return np.array([self.samples[i] for i in range(from_sample, len(self.frames) * FRAME_SAMPLES)], dtype=np.float32)


def step(streaming: StreamingDecoder, streams: list[Stream], n: int) -> None:
    """One shared step: each stream advances n frames."""
    rows = [s.row(n) for s in streams]
    columns = [torch.as_tensor(np.array(c)) for c in zip(*rows)]
    pcm = streaming(*columns[:1], columns[1].long(), *columns[2:]).numpy()
    for s, p in zip(streams, pcm):
        s.take(n, p, streaming.delay)


def full(decoder, stream: Stream) -> np.ndarray:
    return decoder.decode_full(stream.frames, stream.seed)


def test_the_delay_and_state_are_snacs_receptive_field(streaming):
    assert streaming.delay == STREAMING_DELAY_SAMPLES == 4757
    assert len(streaming.state) == 30 and streaming.floats_per_slot() == 124_096  # 485 KiB a stream in fp32


def test_a_frame_at_a_time(decoder, streaming):
    stream = Stream(random_frames(10, seed=1), seed=11, slot=0)
    while stream.left:
        step(streaming, [stream], 1)
    reference = full(decoder, stream)
    assert np.abs(stream.audio() - reference).max() <= TOLERANCE
    assert np.abs(reference).mean() > 1e-3, "a silent decoder would make this comparison vacuous"


def test_random_step_sizes(decoder, streaming):
    stream, rng = Stream(random_frames(23, seed=2), seed=5, slot=1), np.random.default_rng(0)
    while stream.left:
        step(streaming, [stream], int(min(stream.left, rng.integers(1, 9))))
    assert np.abs(stream.audio() - full(decoder, stream)).max() <= TOLERANCE


def test_sixteen_streams_at_different_positions_share_steps(decoder, streaming):
    streams = [Stream(random_frames(4 + i % 7, seed=100 + i), seed=i, slot=i) for i in range(SLOTS)]
    starts = {s.slot: s.slot % 5 for s in streams}  # streams join at different steps
    for t in range(40):
        active = [s for s in streams if starts[s.slot] <= t and s.left]
        if active:
            step(streaming, active, 1)
    for s in streams:
        assert np.abs(s.audio() - full(decoder, s)).max() <= TOLERANCE, f"stream in slot {s.slot}"


@pytest.mark.parametrize("k", [3, 7, 12])
def test_a_resumed_stream_rebuilds_its_state_from_three_frames(decoder, streaming, k):
    """A replica that takes over at frame k gets frames from k - 3 and a fresh slot: the audio from
    sample k * 2048 on is the undisturbed stream's."""
    frames = random_frames(16, seed=3)
    whole = full(decoder, Stream(frames, seed=4, slot=2))
    resumed = Stream(frames, seed=4, slot=2, first_frame=k - RESUME_CONTEXT_FRAMES)
    while resumed.left:
        step(streaming, [resumed], min(2, resumed.left))
    assert np.abs(resumed.audio(k * FRAME_SAMPLES) - whole[k * FRAME_SAMPLES :]).max() <= TOLERANCE


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_short_streams_are_whole(decoder, streaming, n):
    """Every sample, first and last included, even when the stream is shorter than the delay."""
    stream = Stream(random_frames(n, seed=40 + n), seed=n, slot=3)
    while stream.left:
        step(streaming, [stream], 1)
    assert len(stream.audio()) == n * FRAME_SAMPLES
    assert np.abs(stream.audio() - full(decoder, stream)).max() <= TOLERANCE


def test_a_fresh_stream_ignores_what_its_slot_held(decoder, streaming):
    used = Stream(random_frames(6, seed=9), seed=9, slot=4)
    while used.left:
        step(streaming, [used], min(2, used.left))
    stream = Stream(random_frames(5, seed=10), seed=10, slot=4)  # the slot's next stream
    while stream.left:
        step(streaming, [stream], 1)
    assert np.abs(stream.audio() - full(decoder, stream)).max() <= TOLERANCE


def test_the_step_as_captured_never_syncs(streaming):
    """What a CUDA Graph captures: gather the slots, decode, write the state back."""
    args = (torch.tensor([5, 6]), torch.zeros(2, 2, 7, dtype=torch.int64), torch.tensor([0, 9]),
            torch.tensor([OPEN_END, 11]), torch.tensor([1, 2]), torch.tensor([True, False]))
    assert host_syncs(streaming, *args) == []
