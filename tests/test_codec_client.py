"""The LLM tier's codec client against two real codec replicas on loopback."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest
import pytest_asyncio
from conftest import random_frames, server_config, waiting_for_first_audio

from codec_contract.api import codec_pb2
from llm_server.config import CPU_TARGET_PACE, GPU_TARGET_PACE, LlmServerConfig
from llm_server.runtime import codec_client_config
from llm_server.speech.codec_client import CodecClient, CodecClientConfig, CodecError, channel_target
from megapod.launcher import free_ports
from snac_server.server import build_server


@pytest_asyncio.fixture(scope="module")
async def replicas():
    """Two codec replicas; tests that kill one restart it on the same port."""
    servers = []
    for _ in range(2):
        server, port = build_server(server_config(metrics_port=-1))
        await server.start()
        server.port = port
        servers.append(server)
    yield servers
    for server in servers:
        await server.stop(grace_s=0)


def _client(replicas, **kw) -> CodecClient:
    addresses = ",".join(f"127.0.0.1:{s.port}" for s in replicas)
    return CodecClient(CodecClientConfig(addresses=addresses, sample_format=codec_pb2.SAMPLE_FORMAT_F32LE, **kw))


async def _run(client: CodecClient, frames: np.ndarray, seed: int, interval: float = 0.0, on_chunk=None):
    stream = client.stream(seed)

    async def produce():
        for i in range(0, len(frames), 2):
            await stream.send(frames[i : i + 2])
            await asyncio.sleep(interval)
        await stream.end()

    producer = asyncio.create_task(produce())
    chunks = []
    async for chunk in stream.chunks():
        chunks.append(chunk)
        if on_chunk:
            await on_chunk(chunk)
    await producer
    audio = np.concatenate([np.frombuffer(c.pcm, "<f4") for c in chunks])
    return audio, chunks, stream


def test_targets():
    assert channel_target("127.0.0.1:1,localhost:2") == "ipv4:127.0.0.1:1,127.0.0.1:2"
    assert channel_target("snac-headless.megapod.svc:50051") == "dns:///snac-headless.megapod.svc:50051"
    assert channel_target("dns:///x:1") == "dns:///x:1"


def test_worker_settings_reach_the_codec_client():
    config = codec_client_config(LlmServerConfig(
        snac="a:1,b:2", codec_stall_timeout_s=3.5, codec_tls_ca="ca.pem", codec_tls_cert="c.pem",
        codec_tls_key="k.pem", codec_tls_server_name="snac.test",
    ))
    assert (config.addresses, config.stall_timeout_s) == ("a:1,b:2", 3.5)
    assert config.listener_ahead_s == LlmServerConfig().codec_listener_ahead_s == 0.5
    assert codec_client_config(LlmServerConfig(codec_listener_ahead_s=0.0)).listener_ahead_s == 0.0
    assert (config.tls_ca, config.tls_cert, config.tls_key, config.tls_server_name) == (
        "ca.pem", "c.pem", "k.pem", "snac.test"
    )


async def test_a_replica_holding_a_stream_near_its_listener_is_not_counted_slow(replicas):
    """With listener_ahead_s a replica where other streams need rows (here one on each, the whole time) sends a
    stream's rows only as its listener (here at 0.25x) gets within 0.2 s of running out: the stream's chunks come at
    about its listener's pace, and the waits for them are counted from that moment, so the owed audio's pace reads the
    replica's own speed (a tiny random-weight codec, many times the listener's), not the listener's. Counted from when
    the audio became owed, as with no bound, it read about 1x."""
    pace, ahead_s = 0.25, 0.2
    client = _client(replicas, target_pace=pace, listener_ahead_s=ahead_s)
    frames = random_frames(24, seed=3)  # 2.05 s of audio: 8.2 s at 0.25x
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with contextlib.ExitStack() as others_need_rows:
            for replica in replicas:  # another stream on each, waiting for its first audio the whole time
                others_need_rows.enter_context(replica.service.streams.decoding(waiting_for_first_audio()))
            audio, chunks, _ = await _run(client, frames, seed=3)
        took = loop.time() - started
        reference, _, _ = await _run(_client(replicas), frames, seed=3)
    finally:
        await client.close()
    assert np.abs(audio - reference).max() <= 1e-4
    # Held: the last audio came no sooner than the listener needed it, less the bound (and the first row's wait).
    assert took >= (24 * 2048 / 24000 - ahead_s) / pace - 2.0
    assert client.owed_audio_s / client.owed_wait_s > 2 * pace, "the holds were counted as the replica's slowness"


def _served(server) -> float:
    return server.metrics.registry.get_sample_value("snac_streams_total", {"outcome": "ok"}) or 0.0


def _streams(server) -> float:
    """Decode streams a replica has finished, whatever their outcome."""
    registry = server.metrics.registry
    return sum(registry.get_sample_value("snac_streams_total", {"outcome": o}) or 0.0
               for o in ("ok", "cancelled", "error", "refused"))


async def test_streams_spread_over_both_replicas(replicas):
    """Round robin reaches both replicas. It picks among connected replicas only, and the second may
    still be connecting when the first streams start, so rounds go on until both served one."""
    client = _client(replicas)
    assert await client.ready()
    before = [_served(s) for s in replicas]
    for _ in range(5):
        await asyncio.gather(*(_run(client, random_frames(4, seed=i), i, 0.01) for i in range(4)))
        if all(_served(s) > b for s, b in zip(replicas, before)):
            break
    await client.close()
    assert [_served(s) > b for s, b in zip(replicas, before)] == [True, True]


async def test_killing_the_serving_replica_loses_no_audio(replicas):
    frames = random_frames(30, seed=42)
    client = _client(replicas)
    undisturbed, _, _ = await _run(client, frames, seed=5)
    killed = []

    async def kill_after_first_chunks(chunk):
        if chunk.first_sample >= 8 * 2048 and not killed:
            victim = next(s for s in replicas if s.service.active)
            killed.append(victim)
            await victim.grpc_server.stop(0)  # in-flight streams die with it

    audio, chunks, stream = await _run(client, frames, seed=5, interval=0.03, on_chunk=kill_after_first_chunks)
    await client.close()
    assert killed and stream.failovers >= 1
    assert [c.first_sample for c in chunks] == list(np.cumsum([0] + [c.num_samples for c in chunks[:-1]]))
    assert audio.shape == undisturbed.shape == (30 * 2048,)
    assert np.abs(audio - undisturbed).max() <= 1e-4
    # Bring the victim back on its port for later tests.
    victim = killed[0]
    idx = replicas.index(victim)
    server, port = build_server(server_config(metrics_port=-1, port=victim.port))
    await server.start()
    server.port = port
    replicas[idx] = server


async def test_invalid_input_is_not_retried(replicas):
    client = _client(replicas)
    stream = client.stream(1)
    await stream.send(np.full((1, 7), 5000))
    await stream.end()
    try:
        async for _ in stream.chunks():
            pass
    except CodecError as exc:
        assert "INVALID_ARGUMENT" in str(exc)
    else:
        raise AssertionError("out-of-range codes were accepted")
    finally:
        await client.close()


async def test_a_stream_opens_its_call_when_its_audio_is_read(replicas):
    """A speech stream generates its next sentence while the current one plays: frames sent to a
    stream nobody reads yet are kept, not decoded, so they take neither codec time nor a decoder slot."""
    client = _client(replicas)
    for _ in range(100):  # an earlier test's stream may still be ending on its replica (make test: counted here once)
        if not any(s.service.active for s in replicas):
            break
        await asyncio.sleep(0.05)
    before = [_streams(s) for s in replicas]
    frames = random_frames(12, seed=7)
    ahead = client.stream(5)
    await ahead.send(frames[:6])
    await ahead.send(frames[6:])
    await ahead.end()
    await asyncio.sleep(0.2)
    # No call open now, and none opened and finished meanwhile.
    assert [(s.service.active, _streams(s)) for s in replicas] == [(0, b) for b in before], "no call before its audio is wanted"
    chunks = [chunk async for chunk in ahead.chunks()]
    audio = np.concatenate([np.frombuffer(c.pcm, "<f4") for c in chunks])
    reference, _, _ = await _run(client, frames, seed=5)  # read while sent: rows split differently
    assert chunks[-1].final and len(audio) == len(reference) and np.abs(audio - reference).max() < 1e-5
    await client.close()


async def test_a_cancel_ends_a_stream_whose_call_is_still_waiting_for_a_replica():
    """Cancelled while its call waits to send its headers (wait_for_ready, no replica taking it yet):
    the reader ends at once and the producer is not held. grpc.aio 1.85 never wakes a write waiting
    there once its call is cancelled; the stream waited forever, and a worker's speech session with
    it (a slot leaked when a client left 40 ms into its request)."""
    nobody = free_ports(1)[0]  # nothing listens: the call never gets its headers out
    client = CodecClient(CodecClientConfig(addresses=f"127.0.0.1:{nobody}"))
    stream = client.stream(1)
    await stream.send(random_frames(4, seed=1))
    reader = asyncio.create_task(anext(stream.chunks()))  # opens the call; its first write waits
    await asyncio.sleep(0.5)
    assert not reader.done(), "the call should still be waiting for a replica"
    stream.cancel()
    # Hang guards, not timings: before the fix neither ever finished.
    with pytest.raises(CodecError, match="cancelled"):
        await asyncio.wait_for(reader, 30)
    await asyncio.wait_for(stream.send(random_frames(2, seed=2)), 30)
    await asyncio.wait_for(stream.end(), 30)
    await client.close()


def test_the_stall_timeout_and_the_admission_wait_are_slowed_as_the_target_pace_is():
    """On a CPU (slow motion, target 0.103) a first chunk takes two decode rounds of seconds each: a 10 s stall
    timeout failed healthy replicas over (26 of 39 failovers in an overload run, all at sample 0)."""
    gpu, cpu = LlmServerConfig(target_pace=GPU_TARGET_PACE), LlmServerConfig(target_pace=CPU_TARGET_PACE)
    assert gpu.resolved_codec_stall_timeout_s == pytest.approx(10.0)
    assert cpu.resolved_codec_stall_timeout_s == pytest.approx(100.0)
    assert codec_client_config(cpu).stall_timeout_s == pytest.approx(100.0)
    assert (gpu.resolved_admission_queue_s, cpu.resolved_admission_queue_s) == pytest.approx((0.3, 3.0))
    assert LlmServerConfig(codec_stall_timeout_s=2.0, target_pace=CPU_TARGET_PACE).resolved_codec_stall_timeout_s == 2.0


async def test_a_stream_longer_than_the_connections_age_finishes_on_it():
    """A replica retires a connection after max_connection_age_s (new streams go to a new one), and lets the
    streams on it finish within max_connection_age_grace_s. A stream at a CPU's slow motion lasts minutes: cut at
    the SIGTERM drain's grace instead, every stream in flight failed over each time a connection aged (issue 43)."""
    server, port = build_server(server_config(metrics_port=-1, max_connection_age_s=0.5, grace_s=0.2))
    await server.start()
    client = CodecClient(CodecClientConfig(addresses=f"127.0.0.1:{port}", sample_format=codec_pb2.SAMPLE_FORMAT_F32LE,
                                           stall_timeout_s=30))
    try:
        frames = random_frames(24, seed=5)
        audio, chunks, _ = await _run(client, frames, seed=5, interval=0.25)  # 3 s: six times the age
        _, later, _ = await _run(client, frames[:4], seed=6)  # and a new stream on the new connection
    finally:
        await client.close()
        await server.stop(grace_s=0)
    assert client.failovers == 0
    assert sum(c.num_samples for c in chunks) == 24 * 2048 and chunks[-1].final and later[-1].final
