"""The compiled streaming step (torch.compile, Inductor, on CPU here): the same audio and the same state as the eager
step, a stream through it equal to one full decode, every graph compiled at warm-up, and a compile that fails leaves
the eager step serving. Compiling takes about a minute a graph (5-6 minutes for the module with a cold Inductor cache,
half a minute warm): one runner, compiled once, for the module."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import torch._inductor.config
from torch._dynamo.utils import counters

from conftest import random_frames
from processes import TEST_CODEC
from snac_server.codec_model import build_decoder
from snac_server.config import SnacServerConfig
from snac_server.runner import DecoderRunner
from snac_server.selfcheck import streaming_equals_full_decode
from snac_server.session import StreamStep
from snac_server.streaming import OPEN_END, StreamingDecoder

EXACT = 1e-5  # fp32: the compiled step against the eager one (issue 45)
SLOTS = 16


@pytest.fixture(scope="module")
def decoder():
    return build_decoder(TEST_CODEC, "cpu", "float32", max_batch=8)


@pytest.fixture(scope="module")
def compiled(decoder):
    runner = DecoderRunner(decoder, StreamingDecoder(decoder, num_slots=SLOTS), 8, (1, 2, 4, 8), cuda_graphs=False,
                           compile_step=True)
    before = counters["stats"]["unique_graphs"]
    # One compile thread: the worker's own core, not the other xdist worker's (whose stack tests keep time).
    with torch._inductor.config.patch(compile_threads=1):
        runner.warm_up()
    assert runner.compiled, "the compile failed at warm-up (the log says why)"
    runner.graphs_at_warm_up = counters["stats"]["unique_graphs"] - before
    return runner


def _rows(batch: int, frames: int, step: int) -> list[StreamStep]:
    return [StreamStep(i, random_frames(frames, seed=10 * step + i).astype(np.int32), step * frames, OPEN_END, 5 + i,
                       step == 0) for i in range(batch)]


def _both(runner: DecoderRunner, eager: StreamingDecoder, rows: list[StreamStep]) -> tuple[float, float]:
    """One step through the compiled runner and through the eager decoder from the same state rows: the largest
    difference of their audio and of the state each wrote."""
    for buffer, source in zip(eager.state, runner.streaming.state):
        buffer.copy_(source)
    audio: list[np.ndarray] = []
    runner.decode(rows, lambda _, pcm: audio.extend(pcm))
    args = runner._stage("step", rows)
    with torch.inference_mode():
        expected = eager(*args).numpy()
    audio_diff = float(np.abs(np.stack(audio) - expected).max())
    state_diff = max(float((a[:SLOTS] - b[:SLOTS]).abs().max()) for a, b in zip(runner.streaming.state, eager.state))  # not the scratch row
    return audio_diff, state_diff


@pytest.mark.parametrize("batch, frames", [(3, 2), (1, 1), (5, 1), (2, 8)])
def test_the_compiled_step_writes_what_the_eager_step_writes(compiled, decoder, batch, frames):
    """Rows past their first step (state that is not zeros), a lone row and 1-frame rows (shapes of their own) among them."""
    eager = StreamingDecoder(decoder, num_slots=SLOTS)
    for step in range(3):
        audio_diff, state_diff = _both(compiled, eager, _rows(batch, frames, step))
        assert audio_diff <= EXACT and state_diff <= EXACT, (step, audio_diff, state_diff)
    assert audio_diff > 0 or state_diff > 0 or batch == 1, "identical to the bit: was the eager step compared at all?"


def test_a_stream_through_the_compiled_step_equals_one_full_decode(compiled):
    found = streaming_equals_full_decode(compiled)
    assert found["ok"], found
    assert 0 < max(found["max_abs_diff"].values()) <= found["tolerance"]


def test_warm_up_compiles_every_graph_that_serving_needs(compiled):
    """Batch and frames are dynamic: a few graphs (a size of 1 is specialized) compiled at warm-up serve every shape."""
    assert 2 <= compiled.graphs_at_warm_up <= 6
    before = counters["stats"]["unique_graphs"]
    for batch, frames in [(1, 1), (2, 1), (7, 1), (1, 4), (3, 2), (6, 8)]:
        compiled.decode(_rows(batch, frames, 9), lambda *_: None)
    assert counters["stats"]["unique_graphs"] == before


def test_a_compile_that_fails_at_warm_up_leaves_the_eager_step_serving(decoder, caplog):
    runner = DecoderRunner(decoder, StreamingDecoder(decoder, num_slots=4), 4, (1, 2), cuda_graphs=False, compile_step=True)

    def no_compiler(*args):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")  # what a node without gcc raises

    runner._step = no_compiler
    with caplog.at_level(logging.ERROR, logger="snac_server.runner"):
        runner.warm_up()
    assert not runner.compiled and runner._step is runner.streaming
    assert "warming up again with the eager step" in caplog.text and "InvalidCxxCompiler" in caplog.text
    audio: list[np.ndarray] = []
    runner.decode(_rows(2, 1, 0), lambda _, pcm: audio.extend(pcm))
    assert len(audio) == 2 and all(a.shape == (2048,) for a in audio)


@pytest.mark.parametrize("device, setting, compiled", [("cuda:0", "auto", True), ("cpu", "auto", False),
                                                       ("cpu", "on", True), ("cuda", "off", False)])
def test_auto_compiles_on_a_gpu_only(device, setting, compiled):
    assert SnacServerConfig(device=device, compile_step=setting).compiled_step is compiled
