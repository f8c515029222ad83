"""Capacity measured and routed by (issue 25): a worker's limit follows the pace its engine keeps
(llm_server/capacity.py) and every reply says how many more streams it would admit (X-Capacity-Free);
the front sends each stream to the worker with the most free capacity.

The worker runs in-process (tests/served.py: the real app and runtime over an engine double that is
slower or faster than real time, a real codec server); the front's choice is tested on its pool and on
the real front app over two worker doubles that report their capacity. The engine's pace is what these
tests hold, so the streams' listeners are not judged (listener_lag_s 0): an in-process CPU codec beside the
other tests need not keep 1.03 x real time (tests/test_capacity.py and tests/test_playback.py hold that signal)."""

from __future__ import annotations

import asyncio
import logging
import math

import httpx
import openai
import pytest
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from served import ScriptedEngineDouble, body, serve_app, serving
from websockets.asyncio.client import connect

from orpheus_common.http import ADMISSION_WAIT, CAPACITY_FREE, RETRY_COUNT
from orpheus_front import front as front_module
from orpheus_front.front import WorkerPool, create_front_app, requested_voice

A, B = "http://10.0.0.1:8000", "http://10.0.0.2:8000"


def test_the_pool_prefers_the_most_free_capacity_and_counts_what_it_sent_since():
    pool = WorkerPool([A, B])
    assert set(pool.order()) == {A, B} and pool.free(A) == math.inf  # not heard from: tried
    pool.acquire(A)
    pool.report(A, "2")  # A admitted our stream and would take 2 more
    pool.acquire(B)
    pool.report(B, "5")
    assert pool.order() == [B, A]
    for _ in range(4):  # four more streams to B: it has 1 left by its last word, A has 2
        pool.acquire(B)
    assert (pool.free(A), pool.free(B)) == (2, 1) and pool.order() == [A, B]
    pool.release(B)
    pool.release(B)  # two of them ended
    assert pool.free(B) == 3 and pool.order()[0] == B
    pool.report(A, "zero")  # not a count: ignored
    pool.report(A, "²")  # a digit to str.isdigit, not to int()
    assert pool.free(A) == 2
    pool.report(A, "3", uncounted=1)  # a socket's handshake: it takes a slot there once it speaks
    assert pool.free(A) == 2


def test_among_workers_as_free_the_one_whose_engine_holds_the_voices_adapter_comes_first():
    """Issue 26, item 4: a LoRA voice's request goes where its adapter is loaded, when capacity is equal; free
    capacity still comes first."""
    pool = WorkerPool([A, B])
    for url, loaded in ((A, None), (B, "ava,%EC%9C%A0%EB%82%98")):  # B holds ava and 유나 (percent-encoded UTF-8)
        pool.acquire(url)
        pool.report(url, "3", loaded=loaded)
        pool.release(url)
    assert all(pool.order("AVA")[0] == B and pool.order("유나")[0] == B for _ in range(4))  # whatever the rotation
    assert {pool.order("tara")[0] for _ in range(4)} == {A, B}  # no adapter: spread as before
    pool.acquire(A)
    pool.report(A, "5")  # A now has more room: capacity first
    assert pool.order("ava")[0] == A
    pool.report(B, "9")  # a report without the header: B holds no adapter any more
    assert pool.order("ava") == [B, A] and pool.order("ava") == pool.order(None)


@pytest.mark.parametrize("path, body, voice", [
    ("/v1/audio/speech", b'{"model": "tts-1", "voice": "ava", "input": "Hi."}', "ava"),
    ("/tts/bytes", b'{"voice": {"mode": "id", "id": "ava"}, "transcript": "Hi."}', "ava"),
    ("/v1/text-to-speech/%EC%9C%A0%EB%82%98/stream", b'{"text": "Hi."}', "유나"),
    ("/v1/text-to-speech/ava/multi-stream-input", b"", "ava"),
    ("/v1/speak", b'{"text": "Hi."}', None),
    ("/v1/audio/speech", b'{"voice": 3}', None),
    ("/v1/audio/speech", b"{not json", None),
    ("/v1/audio/speech", b"[1, 2]", None),
])
def test_the_voice_a_request_asks_for_is_read_before_routing_where_it_can_be(path, body, voice):
    assert requested_voice(path, body) == voice


def test_a_refusal_reports_no_room_and_a_worker_that_left_is_forgotten_whole():
    pool = WorkerPool([A, B])
    pool.acquire(A)
    pool.release(A)  # its 429: the refused stream is not held...
    pool.report(A, "0")  # ...and it has no room
    assert pool.free(A) == 0 and pool.order() == [B, A]  # B unknown: tried first; A still tried last
    pool.acquire(A)
    pool.update([B])  # A leaves with a stream in flight
    pool.release(A)
    assert A not in pool.active and pool.free(A) == math.inf  # nothing of it kept


