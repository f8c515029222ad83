"""The LLM tier end to end: real vLLM (CPU build), the tiny model, real snac-server replicas (worker 0 of
the session's `megapod up` and its two replicas, spoken to directly), driven by the `openai` SDK and raw HTTP."""

from __future__ import annotations

import asyncio
import base64
import http.client
import io
import json
import os
import random
import signal
import time
import wave

import httpx
import numpy as np
import openai
import pytest
from processes import WORKER_MAX_STREAMS as MAX_STREAMS
from processes import scrape, wait_metric_zero

from llm_server.doors.http import refused_error
from llm_server.speech.session import Refused


@pytest.fixture(scope="module")
def stack(megapod):
    """Worker 0 of the session's `megapod up` (conftest.megapod) and the two codec replicas it uses."""
    worker = megapod["llm"][0]
    return {"worker": worker, "replicas": megapod["snac"], "url": f"http://127.0.0.1:{worker.port}"}


def _frames_generated(stack) -> float:
    return scrape(stack["worker"].port, "orpheus_frames_total")


def _pcm_of_wav(data: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        return np.frombuffer(w.readframes(10**9), "<i2")


def _s16_diff(a: bytes, b: bytes) -> int:
    return int(np.abs(np.frombuffer(a, "<i2").astype(np.int32) - np.frombuffer(b, "<i2").astype(np.int32)).max())


def _openai(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack['url']}/v1", api_key="unused", timeout=300)


@pytest.mark.parametrize("fmt", ["wav", "pcm"])
def test_openai_sdk_streams_valid_audio(stack, fmt):
    before = _frames_generated(stack)
    with _openai(stack).audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input="Hello there.", response_format=fmt
    ) as response:
        assert response.headers["content-type"] == f"audio/{fmt}"
        data = b"".join(response.iter_bytes())
    frames = _frames_generated(stack) - before
    pcm = _pcm_of_wav(data) if fmt == "wav" else np.frombuffer(data, "<i2")
    assert frames > 0
    assert len(pcm) == 2048 * frames
    assert np.abs(pcm.astype(np.int32)).max() > 0, "audio is not silence"


