"""TLS on the codec link: server certificates, required client certificates, rotation without restart.

Certificates are made per test module with `cryptography`: a CA signing the server's certificate
(for the name snac.test, not the address, as in a cluster) and the clients' certificates, and a
second, untrusted CA.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
import pytest_asyncio
from conftest import random_frames, server_config
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llm_server.speech.codec_client import CodecClient, CodecClientConfig
from codec_contract.api import codec_pb2, codec_pb2_grpc
from codec_contract.client import channel
from codec_contract.client import SERVICE
from snac_server.config import SnacServerConfig
from snac_server.metrics import SnacMetrics
from snac_server.server import build_runner, build_server

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVER_NAME = "snac.test"


class Authority:
    """A throwaway CA that writes itself and the certificates it signs as PEM files."""

    def __init__(self, directory: Path, name: str) -> None:
        self.dir = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.cert = self._builder(self.name, self.key.public_key()).add_extension(
            x509.BasicConstraints(ca=True, path_length=None), critical=True
        ).sign(self.key, hashes.SHA256())
        self.ca_file = self._write(f"{name}.crt", self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, server: bool) -> tuple[str, str]:
        """A leaf certificate for `name` (a DNS name for servers); returns (cert file, key file)."""
        key = ec.generate_private_key(ec.SECP256R1())
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = self._builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]), key.public_key())
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return (self._write(f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM)),
                self._write(f"{name}.key", key_pem))

    def _builder(self, subject: x509.Name, public_key) -> x509.CertificateBuilder:
        now = datetime.datetime.now(datetime.UTC)
        return (
            x509.CertificateBuilder().subject_name(subject).issuer_name(self.name).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        )

    def _write(self, filename: str, data: bytes) -> str:
        path = self.dir / f"{self.name.rfc4514_string()}-{filename}"
        path.write_bytes(data)
        return str(path)


def _replace(target: str, source: str) -> None:
    """Rotate a file the way a Secret update does: the new content appears at once, with a new mtime."""
    tmp = f"{target}.new"
    Path(tmp).write_bytes(Path(source).read_bytes())
    os.replace(tmp, target)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    ca, other = Authority(directory, "megapod-ca"), Authority(directory, "other-ca")
    return {
        "ca": ca, "other": other,
        "server": ca.issue(SERVER_NAME, server=True),
        "client": ca.issue("llm-worker", server=False),
        "other_client": other.issue("intruder", server=False),
    }


@pytest_asyncio.fixture(scope="module")
async def tls_server(pki):
    """A codec server that speaks only TLS and requires a client certificate from megapod-ca."""
    cert, key = pki["server"]
    server, port = build_server(
        server_config(metrics_port=-1, tls_cert=cert, tls_key=key, tls_client_ca=pki["ca"].ca_file)
    )
    await server.start()
    server.address = f"127.0.0.1:{port}"
    yield server
    await server.stop(grace_s=0)


async def _health(ch: grpc.aio.Channel, service: str = SERVICE) -> object:
    """A service's health over `ch` (the codec's by default), or the status code of the failure."""
    try:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return reply.status


def _codec_client(address: str, ca: str, cert: str = "", key: str = "") -> CodecClient:
    return CodecClient(CodecClientConfig(
        addresses=address, sample_format=codec_pb2.SAMPLE_FORMAT_F32LE, tls_ca=ca, tls_cert=cert, tls_key=key,
        tls_server_name=SERVER_NAME,
    ))


async def _decode(client: CodecClient, frames: np.ndarray, seed: int) -> np.ndarray:
    stream = client.stream(seed)
    await stream.send(frames)
    await stream.end()
    chunks = [c async for c in stream.chunks()]
    assert sum(c.num_samples for c in chunks) == len(frames) * 2048 and chunks[-1].final
    return np.concatenate([np.frombuffer(c.pcm, "<f4") for c in chunks])


async def test_a_client_with_a_certificate_decodes_over_tls(tls_server, pki):
    client = _codec_client(tls_server.address, pki["ca"].ca_file, *pki["client"])
    try:
        assert await client.ready(timeout_s=5)  # client-side health checking works over TLS too
        audio = await _decode(client, random_frames(10, seed=1), seed=1)
    finally:
        await client.close()
    assert audio.shape == (10 * 2048,) and np.abs(audio).max() > 0


async def test_health_over_tls_reports_serving(tls_server, pki):
    async with channel(tls_server.address, pki["ca"].ca_file, *pki["client"], server_name=SERVER_NAME) as ch:
        assert await _health(ch) == health_pb2.HealthCheckResponse.SERVING


async def test_a_plaintext_client_is_refused(tls_server):
    async with channel(tls_server.address) as ch:
        assert await _health(ch) == grpc.StatusCode.UNAVAILABLE


async def test_a_client_without_a_certificate_is_refused(tls_server, pki):
    async with channel(tls_server.address, pki["ca"].ca_file, server_name=SERVER_NAME) as ch:
        assert await _health(ch) == grpc.StatusCode.UNAVAILABLE


async def test_a_client_certificate_from_another_ca_is_refused(tls_server, pki):
    async with channel(tls_server.address, pki["ca"].ca_file, *pki["other_client"], server_name=SERVER_NAME) as ch:
        assert await _health(ch) == grpc.StatusCode.UNAVAILABLE


async def test_a_client_trusting_another_ca_refuses_the_server(tls_server, pki):
    async with channel(tls_server.address, pki["other"].ca_file, *pki["client"], server_name=SERVER_NAME) as ch:
        assert await _health(ch) == grpc.StatusCode.UNAVAILABLE


async def test_the_server_name_is_checked(tls_server, pki):
    """The certificate names snac.test, not 127.0.0.1: without the override the client refuses it."""
    async with channel(tls_server.address, pki["ca"].ca_file, *pki["client"]) as ch:
        assert await _health(ch) == grpc.StatusCode.UNAVAILABLE


async def test_new_client_certificate_files_are_picked_up_without_a_restart(tls_server, pki, tmp_path):
    """The worker's client certificate is rotated in place: the next stream uses the new one."""
    cert, key = str(tmp_path / "client.crt"), str(tmp_path / "client.key")
    _replace(cert, pki["other_client"][0])  # a certificate the server does not accept, to start with
    _replace(key, pki["other_client"][1])
    client = _codec_client(tls_server.address, pki["ca"].ca_file, cert, key)
    try:
        assert not await client.ready(timeout_s=2)
        _replace(cert, pki["client"][0])
        _replace(key, pki["client"][1])
        audio = await _decode(client, random_frames(6, seed=2), seed=2)  # stream() saw the new files
        assert await client.ready(timeout_s=5)
    finally:
        await client.close()
    assert audio.shape == (6 * 2048,)


