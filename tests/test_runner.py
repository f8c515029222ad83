"""DecoderRunner on CPU: splitting a step under max_step_frames changes nothing but the forwards."""

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from snac_server.batcher import MicroBatcher
from snac_server.codec_model import build_decoder
from snac_server.metrics import SnacMetrics
from snac_server.runner import CPU_STEP_FRAMES, DecoderRunner
from snac_server.session import DecodeRow

from conftest import random_frames

BUCKETS = (4, 8, 12, 16, 24)


@pytest.fixture(scope="module")
def decoder():
    return build_decoder("random-24khz", "cpu", "float32", max_batch=8)


def rows(n: int, width: int) -> list[DecodeRow]:
    return [DecodeRow(random_frames(width, seed=i), frame0=10 * i, seed=100 + i, keep_start=3, keep_end=width - 3,
                      pad_ok=True, first_frame=10 * i + 3, final=False)
            for i in range(n)]


def test_cpu_default_caps_frames_per_forward(decoder):
    runner = DecoderRunner(decoder, BUCKETS, max_batch=32, cuda_graphs=True)
    assert runner.max_step_frames == CPU_STEP_FRAMES
    assert runner.rows_per_forward(24) == CPU_STEP_FRAMES // 24
    assert runner.rows_per_forward(4) == CPU_STEP_FRAMES // 4
    assert DecoderRunner(decoder, BUCKETS, max_batch=32, cuda_graphs=True, max_step_frames=8).rows_per_forward(24) == 1


def test_split_step_gives_the_same_audio_and_hands_rows_back_per_forward(decoder):
    batch = rows(5, 12)
    whole = DecoderRunner(decoder, BUCKETS, max_batch=8, cuda_graphs=False, max_step_frames=10_000)
    split = DecoderRunner(decoder, BUCKETS, max_batch=8, cuda_graphs=False, max_step_frames=24)  # 2 rows a forward
    calls: list[list[int]] = []
    expected = whole.decode(batch)
    got = split.decode(batch, lambda idx, pcms: calls.append(list(idx)))
    assert calls == [[0, 1], [2, 3], [4]]
    for e, g in zip(expected, got):
        assert g.shape == (6 * 2048,)
        np.testing.assert_allclose(g, e, atol=1e-4)


def test_the_decode_thread_makes_the_decoders_gpu_its_current_device(monkeypatch):
    """On cuda:N the decode thread must not run on device 0 (a new thread's default): streams,
    graph capture and the memory pool all follow the current device."""
    bound: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: bound.append((threading.current_thread().name, torch.device(d))))
    on_gpu_1 = SimpleNamespace(device=torch.device("cuda", 1))  # test double: a decoder placed on cuda:1
    runner = DecoderRunner(on_gpu_1, BUCKETS, max_batch=1, cuda_graphs=True)
    monkeypatch.setattr(runner, "warm_up", lambda: None)
    batcher = MicroBatcher(runner, 1, 0.0, SnacMetrics())
    batcher.start()
    batcher.wait_ready()
    batcher.stop()
    assert bound == [("snac-decode", torch.device("cuda", 1))]
