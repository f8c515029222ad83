"""`megapod up` end to end (the session's, conftest.megapod: 2 workers and 2 codec replicas as processes),
driven through the front endpoint with the `openai` SDK and raw HTTP; a replica killed mid-stream;
Ctrl-C with a stream in flight, after every other test that uses the stack."""

from __future__ import annotations

import asyncio
import http.client
import io
import os
import re
import signal
import socket
import sys
import threading
import time
import wave
from pathlib import Path

import httpx
import openai
import pytest

from processes import MAX_MODEL_LEN, scrape

from llm_server.config import LlmServerConfig
from llm_server.speech.prompt import token_budget
from llm_server.speech.segmenter import split_sentences

from megapod.launcher import Child, free_block, free_ports, probe


def _wav_samples(data: bytes) -> int:
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        return len(w.readframes(10**9)) // 2


async def test_a_clone_made_through_the_front_is_every_workers_voice_and_speaks_through_the_openai_sdk(megapod):
    """POST /v1/voices over the front reaches one worker; the voices directory megapod up gives all of them
    carries it to the other within its poll; the OpenAI SDK then speaks in it on either, and DELETE ends it."""
    from test_clones import TRANSCRIPT, wav

    async with httpx.AsyncClient(base_url=megapod["url"], timeout=300) as http:
        made = await http.post("/v1/voices", data={"name": "front-clone", "transcript": TRANSCRIPT},
                               files={"audio": ("ref.wav", wav(1.0), "audio/wav")})
        assert made.status_code == 201, made.text
        for worker in megapod["llm"]:
            deadline = time.monotonic() + 30
            while "front-clone" not in [v["id"] for v in httpx.get(f"http://127.0.0.1:{worker.port}/v1/voices").json()["data"]]:
                assert time.monotonic() < deadline, f"worker {worker.port} never listed the clone"
                await asyncio.sleep(0.2)
        client = openai.AsyncOpenAI(base_url=f"{megapod['url']}/v1", api_key="unused", timeout=600)
        for _ in megapod["llm"]:  # the front spreads them: each worker likely speaks one
            async with client.audio.speech.with_streaming_response.create(
                    model="tts-1", voice="front-clone", input="Hello.", response_format="wav") as response:
                samples = _wav_samples(await response.read())
                assert samples > 0 and samples % 2048 == 0
        gone = await http.delete("/v1/voices/front-clone")
        assert gone.status_code == 200 and gone.json()["deleted"] is True
        assert (await http.delete("/v1/voices/front-clone")).status_code == 404


def _frames(megapod) -> float:
    return sum(scrape(worker.port, "orpheus_frames_total") for worker in megapod["llm"])


def test_random_weights_are_announced_loudly(megapod):
    assert "RANDOM WEIGHTS" in megapod["log"].read_text()


async def test_concurrent_streams_spread_over_both_workers(megapod):
    client = openai.AsyncOpenAI(base_url=f"{megapod['url']}/v1", api_key="unused", timeout=600)
    before = _frames(megapod)

    async def sdk(i):
        async with client.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input=f"Hello number {i}.", response_format="wav") as r:
            return r.headers["x-megapod-worker"], await r.read()

    async def raw(http, i):
        r = await http.post("/v1/audio/speech", json={"model": "orpheus", "input": f"Raw request {i}.", "voice": "tara", "response_format": "wav"})
        assert r.status_code == 200, r.text
        return r.headers["x-megapod-worker"], r.content

    async with httpx.AsyncClient(base_url=megapod["url"], timeout=600) as http:
        results = await asyncio.gather(*(sdk(i) for i in range(3)), *(raw(http, i) for i in range(3)))
    workers = {w for w, _ in results}
    assert len(workers) == 2, f"streams all went to {workers}"
    samples = sum(_wav_samples(data) for _, data in results)
    assert samples == 2048 * (_frames(megapod) - before), "every generated frame arrives as audio"