async def test_new_server_certificate_files_are_served_without_a_restart(pki, tmp_path):
    """Rotate the server's certificate to one from a new CA: new connections get it at once."""
    cert, key = str(tmp_path / "server.crt"), str(tmp_path / "server.key")
    _replace(cert, pki["server"][0])
    _replace(key, pki["server"][1])
    server, port = build_server(server_config(metrics_port=-1, tls_cert=cert, tls_key=key))
    await server.start()
    address = f"127.0.0.1:{port}"
    try:
        async with channel(address, pki["ca"].ca_file, server_name=SERVER_NAME) as ch:
            assert await _health(ch) == health_pb2.HealthCheckResponse.SERVING
        new_ca = Authority(tmp_path, "rotated-ca")
        new_cert, new_key = new_ca.issue(SERVER_NAME, server=True)
        await asyncio.sleep(0.01)  # a distinct mtime even on coarse file system clocks
        _replace(key, new_key)
        _replace(cert, new_cert)
        async with channel(address, new_ca.ca_file, server_name=SERVER_NAME) as ch:
            assert await _health(ch) == health_pb2.HealthCheckResponse.SERVING
        async with channel(address, pki["ca"].ca_file, server_name=SERVER_NAME) as ch:
            assert await _health(ch) == grpc.StatusCode.UNAVAILABLE  # the old certificate is gone
    finally:
        await server.stop(grace_s=0)


# ---------------------------------------------------------------- the plaintext health port (kubelet gRPC probes)


class _HeldWarmUp:
    """The real runner, its warm-up held until the test lets it go: the server is observably warming."""

    def __init__(self, runner) -> None:
        self._runner = runner
        self.release = threading.Event()

    def warm_up(self) -> None:
        assert self.release.wait(60), "warm-up never released"
        self._runner.warm_up()

    def __getattr__(self, name: str):
        return getattr(self._runner, name)


