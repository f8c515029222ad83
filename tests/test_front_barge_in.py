"""The front under what voice agents do (issue 28). Barge-in: a voice agent cuts a stream off mid-audio whenever its user
interrupts. Through `megapod front`, each cut stream kept its connection to the worker checked out of
the front's httpx pool and never told the worker: after 100 cuts (the pool's size) every stream got a
503 and the front's /ready said 503, for good, the worker idle all along. Load: httpx's default pool of
100 connections made every stream past the 100th wait for an earlier one to end, and /ready with them.

Over a test double of a worker (benchmarks/paced_worker.py: paced PCM that counts how each stream ended),
the real front, in its own process, as `megapod front` runs it."""

from __future__ import annotations

import asyncio
import sys

import httpx
import psutil
import pytest

from benchmarks.paced_worker import CHUNK_BYTES, CHUNKS, SPEECH_PATHS
from orpheus_front.front import KEEPALIVE, TIMEOUTS_TO_UNREADY, WorkerReadiness
from megapod.launcher import Child, free_ports

CUTS = 210  # past the pool's old 100, over every relayed path
AT_ONCE = 10
CONCURRENT = 300


@pytest.fixture(scope="module")
def front_and_worker(tmp_path_factory):
    logs = tmp_path_factory.mktemp("front-barge-in")
    worker_port, front_port = free_ports(2)
    worker = Child("paced-worker", [sys.executable, "-m", "benchmarks.paced_worker", str(worker_port)],
                   logs / "worker.log", f"http://127.0.0.1:{worker_port}/ready")
    front = Child("front", [sys.executable, "-m", "orpheus_front", "--host", "127.0.0.1", "--port", str(front_port),
                            "--workers", f"http://127.0.0.1:{worker_port}"], logs / "front.log",
                  f"http://127.0.0.1:{front_port}/ready")
    worker.start().wait_ready(60)
    front.start().wait_ready(60)
    try:
        yield front, f"http://127.0.0.1:{front_port}", f"http://127.0.0.1:{worker_port}"
    finally:
        front.stop()
        worker.stop()


async def _cut_after_first_chunk(http: httpx.AsyncClient, path: str) -> int:
    async with http.stream("POST", path, json={"input": "Hello there.", "voice": "tara"}) as reply:
        if reply.status_code == 200:
            async for _ in reply.aiter_raw():
                break  # the user interrupted: the agent drops the stream
        return reply.status_code


async def _whole(http: httpx.AsyncClient, path: str) -> tuple[int, int]:
    reply = await http.post(path, json={"input": "Hello there.", "voice": "tara"})
    return reply.status_code, len(reply.content)


def _worker_sockets(front: Child, worker_url: str) -> list[str]:
    port = int(worker_url.rsplit(":", 1)[1])
    return [c.status for c in psutil.Process(front.pid).net_connections("tcp") if c.raddr and c.raddr.port == port]


async def test_hundreds_of_cut_streams_reach_the_worker_and_leave_the_front_whole(front_and_worker):
    front, front_url, worker_url = front_and_worker
    async with httpx.AsyncClient(base_url=front_url, timeout=60) as http:
        statuses = []
        for i in range(0, CUTS, AT_ONCE):
            statuses += await asyncio.gather(*(_cut_after_first_chunk(http, SPEECH_PATHS[(i + j) % 3]) for j in range(AT_ONCE)))
        assert statuses == [200] * CUTS, {s: statuses.count(s) for s in set(statuses)}
        # Ordinary streams afterwards, all whole; while they play, the cut ones are over at the worker.
        whole = await asyncio.gather(*(_whole(http, path) for path in SPEECH_PATHS for _ in range(5)))
        assert whole == [(200, CHUNKS * CHUNK_BYTES)] * 15
        stats = (await http.get(f"{worker_url}/stats")).json()
        assert (await http.get("/ready")).status_code == 200
    # Each cut ended the worker's stream before its last chunk: the cut reached it (an event, not a clock:
    # a stream the worker never heard of being cut would have counted as whole).
    assert {k: stats[k] for k in ("active", "started", "whole", "cut")} == {"active": 0, "started": CUTS + 15, "whole": 15, "cut": CUTS}, stats
    # The front holds no connection the cuts left behind: none half-closed, no more than it keeps idle.
    sockets = _worker_sockets(front, worker_url)
    assert "CLOSE_WAIT" not in sockets and len(sockets) <= KEEPALIVE, sockets


