"""Channels and requests of the Decode RPC, and a minimal asyncio client: frames in, PCM chunks out.

The LLM tier's resumable client builds on these; tests and benchmarks use them directly.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from .api import codec_pb2, codec_pb2_grpc
from .audio import DEFAULT_POLICY, POLICIES, pack_frames

SERVICE = codec_pb2.DESCRIPTOR.services_by_name["SnacCodec"].full_name  # megapod.codec.v3.SnacCodec: health checks


@dataclass
class DecodedStream:
    """Everything a stream got back: chunks in arrival order and their arrival times."""

    chunks: list[codec_pb2.PcmChunk]
    arrivals: list[float]

    def audio(self) -> np.ndarray:
        """The float32 PCM of all chunks, concatenated (F32LE sessions)."""
        return np.concatenate([np.frombuffer(c.pcm, dtype="<f4") for c in self.chunks]) if self.chunks else np.zeros(0, np.float32)


def header_request(seed: int, policy: str = DEFAULT_POLICY, **fields) -> codec_pb2.DecodeRequest:
    """The opening message of a stream."""
    header = codec_pb2.SessionHeader(seed=seed, policy=POLICIES[policy], **fields)
    return codec_pb2.DecodeRequest(header=header)


def frames_request(frames: np.ndarray | Sequence[Sequence[int]]) -> codec_pb2.DecodeRequest:
    """A message carrying whole frames (n, 7), packed."""
    return codec_pb2.DecodeRequest(frames=codec_pb2.Frames(codes=pack_frames(frames)))


END_REQUEST = codec_pb2.DecodeRequest(end=codec_pb2.EndOfStream())


async def paced_requests(
    header: codec_pb2.DecodeRequest, frames: np.ndarray, per_message: int = 1, interval_s: float = 0.0
) -> AsyncIterator[codec_pb2.DecodeRequest]:
    """Header, frames `per_message` at a time every `interval_s` seconds, then end of stream."""
    yield header
    for i in range(0, len(frames), per_message):
        yield frames_request(frames[i : i + per_message])
        if interval_s:
            await asyncio.sleep(interval_s)
    yield END_REQUEST


async def decode(
    stub: codec_pb2_grpc.SnacCodecStub, requests: AsyncIterator[codec_pb2.DecodeRequest], timeout_s: float | None = None
) -> DecodedStream:
    """Run one Decode stream to its final chunk."""
    loop = asyncio.get_running_loop()
    out = DecodedStream([], [])
    async for chunk in stub.Decode(requests, timeout=timeout_s):
        out.chunks.append(chunk)
        out.arrivals.append(loop.time())
    return out


def channel_credentials(ca: str, cert: str = "", key: str = "") -> grpc.ChannelCredentials:
    """TLS trusting the CA file `ca`; `cert` and `key` add a client certificate (read now, once)."""
    client_pair = (Path(key).read_bytes(), Path(cert).read_bytes()) if cert else (None, None)
    return grpc.ssl_channel_credentials(Path(ca).read_bytes(), *client_pair)


def tls_options(server_name: str) -> list[tuple[str, str]]:
    """Channel options checking the server's certificate against `server_name` instead of the address."""
    return [("grpc.ssl_target_name_override", server_name)] if server_name else []


def channel(
    address: str, tls_ca: str = "", tls_cert: str = "", tls_key: str = "", server_name: str = "",
    options: Sequence[tuple[str, object]] = (),
) -> grpc.aio.Channel:
    """A channel to a codec server: plaintext (loopback, tests) unless a CA file is given."""
    if not tls_ca:
        return grpc.aio.insecure_channel(address, options=list(options))
    credentials = channel_credentials(tls_ca, tls_cert, tls_key)
    return grpc.aio.secure_channel(address, credentials, options=[*options, *tls_options(server_name)])