async def _plain_health(port: int, service: str = SERVICE) -> object:
    async with channel(f"127.0.0.1:{port}") as ch:
        return await _health(ch, service)


async def _samples(stream) -> int:
    return sum(c.num_samples for c in [c async for c in stream.chunks()])


async def test_the_health_port_tells_kubelet_what_the_tls_port_tells_workers(pki):
    """health_port serves grpc.health.v1 in plaintext with the TLS port's statuses: NOT_SERVING while
    warming up, SERVING, NOT_SERVING while draining; Decode is UNIMPLEMENTED there; TLS still required."""
    cert, key = pki["server"]
    config = server_config(metrics_port=-1, health_port=0, tls_cert=cert, tls_key=key, tls_client_ca=pki["ca"].ca_file)
    runner = _HeldWarmUp(build_runner(config, SnacMetrics()))
    server, port = build_server(config, runner)
    NOT_SERVING, SERVING = health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING
    starting = asyncio.create_task(server.start())
    try:
        deadline = asyncio.get_running_loop().time() + 30
        while (warming := await _plain_health(server.health_port)) != NOT_SERVING:
            assert asyncio.get_running_loop().time() < deadline, warming
            await asyncio.sleep(0.05)
        assert await _plain_health(server.health_port, "") == NOT_SERVING
        runner.release.set()
        await starting
        async with channel(f"127.0.0.1:{port}", pki["ca"].ca_file, *pki["client"], server_name=SERVER_NAME) as tls:
            for service in (SERVICE, ""):
                assert await _plain_health(server.health_port, service) == await _health(tls, service) == SERVING
            async with channel(f"127.0.0.1:{port}") as plaintext:  # the TLS port still refuses plaintext
                assert await _health(plaintext, SERVICE) == grpc.StatusCode.UNAVAILABLE
            async with channel(f"127.0.0.1:{port}", pki["ca"].ca_file, server_name=SERVER_NAME) as no_cert:
                assert await _health(no_cert, SERVICE) == grpc.StatusCode.UNAVAILABLE
            async with channel(f"127.0.0.1:{server.health_port}") as plain:
                decode = codec_pb2_grpc.SnacCodecStub(plain).Decode(iter([codec_pb2.DecodeRequest()]), timeout=5)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    async for _ in decode:
                        pass
                assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED

            # Draining: a stream held open keeps the TLS server in its grace period.
            client = _codec_client(f"127.0.0.1:{port}", pki["ca"].ca_file, *pki["client"])
            stream = client.stream(7)
            await stream.send(random_frames(2, seed=7))
            reading = asyncio.create_task(_samples(stream))  # the client opens its call when read
            deadline = asyncio.get_running_loop().time() + 60
            while server.service.active == 0:  # the call is open on the server
                assert asyncio.get_running_loop().time() < deadline, "the stream never opened on the server"
                await asyncio.sleep(0.02)
            stopping = asyncio.create_task(server.stop(grace_s=30))
            while (draining := await _plain_health(server.health_port)) != NOT_SERVING:
                assert not stopping.done(), draining
                await asyncio.sleep(0.02)
            assert await _plain_health(server.health_port, "") == NOT_SERVING
            assert not stopping.done()  # the health port answered while the TLS port drained
            await stream.end()
            assert await reading == 2 * 2048  # the stream in flight finished during the drain
            await client.close()
            await stopping
        assert await _plain_health(server.health_port) == grpc.StatusCode.UNAVAILABLE  # closed with the server
    finally:
        runner.release.set()
        if not starting.done():
            await starting
        await server.stop(grace_s=0)


def test_health_port_settings_are_checked():
    with pytest.raises(ValueError, match="needs a port of its own"):
        SnacServerConfig(port=50051, health_port=50051)
    with pytest.raises(ValueError, match="needs a port of its own"):  # was a bind error at start-up
        SnacServerConfig(metrics_port=9091, health_port=9091)
    with pytest.raises(ValueError, match="needs a port of its own"):  # the same check for every pair
        SnacServerConfig(port=9091, metrics_port=9091)
    with pytest.raises(ValueError, match="health_port\n  Input should be greater than or equal to -1"):
        SnacServerConfig(health_port=-2)
    assert SnacServerConfig().health_port == -1  # off unless asked for (the chart asks)