async def test_300_concurrent_streams_none_waits_and_ready_answers_throughout(front_and_worker):
    """The worker double holds every stream after its first chunk until all 300 are open at once: a front
    whose pool kept streams past the 100th waiting for earlier ones to end would never get them there
    (the client's timeout, a hang guard, fails it); this front relays all 300 together, whole."""
    front, front_url, worker_url = front_and_worker
    process = psutil.Process(front.pid)
    cpu_before = sum(process.cpu_times()[:2])
    probes: list[int] = []

    async def stream(http: httpx.AsyncClient) -> int:
        size = 0
        async with http.stream("POST", "/v1/audio/speech", json={"input": "Hello there.", "voice": "tara"}) as reply:
            async for chunk in reply.aiter_raw():
                size += len(chunk)
        return size

    async def probe_until(done: asyncio.Future) -> None:
        # A hang guard, not the chart's 3 s: beside a busy test machine the front relaying 300 streams needs
        # more CPU than it gets (benchmarks/front_relay.py times /ready under load; the pool bug made it never answer)
        async with httpx.AsyncClient(base_url=front_url, timeout=30.0) as prober:
            while not done.done():
                try:
                    probes.append((await prober.get("/ready")).status_code)
                except httpx.TimeoutException:
                    probes.append(0)
                await asyncio.sleep(0.2)

    httpx.post(f"{worker_url}/hold", json={"streams": CONCURRENT}).raise_for_status()
    try:
        limits = httpx.Limits(max_connections=CONCURRENT + 10)
        async with httpx.AsyncClient(base_url=front_url, timeout=120, limits=limits) as http:
            streams = asyncio.gather(*(stream(http) for _ in range(CONCURRENT)))
            await asyncio.gather(streams, probe_until(streams))
        peak = httpx.get(f"{worker_url}/stats").json()["peak"]
    finally:
        httpx.post(f"{worker_url}/hold", json={"streams": 0}).raise_for_status()
    assert streams.result() == [CHUNKS * CHUNK_BYTES] * CONCURRENT
    assert peak == CONCURRENT, "all of them were open at the worker at once"
    assert probes and set(probes) == {200}, probes
    cpu_ms = 1000 * (sum(process.cpu_times()[:2]) - cpu_before) / CONCURRENT
    print(f"front CPU per relayed stream ({CHUNKS} chunks): {cpu_ms:.1f} ms")


async def test_a_worker_whose_probe_times_out_stays_ready_until_it_has_hung_for_good(front_and_worker):
    """The front's /ready asked each worker on demand with a 1 s timeout: beside a loaded machine one slow
    answer made it say 503 while its worker served. Now a timed-out probe counts only TIMEOUTS_TO_UNREADY in
    a row: through the first ones the front stays ready, then the hung worker is out, and back at its first
    answer. Judged by the probes the worker received, not by the clock."""
    _, front_url, worker_url = front_and_worker

    def probes() -> int:
        return httpx.get(f"{worker_url}/stats").json()["probes"]

    async def front_ready(http: httpx.AsyncClient) -> int:
        return (await http.get("/ready")).status_code

    async with httpx.AsyncClient(base_url=front_url, timeout=10.0) as http:
        assert await front_ready(http) == 200
        httpx.post(f"{worker_url}/ready_mode", json={"hung": True}).raise_for_status()
        try:
            first = probes()
            while probes() < first + TIMEOUTS_TO_UNREADY - 1:  # the probes that may time out without a verdict
                assert await front_ready(http) == 200
                await asyncio.sleep(0.1)
            assert await front_ready(http) == 200
            async with asyncio.timeout(60):  # a hang guard: the next probe times out within seconds
                while await front_ready(http) == 200:
                    await asyncio.sleep(0.2)
            assert await front_ready(http) == 503
        finally:
            httpx.post(f"{worker_url}/ready_mode", json={"hung": False}).raise_for_status()
        async with asyncio.timeout(60):
            while await front_ready(http) != 200:
                await asyncio.sleep(0.2)


def _readiness(handler) -> WorkerReadiness:
    """Probes through an httpx MockTransport (a test double of the workers' /ready answers)."""
    return WorkerReadiness(httpx.AsyncClient(transport=httpx.MockTransport(handler)), timeout_s=0.1, timeouts_to_unready=3)


async def test_a_refusal_or_a_503_is_believed_at_once_a_timeout_only_three_in_a_row():
    answers = {"http://a": 200, "http://b": 200}

    def handler(request: httpx.Request) -> httpx.Response:
        answer = answers[f"http://{request.url.host}"]
        if isinstance(answer, Exception):
            raise answer
        return httpx.Response(answer)

    readiness = _readiness(handler)
    assert not readiness.any_ready(["http://a"])  # never probed: not ready
    await readiness.probe(["http://a", "http://b"])
    assert readiness.any_ready(["http://a"]) and readiness.any_ready(["http://b"])
    answers["http://a"] = httpx.ConnectError("refused")
    answers["http://b"] = 503
    await readiness.probe(["http://a", "http://b"])
    assert not readiness.any_ready(["http://a", "http://b"])
    answers.update({"http://a": 200, "http://b": 200})
    await readiness.probe(["http://a", "http://b"])
    answers["http://a"] = httpx.ReadTimeout("slow")
    for _ in range(2):
        await readiness.probe(["http://a"])
        assert readiness.any_ready(["http://a"])
    answers["http://a"] = 200  # an answer resets the count
    await readiness.probe(["http://a"])
    answers["http://a"] = httpx.ReadTimeout("slow")
    for expected in (True, True, False):
        await readiness.probe(["http://a"])
        assert readiness.any_ready(["http://a"]) is expected
    await readiness.probe(["http://b"])  # a left the pool: forgotten
    assert not readiness.any_ready(["http://a"]) and readiness.any_ready(["http://b"])
    answers["http://c"] = httpx.ReadTimeout("slow")
    await readiness.probe(["http://b", "http://c"])  # c never answered...
    await readiness.probe(["http://b"])  # ...and left: nothing of it kept (pod addresses come and go)
    assert "http://c" not in readiness._timeouts