async def test_the_front_sends_streams_where_capacity_is_free():
    """Worker `full` refuses (429, no room); `roomy` admits. After one refusal the front goes to `roomy`
    first: no stream pays the full worker's round trip again while `roomy` says it has room."""
    hits = {"full": 0, "roomy": 0}

    def worker(name: str, status: int, free: int) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/audio/speech")
        async def speech() -> Response:
            hits[name] += 1
            return Response(b"\x00\x00" * 2048 if status == 200 else b"{}", status, {CAPACITY_FREE: str(free)},
                            media_type="audio/pcm")

        return app

    async with serve_app(worker("full", 429, 0)) as full_port, serve_app(worker("roomy", 200, 100)) as roomy_port:
        full, roomy = f"http://127.0.0.1:{full_port}", f"http://127.0.0.1:{roomy_port}"
        front = create_front_app([full, roomy])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=front), base_url="http://front") as client:
            replies = [await client.post("/v1/audio/speech", json=body()) for _ in range(10)]
    assert [r.status_code for r in replies] == [200] * 10
    assert hits["roomy"] == 10 and hits["full"] <= 1, hits



async def test_the_fronts_refusal_passes_on_the_first_refusing_workers_wait():
    """Every worker refused: the front's 429 carries the Retry-After of the first worker that gave one in whole seconds
    (the most free, whose queue the request waited in; each is a draw between its queue's wait and when it expects a
    slot, so the soonest or longest of several would undo the spread), not a fixed 1 s; a value that is not whole
    seconds is left out."""
    seen: list[str] = []

    def refusing(retry_after: str) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/audio/speech")
        async def speech() -> Response:
            seen.append(retry_after)
            return Response(b'{"error": {"message": "at the limit", "type": "rate_limit", "code": "at_capacity"}}', 429,
                            {CAPACITY_FREE: "0", "Retry-After": retry_after}, media_type="application/json")
        return app

    async with (serve_app(refusing("soon")) as a, serve_app(refusing("4")) as b, serve_app(refusing("2")) as c,
                serve_app(refusing("6")) as d):
        front = create_front_app([f"http://127.0.0.1:{port}" for port in (a, b, c, d)])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=front), base_url="http://front") as client:
            refused = await client.post("/v1/audio/speech", json=body())
    assert refused.status_code == 429 and len(seen) == 4
    assert refused.headers["retry-after"] == next(s for s in seen if s.isdecimal()), seen  # neither 2 nor 6 if not first


async def test_refusals_reuse_the_front_s_connection_to_the_worker():
    """A worker's 429 is read to its end, so its connection goes back to the front's pool: twenty refusals
    in a row reach the worker over one connection. (Closed unread, each cost a new connection, and a flood
    of knocks left thousands of sockets in TIME_WAIT towards running out of local ports.)"""
    client_ports = []
    app = FastAPI()

    @app.post("/v1/audio/speech")
    async def speech(request: Request) -> Response:
        client_ports.append(request.client.port)
        return Response(b'{"error": {"message": "at the limit", "type": "rate_limit", "code": "at_capacity"}}', 429,
                        {CAPACITY_FREE: "0", "Retry-After": "1"}, media_type="application/json")

    async with serve_app(app) as port:
        front = create_front_app([f"http://127.0.0.1:{port}"])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=front), base_url="http://front") as client:
            statuses = [(await client.post("/v1/audio/speech", json=body())).status_code for _ in range(20)]
    assert statuses == [429] * 20 and len(client_ports) == 20
    assert len(set(client_ports)) == 1, f"{len(set(client_ports))} connections for 20 refusals"


async def test_a_refusal_whose_body_never_comes_is_dropped_not_waited_for(monkeypatch):
    """A worker that sends a 429's headers and then nothing: the front gives the client its 429 once
    REFUSAL_READ_S passes, and closes that connection (a later refusal comes over a new one)."""
    monkeypatch.setattr(front_module, "REFUSAL_READ_S", 0.2)
    client_ports = []
    app = FastAPI()

    async def never_ends():
        yield b'{"error": '
        await asyncio.Event().wait()

    @app.post("/v1/audio/speech")
    async def speech(request: Request) -> StreamingResponse:
        client_ports.append(request.client.port)
        return StreamingResponse(never_ends(), 429, {CAPACITY_FREE: "0"}, media_type="application/json")

    async with serve_app(app) as port:
        front = create_front_app([f"http://127.0.0.1:{port}"])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=front), base_url="http://front") as client:
            statuses = [(await client.post("/v1/audio/speech", json=body())).status_code for _ in range(3)]
    assert statuses == [429] * 3 and len(set(client_ports)) == 3

