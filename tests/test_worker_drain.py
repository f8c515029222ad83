"""SIGTERM drains an LLM worker: the stream in flight completes, new connections are refused
meanwhile, and the process exits 0. A real vLLM worker (tiny model) and a real codec replica."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import numpy as np
import pytest

from processes import scrape

BODY = {"model": "tts-1", "input": "Draining should let this sentence finish before the worker exits.",
        "voice": "leo", "response_format": "pcm", "seed": 4242}


@pytest.fixture
def worker(worker_stack):
    """The session's worker (conftest.worker_stack: a drain grace of 120 s); this test ends it."""
    return worker_stack["worker"]


@pytest.mark.stops_the_worker
def test_sigterm_lets_the_stream_in_flight_finish_and_exits_0(worker):
    url = f"http://127.0.0.1:{worker.port}/v1/audio/speech"
    # The same seed gives the same tokens: the undisturbed run says how long the audio must be.
    before = scrape(worker.port, "orpheus_frames_total")
    undisturbed = httpx.post(url, json=BODY, timeout=300).content
    frames = scrape(worker.port, "orpheus_frames_total") - before
    assert frames > 0 and len(undisturbed) == 2 * 2048 * frames

    audio, errors, flowing = bytearray(), [], threading.Event()

    def listen() -> None:
        try:
            with httpx.stream("POST", url, json=BODY, timeout=300) as r:
                assert r.status_code == 200
                for chunk in r.iter_raw():
                    audio.extend(chunk)
                    flowing.set()
        except Exception as exc:  # reported by the main thread
            errors.append(exc)
            flowing.set()

    listener = threading.Thread(target=listen)
    listener.start()
    assert flowing.wait(120) and not errors, errors
    worker.popen.send_signal(signal.SIGTERM)
    in_flight_at_signal = listener.is_alive()

    refused_at = time.monotonic()
    refused = False
    while time.monotonic() - refused_at < 5 and not refused:
        try:
            httpx.get(f"http://127.0.0.1:{worker.port}/ready", timeout=2)
            time.sleep(0.05)  # the listener closes within a tick of the signal
        # Refused; or accepted into the backlog as the listener closed, then reset or closed unanswered.
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
            refused = True
        except httpx.TimeoutException:  # accepted just before the listener closed, on a busy CPU: ask again
            pass
    assert refused, "new connections still accepted while draining"
    assert in_flight_at_signal, "the stream ended before the signal: nothing to drain"

    listener.join(180)
    assert not errors, errors
    assert len(audio) == len(undisturbed), f"{len(audio)} bytes after the drain, {len(undisturbed)} undisturbed"
    assert np.abs(np.frombuffer(bytes(audio), "<i2").astype(np.int32)).max() > 0
    assert worker.popen.wait(60) == 0, worker.tail()
    assert "draining in-flight streams" in worker.log_path.read_text()