def test_sse_stream_format(stack):
    with httpx.stream("POST", f"{stack['url']}/v1/audio/speech", timeout=300,
                      json={"model": "orpheus", "input": "Hi.", "voice": "tara", "response_format": "pcm", "stream_format": "sse"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["output_tokens"] > 0
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert len(pcm) % (2048 * 2) == 0 and len(pcm) > 0


def test_same_seed_same_audio(stack):
    body = {"model": "orpheus", "input": "Same again.", "voice": "leo", "response_format": "pcm", "seed": 1234}
    a = httpx.post(f"{stack['url']}/v1/audio/speech", json=body, timeout=300).content
    b = httpx.post(f"{stack['url']}/v1/audio/speech", json=body, timeout=300).content
    c = httpx.post(f"{stack['url']}/v1/audio/speech", json={**body, "seed": 99}, timeout=300).content
    # Step sizes and batch shapes depend on timing and change float rounding, so the s16
    # samples may differ by a least significant bit, never more.
    assert len(a) == len(b) > 0
    assert _s16_diff(a, b) <= 2
    assert _s16_diff(a[: min(len(a), len(c))], c[: min(len(a), len(c))]) > 1000


async def test_eight_concurrent_streams_complete(stack):
    async with httpx.AsyncClient(base_url=stack["url"], timeout=600) as client:
        async def one(i):
            r = await client.post("/v1/audio/speech", json={"model": "tts-1", "input": f"Stream number {i}.", "voice": "nova", "response_format": "wav"})
            assert r.status_code == 200, r.text
            return _pcm_of_wav(r.content)

        outs = await asyncio.gather(*(one(i) for i in range(8)))
    assert all(len(o) > 0 and len(o) % 2048 == 0 for o in outs)


async def test_admission_cap_refuses_fast_with_retry_after(stack):
    async with httpx.AsyncClient(base_url=stack["url"], timeout=600) as client:
        # Long enough to outlast the queue's wait on an idle machine too (two segments of ~750 tokens): a short line
        # ended meanwhile, its slot went to the request meant to be refused (200 == 429).
        body = {"model": "tts-1", "input": "A long sentence that keeps the engine busy for quite a while. " * 8,
                "voice": "tara"}
        held = [client.stream("POST", "/v1/audio/speech", json=body) for _ in range(MAX_STREAMS)]
        responses = await asyncio.gather(*(h.__aenter__() for h in held))
        try:
            assert all(r.status_code == 200 for r in responses)
            # Refused after the admission queue's wait at most (3 s on a CPU): the held streams stay open until
            # the answer is in, so a worker that waited for a slot without a bound would never answer.
            refused = await client.post("/v1/audio/speech", json=body, timeout=60)
            assert refused.status_code == 429
            # At least the queue's wait on a CPU (a retry sooner meets the same queue); longer as the streams of earlier
            # tests lived (test_a_refusals_retry_after_is_when_a_slot_is_expected)
            assert int(refused.headers["retry-after"]) >= 3
            assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        finally:
            for h in held:
                await h.__aexit__(None, None, None)
    # The slots come back once the server has seen the clients go (the next test needs them).
    active = wait_metric_zero(stack["worker"].port, "orpheus_active_streams", within_s=30)
    assert active == 0, f"{active} stream(s) still held 30 s after their clients left"


def test_a_refusals_retry_after_is_drawn_between_the_queues_wait_and_when_a_slot_is_expected():
    """Between the queue's wait and when the worker expects a slot for it (AdmissionController.expected_wait_s, at
    most 60 s: the openai SDK gives up on a wait past 120 s), in whole seconds: clients refused together and told one
    time came back together, and slots freed meanwhile went to clients asking again at once (issue 43, run 53)."""
    def bounds(expected_s: float | None, queue_s: float = 3.0) -> tuple[float, float]:
        drawn = []
        refused_error(Refused("at the limit", False), queue_s, expected_s, lambda a, b: drawn.append((a, b)) or b)
        return drawn[0]

    assert [bounds(None), bounds(1.2), bounds(7.2), bounds(500.0)] == [(3, 3), (3, 3), (3, 7.2), (3, 60)]
    told = {refused_error(Refused("at the limit", False), 3.0, 40.0).headers["Retry-After"] for _ in range(200)}
    assert len(told) > 10 and all(3 <= int(s) <= 40 for s in told), told
    assert refused_error(Refused("at the limit", False), queue_s=0.2).headers["Retry-After"] == "1"


def test_client_disconnect_aborts_the_engine_request(stack):
    # One segment whose token budget (capped by --max-model-len 1024) is ~750 tokens: many
    # seconds of generation on this CPU, so the client leaves long before it could finish.
    body = {"model": "tts-1", "input": "A long sentence that keeps the engine busy for quite a while. " * 4, "voice": "dan"}
    tokens_before = scrape(stack["worker"].port, "orpheus_generated_tokens_total")
    with httpx.stream("POST", f"{stack['url']}/v1/audio/speech", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        # Keep the iterator: a dropped httpx iterator closes the connection at once, which is a
        # disconnect racing the gauge read below.
        audio = r.iter_raw()
        next(audio)  # audio is flowing
        assert scrape(stack["worker"].port, "orpheus_active_streams") == 1
    # A hang guard, not the test: the token count below says whether the request was aborted.
    left = wait_metric_zero(stack["worker"].port, "orpheus_engine_unfinished_requests", within_s=10.0)
    assert left == 0, f"the engine still holds {left} request(s) 10 s after the client left"
    time.sleep(1.0)
    generated = scrape(stack["worker"].port, "orpheus_generated_tokens_total") - tokens_before
    assert generated < 700, f"{generated} tokens: the request ran to its budget instead of being aborted"
    assert scrape(stack["worker"].port, "orpheus_active_streams") == 0


def _post_and_leave(url: str, body: dict, after_s: float) -> None:
    """POST `body` as JSON to `url` over a connection of its own, then close it `after_s` later without reading
    (http.client sends a request without waiting for its answer)."""
    parts = httpx.URL(url)
    conn = http.client.HTTPConnection(parts.host, parts.port, timeout=30)
    try:
        conn.request("POST", parts.raw_path.decode(), json.dumps(body), {"Content-Type": "application/json"})
        time.sleep(after_s)  # mostly while the engine works on the first audio
    finally:
        conn.close()


def test_random_disconnects_release_the_engine_codec_and_slots(stack):
    """Clients leave at random points (before the headers, after a few bytes, mid-stream); the
    engine, the codec replicas and the admission slots all end up empty, and the worker serves."""
    rng = random.Random(11)
    url = f"{stack['url']}/v1/audio/speech"
    body = {"model": "tts-1", "input": "Leaving early is allowed. The worker cleans up after every one.", "voice": "tara"}
    for _ in range(10):
        if rng.random() < 0.3:
            # Gone before the response head (it comes with the first audio, 3 frames and a decode in): the request
            # written whole, the connection closed 5-50 ms later, nothing read. A read timeout of that length, asserted
            # to fire, raced the first audio, which an idle machine sometimes won.
            _post_and_leave(url, body, rng.uniform(0.005, 0.05))
            continue
        with httpx.stream("POST", url, json=body, timeout=300) as r:
            assert r.status_code == 200
            audio, limit = r.iter_raw(), rng.choice([1, 4096, 20_000, 60_000])
            got = 0
            for chunk in audio:
                got += len(chunk)
                if got >= limit:
                    break
    port = stack["worker"].port
    # Generous hang guards (a leak never reaches 0; a loaded CI machine notices a gone client late).
    for name in ("orpheus_engine_unfinished_requests", "orpheus_active_streams"):
        left = wait_metric_zero(port, name, within_s=120)
        assert left == 0, f"{name} still {left} after the clients left"
    for replica in stack["replicas"]:
        assert wait_metric_zero(replica.metrics_port, "snac_active_streams", within_s=120) == 0
    before = _frames_generated(stack)
    pcm = np.frombuffer(httpx.post(url, json={**body, "response_format": "pcm"}, timeout=300).content, "<i2")
    assert len(pcm) == 2048 * (_frames_generated(stack) - before) > 0


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": "tts-1", "input": "", "voice": "tara"}, 400, "input"),
        ({"model": "tts-1", "input": "   \n ", "voice": "tara"}, 400, "input"),
        ({"model": "tts-1", "input": "x" * 5000, "voice": "tara"}, 400, "input"),
        ({"model": "tts-1", "input": "hi", "voice": "bob"}, 400, "voice"),
        ({"model": "tts-1", "input": "hi", "voice": "tara", "response_format": "ogg"}, 400, "response_format"),
        ({"model": "tts-1", "input": "hi", "voice": "tara", "sample_rate": 11025}, 400, "sample_rate"),
        ({"model": "tts-1", "input": "hi", "voice": "tara", "stream_format": "ws"}, 400, "stream_format"),
        ({"model": "tts-1", "input": "hi", "voice": "tara", "speed": 1.5}, 400, "speed"),
        ({"model": "gpt-5", "input": "hi", "voice": "tara"}, 404, "model"),
        ({"model": "tts-1", "input": "hi", "voice": "tara", "path": "/etc/passwd"}, 400, "path"),
        ({"model": "tts-1", "voice": "tara"}, 400, "input"),
        ({"model": "tts-1", "input": 5, "voice": "tara"}, 400, "input"),
    ],
)
def test_bad_requests_get_openai_shaped_errors(stack, body, status, param):
    r = httpx.post(f"{stack['url']}/v1/audio/speech", json=body, timeout=30)
    assert r.status_code == status
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"


def test_oversized_bodies_are_refused_before_being_read(stack):
    declared = httpx.post(f"{stack['url']}/v1/audio/speech", content=b"{" + b" " * 70_000 + b"}",
                          headers={"content-type": "application/json"}, timeout=30)
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "body_too_large"

    def chunked():
        for _ in range(100):
            yield b" " * 1024

    streamed = httpx.post(f"{stack['url']}/v1/audio/speech", content=chunked(), headers={"content-type": "application/json"}, timeout=30)
    assert streamed.status_code == 413


def test_malformed_json_is_a_400(stack):
    r = httpx.post(f"{stack['url']}/v1/audio/speech", content=b"{not json", headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_voices_models_health_metrics(stack):
    url = stack["url"]
    voices = httpx.get(f"{url}/v1/voices").json()
    assert {v["id"] for v in voices["data"]} >= {"tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe"}
    assert {(v["kind"], v["language"]) for v in voices["data"]} == {("checkpoint", "en")}
    assert voices["aliases"]["alloy"] == "tara"
    assert {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]} >= {"orpheus", "tts-1"}
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/ready").status_code == 200
    text = httpx.get(f"{url}/metrics").text
    for name in ("orpheus_time_to_first_audio_seconds", "orpheus_active_streams", "orpheus_generated_tokens_total",
                 "orpheus_frames_total", "orpheus_engine_unfinished_requests"):
        assert name in text


def test_killing_the_serving_replica_keeps_the_same_audio(stack):
    """Runs last in this module: it kills a codec replica, and waits for the launcher to restart it."""
    body = {"model": "tts-1", "input": "Failover should be seamless for the listener.", "voice": "zoe",
            "response_format": "pcm", "seed": 777}
    undisturbed = httpx.post(f"{stack['url']}/v1/audio/speech", json=body, timeout=300).content
    killed = None
    audio = b""
    try:
        with httpx.stream("POST", f"{stack['url']}/v1/audio/speech", json=body, timeout=300) as r:
            for chunk in r.iter_bytes():
                audio += chunk
                if killed is None and len(audio) > 2048 * 2 * 4:
                    killed = next(p for p in stack["replicas"] if scrape(p.metrics_port, "snac_active_streams") > 0)
                    restarts = killed.restarts()
                    os.kill(killed.pid(), signal.SIGKILL)
    finally:
        if killed is not None:
            killed.wait_restarted(restarts + 1)  # the session's later tests use both replicas, pass or fail
    assert killed is not None
    assert len(audio) == len(undisturbed)
    assert _s16_diff(audio, undisturbed) <= 2, "resumed audio must match the undisturbed run (to s16 rounding)"