async def test_every_reply_and_handshake_says_the_free_capacity(snac_server):
    engine = ScriptedEngineDouble(frames=200, frames_per_batch=1, batch_delay_s=0.02)  # 4 s streams
    async with serving(snac_server, engine, max_streams=3) as served, httpx.AsyncClient(base_url=served.url, timeout=30) as http:
        assert (await http.get("/health")).headers[CAPACITY_FREE] == "3"
        async with http.stream("POST", "/v1/audio/speech", json=body()) as first:
            assert first.status_code == 200 and first.headers[CAPACITY_FREE] == "2"  # after its own admission
            async with connect(served.url.replace("http", "ws") + "/tts/websocket") as ws:
                assert ws.response.headers[CAPACITY_FREE] == "2"  # a socket holds no slot until it speaks
            async with http.stream("POST", "/v1/audio/speech", json=body()) as second, \
                    http.stream("POST", "/v1/audio/speech", json=body()) as third:
                assert (second.status_code, third.status_code) == (200, 200)
                refused = await http.post("/v1/audio/speech", json=body())
                assert refused.status_code == 429 and refused.headers[CAPACITY_FREE] == "0"


async def _until(condition, within_s: float = 60.0) -> None:
    """Poll until `condition()`; the bound only keeps a broken build from hanging."""
    for _ in range(int(within_s / 0.05)):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met")


async def test_an_engine_slower_than_real_time_brings_the_limit_down_and_refusals_say_why(snac_server, caplog):
    """35 tokens/s a stream (real time is 82): the limit falls under the 4 streams held, counted and logged as a
    pace below target; a new stream is refused for capacity, counted by cause; the pace gauge says how far
    behind, the used-capacity gauge (the autoscaler's) how far over."""
    caplog.set_level(logging.INFO, logger="llm_server.runtime")
    engine = ScriptedEngineDouble(frames=400, frames_per_batch=1, batch_delay_s=0.2)  # 7 tokens / 0.2 s
    async with serving(snac_server, engine, max_streams=8, min_streams=1, initial_streams=4, target_pace=1.03,
                       capacity_window_s=0.25, listener_lag_s=0) as served, httpx.AsyncClient(base_url=served.url, timeout=60) as http:
        admission, registry = served.runtime.admission, served.runtime.metrics.registry
        streams = [asyncio.create_task(http.post("/v1/audio/speech", json=body())) for _ in range(4)]
        await _until(lambda: admission.active == 4)
        await _until(lambda: admission.max_streams < 4)
        refused = await http.post("/v1/audio/speech", json=body())
        assert refused.status_code == 429 and "retry-after" in refused.headers
        assert registry.get_sample_value("megapod_worker_refusals_total", {"cause": "capacity"}) >= 1
        assert registry.get_sample_value("megapod_worker_pace_ratio") < 1.0
        assert registry.get_sample_value("megapod_worker_capacity_streams") == admission.max_streams
        # what the autoscaler reads: past 1 here, as the limit fell below the streams held
        assert registry.get_sample_value("megapod_worker_capacity_used_ratio") == 4 / admission.max_streams > 1
        assert registry.get_sample_value("orpheus_capacity_limit_changes_total", {"reason": "pace_below_realtime"}) >= 1
        assert registry.get_sample_value("orpheus_capacity_limit_changes_total", {"reason": "listener_behind"}) == 0
        moves = [r.getMessage() for r in caplog.records if r.getMessage().startswith("admission limit 4 -> ")]
        assert moves and "pace_below_realtime (pace 0." in moves[0] and "against real time 1.000 and a target of 1.030" in moves[0], moves
        for stream in streams:
            stream.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        await _until(lambda: admission.active == 0)


