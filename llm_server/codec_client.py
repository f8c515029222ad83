"""The LLM tier's client of the SNAC codec tier: one Decode stream per TTS stream, with failover.

Balancing is gRPC's own: one channel over every replica (an `ipv4:` address list or a
`dns:///` name resolving to several) with the round_robin policy and client-side health
checking, so a draining replica (NOT_SERVING) gets no new streams. Failover is ours: a
stream keeps the frames whose audio has not arrived yet (plus 3 frames of context), and if
its replica dies it reopens on another and resumes exactly where the audio stopped; the
codec's noise depends only on (seed, position), so the audio is the same as undisturbed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np

from snac_server.api import codec_pb2, codec_pb2_grpc
from snac_server.chunking import EXACT_CONTEXT
from snac_server.client import END_REQUEST, frames_request

log = logging.getLogger(__name__)

# Status codes after which the same frames are worth resending to another replica.
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
              grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
_SERVICE = "megapod.codec.v1.SnacCodec"


class CodecError(RuntimeError):
    """The codec tier could not produce a stream's audio (no replica left, or it refused the input)."""


def channel_target(addresses: str) -> str:
    """`host:port[,host:port...]` -> an `ipv4:`/`ipv6:` list target; `dns:///...` passes through."""
    if "://" in addresses or addresses.startswith(("dns:", "ipv4:", "ipv6:", "unix:")):
        return addresses
    parts = [a.strip() for a in addresses.split(",") if a.strip()]
    if len(parts) == 1 and not parts[0].split(":")[0].replace(".", "").isdigit():
        return f"dns:///{parts[0]}"  # a name: resolve it, every address becomes a subchannel
    return "ipv4:" + ",".join(p.replace("localhost", "127.0.0.1") for p in parts)


@dataclass(frozen=True)
class CodecClientConfig:
    """How the LLM tier reaches the codec tier."""

    addresses: str = "127.0.0.1:50051"
    policy: int = codec_pb2.POLICY_ADAPTIVE
    chunk_frames: int = 0  # 0: the codec server's default
    sample_format: int = codec_pb2.SAMPLE_FORMAT_S16LE
    max_attempts: int = 4  # replicas tried per stream before giving up
    connect_timeout_s: float = 5.0


