"""The codec client against replicas that hang (SIGSTOP) instead of dying, as real processes.

A hung replica keeps its connections open and never answers, so only deadlines notice it:
the stream's stall timeout (owed audio, none arriving) and the channel's keepalive pings.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
import pytest
from conftest import random_frames
from processes import hang, scrape, snac_process, unhang, wait_metric_zero

from llm_server.speech.codec_client import CodecClient, CodecClientConfig
from codec_contract.api import codec_pb2

# Long enough that a healthy replica on a busy 2-core CI machine (about 1 s per chunk with
# four streams) never trips it; far shorter than keepalive's 10 s + 5 s.
STALL_S = 4.0
# The streaming decoder owes no audio until 3 frames are in (the first 4,757 samples wait for context).
IDLE_FRAMES = 2


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Two snac-server processes on loopback; each test leaves them running (SIGCONT'd)."""
    log_dir = tmp_path_factory.mktemp("snac-logs")
    procs = [snac_process(None, "--grace-s", "1").start(log_dir) for _ in range(2)]
    try:
        for proc in procs:
            proc.wait_ready()
        yield procs
    finally:
        for proc in procs:
            unhang(proc)
            proc.stop(timeout_s=10)


def _client(replicas, **kw) -> CodecClient:
    config = CodecClientConfig(
        addresses=",".join(f"127.0.0.1:{p.port}" for p in replicas),
        sample_format=codec_pb2.SAMPLE_FORMAT_F32LE, stall_timeout_s=STALL_S, **kw,
    )
    return CodecClient(config)


async def _run(client: CodecClient, frames: np.ndarray, seed: int, produce=None, on_chunk=None):
    """One stream to its final chunk: (audio, chunks, arrival times, stream)."""
    stream = client.stream(seed)

    async def paced():
        for i in range(0, len(frames), 2):
            await stream.send(frames[i : i + 2])
            await asyncio.sleep(0.03)
        await stream.end()

    producer = asyncio.create_task(produce(stream) if produce else paced())
    chunks, arrivals = [], []
    async for chunk in stream.chunks():
        chunks.append(chunk)
        arrivals.append(time.monotonic())
        if on_chunk:
            await on_chunk(chunk)
    await producer
    return np.concatenate([np.frombuffer(c.pcm, "<f4") for c in chunks]), chunks, arrivals, stream


def _assert_whole(chunks, n_frames: int) -> None:
    """Every sample exactly once, in order: each chunk starts where the previous one ended."""
    starts = [c.first_sample for c in chunks]
    assert starts == list(np.cumsum([0] + [c.num_samples for c in chunks[:-1]]))
    assert sum(c.num_samples for c in chunks) == n_frames * 2048 and chunks[-1].final


async def test_an_idle_stream_is_not_failed_over(replicas):
    """Too few frames for any sample to be final, then nothing for longer than the stall timeout: no
    audio is owed yet."""
    frames = random_frames(20, seed=7)
    client = _client(replicas)
    try:
        undisturbed, _, _, _ = await _run(client, frames, seed=3)
        resumed_at = []

        async def idle_then_finish(stream):
            await stream.send(frames[:IDLE_FRAMES])  # the first sample's right context is not in yet
            await asyncio.sleep(2 * STALL_S)
            resumed_at.append(time.monotonic())
            for i in range(IDLE_FRAMES, len(frames), 2):
                await stream.send(frames[i : i + 2])
            await stream.end()

        audio, chunks, arrivals, stream = await _run(client, frames, seed=3, produce=idle_then_finish)
        assert client.owed_wait_s < STALL_S, "idle, no audio owed: no wait counted against the codec's pace"
    finally:
        await client.close()
    assert stream.failovers == 0
    assert arrivals[0] >= resumed_at[0]  # the replica really had nothing to send while idle
    _assert_whole(chunks, len(frames))
    assert np.abs(audio - undisturbed).max() <= 1e-4


