"""Runaway generation (llm_server/speech/runaway.py): a segment whose output loops ends at the frame that
completes the loop, its audio so far delivered, counted and logged; speech never loops by chance; a
segment that spends its budget without ending is counted too."""

from __future__ import annotations

import logging

import httpx
import numpy as np
import pytest

from llm_server.speech.prompt import token_budget
from llm_server.speech.runaway import MAX_PERIOD, WINDOW, LoopDetector
from served import ScriptedEngineDouble, body, serving


def _random(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 4096, size=(n, 7))


def _looping(before: int, period: int, total: int, seed: int = 0) -> np.ndarray:
    block = _random(period, seed + 1)
    return np.concatenate([_random(before, seed), np.resize(block, (total - before, 7))])


@pytest.mark.parametrize("period", range(1, MAX_PERIOD + 1))
@pytest.mark.parametrize("batch", [1, 3, 7, 100])
def test_a_loop_is_found_at_the_frame_that_completes_it(period: int, batch: int):
    frames, detector = _looping(before=10, period=period, total=200), LoopDetector()
    kept = 0
    for start in range(0, len(frames), batch):
        if (keep := detector.feed(frames[start:start + batch])) is not None:
            kept = start + keep
            break
    assert kept == 10 + WINDOW and detector.period == period  # the window's frames, all inside the loop


def test_speech_does_not_loop_by_chance_and_longer_blocks_are_not_loops():
    detector = LoopDetector()
    assert detector.feed(_random(5000, 7)) is None
    assert LoopDetector().feed(_looping(before=3, period=MAX_PERIOD + 1, total=300)) is None
    broken = _looping(before=0, period=2, total=WINDOW)
    broken[-1] = broken[-3] + 1  # the last frame breaks the pattern just before it completes
    assert LoopDetector().feed(broken) is None
    steady = np.resize(_random(1, 3), (WINDOW - 1, 7))  # one frame held for just under the window
    assert LoopDetector().feed(np.concatenate([_random(4, 1), steady, _random(4, 2)])) is None


async def test_a_looping_segment_ends_with_its_audio_and_frees_the_engine(snac_server, caplog):
    engine = ScriptedEngineDouble(frames=2000, frames_per_batch=4, loop_after=12, loop_period=3)
    async with serving(snac_server, engine) as served:
        with caplog.at_level(logging.WARNING, logger="llm_server.speech.stream"):
            async with httpx.AsyncClient(base_url=served.url, timeout=120) as http:
                reply = await http.post("/v1/audio/speech", json=body("A sentence the model gets stuck on."))
        assert reply.status_code == 200
        assert len(reply.content) == (12 + WINDOW) * 2048 * 2  # every frame up to the loop's end, whole
        metrics = served.runtime.metrics.registry
        assert metrics.get_sample_value("orpheus_runaway_segments_total", {"kind": "loop"}) == 1
        assert metrics.get_sample_value("orpheus_frames_total") == 12 + WINDOW
        assert engine.num_unfinished() == 0 and served.outcome("ok") == 1
    (line,) = [r.getMessage() for r in caplog.records if "looped" in r.getMessage()]
    assert line.startswith("speech-") and f"segment ended after {12 + WINDOW} frames" in line  # the engine request's id


async def test_a_segment_that_spends_its_budget_is_counted(snac_server):
    text = "Hi."
    frames = token_budget(text) // 7 + 1  # past the budget, and no end of speech: a real engine's max_tokens
    async with serving(snac_server, ScriptedEngineDouble(frames=frames, end_of_speech=False)) as spent, \
            serving(snac_server, ScriptedEngineDouble(frames=frames // 2)) as ended:
        for served in (spent, ended):
            async with httpx.AsyncClient(base_url=served.url, timeout=120) as http:
                assert (await http.post("/v1/audio/speech", json=body(text))).status_code == 200
        count = [s.runtime.metrics.registry.get_sample_value("orpheus_runaway_segments_total", {"kind": "budget"}) or 0
                 for s in (spent, ended)]
    assert count == [1, 0]