async def test_an_engine_ahead_of_real_time_lets_the_limit_grow_under_demand(snac_server):
    """280 tokens/s a stream: with two streams held and a third refused, the limit grows and the third
    is admitted on a later try, never past the ceiling."""
    engine = ScriptedEngineDouble(frames=200, frames_per_batch=2, batch_delay_s=0.05)  # 5 s streams
    async with serving(snac_server, engine, max_streams=3, min_streams=1, initial_streams=2, target_pace=1.03,
                       capacity_window_s=0.5, listener_lag_s=0) as served, httpx.AsyncClient(base_url=served.url, timeout=60) as http:
        admission = served.runtime.admission
        held = [asyncio.create_task(http.post("/v1/audio/speech", json=body())) for _ in range(2)]
        await _until(lambda: admission.active == 2)
        assert (await http.post("/v1/audio/speech", json=body())).status_code == 429  # demand meets the limit
        await _until(lambda: admission.max_streams == 3)
        third = await http.post("/v1/audio/speech", json=body("Hi."))
        assert third.status_code == 200 and admission.max_streams == 3  # the ceiling
        assert served.runtime.metrics.registry.get_sample_value("orpheus_capacity_limit_changes_total",
                                                                {"reason": "growth"}) >= 1
        await asyncio.gather(*held)


async def test_a_body_the_worker_cuts_mid_stream_ends_incomplete_at_the_client_with_one_line_said(caplog):
    """Issue 43, item 4: a worker ends a stream that failed after its audio went out without the body's last chunk
    (how HTTP says incomplete). The front passes the cut on, its client's body ends incomplete too, and the front
    says so in one warning: no 'Exception in ASGI application' traceback, no second line from uvicorn."""
    caplog.set_level(logging.INFO)

    async def cut_worker(scope, receive, send):  # raw ASGI: the start, one chunk, then returns as a cut reply does
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] != "/v1/audio/speech":  # the front's probes: answered whole
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"audio/pcm")]})
        await send({"type": "http.response.body", "body": b"\x01\x00" * 2048, "more_body": True})

    async with serve_app(cut_worker) as worker_port:
        async with serve_app(create_front_app([f"http://127.0.0.1:{worker_port}"])) as front_port:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{front_port}", timeout=30) as client:
                got = bytearray()
                with pytest.raises(httpx.RemoteProtocolError):
                    async with client.stream("POST", "/v1/audio/speech", json=body()) as reply:
                        assert reply.status_code == 200
                        async for chunk in reply.aiter_raw():
                            got += chunk
    assert bytes(got) == b"\x01\x00" * 2048, "the audio before the cut reached the client"
    front_lines = [r.getMessage() for r in caplog.records if r.name == "orpheus_front.front" and "cut" in r.getMessage()]
    assert len(front_lines) == 1 and "incomplete" in front_lines[0], front_lines
    assert not [r for r in caplog.records if "Exception in ASGI application" in r.getMessage()]
    incomplete = [r for r in caplog.records if r.getMessage() == "ASGI callable returned without completing response."]
    assert len(incomplete) == 1, "the worker double's own line only: the front's deliberate cut is not news"


async def test_a_request_past_the_limit_waits_for_the_slot_that_frees_instead_of_a_429(snac_server):
    """Issue 43, fairness: past the limit an HTTP request waits in the worker's queue (admission_queue_s) and gets
    the slot the next stream to end gives back; the queue shows on /metrics; past its wait it is refused, with
    nothing held."""
    engine = ScriptedEngineDouble(frames=40, frames_per_batch=1, batch_delay_s=0.05)  # 2 s streams
    async with serving(snac_server, engine, max_streams=1, admission_queue_s=30.0) as served, \
            httpx.AsyncClient(base_url=served.url, timeout=60) as http:
        admission, registry = served.runtime.admission, served.runtime.metrics.registry
        first = asyncio.create_task(http.post("/v1/audio/speech", json=body()))
        await _until(lambda: admission.active == 1)
        second = asyncio.create_task(http.post("/v1/audio/speech", json=body()))
        await _until(lambda: admission.queued == 1)
        assert registry.get_sample_value("megapod_worker_queued_streams") == 1
        no_wait = await http.post("/v1/audio/speech", json=body(), headers={ADMISSION_WAIT: "0"})
        assert no_wait.status_code == 429, "a caller that asks not to wait (the front, for its other workers) is not queued"
        replies = await asyncio.gather(first, second)
        assert [r.status_code for r in replies] == [200, 200] and all(len(r.content) > 0 for r in replies)
        assert admission.active == 0 and admission.queued == 0
        assert registry.get_sample_value("megapod_worker_refusals_total", {"cause": "capacity"}) == 1


