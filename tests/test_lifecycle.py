"""snac-server as a process: ready, serving, and draining in-flight streams on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import grpc

from conftest import random_frames
from codec_contract.api import codec_pb2_grpc
from codec_contract.client import decode, header_request, paced_requests
from codec_contract.audio import FRAME_SAMPLES
from megapod.launcher import Child, free_ports


async def test_sigterm_drains_in_flight_streams_then_exits(tmp_path):
    port = free_ports(1)[0]
    replica = Child("snac-server", [sys.executable, "-m", "snac_server", "--host", "127.0.0.1", "--port", str(port),
                                    "--metrics-port", "-1", "--device", "cpu", "--grace-s", "30"],
                    tmp_path / "snac.log", f"grpc://127.0.0.1:{port}", {"PYTHONUNBUFFERED": "1"})
    try:
        await asyncio.to_thread(replica.start().wait_ready, 90)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = codec_pb2_grpc.SnacCodecStub(ch)
            frames = random_frames(16, seed=1)
            # Frames trickle in over ~1.6 s, so SIGTERM lands while the stream is mid-way.
            stream = asyncio.create_task(decode(stub, paced_requests(header_request(3), frames, 1, 0.1)))
            await asyncio.sleep(0.5)
            replica.popen.send_signal(signal.SIGTERM)
            result = await stream
        assert result.chunks[-1].final
        assert len(result.audio()) == 16 * FRAME_SAMPLES
        assert await asyncio.to_thread(replica.popen.wait, 30) == 0, replica.tail()
    finally:
        replica.stop(signal.SIGKILL)


# A runner whose warm-up raises as CUDA Graph capture did on GPUs (a test double for a broken GPU).
FAILING_WARM_UP = """
import sys
from snac_server import runner, server

def broken_warm_up(self):
    raise RuntimeError("operation not permitted when stream is capturing")

runner.DecoderRunner.warm_up = broken_warm_up
server.main(sys.argv[1:])
"""


def test_a_failed_warm_up_ends_the_process_non_zero_with_the_error_in_the_log():
    args = ["--host", "127.0.0.1", "--port", str(free_ports(1)[0]), "--metrics-port", "0", "--device", "cpu"]
    done = subprocess.run([sys.executable, "-c", FAILING_WARM_UP, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "decoder warm-up failed" in done.stderr
    assert "operation not permitted when stream is capturing" in done.stderr


async def test_health_is_never_serving_when_warm_up_failed(monkeypatch):
    from grpc_health.v1 import health_pb2 as pb

    from conftest import server_config
    from snac_server.batcher import WarmUpFailed
    from snac_server.runner import DecoderRunner
    from snac_server.server import build_server

    def broken_warm_up(self):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(DecoderRunner, "warm_up", broken_warm_up)
    server, _ = build_server(server_config())
    try:
        await server.start()
    except WarmUpFailed as exc:
        assert "no kernel image" in str(exc)
    else:
        raise AssertionError("start() returned after a failed warm-up")
    reply = await server.health.Check(pb.HealthCheckRequest(service=""), None)
    assert reply.status != pb.HealthCheckResponse.SERVING
    assert server.metrics_http is None, "the metrics endpoint is closed again"