async def test_streams_cut_through_the_front_end_at_the_worker_and_its_engine(megapod):
    """Barge-in through the front (issue 28): four streams cut after their first chunk kept their worker
    streams and engine requests to their natural end (79 of 120 cut-and-retry requests then met the cap).
    The bound is a count, not a clock: each input is five sentences, each a segment that random weights speak
    to its token cap (its budget, within the workers' 1,024-token context), so running on would generate five
    caps; once the workers hold nothing, the four cut streams have generated less than two contexts' worth
    each, and the workers counted them as disconnected. (The bound was half of one short segment's budget: on
    the loaded two cores a cut stream generated 465 tokens of 918 before its abort landed.)"""
    ports = [worker.port for worker in megapod["llm"]]
    sentences = ("This first sentence is long enough that its speech takes the tiny model many seconds to generate, "
                 "because random weights never choose to stop speaking before the budget of the text is spent.",
                 "The second sentence is here so that a stream which kept on going after its listener had left would "
                 "go on to speak it as well, at the cost of another long segment of tokens that nobody will hear.",
                 "A third sentence moves the natural end of every stream further away again, so that the distance "
                 "between an abort that lands at once and no abort at all is many thousands of generated tokens.",
                 "The fourth sentence is one more segment of speech that no listener is waiting for, generated only "
                 "if the worker or its engine failed to notice that the client went away after its first chunk.",
                 "And the fifth sentence ends the input, five segments in all, each with a token budget larger than "
                 "the context of the session's workers allows, so that each of them is spoken to the workers' cap.")
    text = " ".join(sentences)
    assert split_sentences(text, LlmServerConfig().max_segment_chars) == list(sentences)
    assert all(token_budget(sentence) > MAX_MODEL_LEN for sentence in sentences)  # each spoken to its cap
    body = {"model": "orpheus", "voice": "tara", "response_format": "pcm", "input": text}

    def total(name: str) -> float:
        return sum(scrape(p, name) for p in ports)

    def held() -> float:  # streams and engine requests the workers hold
        return total("orpheus_active_streams") + total("orpheus_engine_unfinished_requests")

    def disconnected() -> float:
        return sum(scrape(p, "orpheus_requests_total", outcome="disconnected") for p in ports)

    tokens_before, disconnected_before = total("orpheus_generated_tokens_total"), disconnected()
    async with httpx.AsyncClient(base_url=megapod["url"], timeout=600) as http:
        async def cut() -> int:
            async with http.stream("POST", "/v1/audio/speech", json=body) as reply:
                async for _ in reply.aiter_raw():
                    break  # the user interrupted
                return reply.status_code

        assert await asyncio.gather(*(cut() for _ in range(4))) == [200] * 4
    while await asyncio.to_thread(held):  # an unreleased stream ends too, at its budget: the counts below tell
        await asyncio.sleep(0.05)
    spent = await asyncio.to_thread(total, "orpheus_generated_tokens_total") - tokens_before
    assert spent < 4 * 2 * MAX_MODEL_LEN, (f"the cut streams generated {spent} tokens: more than two {MAX_MODEL_LEN}-token "
                                           f"contexts each, of the five segments running on would have spoken")
    assert await asyncio.to_thread(disconnected) - disconnected_before == 4


async def test_a_killed_replica_loses_no_audio_and_is_restarted(megapod):
    before = _frames(megapod)
    replica = megapod["snac"][0]
    victim, restarts = replica.pid(), replica.restarts()

    async def stream(http, i):
        r = await http.post("/v1/audio/speech", json={"model": "orpheus", "input": f"Keep talking through the failure, stream {i}.", "voice": "leo", "response_format": "wav"})
        assert r.status_code == 200, r.text
        return _wav_samples(r.content)

    async def kill_soon():
        await asyncio.sleep(4)
        os.kill(victim, signal.SIGKILL)

    try:
        async with httpx.AsyncClient(base_url=megapod["url"], timeout=600) as http:
            lengths, _ = await asyncio.gather(asyncio.gather(*(stream(http, i) for i in range(4))), kill_soon())
    finally:  # the launcher logs the death when it notices it, which can be after the streams ended
        replica.wait_restarted(restarts + 1, within_s=120)  # the session's later tests use both replicas
    assert all(n > 0 and n % 2048 == 0 for n in lengths)
    assert sum(lengths) == 2048 * (_frames(megapod) - before), "no audio lost across the replica's death"
    assert f"snac-0 (pid {victim}) died with exit code -9" in megapod["log"].read_text()


def test_the_front_keeps_an_idle_connection_past_a_client_pools_expiry(megapod):
    """A connection idle for longer than httpx keeps one in its pool (5 s) is still the front's. uvicorn's
    default keep-alive, 5 s too, had `megapod up`'s front close such connections as pooled clients sent
    their next request down them: under load a soak's knock now and then met a reset (ReadError) and never
    reached a worker (issue 23). The idle time is the client's, so the test waits for it. http.client
    keeps one socket and never reconnects by itself: the second reply comes down the first connection."""
    front = http.client.HTTPConnection(*megapod["url"].removeprefix("http://").split(":"), timeout=30)
    try:
        front.request("GET", "/health")
        assert front.getresponse().read() and front.sock is not None
        idle = front.sock
        time.sleep(httpx.Limits().keepalive_expiry + 1.0)
        try:
            front.request("GET", "/health")
            reply = front.getresponse()
        except (http.client.RemoteDisconnected, ConnectionError) as exc:
            pytest.fail(f"the front closed an idle connection a client pool still holds: {exc!r}")
        assert reply.status == 200 and front.sock is idle
    finally:
        front.close()