async def test_a_request_the_client_says_it_retried_gets_the_slot_before_one_that_came_first(snac_server):
    """Issue 43, fairness at 2x: a client's retry count (RETRY_COUNT, as the openai SDK sends it) puts its request
    ahead of fresh ones in the worker's queue; a count that is not one is no count."""
    engine = ScriptedEngineDouble(frames=40, frames_per_batch=1, batch_delay_s=0.05)  # 2 s streams
    async with serving(snac_server, engine, max_streams=2, admission_queue_s=30.0) as served, \
            httpx.AsyncClient(base_url=served.url, timeout=60) as http:
        admission = served.runtime.admission
        asked = [asyncio.create_task(http.post("/v1/audio/speech", json=body("Holding."))) for _ in range(2)]
        await _until(lambda: admission.active == 2)
        asked.append(asyncio.create_task(http.post("/v1/audio/speech", json=body("Fresh."), headers={RETRY_COUNT: "-3"})))
        await _until(lambda: admission.queued == 1)
        asked.append(asyncio.create_task(http.post("/v1/audio/speech", json=body("Retried."), headers={RETRY_COUNT: "2"})))
        await _until(lambda: admission.queued == 2)
        replies = await asyncio.gather(*asked)
        assert [r.status_code for r in replies] == [200] * 4 and admission.active == admission.queued == 0
    said = ["".join(chr(i - 1000) for i in prompt if 1000 <= i < 2000) for prompt in engine.prompts.values()]
    assert ["Holding" in p for p in said] == [True, True, False, False]
    assert "Retried" in said[2] and "Fresh" in said[3], "started in this order: the retried request first"


async def test_a_client_that_leaves_while_it_waits_for_a_slot_leaves_the_queue_and_is_never_handed_one(snac_server):
    """Issue 43: a request waiting in the admission queue whose client goes away leaves the queue then, so the slot
    that frees goes to the next waiting (or stays free), not to a stream nobody will hear (an engine request and a
    codec session for nobody)."""
    engine = ScriptedEngineDouble(frames=40, frames_per_batch=1, batch_delay_s=0.05)  # 2 s streams
    async with serving(snac_server, engine, max_streams=1, admission_queue_s=30.0) as served, \
            httpx.AsyncClient(base_url=served.url, timeout=60) as http:
        admission = served.runtime.admission
        first = asyncio.create_task(http.post("/v1/audio/speech", json=body()))
        await _until(lambda: admission.active == 1)
        leaving = asyncio.create_task(http.post("/v1/audio/speech", json=body()))
        await _until(lambda: admission.queued == 1)
        leaving.cancel()  # the client closes its connection
        await _until(lambda: admission.queued == 0)
        assert not first.done(), "it left the queue while the slot was still held"
        assert (await first).status_code == 200
        await _until(lambda: admission.active == 0)
        await asyncio.sleep(0.3)
        assert admission.active == 0 and len(engine.prompts) == 1, "nobody's stream was started"


async def test_the_front_passes_the_openai_sdks_retry_count_to_every_worker_it_asks():
    """The openai SDK counts its retries of a refused request in RETRY_COUNT; the front passes it on, so a worker's
    queue can put the request ahead of fresh ones."""
    counts: list[str | None] = []
    app = FastAPI()

    @app.post("/v1/audio/speech")
    async def speech(request: Request) -> Response:
        counts.append(request.headers.get(RETRY_COUNT))
        return Response(b"{}", 429, {CAPACITY_FREE: "0", "retry-after": "1"}, media_type="application/json")

    async with serve_app(app) as one, serve_app(app) as two:
        front = create_front_app([f"http://127.0.0.1:{port}" for port in (one, two)])
        http_client = httpx.AsyncClient(transport=httpx.ASGITransport(app=front))
        client = openai.AsyncOpenAI(base_url="http://front/v1", api_key="unused", max_retries=1, http_client=http_client)
        with pytest.raises(openai.RateLimitError):
            await client.audio.speech.create(model="tts-1", voice="tara", input="Hello.", response_format="pcm")
        await http_client.aclose()
    assert counts == ["0", "0", "1", "1"]


async def test_the_front_lets_only_its_first_choice_of_worker_queue_a_request():
    """Every worker at its limit: the request may wait at the first worker tried (the most free); the others are
    asked not to queue it (ADMISSION_WAIT 0), so it waits once and not once a worker."""
    asked: list[str | None] = []
    app = FastAPI()

    @app.post("/v1/audio/speech")
    async def speech(request: Request) -> Response:
        asked.append(request.headers.get(ADMISSION_WAIT))
        return Response(b"{}", 429, {CAPACITY_FREE: "0"}, media_type="application/json")

    async with serve_app(app) as one, serve_app(app) as two, serve_app(app) as three:
        front = create_front_app([f"http://127.0.0.1:{port}" for port in (one, two, three)])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=front), base_url="http://front") as client:
            assert (await client.post("/v1/audio/speech", json=body())).status_code == 429
    assert asked == [None, "0", "0"]
