"""Overload: a flood of requests far past the admission cap, against a real worker (vLLM CPU, tiny model)
and a real codec replica.

The worker's stream slots are all held by Cartesia contexts that have not ended: a context keeps
its slot until its client ends it, so the flood meets a full worker however fast or slow anything on
this machine runs. Every flood request must be refused (429, Retry-After, an OpenAI-shaped error), a
new context on a socket too (the protocol's error), and a new socket with close code 1013. Then the
contexts end and must get all their audio; the worker must stay up, healthy and bounded in memory,
and hold no stream afterwards. How fast refusals come is measured by benchmarks/soak.py --overload, not
asserted here: on a shared machine a latency bound flakes.
"""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import psutil
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from benchmarks.concurrency_bench.flood import flood
from processes import WORKER_MAX_STREAMS as CAP
from processes import scrape, wait_metric_zero
from served import cartesia

FLOOD_REQUESTS = 200
BURST = 20  # concurrent requests per burst
# Two of the holding contexts speak; the rest hold their slot with no text yet (no generation to wait for).
TEXTS = ("Thanks for waiting. I found two flights tomorrow.", "Your order shipped today, it arrives Thursday.")
TEXTS += ("",) * (CAP - len(TEXTS))


@pytest.fixture(scope="module")
def worker(megapod):
    """Worker 0 of the session's `megapod up` (conftest.megapod), spoken to directly: CAP stream slots."""
    return megapod["llm"][0]


async def _overload(url: str, port: int) -> dict:
    ws_url = url.replace("http://", "ws://") + "/tts/websocket"
    out: dict = {"audio": {}, "messages": {}}
    async with connect(ws_url) as holder:
        for i, text in enumerate(TEXTS):  # every slot taken, and held until each context ends
            await holder.send(cartesia(f"hold-{i}", text, more=True))
        out["messages"] = {f"hold-{i}": [] for i in range(len(TEXTS))}
        speaking = [f"hold-{i}" for i, text in enumerate(TEXTS) if text]
        while any(not [m for m in out["messages"][c] if m["type"] == "chunk"] for c in speaking):
            message = json.loads(await holder.recv())
            out["messages"][message["context_id"]].append(message)
        assert scrape(port, "orpheus_active_streams") == CAP  # the silent ones too, opened before the audio
        limits = httpx.Limits(max_connections=BURST, max_keepalive_connections=BURST)
        async with httpx.AsyncClient(timeout=60.0, limits=limits, trust_env=False) as client:
            out["flood"] = await flood(client, url, BURST, bursts=FLOOD_REQUESTS // BURST)
        await holder.send(cartesia("one-more", "One too many.", more=False))
        async with connect(ws_url) as late:
            with pytest.raises(ConnectionClosed) as closed:
                await late.recv()
        out["late_socket_close"] = closed.value.rcvd.code
        for i in range(len(TEXTS)):
            await holder.send(cartesia(f"hold-{i}", "", more=False))
        open_ = set(out["messages"]) | {"one-more"}
        while open_ & set(out["messages"]):
            message = json.loads(await asyncio.wait_for(holder.recv(), 300))
            out["messages"].setdefault(message["context_id"], []).append(message)
            if message["type"] in ("done", "error"):
                open_.discard(message["context_id"])
    out["audio"] = {cid: b"".join(base64.b64decode(m["data"]) for m in msgs if m["type"] == "chunk")
                    for cid, msgs in out["messages"].items()}
    return out


@pytest.fixture(scope="module")
def run(worker):
    url = f"http://127.0.0.1:{worker.port}"
    httpx.post(f"{url}/v1/audio/speech", json={"model": "tts-1", "input": "Warm up.", "voice": "tara"}, timeout=300)
    proc, deaths = psutil.Process(worker.pid()), worker.deaths()
    frames, rss = scrape(worker.port, "orpheus_frames_total"), proc.memory_info().rss
    out = asyncio.run(_overload(url, worker.port))
    out["deaths"] = worker.deaths() - deaths
    out["frames"] = scrape(worker.port, "orpheus_frames_total") - frames
    out["active_after"] = wait_metric_zero(worker.port, "orpheus_active_streams", within_s=30)
    out["rss_growth_mb"] = (proc.memory_info().rss - rss) / 2**20
    return out


def test_every_over_cap_request_is_refused_openai_shaped(run):
    assert len(run["flood"]) == FLOOD_REQUESTS
    assert {k.status for k in run["flood"]} == {429}
    for k in run["flood"]:
        assert int(k.headers["retry-after"]) >= 1
        error = json.loads(k.body)["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "invalid_request_error"
        assert error["message"] and "param" in error


def test_a_context_and_a_socket_past_the_cap_get_their_protocols_refusal(run):
    refusal = run["messages"]["one-more"]
    assert [(m["type"], m["status_code"], m["done"]) for m in refusal] == [("error", 429, False)]
    assert run["late_socket_close"] == 1013


def test_the_contexts_holding_the_slots_get_all_their_audio(run):
    for i in range(len(TEXTS)):
        messages = run["messages"][f"hold-{i}"]
        assert messages[-1]["type"] == "done" and "error" not in {m["type"] for m in messages}
        assert len(run["audio"][f"hold-{i}"]) % (2048 * 2) == 0, "whole frames only"
    samples = sum(len(run["audio"][f"hold-{i}"]) for i in range(len(TEXTS))) // 2
    assert run["frames"] > 0 and samples == 2048 * run["frames"], "every frame the worker generated reached the clients"


def test_worker_stays_up_healthy_idle_and_bounded(run, worker):
    assert run["deaths"] == 0, "the worker died under the flood"
    url = f"http://127.0.0.1:{worker.port}"
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{url}/ready", timeout=10).status_code == 200
    assert run["active_after"] == 0
    assert scrape(worker.port, "orpheus_engine_unfinished_requests") == 0
    assert run["rss_growth_mb"] < 100, f"worker RSS grew {run['rss_growth_mb']:.0f} MB"