def test_children_share_the_launchers_session_in_groups_of_their_own(megapod):
    """Own process groups keep the terminal's Ctrl-C away from them; one session keeps them in one
    scheduler autogroup (a replica in a session of its own starved beside a CPU worker)."""
    children = [int(p) for p in re.findall(r"started \S+ \(pid (\d+)\)", megapod["log"].read_text())]
    live = [pid for pid in children if Path(f"/proc/{pid}").exists()]
    assert live
    for pid in live:
        assert os.getsid(pid) == os.getsid(megapod["proc"].pid)
        assert os.getpgid(pid) == pid != os.getpgid(megapod["proc"].pid)


def test_with_no_gpu_each_engines_model_thread_runs_below_the_codec_replicas(megapod):
    """Issue 43: the engine's model thread (its EngineCore process's main thread) at --cpu-engine-nice 5; the
    workers' HTTP loops and the codec replicas, which deliver the audio owed now, at the launcher's own."""
    import psutil

    launcher = psutil.Process(megapod["proc"].pid)
    descendants = launcher.children(recursive=True)
    engines = [p for p in descendants if "EngineCore" in " ".join(p.cmdline())]
    servers = [p for p in descendants if {"llm_server", "snac_server"} & set(p.cmdline())]
    assert len(engines) == 2 and len(servers) == 4, (engines, servers)
    assert [p.nice() for p in engines] == [launcher.nice() + 5] * 2
    assert [p.nice() for p in servers] == [launcher.nice()] * 4


@pytest.mark.stops_the_megapod
def test_ctrl_c_drains_a_stream_in_flight_then_stops_everything_without_a_kill(megapod):
    """Ctrl-C drains: the front first, then the workers (their streams need the codec tier), then the replicas,
    each on SIGTERM. A stream in flight at a worker gets all its audio (as long as the same seed's undisturbed
    run), the worker refuses new connections meanwhile, and every child exits by itself (code 0): the launcher
    kills one only past grace + 5 s (Launcher.stop). The bounds are events, not wall-clock figures
    (a 20 s one failed beside `stress-ng --cpu 2`, with a load of 14)."""
    worker = megapod["llm"][0]
    url = f"http://127.0.0.1:{worker.port}/v1/audio/speech"
    # Random weights speak to each sentence's token budget: five sentences, so that on an idle machine too the stream
    # outlasts the time from Ctrl-C to the worker's SIGTERM (one sentence did not: the drain found nothing in flight).
    text = " ".join(f"Draining should let sentence {n} finish before the worker exits." for n in range(1, 6))
    body = {"model": "tts-1", "input": text, "voice": "leo", "response_format": "pcm", "seed": 4242}
    undisturbed = httpx.post(url, json=body, timeout=300).content
    audio, errors, flowing = bytearray(), [], threading.Event()

    def listen() -> None:
        try:
            with httpx.stream("POST", url, json=body, timeout=300) as r:
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
    children = [int(p) for p in re.findall(r"started \S+ \(pid (\d+)\)", megapod["log"].read_text())]
    megapod["proc"].send_signal(signal.SIGINT)
    refused_in_flight = _refused_while(listener.is_alive, f"http://127.0.0.1:{worker.port}/ready")
    listener.join(180)
    megapod["proc"].wait(3 * (megapod["grace_s"] + 5) + 30)  # the front's drain, the launcher's worst case, its exit
    assert not errors, errors
    assert refused_in_flight, "the worker did not refuse a new connection while its stream was in flight"
    assert len(undisturbed) > 0 and len(undisturbed) % (2 * 2048) == 0, "whole frames"
    assert len(audio) == len(undisturbed), f"{len(audio)} bytes after the drain, {len(undisturbed)} undisturbed"
    assert any(audio), "audio, not silence"
    assert megapod["proc"].returncode == 0
    log = megapod["log"].read_text()
    assert "all MegaPod processes stopped" in log and "killing it" not in log
    assert all(f"{part.name} stopped with exit code 0" in log for part in megapod["llm"] + megapod["snac"]), log[-3000:]
    assert "draining in-flight streams" in worker.log_path.read_text()
    for pid in children:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def _refused_while(in_flight, ready_url: str) -> bool:
    """Ask `ready_url` until its server refuses a connection; whether that came while in_flight() held."""
    while in_flight():
        try:
            httpx.get(ready_url, timeout=2)
            time.sleep(0.05)
        except httpx.TimeoutException:  # accepted just before the listener closed, on a busy CPU: ask again
            pass
        # Refused; or accepted into the backlog as the listener closed, then reset or closed unanswered.
        except httpx.TransportError:
            return in_flight()
    return False