class CodecClient:
    """Opens codec streams over one load-balanced channel; close() when done."""

    def __init__(self, config: CodecClientConfig) -> None:
        self.config = config
        service_config = {
            "loadBalancingConfig": [{"round_robin": {}}],
            "healthCheckConfig": {"serviceName": _SERVICE},
        }
        self._channel = grpc.aio.insecure_channel(
            channel_target(config.addresses),
            options=[("grpc.service_config", json.dumps(service_config)), ("grpc.enable_retries", 0)],
        )
        self._stub = codec_pb2_grpc.SnacCodecStub(self._channel)

    def stream(self, seed: int, stream_id: str = "") -> CodecStream:
        """A new stream; frames go in with send(), audio comes out of chunks()."""
        return CodecStream(self._stub, self.config, seed, stream_id)

    async def ready(self, timeout_s: float = 1.0) -> bool:
        """True when at least one replica accepts connections and reports SERVING."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            reply = await health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(service=_SERVICE), timeout=timeout_s, wait_for_ready=True
            )
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        await self._channel.close()


@dataclass(frozen=True)
class AudioChunk:
    """PCM for frames [first_frame, first_frame + num_frames) of a stream."""

    first_frame: int
    num_frames: int
    pcm: bytes
    final: bool


class CodecStream:
    """One TTS stream's audio: resumable across replica failures, every frame exactly once."""

    def __init__(self, stub: codec_pb2_grpc.SnacCodecStub, config: CodecClientConfig, seed: int, stream_id: str) -> None:
        self._stub = stub
        self._config = config
        self._seed = seed
        self._stream_id = stream_id
        self._frames = np.zeros((0, 7), dtype=np.int64)
        self._frames_start = 0  # absolute index of self._frames[0]
        self._delivered = 0  # next frame whose audio is still owed
        self._ended = False
        self._call: grpc.aio.StreamStreamCall | None = None
        self._lock = asyncio.Lock()  # one writer at a time: resends must not interleave new frames
        self._cancelled = False
        self.failovers = 0

    async def send(self, frames: np.ndarray) -> None:
        """Queue frames (n, 7) for decoding; a dead replica is noticed and replaced by chunks()."""
        async with self._lock:
            self._frames = np.concatenate([self._frames, frames.astype(np.int64)])
            if self._call is None:
                await self._open()
            else:
                await self._write(frames_request(frames))

    async def end(self) -> None:
        """No more frames: the codec flushes the tail."""
        async with self._lock:
            self._ended = True
            if self._call is None:
                await self._open()
            else:
                await self._write(END_REQUEST)
                await self._done_writing()

    async def chunks(self) -> AsyncIterator[AudioChunk]:
        """Audio in stream order, through failovers, until the final chunk."""
        attempts = 1
        while True:
            if self._cancelled:
                raise CodecError("stream cancelled")
            if self._call is None:
                await asyncio.sleep(0.005)  # nothing sent yet
                continue
            call = self._call
            try:
                message = await call.read()
            except grpc.aio.AioRpcError as exc:
                message = exc
            if message is grpc.aio.EOF:
                message = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "stream ended before its final chunk")
            if isinstance(message, grpc.aio.AioRpcError):
                attempts = await self._failover(call, message, attempts)
                continue
            chunk = self._accept(message)
            if chunk is not None:
                yield chunk
                if chunk.final:
                    return

    def cancel(self) -> None:
        """Abandon the stream (client went away): the codec drops its session."""
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()

    def _accept(self, message: codec_pb2.PcmChunk) -> AudioChunk | None:
        """Advance past a chunk; drop audio already delivered by a previous replica."""
        if message.first_frame != self._delivered:
            raise CodecError(f"codec sent frame {message.first_frame}, expected {self._delivered}")
        self._delivered += message.num_frames
        self._trim()
        return AudioChunk(message.first_frame, message.num_frames, message.pcm, message.final)

    async def _failover(self, call: grpc.aio.StreamStreamCall, error: grpc.aio.AioRpcError, attempts: int) -> int:
        if self._cancelled:
            raise CodecError("stream cancelled")
        if error.code() not in _RETRYABLE or attempts >= self._config.max_attempts:
            raise CodecError(f"codec stream failed ({error.code().name}): {error.details()}") from error
        log.warning("codec replica lost (%s) at frame %d; resuming elsewhere", error.code().name, self._delivered)
        async with self._lock:
            if self._call is call:  # not already replaced by a concurrent writer
                call.cancel()
                await self._open()
        self.failovers += 1
        return attempts + 1

    async def _open(self) -> None:
        """Open a call and replay: header, the owed frames with their context, end if seen."""
        first = max(self._frames_start, self._delivered - EXACT_CONTEXT)
        header = codec_pb2.SessionHeader(
            seed=self._seed, policy=self._config.policy, chunk_frames=self._config.chunk_frames,
            sample_format=self._config.sample_format,
            first_frame=first, emit_from_frame=self._delivered, stream_id=self._stream_id,
        )
        self._call = self._stub.Decode(wait_for_ready=True)
        await self._write(codec_pb2.DecodeRequest(header=header))
        pending = self._frames[first - self._frames_start :]
        if len(pending):
            await self._write(frames_request(pending))
        if self._ended:
            await self._write(END_REQUEST)
            await self._done_writing()

    async def _write(self, request: codec_pb2.DecodeRequest) -> None:
        try:
            await self._call.write(request)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the call is dead; chunks() sees it and fails over with every owed frame

    async def _done_writing(self) -> None:
        try:
            await self._call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass

    def _trim(self) -> None:
        """Forget frames no resume can need: all but the 3 before the first owed frame."""
        keep_from = max(self._frames_start, self._delivered - EXACT_CONTEXT)
        if keep_from - self._frames_start > 64:
            self._frames = self._frames[keep_from - self._frames_start :]
            self._frames_start = keep_from