async def test_a_hung_replica_is_failed_over_then_avoided(replicas, caplog):
    """SIGSTOP the replica serving a stream: it resumes elsewhere after the stall timeout, with the
    same audio; once keepalive has dropped the hung replica, new streams never go to it."""
    caplog.set_level(logging.WARNING, logger="llm_server.speech.codec_client")
    frames = random_frames(40, seed=42)
    client = _client(replicas)
    hung = []

    async def hang_the_serving_replica(chunk):
        if chunk.first_sample >= 8 * 2048 and not hung:
            active = [await asyncio.to_thread(scrape, p.metrics_port, "snac_active_streams") for p in replicas]
            assert sorted(active) == [0, 1], active  # exactly one replica has this stream
            hung.append(replicas[active.index(1)])
            hang(hung[0])
            hung.append(time.monotonic())

    try:
        undisturbed, _, _, _ = await _run(client, frames, seed=5)
        for p in replicas:  # the undisturbed stream has left both, so the active count names the victim
            assert await asyncio.to_thread(wait_metric_zero, p.metrics_port, "snac_active_streams", 5.0) == 0
        audio, chunks, _, stream = await _run(client, frames, seed=5, on_chunk=hang_the_serving_replica)

        assert stream.failovers >= 1
        assert client.owed_wait_s >= STALL_S, "the stall's silence counts in the codec's pace, though no chunk ended it"
        # The stall deadline moved it (a cause, not a clock: keepalive's would be UNAVAILABLE, a dead connection).
        assert "DEADLINE_EXCEEDED" in caplog.text
        _assert_whole(chunks, len(frames))
        assert audio.shape == undisturbed.shape == (40 * 2048,)
        assert np.abs(audio - undisturbed).max() <= 1e-4

        # Keepalive: a ping unanswered for 5 s (pings every 10 s) takes the hung replica's
        # connection down, and a new one never completes its handshake; round robin then sends
        # every new stream to the live replica, so none of them has to fail over.
        await asyncio.sleep(max(0.0, hung[1] + 18.0 - time.monotonic()))
        results = await asyncio.gather(*(_run(client, random_frames(12, seed=i), seed=i) for i in range(4)))
        assert [r[3].failovers for r in results] == [0, 0, 0, 0]
    finally:
        await client.close()
        if hung:
            unhang(hung[0])


async def test_a_replica_that_falls_behind_is_counted_late_not_failed_over(replicas):
    """SIGSTOP the serving replica for 1.5 s (under the stall timeout), then SIGCONT: the owed audio comes
    late (slower than target_pace 2: a chunk of a frame or two due within 0.26 s), which admission reads as
    a codec tier without headroom, and the stream goes on whole on the same replica."""
    pause_s = 1.5
    frames = random_frames(24, seed=11)
    client = _client(replicas, target_pace=2.0)
    paused, pausing = [], []

    async def slowly(stream):  # frames keep coming during the pause, so audio is owed throughout
        for i in range(0, len(frames), 2):
            await stream.send(frames[i : i + 2])
            await asyncio.sleep(0.2)
        await stream.end()

    async def pause(replica):
        hang(replica)
        await asyncio.sleep(pause_s)  # the stream's reader waits meanwhile, owed the audio of the frames sent
        unhang(replica)

    async def pause_the_serving_replica(chunk):
        if not paused:
            active = [await asyncio.to_thread(scrape, p.metrics_port, "snac_active_streams") for p in replicas]
            paused.append(replicas[active.index(1)])
            pausing.append(asyncio.create_task(pause(paused[0])))  # not in this callback: it holds the reader

    try:
        for p in replicas:  # earlier tests' streams have left, so the active count names this one's replica
            assert await asyncio.to_thread(wait_metric_zero, p.metrics_port, "snac_active_streams", 5.0) == 0
        _, chunks, _, stream = await _run(client, frames, seed=9, produce=slowly, on_chunk=pause_the_serving_replica)
        await asyncio.gather(*pausing)
    finally:
        await client.close()
        if paused:
            unhang(paused[0])
    assert stream.failovers == 0 and client.failovers == 0
    assert client.late >= 1, "the chunk held up by the pause came slower than the target pace"
    assert client.deliveries == len(chunks)
    _assert_whole(chunks, len(frames))


async def test_a_wait_on_a_hung_replica_counts_as_it_runs_and_stays_counted_when_the_stream_is_cancelled(replicas):
    """The codec's pace (admission's signal) sums the waits for owed audio: one still running counts as it runs, and
    a barge-in that cancels the stream mid-wait must not take it back (the sum stays monotone, or the window after
    it would see a negative wait and a hung codec would look healthy)."""
    frames = random_frames(40, seed=8)
    client = _client(replicas)
    stream = client.stream(8)
    victim = []

    async def produce():
        for i in range(0, len(frames), 2):
            await stream.send(frames[i : i + 2])
            await asyncio.sleep(0.05)

    producer = asyncio.create_task(produce())
    try:
        for p in replicas:  # earlier tests' streams have left, so the active count names this one's replica
            assert await asyncio.to_thread(wait_metric_zero, p.metrics_port, "snac_active_streams", 5.0) == 0
        chunks = stream.chunks()
        await anext(chunks)
        active = [await asyncio.to_thread(scrape, p.metrics_port, "snac_active_streams") for p in replicas]
        victim.append(replicas[active.index(1)])
        hang(victim[0])
        reader = asyncio.create_task(anext(chunks))
        await asyncio.sleep(1.5)  # under the stall timeout: no failover yet
        running = client.owed_wait_s
        assert running >= 1.0, running
        stream.cancel()
        assert client.owed_wait_s >= running, "the cancelled wait stays counted"
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        assert client.owed_wait_s >= running
    finally:
        producer.cancel()
        if victim:
            unhang(victim[0])
        await client.close()