# -- the launcher's Child (how `megapod up`, the tests and the benchmarks start servers) --------------


def test_a_child_is_ready_in_a_process_group_of_its_own_and_stops_on_sigterm(tmp_path):
    port = free_ports(1)[0]
    child = Child("http.server", [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
                  tmp_path / "http.log", f"http://127.0.0.1:{port}/", cwd=tmp_path).start()
    try:
        child.wait_ready(600)
        assert child.port == port and child.alive()
        assert os.getpgid(child.pid) == child.pid and os.getsid(child.pid) == os.getsid(0)
    finally:
        assert child.stop() == -signal.SIGTERM
    assert not child.alive() and not probe(child.ready_url)


def test_free_ports_are_never_ones_the_kernel_hands_out_by_itself():
    """A worker binds its port only after vLLM has started (tens of seconds): a port from the ephemeral
    range could be taken meanwhile by the kernel for anyone's outgoing connection or bind(0) (in CI it
    was: "address already in use"). Ours come from below that range, distinct and free."""
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    if ephemeral_low <= 20001:  # the launcher then falls back to 10000-20000, which overlaps the range
        pytest.skip(f"this kernel hands out ports from {ephemeral_low}: no fixed range below it to test")
    ports = free_ports(64)
    assert len(set(ports)) == 64 and all(10000 <= p < ephemeral_low for p in ports)
    base = free_block(8, avoid=ports)
    assert base + 8 <= ephemeral_low and set(ports).isdisjoint(range(base, base + 8))
    for port in [*ports, *range(base, base + 8)]:
        socket.create_server(("127.0.0.1", port)).close()


def test_a_child_that_exits_during_start_up_fails_wait_ready_with_its_log_tail(tmp_path):
    script = "print('no such model: tiny-typo'); raise SystemExit(3)"
    child = Child("early", [sys.executable, "-c", script], tmp_path / "early.log",
                  f"grpc://127.0.0.1:{free_ports(1)[0]}").start()
    with pytest.raises(RuntimeError, match=r"early exited with 3 during start-up(?s:.*)no such model: tiny-typo"):
        child.wait_ready(600)


def _child_with_an_engine(tmp_path, name: str, on_sigterm: str) -> tuple[Child, int]:
    """As vLLM's engine processes under a worker: the grandchild holds a pipe's only write end, so a read
    of the returned end ends empty when it is killed, or with its words if it outlived the child."""
    fifo = tmp_path / "engine"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    engine = (f"import os, time; pipe = os.open({str(fifo)!r}, os.O_WRONLY); print('engine up', flush=True); "
              "time.sleep(60); os.write(pipe, b'outlived its parent')")
    script = (f"import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, {on_sigterm}); "
              f"subprocess.Popen([sys.executable, '-c', {engine!r}]); time.sleep(600)")
    child = Child(name, [sys.executable, "-c", script], tmp_path / f"{name}.log").start()
    while "engine up" not in child.tail():  # the engine started and holds the pipe
        assert child.alive(), child.tail()
        time.sleep(0.05)
    return child, reader


def _engine_words(reader: int) -> bytes:
    os.set_blocking(reader, True)
    return os.read(reader, 64)


def test_stop_kills_a_child_that_ignores_sigterm_and_what_it_started(tmp_path):
    child, reader = _child_with_an_engine(tmp_path, "stubborn", "signal.SIG_IGN")
    assert child.stop(signal.SIGTERM, timeout_s=1.0) == -signal.SIGKILL
    assert not child.alive()
    assert _engine_words(reader) == b""


def test_stop_kills_what_a_child_left_behind_when_it_exited_on_sigterm(tmp_path):
    """A server that exits on SIGTERM without stopping its own child: the group is swept after it."""
    child, reader = _child_with_an_engine(tmp_path, "careless", "lambda *_: sys.exit(0)")
    assert child.stop(signal.SIGTERM, timeout_s=30.0) == 0
    assert _engine_words(reader) == b""
