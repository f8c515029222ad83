"""The LLM worker's HTTP edge, in-process and fast: the real app, Runtime, codec client, snac
server and uvicorn on loopback; only the engine is a test double (ScriptedEngineDouble).

Covers engine failures mid-stream, clients leaving at random points, slow clients, API keys,
request ids and what reaches the logs.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import logging
import os
import random
import socket

import httpx
import pytest

from llm_server.api import create_app
from llm_server.edge.auth import ApiKeysError
from llm_server.config import LlmServerConfig
from llm_server.edge.request_ids import RequestIdFilter
from megapod.launcher import free_ports

from served import (
    BYTES_PER_SECOND,
    FRAME_BYTES,
    NOTHING_HELD,
    ScriptedEngineDouble,
    baseline,
    body,
    pending_tasks,
    serving,
    settled,
)

SETTLE_S = float(os.environ.get("EDGE_SETTLE_S", "10"))  # how long a left stream may take to release everything


async def _open_raw(port: int, body: dict, rcvbuf: int = 0, headers: str = "", path: str = "/v1/audio/speech") -> socket.socket:
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    payload = json.dumps(body).encode()
    request = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
               f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
    await loop.sock_sendall(sock, request)
    return sock


async def _read_head(sock: socket.socket) -> tuple[bytes, bytes]:
    """The response head and whatever body bytes came with it."""
    loop = asyncio.get_running_loop()
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await loop.sock_recv(sock, 4096)
        assert chunk, f"connection closed before the response head: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


async def _read_to_end(sock: socket.socket, timeout_s: float = 30.0) -> bytes:
    """Everything until the server closes (FIN or RST)."""
    loop = asyncio.get_running_loop()
    data = b""
    while True:
        try:
            chunk = await asyncio.wait_for(loop.sock_recv(sock, 65536), timeout_s)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def _dechunk(raw: bytes) -> tuple[bytes, bool]:
    """A chunked body -> (payload, whether the terminating chunk arrived)."""
    out, pos = [], 0
    while True:
        end = raw.find(b"\r\n", pos)
        if end < 0:
            return b"".join(out), False
        try:
            size = int(raw[pos:end].split(b";")[0], 16)
        except ValueError:  # bytes lost to a reset connection: cut short
            return b"".join(out), False
        if size == 0:
            return b"".join(out), True
        out.append(raw[end + 2 : end + 2 + size])
        if end + 2 + size + 2 > len(raw):
            return b"".join(out), False
        pos = end + 2 + size + 2


# --- engine failure mid-stream ----------------------------------------------------------------


async def test_engine_failure_mid_stream_ends_sse_with_an_error_event_and_raw_audio_short(snac_server, caplog):
    engine = ScriptedEngineDouble(frames=40)
    async with serving(snac_server, engine) as served:
        quiet = await baseline(served, snac_server)
        engine.fail_after_frames = 12
        async with httpx.AsyncClient(base_url=served.url, timeout=30) as client:
            events = []
            async with client.stream("POST", "/v1/audio/speech", json=body(stream_format="sse")) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(json.loads(line[6:]))
                        engine.fail_gate.set()  # audio is out: now the engine fails
            engine.fail_gate.clear()
            assert events[0]["type"] == "speech.audio.delta" and base64.b64decode(events[0]["audio"])
            assert events[-1]["type"] == "error"
            assert events[-1]["error"]["code"] == "generation_failed" and "scripted engine failure" in events[-1]["error"]["message"]
            assert set(events[-1]["error"]) == {"message", "type", "param", "code"}

            received = b""
            with pytest.raises(httpx.RemoteProtocolError):  # the body ends without its last chunk
                async with client.stream("POST", "/v1/audio/speech", json=body()) as r:
                    assert r.status_code == 200
                    async for chunk in r.aiter_bytes():
                        received += chunk
                        engine.fail_gate.set()
            assert 0 < len(received) < 40 * FRAME_BYTES

            engine.fail_after_frames = None
            ok = await client.post("/v1/audio/speech", json=body())
            assert ok.status_code == 200 and len(ok.content) == 40 * FRAME_BYTES
        assert served.outcome("error") == 2
        assert await settled(served, snac_server, quiet) == NOTHING_HELD
    failures = [r for r in caplog.records if "scripted engine failure" in r.getMessage()]
    assert len(failures) == 2 and all(r.exc_info is None for r in failures), "one line per failure, no traceback"
    assert not [r for r in caplog.records if r.name.startswith("uvicorn") and r.levelno >= logging.ERROR]


# --- clients leaving at random points ---------------------------------------------------------


async def test_random_disconnects_release_everything(snac_server, caplog):
    engine = ScriptedEngineDouble(frames=60, batch_delay_s=0.004)
    rng = random.Random(7)
    loop = asyncio.get_running_loop()
    async with serving(snac_server, engine) as served:
        quiet = await baseline(served, snac_server)

        async def leave_while_reading(limit: int) -> None:
            # A raw socket, closed for sure once `limit` body bytes are in: httpx's pooled
            # connection stayed open after an early exit here (seen: server CLOSE-WAIT only
            # after a gc), which is a silent client, not a disconnect.
            sock = await _open_raw(served.port, body(response_format=rng.choice(["wav", "pcm"])))
            try:
                head, got = await _read_head(sock)
                assert head.startswith(b"HTTP/1.1 200"), head
                while len(got) < limit:
                    chunk = await loop.sock_recv(sock, 65536)
                    if not chunk:
                        return  # the whole response came first
                    got += chunk
            finally:
                sock.close()

        async def leave_before_headers(after_s: float) -> None:
            # A socket of our own, closed for sure: a cancelled httpx request can leave its
            # connection open (a silent client, not a disconnect).
            sock = await _open_raw(served.port, body())
            await asyncio.sleep(after_s)
            sock.close()

        for round_ in range(5):
            clients = []
            for _ in range(4):
                if rng.random() < 0.3:
                    clients.append(leave_before_headers(rng.uniform(0.0, 0.15)))
                else:
                    clients.append(leave_while_reading(rng.choice([1, 4096, 30_000, 100_000, 300_000])))
            await asyncio.gather(*clients)
        readings = await settled(served, snac_server, quiet, within_s=SETTLE_S)
        assert readings == dict.fromkeys(readings, 0), readings
        assert served.runtime.admission.active == 0
        async with httpx.AsyncClient(base_url=served.url, timeout=30) as client:
            assert len((await client.post("/v1/audio/speech", json=body())).content) == 60 * FRAME_BYTES
    # A client leaving is no error of ours: no traceback, no error line (each was an "Exception in ASGI application").
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_client_gone_while_no_codec_replica_takes_the_call_releases_everything(snac_server):
    """The codec tier unreachable (the stream's call waits for a replica to take it) and the client
    gives up: its slot, engine request and tasks are all freed. Before, the call's first write never
    woke once cancelled (grpc.aio 1.85), so the session stayed open for good (seen in CI: a worker's
    active stream left over after a client left 40 ms into its request)."""
    nobody = free_ports(1)[0]
    async with serving(snac_server, ScriptedEngineDouble(frames=8), snac=f"127.0.0.1:{nobody}") as served:
        quiet = pending_tasks()
        sock = await _open_raw(served.port, body())
        await _until(lambda: served.runtime.metrics.registry.get_sample_value("orpheus_frames_total"), within_s=30)
        await asyncio.sleep(0.3)  # the first frames are in the codec stream; its call waits for a replica
        sock.close()
        readings = await settled(served, snac_server, quiet, within_s=SETTLE_S)
        assert readings == dict.fromkeys(readings, 0), readings
        assert served.outcome("disconnected") == 1


async def test_a_stream_frees_its_slot_before_its_client_sees_the_end(snac_server):
    """A client that asks again the moment its audio ended (one stream at a time, at its cap) is not
    refused for the stream it just finished: the response's last message goes out after the session
    let go of its slot. Before, the slot was freed after it (the soak's back-to-back warm-up got a 429
    in make test)."""
    async with serving(snac_server, ScriptedEngineDouble(frames=8), max_streams=1) as served:
        held_when_ended = []

        async def app(scope, receive, send):
            async def watched(message):
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    held_when_ended.append(served.runtime.admission.active)
                await send(message)
            await served.app(scope, receive, watched)

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://edge") as client:
            for fmt in ("pcm", "wav"):
                reply = await client.post("/v1/audio/speech", json=body(response_format=fmt))
                assert reply.status_code == 200 and reply.content
            reply = await client.post("/v1/audio/speech", json=body(stream_format="sse", response_format="pcm"))
            assert reply.status_code == 200 and b"speech.audio.done" in reply.content
        assert held_when_ended == [0, 0, 0]


# --- slow clients -----------------------------------------------------------------------------


async def test_a_client_that_stops_reading_is_cut_off_and_everything_released(snac_server, caplog):
    frames = 1200  # 102 s of audio: far more than any buffer on the way holds
    engine = ScriptedEngineDouble(frames=frames, frames_per_batch=4)
    async with serving(snac_server, engine, sndbuf=16384, max_client_lag_s=1.0) as served:
        quiet = await baseline(served, snac_server)
        sock = await _open_raw(served.port, body(), rcvbuf=4096)
        try:
            head, early = await _read_head(sock)
            assert head.startswith(b"HTTP/1.1 200")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while served.outcome("slow_client") < 1 and loop.time() < deadline:
                await asyncio.sleep(0.1)  # not reading
            assert served.outcome("slow_client") == 1
            readings = await settled(served, snac_server, quiet)
            assert readings == dict.fromkeys(readings, 0), readings
            payload, complete = _dechunk(early + await _read_to_end(sock))
            assert not complete and len(payload) < frames * FRAME_BYTES / 4, "the server closed the connection long before the end"
        finally:
            sock.close()
    assert any("client too slow" in r.getMessage() for r in caplog.records)


async def test_a_real_time_reader_is_never_cut_off(snac_server):
    frames = 100  # 8.5 s of audio, generated in well under a second
    engine = ScriptedEngineDouble(frames=frames, frames_per_batch=4)
    # 3 s allowed behind, 8.5 s of audio ahead: the pacing must tell a slow reader from a real-time one.
    async with serving(snac_server, engine, sndbuf=16384, max_client_lag_s=3.0) as served:
        await baseline(served, snac_server)
        loop = asyncio.get_running_loop()
        sock = await _open_raw(served.port, body(), rcvbuf=4096)
        try:
            head, raw = await _read_head(sock)
            assert head.startswith(b"HTTP/1.1 200")
            started = loop.time()
            while not _dechunk(raw)[1]:
                # A player: never more than real time allows (plus 0.1 s), reading in small bites.
                allowed = BYTES_PER_SECOND * (loop.time() - started + 0.1)
                if len(raw) >= allowed:
                    await asyncio.sleep(0.02)
                    continue
                chunk = await asyncio.wait_for(loop.sock_recv(sock, 4096), 60)  # generous: a loaded CPU decodes slowly
                assert chunk, "the server closed a real-time reader's stream"
                raw += chunk
        finally:
            sock.close()
        payload, _ = _dechunk(raw)
        assert len(payload) == frames * FRAME_BYTES
        assert served.outcome("slow_client") == 0 and served.outcome("ok") == 2


# --- API keys ---------------------------------------------------------------------------------

ALICE, BOB, ALICE_NEW = "alice-key-000001", "bob-key-0000002", "alice-key-rotated"


def _write_keys(path, text: str, stamp: list[int]) -> None:
    path.write_text(text)
    stamp[0] += 10**9  # a distinct mtime per write, however fast the writes come
    os.utime(path, ns=(stamp[0], stamp[0]))


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def test_api_keys_per_key_caps_rotation_and_a_broken_reload(snac_server, tmp_path, caplog):
    keys = tmp_path / "keys"
    stamp = [1_700_000_000 * 10**9]
    _write_keys(keys, f"# name:key[:max_streams]\n\nalice:{ALICE}:1\nbob:{BOB}\n", stamp)
    engine = ScriptedEngineDouble(frames=600, frames_per_batch=4)
    async with serving(snac_server, engine, api_keys_file=str(keys)) as served:
        async with httpx.AsyncClient(base_url=served.url, timeout=30) as client:
            for headers in ({}, _auth("nope-not-a-key"), {"Authorization": f"Basic {ALICE}"}):
                r = await client.post("/v1/audio/speech", json=body(), headers=headers)
                assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
                assert r.json()["error"]["code"] == "invalid_api_key" and set(r.json()["error"]) == {"message", "type", "param", "code"}
            assert (await client.get("/v1/voices")).status_code == 401
            assert (await client.get("/v1/models", headers=_auth(BOB))).status_code == 200
            for open_path in ("/health", "/ready", "/metrics"):
                assert (await client.get(open_path)).status_code == 200

            # alice may hold one stream; a second is refused while bob still gets in
            async with client.stream("POST", "/v1/audio/speech", json=body(), headers=_auth(ALICE)) as held:
                assert held.status_code == 200
                refused = await client.post("/v1/audio/speech", json=body(), headers=_auth(ALICE))
                assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
                assert "'alice'" in refused.json()["error"]["message"] and "limit of 1" in refused.json()["error"]["message"]
                async with client.stream("POST", "/v1/audio/speech", json=body(), headers=_auth(BOB)) as other:
                    assert other.status_code == 200
            await _until(lambda: served.runtime.admission.active == 0)
            assert served.runtime.admission.active_per_key == {}

            # rotation: old and new key side by side, then the old one removed
            _write_keys(keys, f"alice:{ALICE_NEW}:1\nalice:{ALICE}:1\nbob:{BOB}\n", stamp)
            for key in (ALICE, ALICE_NEW):
                assert (await client.get("/v1/models", headers=_auth(key))).status_code == 200
            _write_keys(keys, f"alice:{ALICE_NEW}:1\nbob:{BOB}\n", stamp)
            assert (await client.get("/v1/models", headers=_auth(ALICE))).status_code == 401
            assert (await client.get("/v1/models", headers=_auth(ALICE_NEW))).status_code == 200

            # a broken file keeps the keys loaded before, and says so once
            _write_keys(keys, f"alice {ALICE_NEW}\nthis is not a key line\n", stamp)
            for _ in range(3):
                assert (await client.get("/v1/models", headers=_auth(ALICE_NEW))).status_code == 200
            errors = [r for r in caplog.records if r.name == "llm_server.edge.auth" and r.levelno == logging.ERROR]
            assert len(errors) == 1 and "line 1" in errors[0].getMessage()
        assert served.runtime.metrics.registry.get_sample_value("orpheus_unauthorized_requests_total") >= 5
        assert served.runtime.metrics.registry.get_sample_value(
            "orpheus_key_requests_total", {"key": "alice", "outcome": "refused_key"}) == 1
    for secret in (ALICE, BOB, ALICE_NEW):
        assert secret not in caplog.text, "a key reached the logs"


def test_a_broken_keys_file_stops_startup_with_a_clear_message(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"alice:{ALICE}:lots\n")
    with pytest.raises(ApiKeysError, match=r"line 1: max_streams") as info:
        create_app(LlmServerConfig(api_keys_file=str(keys)))
    assert ALICE not in str(info.value)
    with pytest.raises(ApiKeysError, match="cannot be read"):
        create_app(LlmServerConfig(api_keys_file=str(tmp_path / "missing")))


async def _until(condition, within_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not condition():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


# --- request ids and logs ---------------------------------------------------------------------

SECRET_TEXT = "Zebra quartz marmalade whispers."


async def test_request_ids_on_every_response_and_log_line_and_no_input_text(snac_server, caplog):
    caplog.set_level(logging.INFO)
    caplog.handler.addFilter(RequestIdFilter())
    async with serving(snac_server, max_streams=1) as served:
        async with httpx.AsyncClient(base_url=served.url, timeout=30) as client:
            ok = await client.post("/v1/audio/speech", json=body(SECRET_TEXT), headers={"X-Request-Id": "call-42.a_B"})
            assert ok.status_code == 200 and ok.headers["x-request-id"] == "call-42.a_B"
            generated = await client.post("/v1/audio/speech", json=body(SECRET_TEXT))
            assert len(generated.headers["x-request-id"]) == 32
            for unsafe in ("has space", "x" * 65, "semi;colon", "<script>"):
                r = await client.get("/health", headers={"X-Request-Id": unsafe})
                assert r.headers["x-request-id"] != unsafe and len(r.headers["x-request-id"]) == 32
            errors = [
                await client.post("/v1/audio/speech", json=body(voice="bob")),
                await client.post("/v1/audio/speech", json={"model": "gpt-9", "input": "hi"}),
                await client.post("/v1/audio/speech", content=b"{nope", headers={"content-type": "application/json"}),
                await client.post("/v1/audio/speech", content=b"x" * 70_000, headers={"content-type": "application/json"}),
                await client.get("/no/such/path"),
            ]
            assert [r.status_code for r in errors] == [400, 404, 400, 413, 404]
            assert all(len(r.headers["x-request-id"]) == 32 for r in errors)
            async with client.stream("POST", "/v1/audio/speech", json=body()) as held:
                busy = await client.post("/v1/audio/speech", json=body(), headers={"X-Request-Id": "busy-1"})
                assert busy.status_code == 429 and busy.headers["x-request-id"] == "busy-1"
                await held.aread()
    mine = [r for r in caplog.records if getattr(r, "request_id", None) == "call-42.a_B"]
    assert any(r.name == "llm_server.doors.openai" and "speech:" in r.getMessage() for r in mine)
    assert any(r.name == "uvicorn.access" for r in mine), "the server's access line carries the id too"
    assert SECRET_TEXT not in caplog.text and "Zebra" not in caplog.text


async def test_input_text_is_logged_only_when_asked(snac_server, caplog):
    caplog.set_level(logging.INFO)
    async with serving(snac_server, log_input_text=True) as served, httpx.AsyncClient(base_url=served.url) as client:
        assert (await client.post("/v1/audio/speech", json=body(SECRET_TEXT), timeout=30)).status_code == 200
    assert SECRET_TEXT in caplog.text


# --- the worker process ----------------------------------------------------------------------


async def test_the_startup_heap_is_out_of_the_collectors_sight_once_serving(snac_server):
    """Torch, transformers and the engine's client, loaded at start-up, are frozen out of the cyclic
    GC: unfrozen, every full collection stalled all of a worker's streams for 300+ ms
    (benchmarks/serving_cpu.py at 256 streams)."""
    gc.unfreeze()
    async with serving(snac_server):
        assert gc.get_freeze_count() > 0
