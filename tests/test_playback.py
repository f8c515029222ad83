"""Continuity as a real-time listener hears it, measured on the worker (speech/playback.py, issue 46 item 3): the
Playback model alone, then orpheus_stream_underrun_seconds and orpheus_stream_continuity_total on the real app
(Runtime, codec tier; engine double) for a stream slower than real time, one faster, and a socket whose client
paused between sentences (its pause is not the worker's gap)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from served import ScriptedEngineDouble, body, serving, ws_url
from websockets.asyncio.client import connect

from llm_server.speech.playback import Playback

FRAME_S = 2048 / 24000


def test_a_listener_waits_only_once_it_has_played_everything_sent():
    p = Playback()
    p.sent(10.0, 1.0, text_at=9.0)  # first audio: plays 10.0-11.0
    p.sent(10.5, 1.0, text_at=9.0)  # queued: plays 11.0-12.0
    p.sent(12.3, 0.5, text_at=9.0)  # ran dry at 12.0: a 0.3 s gap
    assert (p.gaps, round(p.underrun_s, 6), round(p.worst_gap_s, 6)) == (1, 0.3, 0.3)
    p.sent(15.0, 0.5, text_at=14.9)  # ran dry at 12.8, but the text came at 14.9: 0.1 s is ours
    assert (p.gaps, round(p.underrun_s, 6), round(p.worst_gap_s, 6)) == (2, 0.4, 0.3)
    assert p.continuous(0.31) and not p.continuous(0.29)
    p.sent(99.0, 0.0, text_at=0.0)  # an encoder's tail of no audio time: nothing played, nothing waited
    assert p.gaps == 2


def test_no_audio_no_playback():
    p = Playback()
    assert not p.started and p.continuous(0.0)


def _readings(served) -> dict[str, float]:
    get = served.runtime.metrics.registry.get_sample_value
    return {"streams": get("orpheus_stream_underrun_seconds_count") or 0.0,
            "underrun_s": get("orpheus_stream_underrun_seconds_sum") or 0.0,
            **{f"{t}ms_{c}": get("orpheus_stream_continuity_total", {"threshold_ms": str(t), "continuous": c}) or 0.0
               for t in (100, 200) for c in ("true", "false")}}


@pytest.mark.parametrize("delay_s, continuous", [(0.002, True), (0.5, False)])
async def test_the_worker_exports_each_streams_playback_gaps(snac_server, delay_s, continuous):
    """Frames of 85 ms every `delay_s`: far faster than real time plays through; one every 0.5 s leaves the
    listener waiting ~0.4 s before each."""
    engine = ScriptedEngineDouble(frames=6, frames_per_batch=1, batch_delay_s=delay_s)
    async with serving(snac_server, engine) as served:
        assert _readings(served)["200ms_true"] == 0.0  # exported before any stream: a ratio has both series
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
            assert (await client.post("/v1/audio/speech", json=body())).status_code == 200
        got = _readings(served)
    assert got["streams"] == 1
    assert got["100ms_true" if continuous else "100ms_false"] == 1
    assert got["200ms_true" if continuous else "200ms_false"] == 1
    if continuous:
        assert got["underrun_s"] == 0.0
    else:  # five gaps of 0.5 s less the frame's audio (the codec's batching moves a frame between chunks)
        assert got["underrun_s"] > 2 * (0.5 - FRAME_S), got


async def test_a_clients_pause_between_sentences_is_not_a_gap(snac_server):
    """A socket's second sentence, sent a second after the first one's audio was heard: the listener waited for
    the text, then only for that sentence's first audio."""
    async with serving(snac_server, ScriptedEngineDouble(frames=4)) as served:
        async with connect(ws_url(served, "/v1/text-to-speech/leo/stream-input?output_format=pcm_24000")) as ws:
            await ws.send(json.dumps({"text": " "}))
            for sentence in ("Hello there. ", "How are you? "):
                await ws.send(json.dumps({"text": sentence, "flush": True}))
                async with asyncio.timeout(30):
                    while not json.loads(await ws.recv()).get("alignment"):
                        pass
                await asyncio.sleep(1.0)  # longer than the audio: the listener ran dry long ago
            await ws.send(json.dumps({"text": ""}))
            async with asyncio.timeout(30):
                while not json.loads(await ws.recv()).get("isFinal"):
                    pass
        await asyncio.sleep(0.2)
        got = _readings(served)
    assert got["streams"] == 1 and got["underrun_s"] < 0.5, got


async def test_streams_whose_listener_at_the_target_pace_waits_cut_the_admission_limit(snac_server):
    """Admission's signal (capacity.Listeners): two streams whose first audio comes 1.5 s after their text (a long
    prefill), where a listener at the target pace (0.5) waits 0.3 audio-seconds at most: each falls behind (0.45 s),
    and the limit is cut for them while the engine's own pace, once decoding, is far ahead. Every listener leaves
    with its stream."""
    engine = ScriptedEngineDouble(frames=48, frames_per_batch=2, batch_delay_s=0.01, prefill_s=1.5)
    async with serving(snac_server, engine, max_streams=8, min_streams=1, initial_streams=4, target_pace=0.5,
                       capacity_window_s=0.1) as served:
        admission = served.runtime.admission
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
            speaking = [asyncio.create_task(client.post("/v1/audio/speech", json=body())) for _ in range(2)]
            await asyncio.sleep(0.5)
            assert len(admission.listeners) == 2
            assert all(stream.heard.pace == 0.5 for stream in admission.listeners._streams), "at the target pace"
            assert all(r.status_code == 200 for r in await asyncio.gather(*speaking))
        get = served.runtime.metrics.registry.get_sample_value
        assert get("megapod_worker_streams_behind_total") == 2
        assert get("orpheus_capacity_limit_changes_total", {"reason": "listener_behind"}) == 1
        assert get("orpheus_capacity_limit_changes_total", {"reason": "pace_below_realtime"}) == 0
        assert admission.max_streams == 2, "half the limit: its window admitted 2 streams"
        assert len(admission.listeners) == 0
